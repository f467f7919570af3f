"""Tied weights across ranks, and gradient clipping with the global norm.

[Note: tied weights on torch]
``torch.distributed.pipelining`` never synchronises a parameter that several stages share: each
rank updates its own copy with its own gradient, and the copies drift apart from the second
step on. Every rank here builds the whole plan, so within one rank the stages of a tie group
hold one ``Parameter`` object (one gradient, stepped once). Across ranks, the ranks holding a
group's stages form a process group; the copies are broadcast from the lowest of those ranks
when the engine is built, and their gradients are summed (all-reduce) after every backward and
before clipping and the optimizer step, so every copy takes the step the unsplit model takes.

Gradient clipping uses the norm over all of the model's gradients, as the unsplit model would:
each rank sums the squares of its own gradients, counting a tied parameter only on the group's
lowest rank (after the all-reduce every copy holds the same gradient), and the sums are
all-reduced. The clip coefficient is DeepSpeed's, ``min(1, max_norm / (norm + 1e-6))``.

With data parallelism each replica's pipeline has its own tie groups; the sum over a group's
ranks comes first, then the data-parallel sum of every gradient (``_replicas``
[Note: data parallel on torch]), and the norm is all-reduced over one pipeline's ranks only,
so that neither the tie nor the norm counts a replica twice.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipedialect import TieError, TieGroup
from pipedialect.sdk import (
    check_frozen_ties,
    counted_square_norm,
    local_part,
    retie_parameters,
    stage_root,
)

__all__: list[str] = []

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TiedCopy:
    """One tie group as seen from this rank."""

    #: The group's key.
    key: str
    #: The global ranks holding the group's stages: first the one holding its lowest stage,
    #: which owns the weight (as on every dialect), then the others sorted.
    ranks: tuple[int, ...]
    #: The process group of those ranks (None when one rank holds every stage of the group).
    group: Any
    #: This rank's copy, or None when this rank holds none of the group's stages.
    param: nn.Parameter | None
    #: ``(name, stage)`` of this rank's copy (None with ``param``).
    where: tuple[str, int] | None = None

    @property
    def owner(self) -> int:
        """The rank that broadcasts the weight and counts it in the gradient norm."""
        return self.ranks[0]


class TieSync:
    """Keeps the copies of tied parameters on different ranks equal; see the module note."""

    def __init__(self, copies: Sequence[TiedCopy]) -> None:
        self.copies = tuple(copies)

    @classmethod
    def build(
        cls,
        groups: Iterable[TieGroup],
        stages: Sequence[nn.Module],
        placements: Sequence[Mapping[int, int]],
        line: int = 0,
    ) -> TieSync:
        """Resolve each group on this rank and create the process groups (a collective).

        ``placements[l]`` maps every stage to its global rank in pipeline ``l`` (one pipeline
        per data-parallel replica and tensor-parallel rank, ``_replicas`` [Note: the process
        mesh]); this rank is in pipeline ``line``. Every rank must call this with the same
        groups and placements: each cross-rank group of every pipeline becomes a
        ``dist.new_group``, which every rank takes part in.

        Raises:
            TieError: a member names no parameter of its stage, or copies of a tied weight
                cannot be one Parameter again (``retie_parameters``).
        """
        groups = tuple(groups)
        # Stages materialised one by one (to_empty() after a meta build) hold copies: one again.
        retie_parameters(groups, stages)
        placement = placements[line]
        rank = dist.get_rank()
        resolved: list[tuple[TieGroup, tuple[int, ...], tuple[str, int, nn.Parameter] | None]] = []
        for group in groups:
            first = placement[group.stages[0]]  # holds the lowest stage: owns the weight
            ranks = (first, *sorted({placement[s] for s in group.stages} - {first}))
            # Checked for every rank, not only this one, so that all ranks fail alike.
            held: dict[int, tuple[str, int, nn.Parameter]] = {}
            for name, stage in group:
                try:
                    found = stage_root(stages[stage]).get_parameter(name)
                except AttributeError:
                    raise TieError(
                        f"[Stage {stage}] tie group {group.key} names parameter {name!r}, which "
                        "this stage's module does not have; the stage modules do not match the "
                        "plan"
                    ) from None
                owner = placement[stage]
                if owner in held and held[owner][2] is not found:
                    other, other_stage, _ = held[owner]
                    raise TieError(
                        f"[Stage {stage}] tie group {group.key}: {name!r} here and {other!r} on "
                        f"stage {other_stage} run on the same rank ({owner}) but are different "
                        "Parameter objects; stages on one rank must share a tied parameter. "
                        "Build the stage modules with dialect.wrap_stages(plan)."
                    )
                held.setdefault(owner, (name, stage, found))
            resolved.append((group, ranks, held.get(rank)))
        if groups:  # the same groups on every rank: all of them check, or none
            check_frozen_ties(
                {
                    group.key: (name, stage, bool(mine[2].requires_grad))
                    for group, _, mine in resolved
                    if mine is not None
                    for name, stage in group
                    if placement[stage] == rank
                    and stage_root(stages[stage]).get_parameter(name) is mine[2]
                }
            )
        copies = []
        for (group, ranks, mine), pgs in zip(
            resolved, _replica_groups(groups, placements), strict=True
        ):
            pg = pgs[line] if len(ranks) > 1 else None
            param = None if mine is None else mine[2]
            where = None if mine is None else (mine[0], mine[1])
            copies.append(TiedCopy(group.key, ranks, pg, param, where))
            if len(ranks) > 1 and param is not None:
                logger.debug("tie group %s synchronised between ranks %s", group.key, ranks)
        return cls(copies)

    def _cross_rank(self) -> Iterable[tuple[TiedCopy, nn.Parameter]]:
        for copy in self.copies:
            if copy.group is not None and copy.param is not None:
                yield copy, copy.param

    def _trainable(self) -> Iterable[tuple[TiedCopy, nn.Parameter]]:
        """The cross-rank copies that take gradients (a frozen tie is frozen on every rank)."""
        return ((copy, param) for copy, param in self._cross_rank() if param.requires_grad)

    def rebind(self, stages: Sequence[nn.Module]) -> TieSync:
        """The same groups holding the parameter objects the stages hold now (sharding a stage
        replaces its parameters with new ``DTensor`` ones)."""
        copies = []
        for copy in self.copies:
            if copy.where is not None:
                name, stage = copy.where
                copy = dataclasses.replace(
                    copy, param=stage_root(stages[stage]).get_parameter(name)
                )
            copies.append(copy)
        return TieSync(copies)

    def broadcast_weights(self) -> None:
        """Make every copy equal to the owner's (at start, and after loading a checkpoint); a
        sharded copy broadcasts its local part (every copy is sharded alike,
        ``pipedialect.runtime.sharded`` [Note: sharded tensors])."""
        with torch.no_grad():
            for copy, param in self._cross_rank():
                dist.broadcast(local_part(param.data), src=copy.owner, group=copy.group)

    def all_reduce_grads(
        self, grad_of: Callable[[nn.Parameter], torch.Tensor | None] | None = None
    ) -> None:
        """Sum the gradients of every tied parameter over the ranks holding it.

        ``grad_of`` gives the tensor that holds a parameter's gradient when it is not
        ``param.grad`` (the high-precision buffer under bf16, as DeepSpeed all-reduces
        ``_hp_grad``).
        """
        for copy, param in self._trainable():
            if grad_of is not None:
                grad = grad_of(param)
                if grad is None:
                    raise TieError(
                        f"tie group {copy.key}: the engine holds no gradient buffer for this "
                        "rank's copy of the tied weight"
                    )
            else:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                grad = param.grad
            dist.all_reduce(local_part(grad), op=dist.ReduceOp.SUM, group=copy.group)

    def not_counted_here(self) -> set[int]:
        """``id`` of the tied parameters whose gradient another rank counts in the norm."""
        rank = dist.get_rank()
        return {id(param) for copy, param in self._trainable() if copy.owner != rank}


def _replica_groups(
    groups: Sequence[TieGroup], placements: Sequence[Mapping[int, int]]
) -> list[list[Any]]:
    """For each tie group, its process group in every replica (None where one rank holds it).

    Created in one order on every rank: group by group, replica by replica.
    """
    out: list[list[Any]] = []
    for group in groups:
        per_replica: list[Any] = []
        for placement in placements:
            first = placement[group.stages[0]]
            ranks = [first, *sorted({placement[s] for s in group.stages} - {first})]
            per_replica.append(dist.new_group(ranks=ranks) if len(ranks) > 1 else None)
        out.append(per_replica)
    return out


def clip_global_norm(
    parameters: Sequence[nn.Parameter],
    max_norm: float,
    skip: set[int],
    device: torch.device,
    group: Any = None,
) -> torch.Tensor:
    """Clip gradients to the global 2-norm ``max_norm``; return the norm (see the module note).

    ``parameters`` are this rank's, each once; ``skip`` holds the ids of those another rank
    counts. Every rank of ``group`` (one pipeline's ranks; None: the default group) must call
    this: the norm is all-reduced over it. With data parallelism every replica holds the
    averaged gradient by then, so each pipeline finds the same, global, norm. With sharded
    gradients (FSDP, tensor parallelism) each rank counts the elements it holds
    (``pipedialect.runtime.sharded`` [Note: sharded tensors]) and ``group`` is every rank of
    the mesh. ``max_norm <= 0`` (``gradient_clipping`` off) only computes the norm.
    """
    grads = [local_part(p.grad) for p in parameters if p.grad is not None]
    counted = [p.grad for p in parameters if p.grad is not None and id(p) not in skip]
    if counted:
        local = torch.stack([counted_square_norm(g).to(device) for g in counted]).sum()
    else:
        local = torch.zeros((), device=device)
    total_sq = local.to(device=device, dtype=torch.float32)
    dist.all_reduce(total_sq, op=dist.ReduceOp.SUM, group=group)
    total = total_sq.sqrt()
    if max_norm <= 0.0:  # gradient_clipping off: the norm only
        return total
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))
    return total
