"""Sharded data parallelism on the torch dialect: each stage under FSDP2 over the data axis.

[Note: FSDP on torch]
With ``data_parallel_mode="fsdp"`` every stage this rank runs is sharded with ``fully_shard``
over the ``"data"`` dimension of the process mesh (``_replicas`` [Note: the process mesh]): its
parameters, their gradients and the optimizer's state are ``DTensor`` s holding ``1/data`` of
each tensor (dim 0, padded). Everything around it is the DDP mode's: each replica reads its own
micro-batches, each micro-batch loss is divided by ``gas * data`` before its backward, the
returned loss is the mean over replicas. What differs, and why:

- *Units.* One FSDP unit per block by default -- a child of a ``ModuleList``, ``ModuleDict`` or
  ``Sequential`` of the model (``blocks.3``, ``model.layers.0``) -- and one on the stage's
  :class:`~._stage.StageRunner`, the module torch's ``PipelineStage`` holds as ``submod``.
  The runner must be the root: ``PipelineStage`` defers the gradient reduction to the end of
  the step only when ``submod`` is an FSDP module, and the root unit gathers every parameter
  no block unit holds. A stage is an fx ``GraphModule``: a block is rarely a module that is
  *called* (fx traces through it and calls its leaves, ``blocks.3.attn.q``), and a unit whose
  modules never run its forward would never gather its parameters. So a block's unit is the
  list of the modules the graph calls under it (``fully_shard([...])``, one group of hooks),
  and a block is a unit only if every one of its parameters belongs to such a called module
  and nothing else reads it (a ``get_attr`` in the graph, a tie with a module outside the
  block); otherwise its parameters stay in the root unit. No parameter is outside a unit whose
  forward runs, by construction (:func:`unit_plan`).
- *When parameters are gathered.* ``reshard_after_forward=False``: a unit's parameters are
  all-gathered at its first forward of the step and stay gathered through every micro-batch's
  forward and backward; ``PipelineStage`` turns gradient synchronisation off for each
  micro-batch's backward and, after the last one, reduce-scatters every unit's accumulated
  gradients once and reshards (``perform_reduce_grad``). So a step all-gathers each unit once
  and reduce-scatters it once, whatever the number of micro-batches (with ``True`` every
  micro-batch would gather each unit twice more: the schedule interleaves micro-batches, so a
  unit's parameters are needed again before the step ends). The price is that a stage's
  parameters and its unreduced gradients are whole during the step, as in torchtitan's choice
  under pipelining (ZeRO-2-like during the step, ZeRO-3 between steps).
- *The loss scale.* The schedule is built with ``scale_grads=False`` (it does not divide by the
  micro-batch count) and every unit's gradient divide factor is 1 (FSDP sums instead of
  averaging over the replicas); the engine's division of each loss by ``gas * data`` is then
  the only scaling, as in the DDP mode. Either default left on would scale gradients a second
  time with no error. :meth:`FsdpStages.check_untouched` refuses a step after someone changed
  a unit's gradient synchronisation or divide factor by hand (``set_requires_gradient_sync``,
  ``set_gradient_divide_factor``): the engine owns both.
- *Ties.* A weight tied across stages is a separate sharded parameter on each stage's rank,
  sharded alike (same global shape, same data axis), so the tie's gradient sum and weight
  broadcast (``_ties``) run on the local shards, between the ranks of one replica.
- *Clipping.* Each rank sums the squares of its shards (a tied weight on its owning stage
  only) and the sum is all-reduced over the whole mesh: the global norm over every stage and
  replica, as the unsplit model's.
- *bf16.* The stages are cast to bf16 before they are sharded, so FSDP gathers bf16 shards;
  the engine's fp32 masters are sharded like the parameters, and gradients are accumulated
  over the micro-batches and reduce-scattered in ``data_types.grad_accum_dtype``
  (``MixedPrecisionPolicy.reduce_dtype``), which must therefore be the
  ``communication_data_type`` too.
- *A warning silenced.* FSDP2 warns when a unit returns a view, because an in-place update of
  that view would drop the hook that gathers the unit's parameters for its backward. Here the
  parameters stay gathered until the end of the step and ``PipelineStage`` runs every unit's
  post-backward itself, so nothing depends on that hook, and building FSDP stages silences
  that one warning (a stage graph's units are leaves such as ``nn.Linear``, whose outputs are
  often views).
- *Buffers* are not sharded: every replica holds whole buffers (running statistics, counters),
  starts from replica 0's and updates its own from its own micro-batches, as in the DDP mode.
- *Schedules.* GPipe and 1F1B (one stage per rank). A schedule that puts several stages on a
  rank is refused: each stage would be a separate FSDP root on one rank, and torch's
  multi-stage runtime with FSDP is not known to train exactly (pytorch#164756 is open).
- *Checkpoints.* Each rank's engine checkpoint holds its shards (the same layout must load
  it); portable checkpoints (:mod:`pipedialect.checkpoint`) save and load by name through the
  shards, so they move between this and every other layout.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from pipedialect import ConfigError
from pipedialect.sdk import Precision, stage_root

from ._schedules import ScheduleSpec
from ._stage import StageRunner

__all__: list[str] = []

logger = logging.getLogger(__name__)

#: FSDP2's warning about a unit returning a view ([Note: FSDP on torch]: harmless here).
_VIEW_WARNING = r"FSDP2-wrapped module .* returned a view tensor"
#: The containers whose children are blocks (one FSDP unit each).
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def check_fsdp_schedule(spec: ScheduleSpec) -> None:
    """Refuse a schedule that places several stages on a rank ([Note: FSDP on torch]).

    Raises:
        ConfigError: ``spec`` is looped or V-shaped.
    """
    if spec.placement != "single":
        raise ConfigError(
            f"data_parallel_mode='fsdp' runs one stage per rank, and schedule {spec.name!r} "
            "places several stages on each rank: each would be its own FSDP root on one rank, "
            "which torch's multi-stage runtime is not known to train exactly with FSDP "
            "(pytorch#164756 is open). Use schedule='1f1b' or 'gpipe', or "
            "data_parallel_mode='ddp' for this schedule"
        )


def fsdp_reduce_dtype(precision: Precision) -> torch.dtype | None:
    """The dtype FSDP accumulates and reduces gradients in: None in fp32 (the parameters'),
    ``grad_accum_dtype`` under bf16 ([Note: FSDP on torch]).

    Raises:
        ConfigError: under bf16, ``communication_data_type`` differs from ``grad_accum_dtype``
            (FSDP reduces in the dtype it accumulates in).
    """
    if not precision.bf16:
        return None
    if precision.communication_dtype != precision.grad_accum_dtype:
        accum = "fp32" if precision.grad_accum_dtype == torch.float32 else "bf16"
        comm = "fp32" if precision.communication_dtype == torch.float32 else "bf16"
        raise ConfigError(
            f"data_parallel_mode='fsdp' accumulates gradients over the micro-batches and "
            f"reduce-scatters them in one dtype, but the config accumulates in {accum} "
            f"(data_types.grad_accum_dtype) and communicates in {comm} "
            f"(communication_data_type, bf16 by default under bf16); set "
            f'"communication_data_type": "{accum}" (or make both bf16)'
        )
    return precision.grad_accum_dtype


@dataclass(frozen=True)
class Unit:
    """One FSDP unit of a stage: a block, and the modules of it that the stage graph calls."""

    #: The block's path (the model's name for it).
    path: str
    #: The paths, in the stage module, of the modules the graph calls under the block.
    called: tuple[str, ...]


def _graph(stage: nn.Module) -> fx.Graph | None:
    root = stage_root(stage)
    graph = getattr(root, "graph", None)
    return graph if isinstance(graph, fx.Graph) else None


def _blocks(model: nn.Module | None) -> list[str]:
    """The paths of the model's blocks (children of its containers), outermost first."""
    if model is None:
        return []
    paths: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, _CONTAINERS):
            paths.extend(
                f"{name}.{child}" if name else child for child, _ in module.named_children()
            )
    return sorted(set(paths), key=lambda p: (p.count("."), p))


