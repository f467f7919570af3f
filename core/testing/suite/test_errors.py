"""Error behaviour: mistakes are refused with a named PipeDialectError, never a hang or a crash.

Build mistakes (a missing argument, a topology or stage list that does not fit the plan, an
unknown option) must be refused on every rank before any collective. A boundary value no
runtime can carry (a complex tensor that needs a gradient), or a new shape on a dialect that
does not declare dynamic shapes, must be refused by the stage that meets it, naming the stage.
"""

from __future__ import annotations

from typing import ClassVar

import pytest

from ...contracts import Capability
from ...dialect import Dialect
from ...errors import PipeDialectError
from ...plan.partition import partition
from .._harness._base import SuiteBase
from .._harness._cases import case_params, get_case
from .._harness._checks import build_error_failures, fail_if, run_error_failures
from .._harness._data import suite_config
from .._harness._driver import DialectRun
from .._harness._models import suite_model
from .._requirements import requires

__all__ = ["TestErrors"]


class TestErrors(SuiteBase):
    """Bad input gets a named exception."""

    pytestmark: ClassVar[list[pytest.MarkDecorator]] = [pytest.mark.pipedialect_area("errors")]

    @pytest.mark.parametrize(
        "case",
        case_params(
            "error-no-loss-fn",
            "error-no-config",
            "error-topology",
            "error-stage-count",
            "error-unknown-option",
        ),
    )
    def test_build_mistake_is_refused(self, dialect_run: DialectRun, case: str) -> None:
        """Every rank raises a PipeDialectError that names what is wrong."""
        fail_if(build_error_failures(self.case_result(dialect_run, case)))

    @pytest.mark.parametrize("case", case_params("error-complex"))
    def test_uncarriable_boundary_value_is_refused(
        self, dialect_run: DialectRun, case: str
    ) -> None:
        """A complex tensor that needs a gradient is refused at the stage that sends it."""
        what = "a boundary carrying a complex tensor that needs a gradient"
        fail_if(run_error_failures(self.case_result(dialect_run, case), what))

    @pytest.mark.parametrize("case", case_params("error-new-shape"))
    def test_new_shape_is_refused_without_dynamic_shapes(
        self, dialect_run: DialectRun, case: str
    ) -> None:
        """A micro-batch of another sequence length is refused, not sent with stale buffers."""
        what = "a second micro-batch of another shape (the dialect does not declare dynamic-shapes)"
        fail_if(run_error_failures(self.case_result(dialect_run, case), what))

    @requires(Capability.MULTI_PROCESS)
    def test_engine_without_process_group_is_refused(self, dialect: Dialect) -> None:
        """Building a multi-process engine before ``init_distributed()`` is a named error."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            pytest.skip("a process group already exists in this process")
        spec = suite_model("plain")
        plan = partition(spec.build(0), spec.split_points_for(2))
        config = suite_config(get_case("plain-2"))
        try:
            dialect.pipe_engine(
                plan, config=config, loss_fn=spec.loss_fn, topology=dialect.make_topology(2, 1)
            )
        except PipeDialectError:
            return
        except Exception as exc:
            pytest.fail(
                f"error behaviour [no process group]: pipe_engine() without a process group "
                f"raised {type(exc).__name__} ({exc}) instead of a pipedialect.PipeDialectError "
                "telling the user to call init_distributed()",
                pytrace=False,
            )
        pytest.fail(
            "error behaviour [no process group]: pipe_engine() built a multi-process engine "
            "without a process group; it must raise a pipedialect.PipeDialectError telling the "
            "user to call init_distributed()",
            pytrace=False,
        )
