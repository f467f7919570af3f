"""Training equivalence: ``pipe_engine`` + ``runtime_engine`` train like the unsplit model.

Each case trains a suite model for a few steps on the dialect (on ``stages * replicas`` ranks
over gloo for a multi-process dialect) and compares every step's loss, every parameter after
every step, and the evaluation loss with the unsplit model trained by a plain PyTorch loop on
the same micro-batches. What each stage receives in the first micro-batch is compared with the
unsplit values too, so a lost or reordered boundary value is named as such.
"""

from __future__ import annotations

from typing import ClassVar

import pytest

from .._harness._base import SuiteBase
from .._harness._cases import case_params
from .._harness._checks import checkpoint_failures, fail_if, training_failures
from .._harness._driver import DialectRun

__all__ = ["TestTraining"]


class TestTraining(SuiteBase):
    """The dialect's engines give the unsplit model's losses and parameters."""

    pytestmark: ClassVar[list[pytest.MarkDecorator]] = [pytest.mark.pipedialect_area("training")]

    @pytest.mark.parametrize(
        "case",
        case_params(
            "plain-2",
            "plain-4",
            "plain-2x2",
            "plain-2x2-fsdp",
            "skip-2",
            "skip-4",
            "mixed-2",
            "mixed-4",
            "encdec-2",
            "encdec-4",
            "dynamic-2",
        ),
    )
    def test_matches_unsplit(self, dialect_run: DialectRun, case: str) -> None:
        """Losses, parameters after each step and the evaluation loss equal the unsplit run's."""
        fail_if(training_failures(self.case_result(dialect_run, case)))

    @pytest.mark.parametrize("case", case_params("checkpoint-2"))
    def test_checkpoint_resume(self, dialect_run: DialectRun, case: str) -> None:
        """A fresh engine on other weights resumes from a checkpoint as if never stopped."""
        fail_if(checkpoint_failures(self.case_result(dialect_run, case)))
