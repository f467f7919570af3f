"""Portable checkpoints and traces: the features that read a built engine through the contract.

A dialect that declares :attr:`~pipedialect.Capability.PORTABLE_CHECKPOINTS` implements
``Dialect.engine_state``; :mod:`pipedialect.checkpoint` then saves its engines for, and resumes
them from, any other dialect. Each case trains on the dialect, saves with
``pipedialect.checkpoint.save``, resumes on the local dialect (every stage in one process, on
other weights) and trains one more step; and the other way round, from the local dialect onto
the dialect. Both must equal the unsplit model trained without interruption. A dialect that
declares :attr:`~pipedialect.Capability.TRACING` (``engine_state``, and optionally
``Dialect.instrument``) is traced with :func:`pipedialect.trace`: the traced run must train like
the unsplit model, and its timeline must hold one forward per stage and micro-batch and one
backward after each.
"""

from __future__ import annotations

from typing import ClassVar

import pytest

from ...contracts import Capability
from ...dialect import Dialect
from .._harness._base import SuiteBase
from .._harness._cases import case_params
from .._harness._checks import fail_if, portable_checkpoint_failures, trace_failures
from .._harness._driver import DialectRun
from .._requirements import requires

__all__ = ["TestPortableCheckpoints", "TestTracing"]


def _hook_failures(dialect: Dialect, capability: Capability) -> list[str]:
    if type(dialect).engine_state is Dialect.engine_state:
        return [
            f"{capability.value} [{dialect.name}]: the dialect declares {capability.value} but "
            "does not implement Dialect.engine_state(engine) -> EngineState"
        ]
    return []


class TestPortableCheckpoints(SuiteBase):
    """``pipedialect.checkpoint`` carries training state to and from the local dialect."""

    pytestmark: ClassVar[list[pytest.MarkDecorator]] = [pytest.mark.pipedialect_area("portability")]

    @requires(Capability.PORTABLE_CHECKPOINTS)
    def test_implements_engine_state(self, dialect: Dialect) -> None:
        """A dialect declaring portable-checkpoints overrides ``engine_state``."""
        fail_if(_hook_failures(dialect, Capability.PORTABLE_CHECKPOINTS))

    @pytest.mark.parametrize("case", case_params("portable-2", "portable-gpt-2"))
    def test_resume_across_dialects(self, dialect_run: DialectRun, case: str) -> None:
        """Saved on the dialect and resumed on the local one, and back: the unsplit run's."""
        fail_if(portable_checkpoint_failures(self.case_result(dialect_run, case)))


class TestTracing(SuiteBase):
    """``pipedialect.trace`` times every stage's forward and backward and changes nothing."""

    pytestmark: ClassVar[list[pytest.MarkDecorator]] = [pytest.mark.pipedialect_area("tracing")]

    @requires(Capability.TRACING)
    def test_implements_engine_state(self, dialect: Dialect) -> None:
        """A dialect declaring tracing overrides ``engine_state``."""
        fail_if(_hook_failures(dialect, Capability.TRACING))

    @pytest.mark.parametrize("case", case_params("trace-2"))
    def test_traced_run(self, dialect_run: DialectRun, case: str) -> None:
        """The traced run equals the unsplit model; every forward and backward is a span."""
        fail_if(trace_failures(self.case_result(dialect_run, case)))
