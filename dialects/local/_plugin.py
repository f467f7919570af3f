"""The local dialect's plugin: its Dialect class and registration hook."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

import pipedialect
from pipedialect import Capability, ConfigError, Dialect, RuntimeEngine, TopologyError
from pipedialect.contracts import BOUNDARY_CAPABILITIES, EngineState, HeldStage
from pipedialect.sdk import ENGINE_FEATURES, EngineRequest, NoOptions, PipelineRequest

__all__ = ["LocalDialect", "register_dialects"]


class LocalDialect(Dialect):
    """All stages in one process, driven like DeepSpeed's PipelineEngine."""

    name = "local"
    version = pipedialect.__version__
    description = "All stages in one process: the reference and the debugger"
    engine_features = ENGINE_FEATURES
    capabilities = BOUNDARY_CAPABILITIES | {
        Capability.DYNAMIC_SHAPES,
        Capability.CHECKPOINTS,
        Capability.PORTABLE_CHECKPOINTS,
        Capability.TRACING,
        Capability.TRAINER_LOOP,
    }

    def _build_pipeline(self, request: PipelineRequest[NoOptions]) -> nn.Module:
        """A :class:`~pipedialect.dialects.local.engine.LocalPipeline` of every stage.

        A ``topology``, if given, must have one pipe coordinate per stage and no data
        parallelism. ``init_weights(stage_module)`` fills every stage of a meta-device plan on
        the CPU (every stage is local here).
        """
        from pipedialect.sdk import (
            check_topology,
            parse_config,
            prepare_local_stages,
            retie_parameters,
        )

        from .engine import LocalPipeline

        plan, topology = request.plan, request.topology
        parse_config(request.config)
        if topology is not None:
            check_topology(topology, plan.num_stages)
            if topology.world_size() != plan.num_stages:
                raise TopologyError(
                    f"the local dialect runs one replica of each of the {plan.num_stages} stages "
                    f"in one process; the topology has {topology.world_size()} ranks "
                    f"(data axis {topology.get_dim('data')}). Use a topology with data=1, or "
                    "none."
                )
        stages = list(request.stages)
        prepare_local_stages(plan, range(plan.num_stages), "cpu", request.init_weights)
        retie_parameters(plan.tie_groups, stages)  # every stage runs here: one object per tie
        return LocalPipeline(stages, plan=plan, loss_fn=request.loss_fn, config=request.config)

    def _build_engine(self, request: EngineRequest[NoOptions]) -> RuntimeEngine:
        """The :class:`~pipedialect.dialects.local.engine.LocalEngine` that trains the module;
        without ``config``, with the one given to :meth:`pipe_engine`."""
        from .engine import LocalPipeline, build_engine

        config = request.config
        if config is None and isinstance(request.module, LocalPipeline):
            config = request.module.config
        return build_engine(request.module, config, **request.shared_args())

    def init_distributed(self, backend: str | None = None) -> None:
        """Do nothing: every stage runs in this process, with no launcher and no process group.

        A script written for a multi-process dialect (``init_distributed()`` first) thus runs
        unchanged under plain ``python`` with ``get_dialect("local")``.
        """

    def local_stages(self, engine: RuntimeEngine) -> Sequence[int]:
        """Every stage: the local engine runs them all in this process."""
        from .engine import LocalEngine

        if not isinstance(engine, LocalEngine):
            raise ConfigError(f"not a local engine: {type(engine).__name__}")
        return list(range(engine.module.num_stages))

    def engine_state(self, engine: RuntimeEngine) -> EngineState:
        """Every stage of the plan, each run by its wrapper, named as the model."""
        from pipedialect.sdk import stage_root

        from .engine import LocalEngine

        if not isinstance(engine, LocalEngine):
            raise ConfigError(f"not a local engine: {type(engine).__name__}")
        held = [
            HeldStage(k, stage, stage_root(stage)) for k, stage in enumerate(engine.module.stages)
        ]
        return engine.engine_state(held, engine.module.plan)


@pipedialect.hookimpl
def register_dialects(register: Callable[[type[Dialect]], None]) -> None:
    """Register the local dialect."""
    register(LocalDialect)
