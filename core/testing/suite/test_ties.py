"""Ties: tied parameters are found, mapped onto ranks, and trained as the unsplit model trains them.

The gpt model ties its token embedding (stage 0) to its LM head (the last stage); the reference
knows that from the model's definition, not from the dialect's analyzer.
"""

from __future__ import annotations

from typing import ClassVar

import pytest

from ...contracts import Capability
from ...dialect import Dialect
from ...plan.partition import partition
from .._harness._base import SuiteBase
from .._harness._cases import case_params
from .._harness._checks import build_error_failures, fail_if, training_failures
from .._harness._driver import DialectRun
from .._harness._models import suite_model

__all__ = ["TestTies"]


class TestTies(SuiteBase):
    """Tie analysis and tied-weight training."""

    pytestmark: ClassVar[list[pytest.MarkDecorator]] = [pytest.mark.pipedialect_area("ties")]

    @pytest.mark.parametrize("stages", [2, 4])
    def test_find_groups(self, dialect: Dialect, stages: int) -> None:
        """The analyzer finds the embedding/head tie, and nothing in an untied model."""
        spec = suite_model("gpt")
        plan = partition(spec.build(0), spec.split_points_for(stages))
        groups = dialect.tie_analyzer.find_groups(plan.stages)
        head = f"tie analysis [gpt, {stages} stages] of {dialect.name!r}"
        found = [sorted((str(n), int(s)) for n, s in g) for g in groups]
        expected = [[("lm_head.weight", stages - 1), ("wte.weight", 0)]]
        failures = []
        if found != expected:
            failures.append(
                f"{head}: find_groups() returned {found}; the model ties wte.weight on stage 0 "
                f"to lm_head.weight on stage {stages - 1}"
            )
        untied = suite_model("plain")
        plain = partition(untied.build(0), untied.split_points_for(stages))
        extra = list(dialect.tie_analyzer.find_groups(plain.stages))
        if extra:
            failures.append(
                f"tie analysis [plain, {stages} stages] of {dialect.name!r}: find_groups() "
                f"returned {extra} for a model without tied parameters"
            )
        fail_if(failures)

    def test_analyze_ranks(self, dialect: Dialect) -> None:
        """Each data-parallel replica's first- and last-stage ranks keep the tie in sync."""
        shapes = [(2, 1), (4, 1)]
        if Capability.DATA_PARALLEL in dialect.capabilities:
            shapes.append((2, 2))
        spec = suite_model("gpt")
        failures = []
        for stages, replicas in shapes:
            plan = partition(spec.build(0), spec.split_points_for(stages))
            groups = dialect.tie_analyzer.find_groups(plan.stages)
            topology = dialect.make_topology(stages, replicas)
            tie_ranks, tie_stages = dialect.tie_analyzer.analyze_ranks(groups, topology)
            expected = sorted(
                [
                    topology.filter_match(pipe=0, data=d)[0],
                    topology.filter_match(pipe=stages - 1, data=d)[0],
                ]
                for d in range(replicas)
            )
            found = [sorted(list(map(int, ranks)) for ranks in group) for group in tie_ranks]
            if found != [expected] or [list(s) for s in tie_stages] != [[0, stages - 1]]:
                failures.append(
                    f"tie analysis [gpt, {stages} stages x {replicas} replicas] of "
                    f"{dialect.name!r}: analyze_ranks() returned ranks {found} for stages "
                    f"{tie_stages}; expected ranks [{expected}] for stages [[0, {stages - 1}]] "
                    "(the first- and last-stage ranks of each replica)"
                )
        fail_if(failures)

    @pytest.mark.parametrize(
        "case", case_params("gpt-2", "gpt-4", "gpt-2x2", "gpt-2x2-fsdp", "mhgpt-2-tp2")
    )
    def test_tied_training_matches_unsplit(self, dialect_run: DialectRun, case: str) -> None:
        """Tied copies on different ranks train exactly like the one shared parameter."""
        fail_if(training_failures(self.case_result(dialect_run, case)))

    @pytest.mark.parametrize("case", case_params("error-untied"))
    def test_undeclared_ties_are_refused(self, dialect_run: DialectRun, case: str) -> None:
        """A dialect without tied-weights refuses a tied plan instead of silently untying it."""
        fail_if(build_error_failures(self.case_result(dialect_run, case)))
