"""The torch dialect's plugin: its Dialect class and registration hook."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

import pipedialect
from pipedialect import Capability, ConfigError, Dialect, RuntimeEngine, Topology, TopologyError

from ._schedules import resolve_schedule

if TYPE_CHECKING:
    from pipedialect.partition import PipelinePlan

__all__ = ["TorchDialect", "register_dialects"]

_PIPE_ENGINE_KWARGS = frozenset(
    {
        "config",
        "loss_fn",
        "schedule",
        "topology",
        "stages_per_rank",
        "device",
        "dynamic_shapes",
        "dynamic_shape",
        "data_parallel_mode",
        "init_weights",
    }
)


class TorchDialect(Dialect):
    """``torch.distributed.pipelining``: GPipe, 1F1B, interleaved and zero-bubble schedules.

    ``pipe_engine(plan, config=..., loss_fn=..., schedule="1f1b")`` returns this rank's
    :class:`~pipedialect.dialects.torch.TorchPipeline`; ``runtime_engine(module, config=...)``
    its :class:`~pipedialect.dialects.torch.TorchEngine`, which answers to ``train_batch`` and
    ``eval_batch`` as DeepSpeed's ``PipelineEngine`` does.

    Args:
        schedule: the default schedule of :meth:`pipe_engine` (see
            :func:`~pipedialect.dialects.torch.available_schedules`).
        stages_per_rank: the default number of stages per rank; None means 1 for GPipe and
            1F1B and 2 for the looped and V-shaped schedules (used by :meth:`make_topology`;
            :meth:`pipe_engine` derives it from the number of ranks when not given).
    """

    name = "torch"
    version = pipedialect.__version__
    description = "torch.distributed.pipelining (GPipe, 1F1B, interleaved, zero bubble)"
    capabilities = frozenset(
        {
            Capability.TIED_WEIGHTS,
            Capability.MULTI_GRAD_BOUNDARY,
            Capability.NON_FLOAT_TENSORS,
            Capability.PYTHON_VALUES,
            Capability.SKIP_CONNECTIONS,
            Capability.MULTI_PROCESS,
            Capability.CHECKPOINTS,
            Capability.DATA_PARALLEL,
        }
    )

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

    def pipe_engine(
        self, plan: PipelinePlan, stage_modules: Sequence[nn.Module] | None = None, **kwargs: Any
    ) -> nn.Module:
        """Check everything, then build this rank's stages of ``plan``.

        Keyword arguments: ``config`` (a DeepSpeed config dict) and ``loss_fn(outputs, labels)``
        (required); ``schedule`` (a name, default this dialect's); ``topology`` (optional: a
        topology whose pipe axis is the number of ranks, e.g. :meth:`make_topology`; without
        it every rank of the process group is a pipeline rank; with a data axis every stage is
        replicated over it, [Note: data parallel on torch]); ``data_parallel_mode`` (``"ddp"``,
        the default: exact gradient averaging over the replicas; ``"fsdp"`` is refused by name
        for now); ``stages_per_rank`` (optional,
        checked against the plan and the ranks); ``device`` (default: this rank's CUDA device
        under NCCL, else the CPU); ``init_weights(stage_module)`` (fills the stages this rank
        runs of a meta-device plan, on that device; the others stay on meta). Every rank calls
        it with the same arguments.

        Raises:
            ConfigError: a missing or unknown argument, an unknown schedule, no process group.
            TopologyError: the plan's stages do not fit the ranks under the schedule
                ([Note: stage placement]).
            TieError: tied parameters that cannot be kept in sync.
        """
        from pipedialect._agreement import check_plan_agreement

        from ._build import build_pipeline

        check_plan_agreement(plan, dialect=self.name, options={"schedule": self.schedule, **kwargs})
        unknown = set(kwargs) - _PIPE_ENGINE_KWARGS
        if unknown:
            raise ConfigError(
                f"unknown argument(s) {sorted(unknown)} for the torch pipeline engine; accepted: "
                f"{', '.join(sorted(_PIPE_ENGINE_KWARGS - {'dynamic_shape'}))}"
            )
        dynamic = bool(kwargs.get("dynamic_shapes", False) or kwargs.get("dynamic_shape", False))
        stages_per_rank = kwargs.get("stages_per_rank")
        schedule = kwargs.get("schedule")
        if schedule is None:
            schedule = self.schedule
        if stages_per_rank is None and resolve_schedule(schedule).name == self.schedule:
            stages_per_rank = self.stages_per_rank
        return build_pipeline(
            plan,
            stage_modules,
            wrapper=self.stage_wrapper,
            config=kwargs.get("config"),
            loss_fn=kwargs.get("loss_fn"),
            schedule=schedule,
            topology=kwargs.get("topology"),
            stages_per_rank=stages_per_rank,
            device=kwargs.get("device"),
            dynamic_shapes=dynamic,
            data_parallel_mode=kwargs.get("data_parallel_mode"),
            init_weights=kwargs.get("init_weights"),
        )

    def runtime_engine(self, module: nn.Module, **kwargs: Any) -> RuntimeEngine:
        """Return the :class:`~pipedialect.dialects.torch.TorchEngine` that trains ``module``.

        ``config`` defaults to the one given to :meth:`pipe_engine`; ``check_finite=True``
        refuses a step whose loss or gradients are not finite, on every rank;
        ``lr_scheduler`` (an object with ``step()``, or a callable building one from the
        optimizer) replaces the config's ``scheduler`` section, as in ``deepspeed.initialize``.
        """
        from ._setup import leave_group_at_exit
        from .engine import build_engine

        config = kwargs.pop("config", None)
        check_finite = bool(kwargs.pop("check_finite", False))
        lr_scheduler = kwargs.pop("lr_scheduler", None)
        if kwargs:
            raise ConfigError(f"the torch runtime engine takes no argument(s) {sorted(kwargs)}")
        engine = build_engine(module, config, check_finite=check_finite, lr_scheduler=lr_scheduler)
        leave_group_at_exit()  # _setup [Note: leaving the process group]
        return engine

    def local_stages(self, engine: RuntimeEngine) -> Sequence[int]:
        """The stages this rank runs (several under looped and V-shaped schedules)."""
        from .engine import TorchEngine

        if not isinstance(engine, TorchEngine):
            raise ConfigError(f"not a torch engine: {type(engine).__name__}")
        return list(engine.stage_ids)

    def make_topology(self, num_stages: int, data_parallel: int = 1) -> Topology:
        """A ``pipe`` axis of ``num_stages / stages_per_rank`` ranks (see the class arguments)
        by a ``data`` axis of ``data_parallel`` replicas, laid out as DeepSpeed lays them out.

        Raises:
            TopologyError: ``data_parallel`` is not a positive integer, or the stages do not
                divide evenly.
        """
        from pipedialect import GridTopology

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
        return GridTopology(pipe=ranks, data=data_parallel)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self.version} schedule={self.schedule!r}>"


@pipedialect.hookimpl
def register_dialects(register: Callable[[type[Dialect]], None]) -> None:
    """Register the torch dialect."""
    register(TorchDialect)
