"""Sends, receives, reductions and the optimizer step of DeepSpeed's ``PipelineEngine``, timed.

``PipelineEngine`` runs each instruction of its schedule through the class table
``_INSTRUCTION_MAP`` (instruction type to method), looked up on the engine. Tracing gives the
engine an instance table whose communication, reduction and optimizer entries time the
method they stand for and call it unchanged; leaving the trace removes it. Micro-batches are
numbered per instruction type in schedule order (DeepSpeed sends and receives them in order).
:meth:`DeepSpeedDialect.instrument` installs it for :func:`pipedialect.trace` ([Note: how
spans are taken]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from deepspeed.runtime.pipe import schedule

from pipedialect.contracts import Instrumented, SpanRecorder
from pipedialect.sdk import patch_attribute

__all__ = ["instrument"]

#: Instruction type -> (span kind, span name, what it carries; None: no micro-batch).
_TIMED: dict[type, tuple[str, str, str | None]] = {
    schedule.SendActivation: ("send", "send", "activations"),
    schedule.RecvActivation: ("recv", "recv", "activations"),
    schedule.SendGrad: ("send", "send", "grads"),
    schedule.RecvGrad: ("recv", "recv", "grads"),
    schedule.ReduceTiedGrads: ("reduce", "reduce", None),
    schedule.ReduceGrads: ("reduce", "reduce", None),
    schedule.OptimizerStep: ("optimizer", "opt", None),
}


def _timed(
    method: Callable[..., Any], recorder: SpanRecorder, instruction: type, stage: int
) -> Callable[..., Any]:
    kind, name, carries = _TIMED[instruction]

    def run(engine: Any, **kwargs: Any) -> Any:
        if not recorder.recording:
            return method(engine, **kwargs)
        micro_batch = None if carries is None else recorder.next_index(instruction)
        start = recorder.now()
        try:
            return method(engine, **kwargs)
        finally:
            recorder.add(kind, name, stage, start, recorder.now(), micro_batch, carries)

    return run


def instrument(engine: Any, recorder: SpanRecorder) -> Instrumented:
    """Time ``engine``'s communication, reduction and optimizer instructions."""
    stage = recorder.home_stage
    table = dict(engine._INSTRUCTION_MAP)
    for instruction in _TIMED:
        if instruction in table:
            table[instruction] = _timed(table[instruction], recorder, instruction, stage)
    undo = patch_attribute(engine, "_INSTRUCTION_MAP", table)
    return Instrumented(undo=undo, records=frozenset({"optimizer"}))