def _under(name: str, path: str) -> bool:
    return name == path or name.startswith(path + ".")


def unit_plan(
    stage: nn.Module, model: nn.Module | None, recomputed: Sequence[str] = ()
) -> list[Unit]:
    """The block units of one stage module ([Note: FSDP on torch]); the rest is the root's.

    A block is a unit when the stage holds parameters under it, every one of them belongs to a
    module the stage's graph calls (inside the block), and none is also reached otherwise (a
    ``get_attr`` node, another name outside the block). An outer block that qualifies is taken
    whole; one that does not leaves its inner blocks to be tried. A module the plan recomputes
    (``recomputed``, the plan's paths) is read by a ``get_attr`` and called by the
    recomputation, so it counts as called.
    """
    root = stage_root(stage)
    graph = _graph(stage)
    if graph is None:  # not a graph: its children's forwards are not known to run
        return []
    again = set(recomputed)
    # Only modules holding parameters join a unit: FSDP hands every module of a unit its
    # inputs as views a custom Function made, which a module updating its input in place
    # (``nn.ReLU(inplace=True)``) may not modify.
    called = sorted(
        {
            str(n.target)
            for n in graph.nodes
            if n.op == "call_module" or (n.op == "get_attr" and str(n.target) in again)
        }
        - {
            str(n.target)
            for n in graph.nodes
            if n.op == "call_module"
            and not any(True for _ in root.get_submodule(str(n.target)).parameters())
        }
    )
    read = {str(n.target) for n in graph.nodes if n.op == "get_attr"} - again
    names_of: dict[int, list[str]] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    units: list[Unit] = []
    taken: list[str] = []
    for path in _blocks(model):
        if any(_under(path, t) for t in taken):
            continue
        try:
            block = root.get_submodule(path)
        except AttributeError:
            continue
        params = list(block.named_parameters(prefix=path, remove_duplicate=False))
        if not params:
            continue
        members = tuple(c for c in called if _under(c, path))
        if not members:
            continue
        ok = True
        for name, param in params:
            owned = any(_under(name, m) for m in members)
            elsewhere = any(not _under(other, path) for other in names_of.get(id(param), []))
            if not owned or elsewhere or any(_under(name, r) or r == name for r in read):
                ok = False
                break
        if ok:
            units.append(Unit(path, members))
            taken.append(path)
    return units


