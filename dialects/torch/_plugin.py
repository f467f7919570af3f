"""The torch dialect's plugin: its Dialect class and registration hook."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import field
from typing import Any

from torch import nn

import pipedialect
from pipedialect import Capability, ConfigError, Dialect, RuntimeEngine, Topology, TopologyError
from pipedialect.contracts import (
    BOUNDARY_CAPABILITIES,
    EngineState,
    HeldStage,
    Instrumented,
    SpanRecorder,
)
from pipedialect.sdk import ENGINE_FEATURES, EngineRequest, NoOptions, PipelineRequest

from ._schedules import resolve_schedule

__all__ = ["TorchDialect", "TorchOptions", "register_dialects"]


@dataclasses.dataclass(frozen=True)
class TorchOptions:
    """What the torch dialect's ``pipe_engine`` takes beyond the shared arguments."""

    schedule: str | None = field(
        default=None, metadata={"doc": "a schedule name; default: the dialect's (1f1b)"}
    )
    stages_per_rank: int | None = field(
        default=None,
        metadata={"doc": "stages per pipeline rank; default: derived from the ranks"},
    )
    device: Any = field(
        default=None,
        metadata={"doc": "this rank's device; default: its CUDA device under NCCL, else CPU"},
    )
    data_parallel_mode: str | None = field(
        default=None,
        metadata={
            "doc": "'ddp' (default: whole stages, exact gradient averaging) or 'fsdp' (each "
            "stage's parameters, gradients and optimizer state sharded over the data axis)"
        },
    )
    tensor_parallel: Any = field(
        default=None,
        metadata={
            "doc": "{'<module path glob>': 'colwise' | 'rowwise'}: nn.Linear and nn.Embedding "
            "modules sharded over the topology's tensor axis; 'auto': a Hugging Face model's "
            "config.base_model_tp_plan"
        },
    )


