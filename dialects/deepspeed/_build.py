"""Building the DeepSpeed pipeline module: every check that can fail runs before any collective.

``PipelineModule.__init__`` creates process groups, and a collective call that only some ranks
reach hangs the others. So the arguments, the topology, the process group and the ties are all
validated first; a mistake raises a named error on every rank alike (they all see the same
arguments), never a hang.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

from pipedialect import ConfigError, TieAnalyzer, TieError, Topology, TopologyError
from pipedialect.contracts import TieGroup
from pipedialect.sdk import DefaultTieAnalyzer, given_options, retie_parameters, stage_root

if TYPE_CHECKING:
    from pipedialect.sdk import PipelinePlan, PipelineRequest

    from ._module import PipeDialectPipelineModule, TieSpec

__all__ = ["build_pipeline_module", "check_zero_stage"]

#: PipelineModule arguments about checkpointing that a whole-stage checkpoint cannot honour.
_REFUSED_CHECKPOINT_KWARGS = frozenset({"activation_checkpoint_func", "checkpointable_layers"})


def build_pipeline_module(
    request: PipelineRequest[Any], tie_analyzer: TieAnalyzer
) -> PipeDialectPipelineModule:
    """Check what is DeepSpeed's own, then build the ``PipelineModule`` of ``request.stages``.

    :meth:`pipedialect.Dialect.pipe_engine` has checked the shared arguments (``config``,
    ``loss_fn``, the topology object, the options' names, the stage count);
    ``request.process_grid()`` checks the topology against the plan and the process group.
    ``tie_analyzer`` maps tied parameters onto ranks.
    """
    kwargs = given_options(request.options)
    refused = sorted(set(kwargs) & _REFUSED_CHECKPOINT_KWARGS)
    if refused:
        raise ConfigError(
            f"{', '.join(refused)} cannot be passed: each stage is one DeepSpeed layer and is "
            "recomputed whole with torch's non-reentrant checkpoint; pass only "
            "activation_checkpoint_interval (any value >= 1 means the same)"
        )
    config = request.config
    _check_precision(config, kwargs)
    check_zero_stage(config)
    interval = checkpoint_interval_of(config, kwargs)
    topology = _process_grid(request)
    stages = list(request.stages)
    _materialise_local_stage(request.plan, topology, request.init_weights)
    ties = resolve_ties(tie_groups_of(request.plan), stages, topology, tie_analyzer)

    from ._module import PipeDialectPipelineModule

    return PipeDialectPipelineModule(
        stages,
        topology=topology,
        loss_fn=request.loss_fn,
        ties=ties,
        dynamic_shape=request.dynamic_shapes,
        activation_checkpoint_interval=interval,
    )


def _materialise_local_stage(plan: PipelinePlan, topology: Topology, init_weights: Any) -> None:
    """Fill this rank's stage (its pipe coordinate) of a meta plan before DeepSpeed sees it.

    It runs before the ``PipelineModule`` is built (which moves its layers to the device) and
    before tied weights are broadcast, so every rank sends and receives real values.
    """
    import torch
    import torch.distributed as dist

    from pipedialect.sdk import prepare_local_stages

    stage = int(topology.get_coord(dist.get_rank()).pipe)
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    else:
        device = torch.device("cpu")
    prepare_local_stages(plan, [stage], device, init_weights)


def checkpoint_interval_of(config: Any, kwargs: Mapping[str, Any]) -> int:
    """The ``activation_checkpoint_interval`` argument, checked against the config's.

    DeepSpeed's engine lets a positive ``pipeline.activation_checkpoint_interval`` in the config
    override the module's; both must be ints >= 0 and must not disagree.
    """
    given = kwargs.get("activation_checkpoint_interval", 0)
    _check_interval("activation_checkpoint_interval", given)
    section = config.get("pipeline", {}) if isinstance(config, Mapping) else {}
    if isinstance(section, Mapping) and "activation_checkpoint_interval" in section:
        configured = section["activation_checkpoint_interval"]
        _check_interval("the config's pipeline.activation_checkpoint_interval", configured)
        if "activation_checkpoint_interval" in kwargs and configured != given:
            raise ConfigError(
                f"activation_checkpoint_interval={given} was passed but the DeepSpeed config has "
                f"pipeline.activation_checkpoint_interval={configured}; set one of them"
            )
    return int(given)


def _check_interval(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(
            f"{name} must be an int >= 0 (0: no activation recomputation; any positive value "
            f"checkpoints each whole stage, which is one DeepSpeed layer), got {value!r}"
        )


def _check_precision(config: Mapping[str, Any], kwargs: Mapping[str, Any]) -> None:
    for key in ("fp16", "bf16"):
        if key not in kwargs:
            continue
        section = config.get(key, {})
        enabled = bool(section.get("enabled", False)) if isinstance(section, Mapping) else False
        if bool(kwargs[key]) != enabled:
            raise ConfigError(
                f"{key}={kwargs[key]!r} was passed but the DeepSpeed config has "
                f"{key}.enabled={enabled}; DeepSpeed converts the model from the config, so make "
                "them agree"
            )


def check_zero_stage(config: Any) -> int:
    """The config's ZeRO stage, refused by name unless a pipeline can use it (0 or 1).

    DeepSpeed's ``PipelineEngine`` runs its own gradient reduction once per step, after the last
    micro-batch; ZeRO stage 2 (which partitions gradients during the backward passes) and stage 3
    (which partitions the parameters) do not fit that, and DeepSpeed 0.19 only asserts so after
    its base engine has built the ZeRO optimizer and its process groups. Stage 1 (optimizer state
    partitioned over the data-parallel ranks) works. A JSON path is checked when it is read.

    Raises:
        ConfigError: ``zero_optimization`` asks for stage 2 or 3, or is not understood.
    """
    if not isinstance(config, Mapping) or "zero_optimization" not in config:
        return 0
    section = config["zero_optimization"]
    if isinstance(section, bool):  # DeepSpeed's deprecated form: true means stage 1
        return int(section)
    if not isinstance(section, Mapping):
        raise ConfigError(
            f"zero_optimization must be a dict such as {{'stage': 1}}, got {section!r}"
        )
    stage = section.get("stage", 0)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage <= 3:
        raise ConfigError(
            f"zero_optimization.stage must be 0 or 1 with a DeepSpeed pipeline, got {stage!r}"
        )
    if stage >= 2:
        what = "gradients" if stage == 2 else "gradients and parameters"
        raise ConfigError(
            f"zero_optimization.stage={stage} is refused: DeepSpeed's PipelineEngine supports "
            f"ZeRO stage 0 or 1 only (stage {stage} partitions the {what} during the backward "
            "passes, but the pipeline reduces gradients itself once per step). Use stage 1, "
            "which partitions the optimizer state over the data-parallel ranks"
        )
    return stage


def _process_grid(request: PipelineRequest[Any]) -> Topology:
    """The caller's topology, which must be one of DeepSpeed's own classes, checked against the
    plan and the process group (``request.process_grid()``); the launcher must set LOCAL_RANK."""
    topology = request.topology
    if topology is None:
        raise ConfigError(
            "the DeepSpeed dialect needs topology=<one of DeepSpeed's topology classes>, e.g. "
            "dialect.make_topology(num_stages, data_parallel) "
            "(PipeModelDataParallelTopology(num_pp, num_mp=1, num_dp))"
        )
    if not hasattr(topology, "get_axis_names"):
        raise TopologyError(
            f"the DeepSpeed dialect needs one of DeepSpeed's own topology classes (it builds its "
            f"process grid from them), got {type(topology).__name__}; use "
            "dialect.make_topology(num_stages, data_parallel)"
        )
    grid = request.process_grid()
    if os.environ.get("LOCAL_RANK") is None:
        raise ConfigError(
            "LOCAL_RANK is not set; launch with torchrun or the deepspeed launcher, which set it"
        )
    return grid


def tie_groups_of(plan: PipelinePlan) -> list[tuple[str, list[tuple[str, int]]]]:
    """Return ``(key, [(parameter name, stage), ...])`` for each tie group of ``plan``."""
    return [(str(g.key), [(str(n), int(s)) for n, s in g]) for g in plan.tie_groups]


def resolve_ties(
    groups: Sequence[tuple[str, Sequence[tuple[str, int]]]],
    stages: Sequence[nn.Module],
    topology: Topology,
    tie_analyzer: TieAnalyzer | None = None,
) -> list[TieSpec]:
    """Find the module and attribute holding each tied weight on each stage.

    Raises:
        TieError: a member names no parameter of its stage, or two copies of a tied weight
            cannot be one Parameter again (``retie_parameters``: DeepSpeed keeps one copy per
            stage in sync).
    """
    from ._module import TieSpec

    specs = []
    cross = [(key, members) for key, members in groups if len({s for _, s in members}) > 1]
    if not cross:
        return []
    # Stages materialised one by one (to_empty() after a meta build) hold copies: one again.
    cross_groups = [TieGroup(key, tuple(members)) for key, members in cross]
    retie_parameters(cross_groups, stages)
    analyzer = tie_analyzer if tie_analyzer is not None else DefaultTieAnalyzer()
    tie_ranks, tie_stages = analyzer.analyze_ranks(cross_groups, topology)
    for (key, members), rank_lists, stage_ids in zip(cross, tie_ranks, tie_stages, strict=True):
        owners: dict[int, tuple[nn.Module, str]] = {}
        held: dict[int, tuple[str, nn.Parameter]] = {}
        for name, stage in members:
            if not 0 <= stage < len(stages):
                raise TieError(
                    f"tie group {key!r}: member {name!r} names stage {stage}, "
                    f"but there are {len(stages)} stages"
                )
            module, attr, param = _owner(stages[stage], name, key, stage)
            if stage in held:
                other_name, other = held[stage]
                if other is not param:
                    raise TieError(
                        f"[Stage {stage}] tie group {key!r} has two members on this stage, "
                        f"{other_name!r} and {name!r}, that are different Parameter objects; "
                        "DeepSpeed keeps one copy of a tied weight per stage in sync. Tie them "
                        f"again ({name} = {other_name}) after building the stage modules."
                    )
                continue
            held[stage] = (name, param)
            owners[stage] = (module, attr)
        specs.append(
            TieSpec(
                key=key,
                rank_groups=tuple(tuple(r) for r in rank_lists),
                owners={s: owners[s] for s in stage_ids},
            )
        )
    return specs


def _owner(stage: nn.Module, name: str, key: str, stage_id: int) -> tuple[nn.Module, str, Any]:
    root = stage_root(stage)
    prefix, _, attr = name.rpartition(".")
    try:
        module = root.get_submodule(prefix) if prefix else root
        param = getattr(module, attr)
    except AttributeError:
        raise TieError(
            f"[Stage {stage_id}] tie group {key!r} names parameter {name!r}, which this stage's "
            "module does not have; the stage modules do not match the plan"
        ) from None
    if not isinstance(param, nn.Parameter):
        raise TieError(f"[Stage {stage_id}] tie group {key!r}: {name!r} is not a Parameter")
    return module, attr, param
