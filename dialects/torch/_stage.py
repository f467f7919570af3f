"""What ``PipelineStage`` runs: a stage wrapper behind an adapter that speaks torch's protocol.

[Note: micro-batch indices]
``schedule.step(*args, target=...)`` splits whole-batch tensors into micro-batches along dim 0.
Our data iterator yields ready micro-batches of any structure (tuples, dicts, Python values)
and labels of any structure, and each micro-batch must reach the stages exactly as it was
yielded. So the engine hands the schedule ``torch.arange(n)`` as both the input and the target:
torch splits it into ``[0], [1], ...``, the first stage's adapter looks its micro-batch up by that
index, and the loss adapter looks the labels up the same way. Only public ``step`` is used,
and the first stage's input is one static ``int64`` tensor of shape ``(1,)``.

[Note: last-stage output]
Torch passes the last stage's output to the loss function right after that stage's forward
(``_maybe_compute_loss``), but it also treats the output as a tuple of tensors afterwards
(it detaches them in place). The model's output may be anything (a dict, a tuple holding
None), so the last stage's adapter keeps the real output in the shared batch context and returns
a placeholder tensor; the loss adapter computes the loss from the kept output, so autograd sees
exactly the graph the unsplit model would have.

[Note: wire tensors for torch]
Every boundary tensor is sent as it is produced, except that torch needs plain tensors: p2p
sends need contiguous memory, and the zero-bubble schedules detach stage outputs in place,
which autograd refuses for views. A non-contiguous tensor is made contiguous (a copy), a view
that needs no gradient is detached (no copy), and a view that needs one is cloned (a copy,
rare: boundary values are usually fresh results).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from pipedialect import ConfigError

__all__: list[str] = []

logger = logging.getLogger(__name__)


class BatchContext:
    """The micro-batches of the current ``train_batch``/``eval_batch`` call, shared by adapters."""

    def __init__(self) -> None:
        #: The model inputs of each micro-batch (only on the rank holding the first stage).
        self.inputs: list[Any] = []
        #: The labels of each micro-batch (only on the rank holding the last stage).
        self.labels: list[Any] = []
        #: The last stage's most recent output, waiting for the loss ([Note: last-stage output]).
        self.pending_output: Any = None
        #: Whether a pending output is set (the output itself may be None).
        self.has_pending = False
        #: The unscaled loss of each micro-batch, by index.
        self.losses: dict[int, torch.Tensor] = {}
        #: The output of the most recent micro-batch whose loss was computed.
        self.last_output: Any = None
        #: Micro-batches per optimizer step; training losses are divided by it for backward.
        self.scale = 1

    def start(self, inputs: list[Any], labels: list[Any], scale: int) -> None:
        """Begin a batch: forget everything from the previous one."""
        self.inputs = inputs
        self.labels = labels
        self.pending_output = None
        self.has_pending = False
        self.losses = {}
        self.last_output = None
        self.scale = scale


def normalize_wire(wire: Any, prefix: str) -> tuple[torch.Tensor, ...]:
    """Return the stage's wire tuple as torch can send it ([Note: wire tensors for torch])."""
    if isinstance(wire, torch.Tensor):
        wire = (wire,)
    if not isinstance(wire, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in wire):
        raise ConfigError(
            f"{prefix} a stage module must return a tuple of tensors (a StageWrapper does), "
            f"got {type(wire).__name__}"
        )
    out = []
    for t in wire:
        if not t.is_contiguous():
            t = t.contiguous()
        elif t._is_view():
            t = t.clone() if t.requires_grad else t.detach()
        out.append(t)
    return tuple(out)


def index_of(index: torch.Tensor) -> int:
    """The micro-batch number carried by an index chunk ([Note: micro-batch indices])."""
    return int(index.reshape(-1)[0].item())


