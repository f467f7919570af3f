"""Stage wrappers: the dialect's wrappers, chained in one process, compute the unsplit forward.

This is how a pipeline runtime uses them (each wrapper encodes what it sends, the next decodes
it), minus the runtime. What each stage decodes is compared with what the plan's stage modules
compute when called directly, so a wrong value is pinned to its boundary and name.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from ...contracts import Capability
from ...dialect import Dialect
from ...plan.partition import partition
from .._harness._base import SuiteBase
from .._harness._cases import Case, case_params, get_case
from .._harness._checks import RTOL, boundary_failures, fail, fail_if
from .._harness._compare import first_difference
from .._harness._data import train_stream
from .._harness._models import suite_model
from .._harness._runner import Probe, one_thread

__all__ = ["TestStages"]


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    return value


class TestStages(SuiteBase):
    """Chained stage wrappers equal the unsplit model, in training and in evaluation."""

    pytestmark: ClassVar[list[pytest.MarkDecorator]] = [pytest.mark.pipedialect_area("stages")]

    @pytest.mark.parametrize(
        "layout",
        case_params(
            "plain-2",
            "plain-4",
            "gpt-2",
            "gpt-4",
            "skip-2",
            "skip-4",
            "mixed-2",
            "mixed-4",
            "encdec-2",
            "encdec-4",
        ),
    )
    def test_chained_wrappers_equal_unsplit_forward(self, dialect: Dialect, layout: str) -> None:
        """Two micro-batches with grad enabled, then one under ``no_grad``."""
        with one_thread():
            self._check_chain(dialect, get_case(layout))

    def _check_chain(self, dialect: Dialect, spec_case: Case) -> None:
        spec = suite_model(spec_case.model)
        head = f"stage wrappers [{spec_case.title}]"
        device = torch.device("cuda" if Capability.CUDA_ONLY in dialect.capabilities else "cpu")
        model = spec.build(0).to(device)
        plan = partition(spec.build(0), spec.split_points_for(spec_case.stages))
        wrappers = [w.to(device) for w in dialect.wrap_stages(plan)]
        probe = Probe()
        for wrapper in wrappers:
            probe.attach(wrapper)

        def chained(inputs: Any) -> Any:
            args = inputs if isinstance(inputs, tuple) else (inputs,)
            value = wrappers[0](*args)
            for wrapper in wrappers[1:]:
                value = wrapper(value)
            return value

        failures: list[str] = []
        batches = train_stream(spec_case, 0, count=2)
        for i, (inputs, _) in enumerate(batches):
            inputs = _to(inputs, device)
            expected = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
            try:
                output = chained(inputs)
            except Exception as exc:
                failures += boundary_failures(spec_case, probe.received, "stage wrappers")
                failures.append(
                    f"{head}: micro-batch {i + 1}: the chained wrappers raised "
                    f"{type(exc).__name__}: {exc}"
                )
                fail(failures)
            diff = first_difference(output, expected, rtol=RTOL)
            if diff is not None:
                failures.append(
                    f"{head}: micro-batch {i + 1}: the chained wrappers' output differs from "
                    f"the unsplit forward {diff}"
                )
            if i == 0:
                failures += boundary_failures(spec_case, probe.received, "stage wrappers")
        with torch.no_grad():
            inputs = _to(batches[0][0], device)
            expected = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
            diff = first_difference(chained(inputs), expected, rtol=RTOL)
            if diff is not None:
                failures.append(
                    f"{head}: under torch.no_grad() (evaluation) the chained wrappers' output "
                    f"differs from the unsplit forward {diff}"
                )
        fail_if(failures)
