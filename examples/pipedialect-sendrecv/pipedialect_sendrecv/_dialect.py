"""The ``sendrecv`` dialect: what it declares and how it builds its engines."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from pipedialect import Capability, ConfigError, Dialect, RuntimeEngine
from pipedialect.config import parse_config
from pipedialect.contracts import BOUNDARY_CAPABILITIES
from pipedialect.dialect import EngineRequest, NoOptions, PipelineRequest

from ._engine import SendRecvEngine, SendRecvPipeline

__all__ = ["SendRecvDialect"]


class SendRecvDialect(Dialect):
    """GPipe over ``torch.distributed`` send/recv: one stage per rank, gloo, CPU.

    ``pipe_engine(plan, config=..., loss_fn=...)`` (after ``init_distributed()``) returns this
    rank's :class:`~pipedialect_sendrecv.SendRecvPipeline`; ``runtime_engine(module)`` the
    :class:`~pipedialect_sendrecv.SendRecvEngine` that trains it. The base class has already
    checked the shared arguments, wrapped the stages with our codec and checked that every rank
    built the same plan when the hooks below run.
    """

    name = "sendrecv"
    version = "0.1.0"
    description = "GPipe over torch.distributed send/recv (example third-party dialect)"
    #: What the default stage wrapper carries, plus what this engine adds.
    capabilities = BOUNDARY_CAPABILITIES | {
        Capability.DYNAMIC_SHAPES,
        Capability.MULTI_PROCESS,
        Capability.DATA_PARALLEL,
    }
    #: The pipeline module class built by :meth:`_build_pipeline` (subclasses may swap it).
    pipeline_class: type[SendRecvPipeline] = SendRecvPipeline

    def _build_pipeline(self, request: PipelineRequest[NoOptions]) -> nn.Module:
        """This rank's pipeline module; creating its process groups is the only collective."""
        topology = request.process_grid()
        parse_config(request.config, world_size=topology.get_dim("data"))
        tie_ranks, _ = request.tie_ranks(topology)
        return self.pipeline_class(
            request.stages,
            plan=request.plan,
            topology=topology,
            tie_ranks=tie_ranks,
            loss_fn=request.loss_fn,
            config=request.config,
        )

    def _build_engine(self, request: EngineRequest[NoOptions]) -> RuntimeEngine:
        """The :class:`~pipedialect_sendrecv.SendRecvEngine` that trains ``request.module``."""
        module = request.module
        if not isinstance(module, SendRecvPipeline):
            raise ConfigError(f"runtime_engine() trains what pipe_engine() built, not {module!r}")
        config = parse_config(request.config or module.config, world_size=module.replicas)
        return SendRecvEngine(module, config)

    def local_stages(self, engine: RuntimeEngine) -> Sequence[int]:
        """The one stage this rank trains."""
        if not isinstance(engine, SendRecvEngine):
            raise ConfigError(f"not a sendrecv engine: {type(engine).__name__}")
        return [engine.module.stage_id]
