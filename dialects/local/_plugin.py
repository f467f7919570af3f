"""The local dialect's plugin: its Dialect class and registration hook."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

import pipedialect
from pipedialect import Capability, ConfigError, Dialect, RuntimeEngine, Topology, TopologyError

if TYPE_CHECKING:
    from pipedialect.partition import PipelinePlan

__all__ = ["LocalDialect", "register_dialects"]


class LocalDialect(Dialect):
    """All stages in one process, driven like DeepSpeed's PipelineEngine."""

    name = "local"
    version = pipedialect.__version__
    description = "All stages in one process: the reference and the debugger"
    capabilities = frozenset(
        {
            Capability.TIED_WEIGHTS,
            Capability.MULTI_GRAD_BOUNDARY,
            Capability.NON_FLOAT_TENSORS,
            Capability.PYTHON_VALUES,
            Capability.SKIP_CONNECTIONS,
            Capability.DYNAMIC_SHAPES,
            Capability.CHECKPOINTS,
        }
    )

    def pipe_engine(
        self,
        plan: PipelinePlan,
        stage_modules: Sequence[nn.Module] | None = None,
        *,
        config: dict[str, Any] | None = None,
        loss_fn: Callable[[Any, Any], Any] | None = None,
        topology: Topology | None = None,
        dynamic_shapes: bool = False,
        init_weights: Callable[[nn.Module], None] | None = None,
        **kwargs: Any,
    ) -> nn.Module:
        """Return a :class:`~pipedialect.dialects.local.engine.LocalPipeline` of ``plan``.

        ``stage_modules`` (already-wrapped stages) default to ``plan.wrap()``. ``config`` (a
        DeepSpeed config dict) and ``loss_fn(outputs, labels)`` are required; ``topology``, if
        given, must have one pipe coordinate per stage and no data parallelism.
        ``init_weights(stage_module)`` fills the stages of a meta-device plan on the CPU
        (:func:`pipedialect.weights.prepare_local_stages`; every stage is local here).
        """
        from pipedialect.ties import check_topology, retie_parameters
        from pipedialect.weights import prepare_local_stages

        from .config import parse_config
        from .engine import LocalPipeline

        if kwargs:
            raise ConfigError(f"the local dialect takes no argument(s) {sorted(kwargs)}")
        if config is None:
            raise ConfigError("config (a DeepSpeed config dict) is required to build an engine")
        parse_config(config)
        if loss_fn is None or not callable(loss_fn):
            raise ConfigError("loss_fn(outputs, labels) is required to build a pipeline engine")
        if topology is not None:
            check_topology(plan, topology)
            if topology.world_size() != plan.num_stages:
                raise TopologyError(
                    f"the local dialect runs one replica of each of the {plan.num_stages} stages "
                    f"in one process; the topology has {topology.world_size()} ranks "
                    f"(data axis {topology.get_dim('data')}). Use a topology with data=1, or "
                    "none."
                )
        if stage_modules is None:
            stages: list[nn.Module] = list(
                plan.wrap(self.stage_wrapper, dynamic_shapes=dynamic_shapes)
            )
        else:
            stages = list(stage_modules)
            if len(stages) != plan.num_stages:
                raise ConfigError(
                    f"got {len(stages)} stage modules for a plan of {plan.num_stages} stages"
                )
        prepare_local_stages(plan, range(plan.num_stages), "cpu", init_weights)
        retie_parameters(plan.tie_groups, stages)  # every stage runs here: one object per tie
        return LocalPipeline(stages, plan=plan, loss_fn=loss_fn, config=config)

    def runtime_engine(
        self, module: nn.Module, *, config: dict[str, Any] | None = None, **kwargs: Any
    ) -> RuntimeEngine:
        """Return the :class:`~pipedialect.dialects.local.engine.LocalEngine` that trains it;
        ``check_finite=True`` refuses a step whose loss or gradients are not finite;
        ``lr_scheduler`` (an object with ``step()``, or a callable building one from the
        optimizer) replaces the config's ``scheduler`` section, as in ``deepspeed.initialize``;
        ``param_groups`` (see :mod:`pipedialect.param_groups`) groups the optimizer's
        parameters."""
        from .engine import build_engine

        check_finite = bool(kwargs.pop("check_finite", False))
        lr_scheduler = kwargs.pop("lr_scheduler", None)
        param_groups = kwargs.pop("param_groups", None)
        if kwargs:
            raise ConfigError(f"the local runtime engine takes no argument(s) {sorted(kwargs)}")
        return build_engine(
            module,
            config,
            check_finite=check_finite,
            lr_scheduler=lr_scheduler,
            param_groups=param_groups,
        )

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


@pipedialect.hookimpl
def register_dialects(register: Callable[[type[Dialect]], None]) -> None:
    """Register the local dialect."""
    register(LocalDialect)
