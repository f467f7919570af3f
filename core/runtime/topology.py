"""Process grids and joining the process group: the concrete side of :class:`Topology`.

:class:`GridTopology` is the ``pipe`` x ``data`` grid for dialects without a runtime topology
class; :func:`join_process_group` is what :meth:`~pipedialect.dialect.Dialect.init_distributed`
does by default. Every check of a topology is here, written once for every dialect:
:func:`check_topology_object` (the calls it answers, its pipe size), :func:`check_topology`
(one pipe coordinate per stage, no model axis), :func:`joined_world_size` and
:func:`check_world_size` (the process group exists and has the topology's ranks);
:meth:`PipelineRequest.process_grid() <pipedialect.dialect.PipelineRequest.process_grid>` runs
them in that order.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch

from ..contracts import Capability, Topology
from ..errors import ConfigError, TopologyError

__all__ = [
    "GridCoord",
    "GridTopology",
    "check_topology",
    "check_topology_object",
    "check_world_size",
    "join_process_group",
    "joined_world_size",
]

#: What ``torch.distributed``'s default ``env://`` rendezvous reads; a launcher sets them.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class GridTopology:
    """A row-major ``pipe`` x ``data`` x ``tensor`` grid, for dialects that need no runtime
    topology class.

    Ranks are laid out as DeepSpeed's ``PipeModelDataParallelTopology`` lays out its ``pipe``,
    ``data`` and ``model`` axes: the pipe axis is outermost and the tensor axis innermost, so
    the rank at ``(pipe=p, data=d, tensor=t)`` is ``(p * data + d) * tensor + t`` and the ranks
    of one stage are contiguous. ``tensor`` is 1 unless a dialect runs tensor parallelism.
    """

    def __init__(self, pipe: int, data: int = 1, tensor: int = 1) -> None:
        if pipe < 1 or data < 1 or tensor < 1:
            raise TopologyError(
                f"pipe ({pipe}), data ({data}) and tensor ({tensor}) must all be at least 1"
            )
        self._dims = {"pipe": pipe, "data": data, "tensor": tensor}

    def get_dim(self, axis: str) -> int:
        """Return the size of ``axis``; 0 for an axis the grid does not have."""
        return self._dims.get(axis, 0)

    def world_size(self) -> int:
        """Return ``pipe * data * tensor``."""
        return self._dims["pipe"] * self._dims["data"] * self._dims["tensor"]

    def get_coord(self, rank: int) -> GridCoord:
        """Return the ``(pipe, data, tensor)`` coordinate of ``rank``."""
        if not 0 <= rank < self.world_size():
            raise TopologyError(f"rank {rank} is outside a grid of {self.world_size()} ranks")
        rest, tensor = divmod(rank, self._dims["tensor"])
        pipe, data = divmod(rest, self._dims["data"])
        return GridCoord(pipe=pipe, data=data, tensor=tensor)

    def get_rank(self, *, pipe: int, data: int = 0, tensor: int = 0) -> int:
        """Return the global rank at ``(pipe, data, tensor)``."""
        return (pipe * self._dims["data"] + data) * self._dims["tensor"] + tensor

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """Return the ranks whose coordinates match every ``axis=value`` given, in order."""
        return [
            rank
            for rank in range(self.world_size())
            if all(
                getattr(self.get_coord(rank), axis) == value
                for axis, value in filter_kwargs.items()
            )
        ]

    def __repr__(self) -> str:
        tensor = f", tensor={self._dims['tensor']}" if self._dims["tensor"] > 1 else ""
        return f"GridTopology(pipe={self._dims['pipe']}, data={self._dims['data']}{tensor})"


class GridCoord(NamedTuple):
    """A ``(pipe, data, tensor)`` coordinate with named fields, like DeepSpeed's ProcessCoord."""

    #: The pipeline stage.
    pipe: int
    #: The data-parallel replica.
    data: int
    #: The position on the tensor-parallel axis (0 without tensor parallelism).
    tensor: int = 0


