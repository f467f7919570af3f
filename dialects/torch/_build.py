"""Building the torch pipeline: every check that can fail runs before any collective.

Creating the tie process groups and broadcasting tied weights are collectives, and a collective
that only some ranks reach hangs the others. So the arguments, the schedule, the placement, the
process group and the stage modules are all validated first; a mistake raises a named error on
every rank alike (they all see the same arguments), never a hang.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pipedialect import ConfigError, Topology, TopologyError
from pipedialect.sdk import (
    Precision,
    check_topology,
    check_world_size,
    joined_world_size,
    parse_config,
    written_in_forward,
)

from ._fsdp import check_fsdp_schedule, fsdp_reduce_dtype
from ._replicas import check_data_parallel_mode
from ._schedules import ScheduleSpec, resolve_schedule, stage_to_rank
from ._tensor import (
    TensorLayout,
    apply_layout,
    reference_skeletons,
    resolve_layout,
    retie_sharded,
)

if TYPE_CHECKING:
    from pipedialect.sdk import PipelinePlan, PipelineRequest

    from .engine import TorchPipeline

__all__: list[str] = []


def resolve_placement(
    spec: ScheduleSpec,
    num_stages: int,
    num_ranks: int,
    stages_per_rank: int | None,
) -> dict[int, int]:
    """Check ``stages_per_rank`` against the plan and the ranks; return the placement."""
    if stages_per_rank is not None:
        if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int):
            raise ConfigError(f"stages_per_rank must be an integer, got {stages_per_rank!r}")
        if stages_per_rank * num_ranks != num_stages:
            raise TopologyError(
                f"stages_per_rank={stages_per_rank} on {num_ranks} pipeline ranks needs a plan "
                f"of {stages_per_rank * num_ranks} stages, but the plan has {num_stages}; "
                "partition the model accordingly, or change stages_per_rank or the number of "
                "ranks"
            )
    return stage_to_rank(spec, num_stages, num_ranks)


def _grid(topology: Topology | None) -> tuple[int, int, int] | None:
    """The topology's ``(pipe, data, tensor)`` sizes; None without a topology."""
    if topology is None:
        return None
    pipe = check_topology(topology)  # the pipe axis counts ranks here, not stages
    data = topology.get_dim("data") or 1
    tensor = topology.get_dim("tensor") or 1
    if topology.world_size() != pipe * data * tensor:
        raise TopologyError(
            f"the topology has {topology.world_size()} ranks but a pipe axis of {pipe}, a "
            f"data axis of {data} and a tensor axis of {tensor}; the torch dialect needs every "
            "rank on the pipe x data x tensor grid"
        )
    return pipe, data, tensor


def _device(device: torch.device | str | None) -> torch.device:
    import torch.distributed as dist

    if device is not None:
        return torch.device(device)
    if dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device("cpu")


def build_pipeline(
    request: PipelineRequest[Any],
    *,
    schedule: str,
    stages_per_rank: int | None,
    device: torch.device | str | None,
    data_parallel_mode: object = None,
    tensor_parallel: object = None,
) -> TorchPipeline:
    """Validate what is torch's own, then build the :class:`~.engine.TorchPipeline` of this rank.

    The shared arguments were checked by :meth:`pipedialect.Dialect.pipe_engine`.
    """
    plan, topology = request.plan, request.topology
    mode = check_data_parallel_mode(data_parallel_mode)
    grid = _grid(topology)
    data = 1 if grid is None else grid[1]
    tensor = 1 if grid is None else grid[2]
    config = parse_config(request.config, world_size=data)
    spec = resolve_schedule(schedule)
    check_split_backward_stages(spec, request.stages)
    if mode == "fsdp":
        check_fsdp_schedule(spec)
        fsdp_reduce_dtype(config.precision)
        _refuse_written_parameters(request.stages)
    layout = resolve_layout(tensor_parallel, request.stages, plan.model, tensor, plan.tie_groups)
    if layout is None and tensor > 1:
        raise ConfigError(
            f"the topology has a tensor axis of {tensor} ranks but pipe_engine was given no "
            "tensor_parallel plan, so every rank of that axis would run the same whole "
            "stages; pass tensor_parallel={'<module path glob>': 'colwise' | 'rowwise'} (or "
            "'auto' for a Hugging Face model), or build the topology with tensor_parallel=1"
        )
    num_stages = plan.num_stages
    if grid is not None:
        placement = resolve_placement(spec, num_stages, grid[0], stages_per_rank)
    world = joined_world_size(request.dialect.name)
    if topology is not None:
        check_world_size(topology, world)
    if grid is None:
        placement = resolve_placement(spec, num_stages, world, stages_per_rank)
    return _construct(
        plan,
        list(request.stages),
        spec,
        placement,
        request.loss_fn,
        request.config,
        device,
        topology,
        data,
        request.init_weights,
        fsdp=mode == "fsdp",
        precision=config.precision,
        layout=layout,
    )


