"""Working out every boundary's tensors before torch builds its buffers.

[Note: boundary examples]
``PipelineStage`` either takes example input and output tensors (static metadata) or runs each
stage on zero-filled tensors of the received shapes to infer them. The second would feed our
decoder a zero metadata tensor, so this dialect gives examples, built from the first
micro-batch: each rank runs its own stages once, in stage order, on the real values. The first
stage runs on the micro-batch's inputs; a later stage on the wire its predecessor produced,
passed in-process when both stages are on this rank and sent with ``send_object_list`` (once,
a few tensors) otherwise. Only the rank holding the first stage needs data. Every stage runs
with gradients enabled, so its wire layout is the one training uses (``pipedialect.runtime.wire``
[Note: wire layout]) and the ``requires_grad`` of each example tells torch which boundary
tensors carry gradients. The run leaves no trace: the RNG state is restored afterwards and the
stages' random streams are not advanced (``pipedialect.runtime.randomness`` [Note: random
streams]), so the training steps draw what they would have, the stages run on copies of their
buffers and their plain Python attributes are put back
(``pipedialect.runtime.module_state.preserved_state``: running statistics count only the
training micro-batches), and the first stage runs on a copy of the micro-batch.

The examples fix the shape, dtype and stride of every boundary tensor for the whole run
(static shapes), and the run also freezes each wrapper's wire layout.

[Note: leaving the process group]
A script run by ``torchrun`` ends with interpreter shutdown while the process group still
exists. gloo runs each collective on a worker thread, and that thread may still be releasing the
last one (the loss broadcast of the final ``train_batch``) after ``wait()`` has returned. When
it drops the last reference to a tensor Python created, it needs the GIL; during shutdown a
thread that asks for the GIL is ended with ``pthread_exit``, whose unwinding through a
``noexcept`` destructor aborts the process: "terminate called without an active exception"
(seen on about one run in five under ``torchrun`` on two busy cores, with gdb showing exactly
that stack). So building an engine registers an exit hook: after a normal exit every rank waits
for the others (a barrier, by which time the worker threads are idle) and destroys the process
group while the interpreter is whole. After an uncaught exception the hook does nothing: the
peers may be anywhere, and waiting for them could hang. The launcher of
:mod:`pipedialect.runtime.launch` leaves through ``os._exit`` after its own barrier, so the hook
never runs there.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipedialect.sdk import not_counted, preserved_state

from ._stage import StageRunner, map_tensors, normalize_wire, to_device

__all__: list[str] = []

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageExamples:
    """Example tensors for one stage: what it receives and what it sends."""

    #: The stage's input tensors (the micro-batch index on the first stage).
    inputs: tuple[torch.Tensor, ...]
    #: The stage's output tensors (a placeholder on the last stage).
    outputs: tuple[torch.Tensor, ...]


def _detached(wire: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Fresh leaves with the same values and ``requires_grad`` as ``wire``."""
    return tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in wire)


def infer_examples(
    runners: Mapping[int, StageRunner],
    placement: Mapping[int, int],
    first_inputs: Any,
    device: torch.device,
) -> dict[int, StageExamples]:
    """Run this rank's stages once on the first micro-batch; see [Note: boundary examples].

    ``runners`` are this rank's stages by id, ``placement`` maps every stage to its rank and
    ``first_inputs`` is the first micro-batch's model inputs (needed only where stage 0 runs).
    Every rank of the pipeline must call this at the same time.
    """
    rank = dist.get_rank()
    num_stages = len(placement)
    examples: dict[int, StageExamples] = {}
    devices = [device] if device.type == "cuda" else []
    local = [runners[k].stage for k in sorted(runners)]
    # The model inputs as well: a stage may update them in place.
    first_inputs = _copied(first_inputs)
    with (
        torch.random.fork_rng(devices=devices),
        torch.enable_grad(),
        preserved_state(local),
        not_counted(local),
    ):
        carried: tuple[torch.Tensor, ...] | None = None
        for k in range(num_stages):
            if placement[k] != rank:
                carried = None
                continue
            runner = runners[k]
            if k == 0:
                index = torch.zeros(1, dtype=torch.int64)
                out = runner.run_example((first_inputs,))
                inputs: tuple[torch.Tensor, ...] = (index,)
            else:
                if carried is None:
                    carried = _receive(placement[k - 1], device)
                inputs = carried
                out = runner.run_example(_detached(inputs))
            if k == num_stages - 1:
                outputs: tuple[torch.Tensor, ...] = (runner.placeholder(),)
                examples[k] = StageExamples(_detached(inputs), outputs)
                break
            wire = normalize_wire(out, runner.log_prefix)
            examples[k] = StageExamples(_detached(inputs), _detached(wire))
            if placement[k + 1] == rank:
                carried = _detached(wire)
            else:
                _send(wire, placement[k + 1])
                carried = None
    for k, ex in sorted(examples.items()):
        logger.debug(
            "[Stage %d] receives %s, sends %s",
            k,
            [(tuple(t.shape), t.dtype, t.requires_grad) for t in ex.inputs],
            [(tuple(t.shape), t.dtype, t.requires_grad) for t in ex.outputs],
        )
    return examples


def _copied(value: Any) -> Any:
    """``value`` with every tensor in it (tuples, lists, dicts) copied."""
    return map_tensors(value, lambda t: t.detach().clone())


def _send(wire: Sequence[torch.Tensor], dst: int) -> None:
    payload = [(t.detach().cpu(), t.requires_grad) for t in wire]
    dist.send_object_list([payload], dst=dst)


def _receive(src: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src)
    return tuple(to_device(t, device).requires_grad_(flag) for t, flag in box[0])


#: How long the exit barrier waits for the other ranks before giving up (with a warning).
EXIT_BARRIER_SECONDS = 120.0
_exit_hook: list[bool] = []


def leave_group_at_exit() -> None:
    """Register, once per process, the exit hook of [Note: leaving the process group]."""
    if not _exit_hook:
        atexit.register(_leave_group)
        _exit_hook.append(True)


def _leave_group() -> None:
    if not dist.is_initialized() or getattr(sys, "last_value", None) is not None:
        return
    try:
        if dist.get_backend() == "gloo":
            timeout = datetime.timedelta(seconds=EXIT_BARRIER_SECONDS)
            dist.monitored_barrier(timeout=timeout, wait_all_ranks=True)
        else:
            dist.barrier()
        dist.destroy_process_group()
    except Exception as exc:  # a peer already gone: nothing left to tear down in step
        logger.warning("leaving the process group at exit: %s", exc)