class FsdpStages:
    """This rank's stages under FSDP2 ([Note: FSDP on torch]).

    Args:
        runners: the stage runners of this rank (each becomes its stage's root unit).
        mesh: the process mesh; its ``"data"`` dimension shards the stages.
        model: the partitioned model (its containers name the blocks), or None.
        recomputed: the module paths the plan recomputes (``plan.recomputed``).
        reduce_dtype: the dtype gradients are accumulated and reduced in under bf16 (None:
            the parameters' own).
    """

    def __init__(
        self,
        runners: Sequence[StageRunner],
        mesh: Any,
        model: nn.Module | None,
        reduce_dtype: torch.dtype | None = None,
        recomputed: Sequence[str] = (),
    ) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        warnings.filterwarnings("ignore", message=_VIEW_WARNING, category=UserWarning)

        data_mesh = mesh["data"]
        policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
        self.modules: list[Any] = []
        #: For each of :attr:`modules`: ``(stage id, its unit's path; "" for the root)``.
        self.labels: list[tuple[int, str]] = []
        self.units: dict[int, list[Unit]] = {}
        for runner in runners:
            stage = runner.stage
            units = unit_plan(stage, model, recomputed)
            root = stage_root(stage)
            for unit in units:
                group = [root.get_submodule(path) for path in unit.called]
                fully_shard(
                    group if len(group) > 1 else group[0],
                    mesh=data_mesh,
                    reshard_after_forward=False,
                    mp_policy=policy,
                )
                self.modules.extend(group)
                self.labels.extend((int(runner.stage_id), unit.path) for _ in group)
            fully_shard(runner, mesh=data_mesh, reshard_after_forward=False, mp_policy=policy)
            self.modules.append(runner)
            self.labels.append((int(runner.stage_id), ""))
            self.units[int(runner.stage_id)] = units
            logger.debug(
                "[Stage %d] FSDP units: %s and the stage root",
                runner.stage_id,
                [u.path for u in units],
            )
        for module in self.modules:
            # A plain sum (no PREMUL_SUM, which gloo lacks): the loss is already divided.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
        self._expected = self._settings()

    @property
    def num_units(self) -> int:
        """FSDP units on this rank: each stage's block units and its root."""
        return sum(len(units) + 1 for units in self.units.values())

    def _settings(self) -> list[tuple[tuple[bool, float | None, bool], ...]]:
        """For every module, each of its groups' (gradient sync, divide factor, sum-only)."""
        return [
            tuple(
                (
                    bool(group.reduce_grads),
                    group.gradient_divide_factor,
                    bool(group.force_sum_reduction_for_comms),
                )
                for group in module._get_fsdp_state()._fsdp_param_groups
            )
            for module in self.modules
        ]

    def check_untouched(self) -> None:
        """Refuse a step after a unit's gradient sync or divide factor was changed by hand.

        Raises:
            ConfigError: a unit's setting differs from the one the engine made (named).
        """
        now = self._settings()
        changed = [i for i, (a, b) in enumerate(zip(now, self._expected, strict=True)) if a != b]
        if not changed:
            return
        stage, path = self.labels[changed[0]]
        sync, factor, _ = next(
            got
            for got, want in zip(now[changed[0]], self._expected[changed[0]], strict=True)
            if got != want
        )
        raise ConfigError(
            f"[Stage {stage}] the FSDP unit {path or '(stage root)'} has gradient "
            f"synchronisation {'on' if sync else 'off'} and divide factor {factor}, not what "
            "the engine set (set_requires_gradient_sync / set_gradient_divide_factor called on "
            "a stage module): the torch dialect reduces every unit once per step, after the "
            "last micro-batch, with each loss already divided by gas x replicas, and a changed "
            "setting would skip or rescale that reduction without an error. Leave them to the "
            "engine; accumulate over more micro-batches with gradient_accumulation_steps"
        )

    def reset_shards(self) -> None:
        """Re-bind every unit to the parameters its modules hold now: after ``to_empty`` (a
        meta stage given storage) each module holds a new ``DTensor`` parameter."""
        for module in self.modules:
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for param in group.fsdp_params:
                    param.reset_sharded_param()

    def reshard(self) -> None:
        """Free every gathered parameter (after evaluation, or before loading weights)."""
        for module in self.modules:
            module.reshard()