def check_split_backward_stages(spec: ScheduleSpec, stages: Sequence[nn.Module]) -> None:
    """Refuse a zero-bubble schedule when a stage has nothing to train.

    [Note: split backward and stages with nothing to train] The zero-bubble schedules
    (``interleaved_zero_bubble``, ``zbv_zero_bubble``, ``dualpipev``) split each stage's
    backward into an input pass and a weight pass. With a stage whose parameters are all frozen
    (or that has none), torch 2.13's ZBV schedule trained a fuzzer model (a frozen first stage
    on the rank that also holds the last, frozen tied blocks) to gradients 1e-2 away from the
    unsplit model, with no error. Until the cause is known such layouts are refused, on every
    rank alike (every rank holds the plan's stage modules), before any collective.

    Raises:
        ConfigError: ``spec`` splits backward and a stage has no trainable parameter.
    """
    if not spec.split_backward:
        return
    idle = [
        k for k, stage in enumerate(stages) if not any(p.requires_grad for p in stage.parameters())
    ]
    if idle:
        which = ("stage " if len(idle) == 1 else "stages ") + ", ".join(str(k) for k in idle)
        verb = "has" if len(idle) == 1 else "have"
        raise ConfigError(
            f"schedule {spec.name!r} splits backward into input and weight passes, and {which} "
            f"{verb} nothing to train (every parameter frozen, or none); torch's "
            f"zero-bubble weight pass is not known to train such a layout as the unsplit model "
            f"does, so it is refused: use a schedule without split backward ('1f1b', "
            f"'interleaved_1f1b', 'looped_bfs', 'gpipe'), or move the split points so that "
            f"every stage holds a trainable parameter"
        )


def _construct(
    plan: PipelinePlan,
    stages: list[nn.Module],
    spec: ScheduleSpec,
    pipe_placement: dict[int, int],
    loss_fn: Callable[[Any, Any], Any],
    config: Mapping[str, Any],
    device: torch.device | str | None,
    topology: Topology | None,
    data: int,
    init_weights: Callable[[nn.Module], None] | None = None,
    *,
    fsdp: bool = False,
    precision: Precision | None = None,
    layout: TensorLayout | None = None,
) -> TorchPipeline:
    import torch.distributed as dist

    from pipedialect.sdk import cast_parameters, prepare_local_stages

    from ._fsdp import FsdpStages
    from ._replicas import Replicas
    from ._ties import TieSync
    from .engine import TorchPipeline

    pipe = len(set(pipe_placement.values()))
    where = _device(device)
    tensor = 1 if layout is None else layout.size
    replicas = Replicas(
        pipe,
        data,
        topology if data > 1 or tensor > 1 else None,
        tensor=tensor,
        mesh=fsdp,
        device_type=where.type,
    )
    placements = replicas.placements(pipe_placement)
    rank = dist.get_rank()
    local = [k for k, r in placements[replicas.line].items() if r == rank]
    # Sharded with weights to load: shard on the meta device first, so that each rank
    # materialises its shards only ([Note: FSDP on torch] in ``_fsdp``).
    shard_first = (fsdp or layout is not None) and init_weights is not None
    if not shard_first:
        prepare_local_stages(plan, local, where, init_weights)
    references: dict[int, nn.Module] = {}
    if layout is not None:
        # Every rank of the tensor axis starts from its rank 0's whole stages, which the
        # shards are then cut from; the first batch checks the layout against references
        # (skeletons now, filled from the shards then: [Note: the layout check's reference]). Under
        # bf16 the stages are cast first: a sharded parameter is cast as a whole, here.
        if precision is not None and precision.bf16:
            for k in local:
                cast_parameters(stages[k], precision.param_dtype)
        if not shard_first:
            replicas.broadcast_state(nn.ModuleList(stages[k] for k in local))
        references = reference_skeletons({k: stages[k] for k in local})
        for k in local:
            apply_layout(k, stages[k], layout, replicas.mesh["tensor"])
        retie_sharded(plan.tie_groups, stages, local)
    ties = TieSync.build(plan.tie_groups, stages, placements, line=replicas.line)
    pipeline = TorchPipeline(
        plan,
        stages,
        spec=spec,
        placement=placements[replicas.line],
        loss_fn=loss_fn,
        config=config,
        ties=ties,
        device=where,
        replicas=replicas,
    )
    pipeline.tensor_layout = layout
    pipeline.references = references
    if not fsdp and not shard_first:
        replicas.broadcast_state(pipeline)
        ties.broadcast_weights()
        return pipeline
    precision = precision or Precision()
    if not shard_first:  # replicas start from replica 0's whole stages
        replicas.broadcast_state(pipeline)
        ties.broadcast_weights()
    if not fsdp:  # tensor parallel alone, on the meta device: materialise the shards
        prepare_local_stages(plan, local, where, init_weights)
        pipeline.ties = ties.rebind(stages)
        replicas.broadcast_state(pipeline)
        pipeline.ties.broadcast_weights()
        return pipeline
    if precision.bf16:  # cast before sharding: FSDP gathers what the engine trains
        cast_parameters(pipeline, precision.param_dtype)
    sharded = FsdpStages(
        pipeline._runners(),
        replicas.mesh,
        plan.model,
        fsdp_reduce_dtype(precision),
        recomputed=plan.recomputed,
    )
    pipeline.fsdp = sharded
    if shard_first:
        prepare_local_stages(plan, local, where, init_weights, after_empty=sharded.reset_shards)
    pipeline.ties = ties.rebind(stages)
    if shard_first:  # every replica loaded the same weights; buffers and ties still agree
        replicas.broadcast_state(pipeline)
        pipeline.ties.broadcast_weights()
    return pipeline


def _refuse_written_parameters(stages: Sequence[nn.Module]) -> None:
    """FSDP gathers each parameter into a copy for the forward and drops the copy afterwards: a
    forward that writes a parameter in place (running state kept in an ``nn.Parameter``,
    ``nn.Embedding(max_norm=...)``) would lose the write. Refused by name, on every rank alike
    (every rank scans the same plan)."""
    for k, stage in enumerate(stages):
        for name in sorted(written_in_forward(stage)):
            raise ConfigError(
                f"[Stage {k}] forward writes the parameter {name!r} in place, and "
                "data_parallel_mode='fsdp' gathers parameters into copies it drops after the "
                "forward, so the write would be lost. Keep the running state in a buffer "
                "(register_buffer), or use data_parallel_mode='ddp'"
            )
