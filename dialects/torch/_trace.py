"""Sends and receives of ``torch.distributed.pipelining``, timed.

A schedule asks each ``PipelineStage`` for its point-to-point ops (``get_fwd_recv_ops(k)``,
``get_bwd_send_ops(k)``, ...), issues them with the module function ``_batch_p2p`` and later
waits on what it returned with ``_wait_batch_p2p``. While a trace runs, the stage methods note
which stage and micro-batch each op belongs to, and the two functions of
``torch.distributed.pipelining.schedules`` are replaced by ones that time the issue and the
wait of annotated ops and call the originals unchanged; a wait that follows its own issue at
once extends the issue's span (a receive reads as one span, from issue to arrival). The
first batch builds the torch stages, running every stage once on the first micro-batch
(``_setup`` [Note: boundary examples]): that is set-up, so nothing is recorded while it runs.
:meth:`TorchDialect.instrument <pipedialect.dialects.torch.TorchDialect.instrument>` installs it
for :func:`pipedialect.trace` ([Note: how spans are taken]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.distributed.pipelining import schedules

from pipedialect.contracts import Instrumented, SpanRecorder
from pipedialect.sdk import patch_attribute

__all__ = ["instrument"]

#: Stage method -> (what the ops do, what they carry).
_OPS = {
    "get_fwd_recv_ops": ("recv", "activations"),
    "get_fwd_send_ops": ("send", "activations"),
    "get_bwd_recv_ops": ("recv", "grads"),
    "get_bwd_send_ops": ("send", "grads"),
}
_OPS_KEY = "torch-p2p-ops"
_WORKS_KEY = "torch-p2p-works"


def _annotating(
    method: Callable[..., Any], recorder: SpanRecorder, stage: int, kind: str, carries: str
) -> Callable[..., Any]:
    def get_ops(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        ops = method(chunk_id, *args, **kwargs)
        if recorder.recording:
            table = recorder.step_state.setdefault(_OPS_KEY, {})
            for op in ops:
                table[id(op)] = (op, kind, stage, int(chunk_id), carries)
        return ops

    return get_ops


class _Instrumentation:
    """The patches of one traced engine, and how to take them off."""

    def __init__(self, engine: Any, recorder: SpanRecorder) -> None:
        self.recorder = recorder
        self.undo: list[Callable[[], None]] = []
        self._patched: set[int] = set()
        module = engine.module
        build = module.build

        def paused_build(*args: Any, **kwargs: Any) -> Any:
            with recorder.paused():
                result = build(*args, **kwargs)
            self.annotate(module._stages)
            return result

        self.undo.append(patch_attribute(module, "build", paused_build))
        self.annotate(module._stages)
        self.undo.append(
            patch_attribute(schedules, "_batch_p2p", self._batch(schedules._batch_p2p))
        )
        self.undo.append(
            patch_attribute(schedules, "_wait_batch_p2p", self._wait(schedules._wait_batch_p2p))
        )

    def annotate(self, stages: list[Any]) -> None:
        """Make ``stages``' op getters note their stage and micro-batch (once per stage)."""
        for stage in stages:
            if id(stage) in self._patched:
                continue
            self._patched.add(id(stage))
            for name, (kind, carries) in _OPS.items():
                method = getattr(stage, name)
                wrapped = _annotating(method, self.recorder, int(stage.stage_index), kind, carries)
                self.undo.append(patch_attribute(stage, name, wrapped))

    def _batch(self, original: Callable[..., Any]) -> Callable[..., Any]:
        recorder = self.recorder

        def batch_p2p(p2p_ops: list[Any], *args: Any, **kwargs: Any) -> Any:
            table = recorder.step_state.get(_OPS_KEY, {})
            notes = [table[id(op)] for op in p2p_ops if id(op) in table]
            if not recorder.recording or not notes:
                return original(p2p_ops, *args, **kwargs)
            # A schedule may issue a send and a receive together: "send/recv", with what each
            # carries in the same order ("activations/grads").
            by_kind = {n[1]: n[4] for n in reversed(notes)}
            kinds = sorted(by_kind, reverse=True)
            name = "/".join(kinds)
            carries = "/".join(by_kind[k] for k in kinds)
            _, _, stage, micro_batch, _ = notes[0]
            start = recorder.now()
            works = original(p2p_ops, *args, **kwargs)
            index = recorder.add(name, name, stage, start, recorder.now(), micro_batch, carries)
            waits = recorder.step_state.setdefault(_WORKS_KEY, {})
            waits[id(works)] = (works, index, name, stage, micro_batch, carries)
            return works

        return batch_p2p

    def _wait(self, original: Callable[..., Any]) -> Callable[..., Any]:
        recorder = self.recorder

        def wait_batch_p2p(work: Any, *args: Any, **kwargs: Any) -> Any:
            waits = recorder.step_state.get(_WORKS_KEY, {})
            note = waits.pop(id(work), None)
            if not recorder.recording or note is None:
                return original(work, *args, **kwargs)
            _, index, name, stage, micro_batch, carries = note
            start = recorder.now()
            result = original(work, *args, **kwargs)
            end = recorder.now()
            if not recorder.extend(index, end):
                recorder.add(name, name, stage, start, end, micro_batch, carries)
            return result

        return wait_batch_p2p

    def remove(self) -> None:
        for undo in reversed(self.undo):
            undo()


def instrument(engine: Any, recorder: SpanRecorder) -> Instrumented:
    """Time ``engine``'s point-to-point sends and receives; skip the stages' set-up."""
    patches = _Instrumentation(engine, recorder)
    return Instrumented(undo=patches.remove)