class TorchDialect(Dialect):
    """``torch.distributed.pipelining``: GPipe, 1F1B, interleaved and zero-bubble schedules.

    ``pipe_engine(plan, config=..., loss_fn=..., schedule="1f1b")`` returns this rank's
    :class:`~pipedialect.dialects.torch.TorchPipeline`; ``runtime_engine(module, config=...)``
    its :class:`~pipedialect.dialects.torch.TorchEngine`, which answers to ``train_batch`` and
    ``eval_batch`` as DeepSpeed's ``PipelineEngine`` does.

    Args:
        schedule: the default schedule of :meth:`pipe_engine` (see
            :func:`~pipedialect.dialects.torch.available_schedules`). An instance whose
            default schedule places several stages on a rank does not declare
            ``sharded-data-parallel`` (FSDP runs with GPipe and 1F1B).
        stages_per_rank: the default number of stages per rank; None means 1 for GPipe and
            1F1B and 2 for the looped and V-shaped schedules (used by :meth:`make_topology`;
            :meth:`pipe_engine` derives it from the number of ranks when not given).
    """

    name = "torch"
    options = TorchOptions
    version = pipedialect.__version__
    description = "torch.distributed.pipelining (GPipe, 1F1B, interleaved, zero bubble)"
    engine_features = ENGINE_FEATURES
    capabilities = BOUNDARY_CAPABILITIES | {
        Capability.MULTI_PROCESS,
        Capability.CHECKPOINTS,
        Capability.DATA_PARALLEL,
        Capability.SHARDED_DATA_PARALLEL,
        Capability.TENSOR_PARALLEL,
        Capability.PORTABLE_CHECKPOINTS,
        Capability.TRACING,
        Capability.TRAINER_LOOP,
    }

    def __init__(self, schedule: str = "1f1b", stages_per_rank: int | None = None) -> None:
        self.schedule = resolve_schedule(schedule, installed=False).name
        if stages_per_rank is not None and (
            isinstance(stages_per_rank, bool)
            or not isinstance(stages_per_rank, int)
            or stages_per_rank < 1
        ):
            raise ConfigError(
                f"stages_per_rank must be a positive integer, got {stages_per_rank!r}"
            )
        self.stages_per_rank = stages_per_rank
        if resolve_schedule(self.schedule, installed=False).placement != "single":
            # Its default schedule puts several stages on a rank, which FSDP does not run
            # (``_fsdp`` [Note: FSDP on torch]): this instance does not declare it.
            self.__dict__["capabilities"] = type(self).capabilities - {
                Capability.SHARDED_DATA_PARALLEL
            }

    def _build_pipeline(self, request: PipelineRequest[TorchOptions]) -> nn.Module:
        """Check torch's own options, then build this rank's stages of the plan.

        ``topology`` is optional: without it every rank of the process group is a pipeline
        rank; its pipe axis is the number of pipeline ranks (e.g. :meth:`make_topology`), and
        with a data axis every stage is replicated over it ([Note: data parallel on torch]).
        ``init_weights`` fills the stages this rank runs, on its device; the others stay on
        meta.

        Raises:
            ConfigError: an unknown schedule, dynamic shapes, no process group.
            TopologyError: the plan's stages do not fit the ranks under the schedule
                ([Note: stage placement]).
            TieError: tied parameters that cannot be kept in sync.
        """
        from ._build import build_pipeline

        opts = request.options
        schedule = opts.schedule if opts.schedule is not None else self.schedule
        stages_per_rank = opts.stages_per_rank
        if stages_per_rank is None and resolve_schedule(schedule).name == self.schedule:
            stages_per_rank = self.stages_per_rank
        return build_pipeline(
            request,
            schedule=schedule,
            stages_per_rank=stages_per_rank,
            device=opts.device,
            data_parallel_mode=opts.data_parallel_mode,
            tensor_parallel=opts.tensor_parallel,
        )

    def _build_engine(self, request: EngineRequest[NoOptions]) -> RuntimeEngine:
        """The :class:`~pipedialect.dialects.torch.TorchEngine` that trains the module.

        ``config`` defaults to the one given to :meth:`pipe_engine`.
        """
        from ._setup import leave_group_at_exit
        from .engine import build_engine

        engine = build_engine(request.module, request.config, **request.shared_args())
        leave_group_at_exit()  # _setup [Note: leaving the process group]
        return engine

    def local_stages(self, engine: RuntimeEngine) -> Sequence[int]:
        """The stages this rank runs (several under looped and V-shaped schedules)."""
        from .engine import TorchEngine

        if not isinstance(engine, TorchEngine):
            raise ConfigError(f"not a torch engine: {type(engine).__name__}")
        return list(engine.stage_ids)

    def engine_state(self, engine: RuntimeEngine) -> EngineState:
        """This rank's stages, each run by its wrapper inside a stage runner."""
        from pipedialect.sdk import stage_root

        from .engine import TorchEngine

        if not isinstance(engine, TorchEngine):
            raise ConfigError(f"not a torch engine: {type(engine).__name__}")
        held = []
        for runner in engine.module._runners():
            stage = runner.stage
            root = stage_root(stage)
            held.append(HeldStage(int(runner.stage_id), stage, root))
        return engine.engine_state(held, engine.module.plan)

    def instrument(self, engine: RuntimeEngine, recorder: SpanRecorder) -> Instrumented:
        """Time the schedule's sends and receives (``_trace``); skip the stages' set-up."""
        from ._trace import instrument

        return instrument(engine, recorder)

    def make_topology(
        self, num_stages: int, data_parallel: int = 1, tensor_parallel: int = 1
    ) -> Topology:
        """A ``pipe`` axis of ``num_stages / stages_per_rank`` ranks (see the class arguments)
        by a ``data`` axis of ``data_parallel`` replicas by a ``tensor`` axis of
        ``tensor_parallel`` ranks: ``pipe * data * tensor`` ranks, the pipe axis outermost and
        the tensor axis innermost (``_replicas`` [Note: the process mesh]).

        Raises:
            TopologyError: ``data_parallel`` or ``tensor_parallel`` is not a positive integer,
                or the stages do not divide evenly.
        """
        from pipedialect import GridTopology
        from pipedialect.sdk import check_tensor_axis

        check_tensor_axis(self, tensor_parallel)

        if (
            isinstance(data_parallel, bool)
            or not isinstance(data_parallel, int)
            or data_parallel < 1
        ):
            raise TopologyError(
                f"data_parallel must be a positive integer (replicas of the pipeline), got "
                f"{data_parallel!r}"
            )
        per_rank = (
            self.stages_per_rank
            or resolve_schedule(self.schedule, installed=False).default_stages_per_rank()
        )
        ranks, rest = divmod(num_stages, per_rank)
        if rest or ranks < 1:
            raise TopologyError(
                f"{num_stages} stages cannot be spread as {per_rank} stages per rank under "
                f"schedule {self.schedule!r}; partition the model into a multiple of {per_rank} "
                "stages"
            )
        return GridTopology(pipe=ranks, data=data_parallel, tensor=tensor_parallel)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self.version} schedule={self.schedule!r}>"


@pipedialect.hookimpl
def register_dialects(register: Callable[[type[Dialect]], None]) -> None:
    """Register the torch dialect."""
    register(TorchDialect)
