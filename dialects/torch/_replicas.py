"""Data parallelism on the torch dialect: pipeline replicas and their gradient averaging.

[Note: data parallel on torch]
A topology of ``pipe`` x ``data`` ranks is laid out as DeepSpeed lays it out (the data axis
varies fastest: the rank at ``(pipe=p, data=d)`` is ``p * data + d``), so ``analyze_tie_ranks``
and every tool that reads a DeepSpeed topology reads this one too. Replica ``d`` is one whole
pipeline: its ranks form a process group, which its ``PipelineStage`` objects use for their
sends and receives, so the replicas' pipelines never see each other. The ranks running pipeline
position ``p`` in every replica form that position's data-parallel group.

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

``data_parallel_mode="ddp"`` (the default and, for now, the only mode) is this explicit,
exact averaging: every replica keeps whole stages, so tied weights, gradient clipping and the
per-rank checkpoints work unchanged, and the numbers are the unsplit model's. FSDP2
(``fully_shard``) would shard each stage's parameters over the data axis to save memory; its
sharded ``DTensor`` parameters do not fit the tied-weight synchronisation and the checkpoints of
this dialect yet, so ``"fsdp"`` is refused by name rather than run half-right.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipedialect import ConfigError, Topology

__all__: list[str] = []

logger = logging.getLogger(__name__)

#: The values of ``data_parallel_mode``.
DATA_PARALLEL_MODES = ("ddp", "fsdp")


def check_data_parallel_mode(mode: object) -> str:
    """Return ``mode`` if this dialect runs it; see [Note: data parallel on torch].

    Raises:
        ConfigError: an unknown mode, or ``"fsdp"``.
    """
    if mode is None:
        return "ddp"
    if not isinstance(mode, str) or mode not in DATA_PARALLEL_MODES:
        raise ConfigError(
            f"data_parallel_mode must be one of {', '.join(map(repr, DATA_PARALLEL_MODES))}, "
            f"got {mode!r}"
        )
    if mode == "fsdp":
        raise ConfigError(
            "data_parallel_mode='fsdp' is not supported by the torch dialect yet: FSDP2 shards "
            "each stage's parameters into DTensors, which its tied-weight synchronisation and "
            "per-rank checkpoints do not handle; use data_parallel_mode='ddp' (the default), "
            "which averages gradients exactly across the replicas"
        )
    return mode


def _rank_at(topology: Topology | None, pipe: int, data: int, data_size: int) -> int:
    """The global rank at ``(pipe, data)``: the topology's, else DeepSpeed's layout."""
    if topology is None:
        return pipe * data_size + data
    coords = {"pipe": pipe, "data": data} if topology.get_dim("data") else {"pipe": pipe}
    return int(topology.filter_match(**coords)[0])


class Replicas:
    """The ``data`` replicas of a ``pipe``-rank pipeline; see [Note: data parallel on torch].

    ``placements[d]`` maps every stage to the global rank running it in replica ``d``. Building
    one creates the process groups, a collective every rank takes part in alike.
    """

    def __init__(self, pipe: int, data: int, topology: Topology | None) -> None:
        self.pipe = pipe
        self.data = data
        #: ``ranks[d][p]``: the global rank at pipeline position ``p`` of replica ``d``.
        self.ranks = tuple(
            tuple(_rank_at(topology, p, d, data) for p in range(pipe)) for d in range(data)
        )
        rank = dist.get_rank()
        (self.replica, self.position) = next(
            (d, p) for d in range(data) for p in range(pipe) if self.ranks[d][p] == rank
        )
        self.pipeline_group: Any = None
        self.data_group: Any = None
        if data > 1:
            # Every rank creates every group, in the same order (new_group is a collective).
            pipelines = [dist.new_group(ranks=list(ranks)) for ranks in self.ranks]
            columns = [
                dist.new_group(ranks=[self.ranks[d][p] for d in range(data)]) for p in range(pipe)
            ]
            self.pipeline_group = pipelines[self.replica]
            self.data_group = columns[self.position]
            logger.debug(
                "replica %d of %d, pipeline ranks %s", self.replica, data, self.ranks[self.replica]
            )

    def position_of(self, rank: int) -> int:
        """The pipeline position of global ``rank`` in this rank's replica."""
        return self.ranks[self.replica].index(rank)

    def placements(self, pipe_placement: Mapping[int, int]) -> list[dict[int, int]]:
        """Every replica's stage -> global rank map, from the stage -> position map."""
        return [{k: ranks[p] for k, p in pipe_placement.items()} for ranks in self.ranks]

    def broadcast_state(self, module: nn.Module) -> None:
        """Give every replica replica 0's parameters and buffers of this rank's stages.

        Every rank builds its own model; this makes the replicas start equal even when the
        model's initialisation is not seeded alike on every rank (as DeepSpeed's engine
        broadcasts the model at start). Nothing happens with one replica.
        """
        if self.data_group is None:
            return
        tensors = [p.data for p in module.parameters()] + list(module.buffers())
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        src = self.ranks[0][self.position]
        with torch.no_grad():
            for group in by_dtype.values():
                flat = torch.cat([t.reshape(-1) for t in group])
                dist.broadcast(flat, src=src, group=self.data_group)
                offset = 0
                for t in group:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()

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
            grads = [p.grad for p in params if p.grad is not None]
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
        gathered = [torch.zeros((), device=device) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        total = gathered[self.ranks[0][last_position]].clone()
        for d in range(1, self.data):
            total += gathered[self.ranks[d][last_position]]
        return total / self.data
