"""The ``sendrecv`` dialect: what it declares and how it builds its engines."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from pipedialect.sdk import (
    BOUNDARY_CAPABILITIES,
    AttributeCounters,
    Capability,
    ConfigError,
    Dialect,
    EngineRequest,
    EngineState,
    HeldStage,
    Instrumented,
    NoOptions,
    PipelineRequest,
    RuntimeEngine,
    SpanRecorder,
    parse_config,
    patch_attribute,
    stage_root,
    tie_keys,
)

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
    #: What the default stage wrapper carries, plus what this engine adds: portable
    #: checkpoints and traces come with the two hooks at the end (engine_state, instrument).
    capabilities = BOUNDARY_CAPABILITIES | {
        Capability.DYNAMIC_SHAPES,
        Capability.MULTI_PROCESS,
        Capability.DATA_PARALLEL,
        Capability.PORTABLE_CHECKPOINTS,
        Capability.TRACING,
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

    def engine_state(self, engine: RuntimeEngine) -> EngineState:
        """What ``pipedialect.checkpoint`` and ``pipedialect.trace`` read: this rank's stage
        (run by its wrapper; named as the model by :func:`stage_root`), the optimizer, the
        tied weights' keys and the step counter."""
        if not isinstance(engine, SendRecvEngine):
            raise ConfigError(f"not a sendrecv engine: {type(engine).__name__}")
        module = engine.module
        root = stage_root(module.stage)
        stage = HeldStage(module.stage_id, module.stage, root)
        return EngineState(
            stages=(stage,),
            num_stages=module.num_stages,
            optimizer=engine.optimizer,
            tie_keys=tie_keys(module.plan.tie_groups, [(stage.stage_id, root)]),
            counters=AttributeCounters(engine, ("global_steps",)),
            gradient_accumulation_steps=engine.config.gradient_accumulation_steps,
            train_batch_size=engine.config.train_batch_size,
        )

    def instrument(self, engine: RuntimeEngine, recorder: SpanRecorder) -> Instrumented:
        """Time every send and receive of the schedule while a trace runs (the trace itself
        times each stage's forward and backward, and the optimizer step)."""
        if not isinstance(engine, SendRecvEngine):
            raise ConfigError(f"not a sendrecv engine: {type(engine).__name__}")
        module = engine.module
        undo = [
            patch_attribute(module, "send", _timed(module.send, "send", recorder)),
            patch_attribute(module, "recv", _timed(module.recv, "recv", recorder)),
        ]

        def remove() -> None:
            for step in reversed(undo):
                step()

        return Instrumented(undo=remove)


def _timed(method: Callable[..., Any], kind: str, recorder: SpanRecorder) -> Callable[..., Any]:
    """``method(*args, carries=...)`` recorded as one span per call (micro-batches in order)."""

    def timed(*args: Any, carries: str) -> Any:
        if not recorder.recording:
            return method(*args, carries=carries)
        micro_batch = recorder.next_index((kind, carries))
        start = recorder.now()
        try:
            return method(*args, carries=carries)
        finally:
            end = recorder.now()
            recorder.add(kind, kind, recorder.home_stage, start, end, micro_batch, carries)

    return timed
