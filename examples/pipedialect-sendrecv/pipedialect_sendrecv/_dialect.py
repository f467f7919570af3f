"""The ``sendrecv`` dialect: what it declares and how it builds its engines."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from torch import nn

from pipedialect import (
    Capability,
    ConfigError,
    Dialect,
    GridTopology,
    PipelinePlan,
    RuntimeEngine,
    StageWrapper,
    Topology,
    TopologyError,
)
from pipedialect.config import parse_config
from pipedialect.ties import check_topology

from ._engine import SendRecvEngine, SendRecvPipeline

__all__ = ["SendRecvDialect"]

_VERSION = "0.1.0"


class SendRecvDialect(Dialect):
    """GPipe over ``torch.distributed`` send/recv: one stage per rank, gloo, CPU.

    ``pipe_engine(plan, config=..., loss_fn=..., topology=None, dynamic_shapes=False)`` needs
    the process group (``init_distributed()``) and returns this rank's
    :class:`~pipedialect_sendrecv.SendRecvPipeline`; ``runtime_engine(module, config=...)``
    returns the :class:`~pipedialect_sendrecv.SendRecvEngine` that trains it.
    """

    name = "sendrecv"
    version = _VERSION
    description = "GPipe over torch.distributed send/recv (example third-party dialect)"
    capabilities = frozenset(
        {
            Capability.TIED_WEIGHTS,
            Capability.MULTI_GRAD_BOUNDARY,
            Capability.NON_FLOAT_TENSORS,
            Capability.PYTHON_VALUES,
            Capability.SKIP_CONNECTIONS,
            Capability.DYNAMIC_SHAPES,
            Capability.MULTI_PROCESS,
            Capability.DATA_PARALLEL,
        }
    )
    #: The pipeline module class built by :meth:`pipe_engine` (subclasses may swap it).
    pipeline_class: ClassVar[type[SendRecvPipeline]] = SendRecvPipeline

    def wrap_stages(
        self, plan: PipelinePlan, *, dynamic_shapes: bool = False
    ) -> list[StageWrapper]:
        """One :attr:`stage_wrapper` per stage, each with its own :attr:`codec`."""
        liveness = plan.liveness_dict()
        arg_names = plan.arg_names_dict()
        return [
            self.stage_wrapper(
                stage,
                k,
                plan.stage_names[k],
                plan.num_stages,
                liveness,
                arg_names,
                codec=self.codec,
                dynamic_shapes=dynamic_shapes,
            )
            for k, stage in enumerate(plan.stages)
        ]

    def pipe_engine(
        self,
        plan: PipelinePlan,
        stage_modules: Sequence[nn.Module] | None = None,
        *,
        config: dict[str, Any] | None = None,
        loss_fn: Callable[[Any, Any], Any] | None = None,
        topology: Topology | None = None,
        dynamic_shapes: bool = False,
        **kwargs: Any,
    ) -> nn.Module:
        """Check everything, then build this rank's pipeline module (the only collectives)."""
        import torch.distributed as dist

        if kwargs:
            raise ConfigError(
                f"the sendrecv dialect takes no argument(s) {sorted(kwargs)}; it accepts "
                "config, loss_fn, topology and dynamic_shapes"
            )
        if config is None:
            raise ConfigError("config (a DeepSpeed-style config dict) is required")
        if loss_fn is None or not callable(loss_fn):
            raise ConfigError("loss_fn(outputs, labels) is required to build a pipeline engine")
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                "the process group is not initialised: call dialect.init_distributed() on every "
                "rank (launched with torchrun or an equivalent) before building the engine"
            )
        world = dist.get_world_size()
        if topology is None:
            if world % plan.num_stages:
                raise TopologyError(
                    f"{world} ranks cannot hold {plan.num_stages} stages evenly; launch a "
                    f"multiple of {plan.num_stages} processes"
                )
            topology = GridTopology(pipe=plan.num_stages, data=world // plan.num_stages)
        if not isinstance(topology, Topology):
            raise TopologyError(f"topology must be a pipedialect.Topology, got {topology!r}")
        check_topology(plan, topology)
        if topology.world_size() != world:
            raise TopologyError(
                f"the topology describes {topology.world_size()} ranks but the process group "
                f"has {world}; launch pipe x data = {topology.world_size()} processes"
            )
        replicas = max(topology.get_dim("data"), 1)
        parse_config(config, world_size=replicas)
        if stage_modules is None:
            stages: list[nn.Module] = list(self.wrap_stages(plan, dynamic_shapes=dynamic_shapes))
        else:
            stages = list(stage_modules)
            if len(stages) != plan.num_stages:
                raise ConfigError(
                    f"got {len(stages)} stage modules for a plan of {plan.num_stages} stages"
                )
        tie_ranks, _ = self.tie_analyzer.analyze_ranks(plan.tie_groups, topology)
        return self.pipeline_class(
            stages,
            plan=plan,
            topology=topology,
            tie_ranks=tie_ranks,
            loss_fn=loss_fn,
            config=config,
        )

    def runtime_engine(
        self, module: nn.Module, *, config: dict[str, Any] | None = None, **kwargs: Any
    ) -> RuntimeEngine:
        """Return the :class:`~pipedialect_sendrecv.SendRecvEngine` that trains ``module``."""
        if kwargs:
            raise ConfigError(f"the sendrecv runtime engine takes no argument(s) {sorted(kwargs)}")
        if not isinstance(module, SendRecvPipeline):
            raise ConfigError(
                f"runtime_engine() trains what pipe_engine() built, got {type(module).__name__}"
            )
        return SendRecvEngine(
            module, parse_config(config or module.config, world_size=module.replicas)
        )

    def local_stages(self, engine: RuntimeEngine) -> Sequence[int]:
        """The one stage this rank trains."""
        if not isinstance(engine, SendRecvEngine):
            raise ConfigError(f"not a sendrecv engine: {type(engine).__name__}")
        return [engine.module.stage_id]
