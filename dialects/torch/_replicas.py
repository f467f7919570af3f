"""Data parallelism on the torch dialect: the process mesh, pipeline replicas and their
gradient averaging.

[Note: the process mesh]
A topology of ``pipe`` x ``data`` x ``tensor`` ranks is laid out as DeepSpeed lays out its
``pipe``, ``data`` and ``model`` axes: the pipe axis outermost, the tensor axis innermost, so the
rank at ``(pipe=p, data=d, tensor=t)`` is ``(p * data + d) * tensor + t`` (``make_topology``'s
:class:`~pipedialect.GridTopology`; a caller's topology may lay ranks out otherwise, and its
``filter_match`` is read instead). ``analyze_tie_ranks`` and every tool that reads a DeepSpeed
topology read this one too. When any axis but the pipe axis has more than one rank, or the
stages are sharded, one ``DeviceMesh`` with the dimensions ``("pipe", "data", "tensor")`` is
built over exactly that layout, once, and every axis takes its process group from it: the
pipeline sends and receives (``"pipe"``), the replicas' gradient sums or FSDP's collectives
(``"data"``) and tensor parallelism (``"tensor"``). The ranks at one ``(data, tensor)``
coordinate are one pipeline (a *line*), whose ``PipelineStage`` objects talk over its pipe
group only, so the pipelines never see each other.

[Note: data parallel on torch]
Replica ``d`` is one whole pipeline; the ranks running pipeline position ``p`` in every replica
form that position's data-parallel group.

When the engine is built, replica 0's parameters and buffers are broadcast to the other
replicas (as DeepSpeed's engine broadcasts the model), so they start equal even if each rank
initialised its model differently. Each replica reads its own data iterator,
``gradient_accumulation_steps`` micro-batches per step (DeepSpeed's triple:
``train_batch_size = micro * gas * data``). Every micro-batch loss is
divided by ``gas * data`` before its backward, and after the schedule's backward (and the
tied-weight sum within each pipeline, ``_ties``) each data-parallel group sums its gradients:
every replica then holds the gradient of the mean loss over all replicas' micro-batches, the
unsplit model's on the concatenated batches. Each parameter is summed once, over its own
position's group, so a tied weight is summed over the stages of its pipeline and then over the
replicas, never twice. The sum runs on one flat buffer per dtype, in the stage modules'
parameter order, which is the same on every rank of a group.

The gradient norm for clipping is the norm of that averaged gradient: each pipeline sums its
stages' squares over its own group (ties counted once, ``_ties``), and every replica finds the
same norm. The loss ``train_batch`` returns is the mean over replicas of each replica's mean
micro-batch loss, gathered from each replica's last stage in replica order, on every rank.

``data_parallel_mode="ddp"`` (the default) is this explicit, exact averaging: every replica
keeps whole stages. ``data_parallel_mode="fsdp"`` shards each stage's parameters, gradients and
optimizer state over the data axis instead (``_fsdp`` [Note: FSDP on torch]); the loss scaling
and the meaning of the returned loss are the same.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipedialect import ConfigError, Topology
from pipedialect.sdk import is_sharded, local_part

__all__: list[str] = []

logger = logging.getLogger(__name__)

#: The values of ``data_parallel_mode``.
DATA_PARALLEL_MODES = ("ddp", "fsdp")
#: The names of the mesh's dimensions, outermost first ([Note: the process mesh]).
MESH_DIMS = ("pipe", "data", "tensor")


def check_data_parallel_mode(mode: object) -> str:
    """Return ``mode`` (``"ddp"`` when None) if this dialect runs it; see [Note: data parallel
    on torch] and ``_fsdp`` [Note: FSDP on torch].

    Raises:
        ConfigError: an unknown mode.
    """
    if mode is None:
        return "ddp"
    if not isinstance(mode, str) or mode not in DATA_PARALLEL_MODES:
        raise ConfigError(
            f"data_parallel_mode must be one of {', '.join(map(repr, DATA_PARALLEL_MODES))}, "
            f"got {mode!r}"
        )
    return mode


def _rank_at(
    topology: Topology | None, pipe: int, data: int, tensor: int, data_size: int, tensor_size: int
) -> int:
    """The global rank at ``(pipe, data, tensor)``: the topology's, else the grid's layout."""
    if topology is None:
        return (pipe * data_size + data) * tensor_size + tensor
    coords = {"pipe": pipe}
    if topology.get_dim("data"):
        coords["data"] = data
    if topology.get_dim("tensor"):
        coords["tensor"] = tensor
    return int(topology.filter_match(**coords)[0])


def _over_data(tensor: Any) -> bool:
    """Whether ``tensor`` is sharded over the data axis (FSDP), not only the tensor axis."""
    if not is_sharded(tensor):
        return False
    names = tensor.device_mesh.mesh_dim_names or ()
    return "data" in names


def _broadcast(tensors: Sequence[torch.Tensor], src: int, group: Any) -> None:
    """Broadcast ``tensors`` from global rank ``src`` over ``group``, one flat buffer per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for same in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in same])
            dist.broadcast(flat, src=src, group=group)
            offset = 0
            for t in same:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


