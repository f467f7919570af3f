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
sends need contiguous memory, and the zero-bubble schedules detach stage outputs in place after
the input-gradient pass. A non-contiguous tensor is made contiguous (a copy) and a view that
needs no gradient is detached (no copy). A tensor that needs a gradient is sent as an alias
(``pipedialect.runtime.pass_through``): a new tensor object on the same memory whose autograd
node passes the gradient through (no copy). Detaching the alias in place leaves the stage's own
value attached, which matters when that value is also saved by a later operation of the stage
whose weight gradient is computed in the weight pass (a split point's output used again inside
the stage: detaching it made torch fail with "Trying to use a saved tensor that has been
detached in-place"), and autograd refuses to detach views in place, which the alias is not.

[Note: split backward without a gradient-carrying input]
The zero-bubble schedules (``split_backward`` in ``_schedules``) compute a stage's input
gradients first, then its weight gradients starting from the autograd nodes where the
parameters' paths meet the paths of the stage inputs that need a gradient. A parameter path
that reaches a stage output without meeting such an input (an embedding of integer ids sent on
as it is, or a stage whose inputs need no gradient at all) is not followed, and torch's weight
pass silently leaves that parameter's gradient out. Before each input-gradient pass, this
dialect's stage checks whether some output that needs a gradient depends on no input that needs
one; if so, that micro-batch's backward runs in full at once and its weight pass has nothing
left to do. The gradients are exact; that stage only loses the zero-bubble overlap.

Torch's weight pass also frees the graph as it goes, one parameter group after another. When a
parameter is used at two places along the input path (a weight tied within the stage), its
group's pass walks the graph between the two uses and frees it, and the next group, whose
parameters lie on that stretch, fails with "Trying to backward through the graph a second
time". This dialect's weight pass keeps the graph until the pass ends (torch's own function
with ``retain_graph``); the graph is released with the micro-batch's backward state right after.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from pipedialect import ConfigError
from pipedialect.sdk import kept_loss, pass_through

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
        if t.requires_grad:
            t = pass_through(t)
        elif t._is_view():
            t = t.detach()
        out.append(t)
    return tuple(out)


def _grad_node(value: torch.Tensor) -> Any:
    """The autograd node of ``value``: its ``grad_fn``, or its gradient accumulator if a leaf."""
    if value.grad_fn is not None:
        return value.grad_fn
    view = value.view_as(value)
    return view.grad_fn.next_functions[0][0] if view.grad_fn is not None else None


def outputs_without_grad_input(outputs: Sequence[Any], inputs: Sequence[Any]) -> list[int]:
    """Indices of the ``outputs`` that need a gradient but depend on no ``inputs`` that need one.

    See [Note: split backward without a gradient-carrying input].
    """
    sources = {_grad_node(t) for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad}
    sources.discard(None)
    return [
        i
        for i, out in enumerate(outputs)
        if isinstance(out, torch.Tensor) and out.requires_grad and not _reaches(out, sources)
    ]


def _reaches(value: torch.Tensor, sources: set[Any]) -> bool:
    """Whether the autograd graph of ``value`` contains one of the ``sources`` nodes."""
    root = _grad_node(value)
    if root is None:
        return False
    seen = {root}
    todo = [root]
    while todo:
        node = todo.pop()
        if node in sources:
            return True
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                todo.append(child)
    return False


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
        #: Called after each backward action of this stage (the engine sets it under bf16 to
        #: move the micro-batch's gradients into its high-precision buffers).
        self.after_backward: Callable[[], None] | None = None

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

    def run_example(self, args: Sequence[Any]) -> Any:
        """Run the stage once outside the schedule, through this module's own call, so that
        hooks on it run as in training (FSDP's root unit gathers its parameters there:
        ``_fsdp`` [Note: FSDP on torch]). ``args``: the model inputs on the first stage, else
        the wire. Returns the wire (nothing useful on the last stage)."""
        ctx = self._context
        if self.first:
            saved = ctx.inputs
            ctx.inputs = [args[0]]
            try:
                return self(torch.zeros(1, dtype=torch.int64))
            finally:
                ctx.inputs = saved
        out = self(*args)
        if self.last:
            ctx.pending_output = None
            ctx.has_pending = False
        return out

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
        ctx.losses[i] = kept_loss(loss).reshape(())
        ctx.last_output = out
        # Always a fresh tensor: zero-bubble schedules detach the loss in place.
        return loss.reshape(()) / ctx.scale


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with ``fn`` applied to every tensor in it, through tuples (not named ones),
    lists and plain dicts; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(map_tensors(v, fn) for v in value)
    if isinstance(value, list):
        return [map_tensors(v, fn) for v in value]
    if type(value) is dict:
        return {k: map_tensors(v, fn) for k, v in value.items()}
    return value


def to_device(value: Any, device: torch.device) -> Any:
    """Move every tensor in ``value`` (tuples, lists, dicts) to ``device``."""
    return map_tensors(value, lambda t: t.to(device))


def pipeline_stage_class() -> type[Any]:
    """``PipelineStage`` with forward-only runs fixed for V-shaped schedules.

    [Note: evaluation on V schedules]
    ``schedule.eval()`` runs the schedule's actions with backward switched off. On a V-shaped
    schedule the two stages of a rank hand gradients to each other in-process after each
    backward action, and torch 2.13 asserts that the stage has a backward even when the
    backward itself was skipped. Without a backward there is nothing to hand over, so this
    subclass makes that hand-over a no-op then; with a backward it is torch's own.

    It also runs the backward in full where the split one would lose weight gradients, and
    keeps the graph through the weight pass ([Note: split backward without a
    gradient-carrying input]).
    """
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining._backward import stage_backward_weight

    class _PipeDialectStage(PipelineStage):
        def get_local_bwd_output(self, mb_index: int) -> Any:
            if not self.has_backward:
                return None
            return super().get_local_bwd_output(mb_index)  # type: ignore[no-untyped-call]

        def set_local_bwd_input(self, next_stage_bwd_outputs: Any, mb_index: int) -> None:
            if not self.has_backward:
                return
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

        def backward_maybe_with_nosync(
            self, backward_type: str, bwd_kwargs: dict[str, Any], last_backward: bool = False
        ) -> Any:
            """Torch's backward step, made exact for split backward (see the notes above).

            The weight pass calls torch's function directly: only schedules with one stage
            per rank run under FSDP (``_fsdp``), and none of them splits the backward, so
            there is no synchronisation for the weight pass to defer.
            """
            result = self._backward(backward_type, bwd_kwargs, last_backward)
            hook = getattr(self.submod, "after_backward", None)
            if hook is not None:
                hook()
            return result

        def _backward(
            self, backward_type: str, bwd_kwargs: dict[str, Any], last_backward: bool
        ) -> Any:
            if backward_type == "input":
                outputs = bwd_kwargs["stage_output"]
                if isinstance(outputs, torch.Tensor):
                    outputs = (outputs,)
                lone = outputs_without_grad_input(outputs, bwd_kwargs["input_values"])
                if lone:
                    logger.debug(
                        "[Stage %d] outputs %s need a gradient but depend on no input that "
                        "needs one: full backward in place of the input pass",
                        self.stage_index,
                        lone,
                    )
                    grads, _ = super().backward_maybe_with_nosync("full", bwd_kwargs, last_backward)
                    return grads, []
            if backward_type == "weight":
                weights = stage_backward_weight(
                    self.submod.parameters(), bwd_kwargs["param_groups"], retain_graph=True
                )
                return weights, None
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    return _PipeDialectStage
