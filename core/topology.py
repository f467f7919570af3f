"""Process grids and joining the process group: the concrete side of :class:`Topology`.

:class:`GridTopology` is the ``pipe`` x ``data`` grid for dialects without a runtime topology
class; :func:`join_process_group` is what :meth:`~pipedialect.dialect.Dialect.init_distributed`
does by default.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import NamedTuple

import torch

from .contracts import Capability
from .errors import ConfigError, TopologyError

__all__ = ["GridCoord", "GridTopology", "join_process_group"]

#: What ``torch.distributed``'s default ``env://`` rendezvous reads; a launcher sets them.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class GridTopology:
    """A row-major ``pipe`` x ``data`` grid, for dialects that need no runtime topology class.

    Ranks are laid out as DeepSpeed's ``PipeDataParallelTopology`` lays them out: the data axis
    varies fastest, so the ranks of one pipeline stage are contiguous.
    """

    def __init__(self, pipe: int, data: int = 1) -> None:
        if pipe < 1 or data < 1:
            raise TopologyError(f"pipe ({pipe}) and data ({data}) must both be at least 1")
        self._dims = {"pipe": pipe, "data": data}

    def get_dim(self, axis: str) -> int:
        """Return the size of ``axis``; 0 for an axis the grid does not have."""
        return self._dims.get(axis, 0)

    def world_size(self) -> int:
        """Return ``pipe * data``."""
        return self._dims["pipe"] * self._dims["data"]

    def get_coord(self, rank: int) -> GridCoord:
        """Return the ``(pipe, data)`` coordinate of ``rank``."""
        if not 0 <= rank < self.world_size():
            raise TopologyError(f"rank {rank} is outside a grid of {self.world_size()} ranks")
        pipe, data = divmod(rank, self._dims["data"])
        return GridCoord(pipe=pipe, data=data)

    def get_rank(self, *, pipe: int, data: int = 0) -> int:
        """Return the global rank at ``(pipe, data)``."""
        return pipe * self._dims["data"] + data

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
        return f"GridTopology(pipe={self._dims['pipe']}, data={self._dims['data']})"


class GridCoord(NamedTuple):
    """A ``(pipe, data)`` coordinate with named fields, like DeepSpeed's ProcessCoord."""

    #: The pipeline stage.
    pipe: int
    #: The data-parallel replica.
    data: int


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