class Replicas:
    """The pipelines of a ``pipe`` x ``data`` x ``tensor`` grid; see [Note: data parallel on
    torch] and [Note: the process mesh].

    A *line* is one pipeline: the ranks at one ``(data, tensor)`` coordinate, ``line = data *
    tensor_size + tensor``. ``placements[line]`` maps every stage to the global rank running it
    in that line. Building one creates the process groups (the device mesh), a collective every
    rank takes part in alike.

    Args:
        pipe: pipeline ranks per line.
        data: data-parallel replicas.
        topology: the caller's topology (its rank layout), or None for the grid's own.
        tensor: ranks on the tensor axis.
        mesh: build the device mesh even when ``data`` and ``tensor`` are 1 (a sharded mode).
        device_type: the mesh's device type (``"cpu"`` under gloo, ``"cuda"`` under NCCL).
    """

    def __init__(
        self,
        pipe: int,
        data: int,
        topology: Topology | None,
        *,
        tensor: int = 1,
        mesh: bool = False,
        device_type: str = "cpu",
    ) -> None:
        self.pipe = pipe
        self.data = data
        self.tensor = tensor
        #: ``ranks[line][p]``: the global rank at pipeline position ``p`` of ``line``.
        self.ranks = tuple(
            tuple(_rank_at(topology, p, d, t, data, tensor) for p in range(pipe))
            for d in range(data)
            for t in range(tensor)
        )
        rank = dist.get_rank()
        (self.line, self.position) = next(
            (line, p)
            for line in range(len(self.ranks))
            for p in range(pipe)
            if self.ranks[line][p] == rank
        )
        #: This rank's data-parallel replica and tensor-parallel position.
        self.replica, self.tensor_rank = divmod(self.line, tensor)
        #: The one device mesh of every axis (None for a plain pipeline).
        self.mesh: Any = None
        self.pipeline_group: Any = None
        self.data_group: Any = None
        #: The ranks of this pipeline position and replica on the tensor axis (None: one).
        self.tensor_group: Any = None
        if data > 1 or tensor > 1 or mesh:
            self.mesh = self._build_mesh(device_type)
            self.pipeline_group = self.mesh.get_group("pipe")
            if data > 1:
                self.data_group = self.mesh.get_group("data")
            if tensor > 1:
                self.tensor_group = self.mesh.get_group("tensor")
            logger.debug(
                "replica %d of %d, tensor rank %d of %d, pipeline ranks %s",
                self.replica,
                data,
                self.tensor_rank,
                tensor,
                self.ranks[self.line],
            )

    def _build_mesh(self, device_type: str) -> Any:
        """The ``(pipe, data, tensor)`` device mesh over the grid's ranks (a collective)."""
        from torch.distributed.device_mesh import DeviceMesh

        grid = torch.tensor(
            [
                [
                    [self.ranks[d * self.tensor + t][p] for t in range(self.tensor)]
                    for d in range(self.data)
                ]
                for p in range(self.pipe)
            ],
            dtype=torch.int64,
        )
        return DeviceMesh(device_type, grid, mesh_dim_names=MESH_DIMS)

    def position_of(self, rank: int) -> int:
        """The pipeline position of global ``rank`` in this rank's replica."""
        return self.ranks[self.line].index(rank)

    def placements(self, pipe_placement: Mapping[int, int]) -> list[dict[int, int]]:
        """Every line's stage -> global rank map, from the stage -> position map."""
        return [{k: ranks[p] for k, p in pipe_placement.items()} for ranks in self.ranks]

    def broadcast_state(self, module: nn.Module) -> None:
        """Give every replica replica 0's parameters and buffers of this rank's stages, and
        every rank of the tensor axis its rank 0's whole tensors.

        Every rank builds its own model; this makes the replicas start equal even when the
        model's initialisation is not seeded alike on every rank (as DeepSpeed's engine
        broadcasts the model at start). Nothing happens with one replica and no tensor axis.
        """
        if self.tensor_group is not None:
            # Whole tensors first, within the replica: a tensor-parallel shard was cut from
            # the tensor axis' rank 0 already (``_tensor``).
            whole = [p.data for p in module.parameters() if not is_sharded(p)]
            whole += [b for b in module.buffers() if not is_sharded(b)]
            src = self.ranks[self.replica * self.tensor][self.position]
            _broadcast(whole, src, self.tensor_group)
        if self.data_group is None:
            return
        # A parameter sharded over the data axis (FSDP) holds another slice on every replica:
        # nothing to broadcast (its stage was loaded alike on every replica, ``_fsdp``); a
        # tensor-parallel shard is the same slice on every replica.
        tensors = [local_part(p.data) for p in module.parameters() if not _over_data(p)]
        tensors += [local_part(b) for b in module.buffers() if not _over_data(b)]
        _broadcast(tensors, self.ranks[self.tensor_rank][self.position], self.data_group)

    def sum_grads(self, parameters: Sequence[nn.Parameter]) -> None:
        """Sum the gradients of ``parameters`` over this position's data-parallel group.

        A parameter without a gradient takes part with zeros (every rank of the group sends the
        same layout). Nothing happens with one replica.
        """
        if self.data_group is None:
            return
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for param in parameters:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            by_dtype.setdefault(param.grad.dtype, []).append(param)
        for params in by_dtype.values():
            grads = [local_part(p.grad) for p in params if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.data_group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def sum_flat(self, flat: torch.Tensor) -> None:
        """Sum one flat gradient tensor in place over this position's data-parallel group (the
        bf16 engine's reduction in its communication dtype, ``pipedialect.engine.precision``)."""
        if self.data_group is not None:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.data_group)

    def mean_loss(
        self, loss: torch.Tensor, last_position: int, device: torch.device
    ) -> torch.Tensor:
        """The mean over replicas of each replica's loss (held by its last stage's rank).

        Every rank calls it and gets the same value.
        """
        mine = loss.detach().reshape(()).to(device, torch.float32).clone()
        if self.data == 1:
            dist.broadcast(mine, src=self.ranks[0][last_position])
            return mine
        gathered = [
            torch.zeros((), device=device, dtype=torch.float32)
            for _ in range(dist.get_world_size())
        ]
        dist.all_gather(gathered, mine)
        total = gathered[self.ranks[0][last_position]].clone()
        for d in range(1, self.data):
            total += gathered[self.ranks[d * self.tensor][last_position]]
        return total / self.data