def join_process_group(
    dialect_name: str, capabilities: Iterable[Capability], backend: str | None = None
) -> None:
    """Join the process group described by the launcher's environment (RANK, WORLD_SIZE, ...).

    ``backend`` defaults to ``nccl`` when CUDA is available, else ``gloo``. Nothing happens for
    a dialect that does not declare ``multi-process`` (there is no group to join) or when the
    group already exists.

    Raises:
        ConfigError: the process was not started by a launcher (``torchrun``, the conformance
            suite's): the environment lacks the variables that describe the group.
    """
    import torch.distributed as dist

    if Capability.MULTI_PROCESS not in set(capabilities) or dist.is_initialized():
        return
    missing = [name for name in LAUNCH_VARIABLES if name not in os.environ]
    if missing:
        raise ConfigError(
            f"dialect {dialect_name!r} runs one process per pipeline rank, but this process "
            f"was not started by a launcher ({', '.join(missing)} not set): start the "
            "script with `torchrun --nproc_per_node N script.py` (N = stages x replicas), "
            "or use the 'local' dialect to run every stage in this process"
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend)


#: The calls of a :class:`~pipedialect.Topology` that tie analysis makes.
_TOPOLOGY_CALLS = ("get_dim", "filter_match", "get_coord")


def check_topology_object(topology: Any, calls: Sequence[str] = _TOPOLOGY_CALLS) -> int:
    """Raise :class:`TopologyError` unless ``topology`` answers ``calls``; return its pipe size.

    Checked up front so that a wrong object (a class instead of an instance, a topology of
    another library) gets a named error instead of a ``TypeError`` deep inside the analysis.
    """
    wanted = "get_dim(axis), filter_match(**axes), get_coord(rank) and world_size()"
    if isinstance(topology, type):
        raise TopologyError(
            f"topology must be a topology object, got the class {topology.__name__}; create "
            f"one first (e.g. {topology.__name__}(num_pp=..., num_mp=1, num_dp=...))"
        )
    missing = [call for call in calls if not callable(getattr(topology, call, None))]
    if missing:
        raise TopologyError(
            f"topology {topology!r} ({type(topology).__name__}) has no "
            f"{', '.join(f'{m}()' for m in missing)} method; a topology needs {wanted}, as "
            "DeepSpeed's ProcessTopology and pipedialect.GridTopology provide"
        )
    raw = topology.get_dim("pipe")
    try:
        num_pipe = operator.index(raw)
    except TypeError:
        num_pipe = 0
    if isinstance(raw, bool) or num_pipe < 1:
        raise TopologyError(
            f"topology {type(topology).__name__}.get_dim('pipe') returned {raw!r}; it must "
            "return the number of pipeline stages, a positive int"
        )
    return num_pipe


def check_topology(topology: Any, num_stages: int | None = None) -> int:
    """Raise :class:`TopologyError` unless ``topology`` can hold a plan; return its pipe size.

    It must answer ``get_dim`` with a positive pipe size, equal to ``num_stages`` when given
    (one stage per pipe coordinate), and have no model axis beyond 1: pipedialect does not
    shard stages for tensor parallelism.
    """
    num_pipe = check_topology_object(topology, ("get_dim",))
    model = topology.get_dim("model") or 1
    if model > 1:
        raise TopologyError(
            f"the topology has a model-parallel axis of size {model}; pipedialect does not "
            "shard stages for tensor parallelism: use a topology with model=1 (num_mp=1), e.g. "
            "dialect.make_topology(num_stages, data_parallel)"
        )
    if num_stages is not None and num_pipe != num_stages:
        raise TopologyError(
            f"the topology's pipe axis has {num_pipe} coordinates but the plan has "
            f"{num_stages} stages; build the topology with num_pp={num_stages} "
            "(one stage per pipe rank)"
        )
    return num_pipe


def joined_world_size(dialect_name: str) -> int:
    """The size of the default process group, which a multi-process engine needs.

    Raises:
        ConfigError: the process group is not initialised.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            f"the process group is not initialised: call get_dialect({dialect_name!r})"
            ".init_distributed() on every rank (started by torchrun or an equivalent) "
            "before building the engine"
        )
    return int(dist.get_world_size())


def check_world_size(topology: Topology, world_size: int) -> None:
    """Raise :class:`TopologyError` unless ``topology`` describes ``world_size`` ranks."""
    if topology.world_size() != world_size:
        raise TopologyError(
            f"the topology describes {topology.world_size()} ranks but the process group "
            f"has {world_size}; launch pipe x data = {topology.world_size()} processes"
        )
