"""Registration and declaration: the dialect is found by entry point and describes itself."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from ...contracts import Capability, TensorCodec, TieAnalyzer, Topology
from ...dialect import Dialect
from ...plan.partition import partition
from ...plugins import ENTRY_POINT_GROUP, get_dialect, list_dialects
from ...runtime.stage import StageWrapper
from .._harness._base import SuiteBase
from .._harness._checks import fail, fail_if
from .._harness._models import suite_model

__all__ = ["TestRegistration"]


class TestRegistration(SuiteBase):
    """The dialect is registered, declares what it supports, and names valid components."""

    pytestmark: ClassVar[list[pytest.MarkDecorator]] = [
        pytest.mark.pipedialect_area("registration")
    ]

    def test_registered_by_entry_point(self, dialect: Dialect) -> None:
        """``get_dialect(name)`` finds it, once, through an installed distribution."""
        head = f"registration: dialect {dialect.name!r}"
        try:
            found = get_dialect(dialect.name)
        except Exception as exc:
            fail([f"{head}: get_dialect({dialect.name!r}) raised {type(exc).__name__}: {exc}"])
        if type(found) is not type(dialect):
            fail(
                [
                    f"{head}: get_dialect({dialect.name!r}) returns a {type(found).__qualname__}, "
                    f"not the {type(dialect).__qualname__} under test; register it under its "
                    "own name"
                ]
            )
        infos = [i for i in list_dialects() if i.name == dialect.name]
        failures = []
        if len(infos) != 1 or infos[0].status != "ok":
            failures.append(
                f"{head}: `pipedialect list` shows {[(i.status, i.error) for i in infos]}, "
                "expected one entry with status 'ok'"
            )
        elif infos[0].distribution is None:
            failures.append(
                f"{head}: registered in-process only; publish it through the "
                f"{ENTRY_POINT_GROUP!r} entry-point group of an installed distribution"
            )
        fail_if(failures)

    def test_declares_name_version_and_capabilities(self, dialect: Dialect) -> None:
        """Name, version and capabilities are of the declared types and consistent."""
        head = f"registration: dialect {dialect.name!r}"
        failures = []
        # Typed Any: the declarations are what a third party wrote, whatever the annotations say.
        name: Any = dialect.name
        version: Any = dialect.version
        caps: Any = dialect.capabilities
        if not isinstance(name, str) or not name or any(c.isspace() for c in name):
            failures.append(f"{head}: name must be a non-empty string without spaces")
        if not isinstance(version, str) or not version:
            failures.append(f"{head}: version must be a non-empty string, got {version!r}")
        if not isinstance(caps, frozenset):
            failures.append(f"{head}: capabilities must be a frozenset, got {type(caps).__name__}")
        strays = [c for c in caps if not isinstance(c, Capability)]
        if strays:
            failures.append(
                f"{head}: capabilities {strays!r} are not pipedialect.Capability members"
            )
        if Capability.DATA_PARALLEL in caps and Capability.MULTI_PROCESS not in caps:
            failures.append(
                f"{head}: declares data-parallel without multi-process; replicas need processes"
            )
        for sharded in (Capability.SHARDED_DATA_PARALLEL, Capability.TENSOR_PARALLEL):
            if sharded in caps and Capability.MULTI_PROCESS not in caps:
                failures.append(
                    f"{head}: declares {sharded.value} without multi-process; a shard lives on "
                    "a rank of its own"
                )
        fail_if(failures)

    def test_names_valid_components(self, dialect: Dialect) -> None:
        """``stage_wrapper``, ``codec`` and ``tie_analyzer`` implement the interfaces."""
        head = f"registration: dialect {dialect.name!r}"
        failures = []
        wrapper: Any = dialect.stage_wrapper
        if not (isinstance(wrapper, type) and issubclass(wrapper, StageWrapper)):
            failures.append(f"{head}: stage_wrapper {wrapper!r} is not a StageWrapper subclass")
        codec: Any = dialect.codec
        analyzer: Any = dialect.tie_analyzer
        if not isinstance(codec, TensorCodec):
            failures.append(f"{head}: codec {codec!r} is not a TensorCodec")
        if not isinstance(analyzer, TieAnalyzer):
            failures.append(f"{head}: tie_analyzer {analyzer!r} is not a TieAnalyzer")
        fail_if(failures)

    def test_make_topology(self, dialect: Dialect) -> None:
        """``make_topology(stages, replicas)`` is a pipe x data grid of the right size."""
        shapes = [(2, 1), (4, 1)]
        if Capability.DATA_PARALLEL in dialect.capabilities:
            shapes.append((2, 2))
        failures = []
        for stages, replicas in shapes:
            head = f"registration: make_topology({stages}, {replicas}) of {dialect.name!r}"
            topology: Any = dialect.make_topology(stages, replicas)
            if not isinstance(topology, Topology):
                failures.append(f"{head} returned {topology!r}, which is not a Topology")
                continue
            found = (topology.get_dim("pipe"), max(topology.get_dim("data"), 1))
            if found != (stages, replicas) or topology.world_size() != stages * replicas:
                failures.append(
                    f"{head} has pipe x data = {found[0]} x {found[1]} and "
                    f"{topology.world_size()} ranks"
                )
                continue
            ranks = sorted(r for s in range(stages) for r in topology.filter_match(pipe=s))
            if ranks != list(range(stages * replicas)):
                failures.append(
                    f"{head}: filter_match(pipe=s) over all stages gives ranks {ranks}, not "
                    f"each of 0..{stages * replicas - 1} once"
                )
        fail_if(failures)

    def test_wrap_stages(self, dialect: Dialect) -> None:
        """``wrap_stages(plan)`` returns one ``stage_wrapper`` per stage, in stage order."""
        spec = suite_model("plain")
        plan = partition(spec.build(0), spec.split_points_for(4))
        wrappers = list(dialect.wrap_stages(plan))
        head = f"registration: wrap_stages() of {dialect.name!r}"
        ids = [getattr(w, "stage_id", None) for w in wrappers]
        if ids != [0, 1, 2, 3]:
            fail([f"{head} returned stage ids {ids} for a plan of 4 stages"])
        wrong = [type(w).__name__ for w in wrappers if not isinstance(w, dialect.stage_wrapper)]
        fail_if([f"{head} returned {wrong}, not instances of stage_wrapper"] if wrong else [])