class StageRunner(nn.Module):
    """Runs one stage module inside ``PipelineStage``; see the notes of this module.

    Args:
        stage: the stage module (a :class:`~pipedialect.StageWrapper`).
        stage_id: its index.
        num_stages: the number of stages.
        context: the batch context shared with the engine and the loss adapter.
        device: where the first stage puts model inputs.
    """

    def __init__(
        self,
        stage: nn.Module,
        stage_id: int,
        num_stages: int,
        context: BatchContext,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.stage = stage
        self.stage_id = stage_id
        self.first = stage_id == 0
        self.last = stage_id == num_stages - 1
        self.log_prefix = f"[Stage {stage_id}]"
        self._context = context
        self._device = device
        self._placeholder: torch.Tensor | None = None

    def call_stage(self, args: Sequence[Any]) -> Any:
        """Run the stage module on ``args`` (model inputs on the first stage, else wire)."""
        if self.first:
            inputs = to_device(args[0], self._device) if args else ()
            if isinstance(inputs, dict):
                return self.stage(**inputs)
            if isinstance(inputs, (tuple, list)):
                return self.stage(*inputs)
            return self.stage(inputs)
        return self.stage(*args)

    def forward(self, *args: torch.Tensor) -> Any:
        """Run the stage on one micro-batch; see [Note: micro-batch indices]."""
        if self.first:
            (index,) = args
            out = self.call_stage((self._context.inputs[index_of(index)],))
        else:
            out = self.call_stage(args)
        if not self.last:
            return normalize_wire(out, self.log_prefix)
        self._context.pending_output = out
        self._context.has_pending = True
        return self.placeholder()

    def placeholder(self) -> torch.Tensor:
        """The tensor the last stage returns in place of the model's output."""
        if self._placeholder is None:
            self._placeholder = torch.zeros((), device=self._device)
        return self._placeholder

    def extra_repr(self) -> str:
        return f"stage_id={self.stage_id}, first={self.first}, last={self.last}"


class LossAdapter:
    """The ``loss_fn`` the schedule calls: the user's loss on the kept output and the labels.

    Records each micro-batch's loss unscaled, and returns it divided by the number of
    micro-batches when training, so that gradients are those of the mean loss (as DeepSpeed
    scales each loss before its backward).
    """

    def __init__(self, loss_fn: Callable[[Any, Any], Any], context: BatchContext) -> None:
        self.loss_fn = loss_fn
        self.context = context

    def __call__(self, placeholder: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        del placeholder
        ctx = self.context
        if not ctx.has_pending:
            raise ConfigError(
                "the loss was requested before the last stage produced an output; this torch "
                "version calls loss_fn in an order this dialect does not support"
            )
        i = index_of(target)
        out = ctx.pending_output
        ctx.pending_output = None
        ctx.has_pending = False
        loss = self.loss_fn(out, ctx.labels[i])
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ConfigError(
                f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
            )
        ctx.losses[i] = loss.detach().reshape(())
        ctx.last_output = out
        # Always a fresh tensor: zero-bubble schedules detach the loss in place.
        return loss.reshape(()) / ctx.scale


def to_device(value: Any, device: torch.device) -> Any:
    """Move every tensor in ``value`` (tuples, lists, dicts) to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(to_device(v, device) for v in value)
    if isinstance(value, list):
        return [to_device(v, device) for v in value]
    if type(value) is dict:
        return {k: to_device(v, device) for k, v in value.items()}
    return value


def pipeline_stage_class() -> type[Any]:
    """``PipelineStage`` with forward-only runs fixed for V-shaped schedules.

    [Note: evaluation on V schedules]
    ``schedule.eval()`` runs the schedule's actions with backward switched off. On a V-shaped
    schedule the two stages of a rank hand gradients to each other in-process after each
    backward action, and torch 2.13 asserts that the stage has a backward even when the
    backward itself was skipped. Without a backward there is nothing to hand over, so this
    subclass makes that hand-over a no-op then; with a backward it is torch's own.
    """
    from torch.distributed.pipelining import PipelineStage

    class _PipeDialectStage(PipelineStage):
        def get_local_bwd_output(self, mb_index: int) -> Any:
            if not self.has_backward:
                return None
            return super().get_local_bwd_output(mb_index)  # type: ignore[no-untyped-call]

        def set_local_bwd_input(self, next_stage_bwd_outputs: Any, mb_index: int) -> None:
            if not self.has_backward:
                return
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    return _PipeDialectStage
