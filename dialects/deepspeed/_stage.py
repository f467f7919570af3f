"""The DeepSpeed stage wrapper: the generic wire plus DeepSpeed's own rules.

DeepSpeed's ``PipelineEngine`` (0.19) sends a tuple of tensors between stages and decides who gets
a gradient by ``is_floating_point()``. The generic wire already puts gradient-carrying floats
first and disguises floats that need no gradient (:mod:`pipedialect.runtime.wire` [Note: wire
layout]). This wrapper adds what only DeepSpeed needs, checked once per boundary at the first
micro-batch so that a payload DeepSpeed cannot carry is refused here, naming the value,
instead of crashing or hanging inside the engine:

- every wire dtype must be one DeepSpeed's tensor-meta table knows;
- the tuple's description must fit DeepSpeed's 256-int tensor-meta buffer;
- every tensor is sent contiguous (a copy only for views such as an expanded mask);
- every received float that needs a gradient must get one: DeepSpeed asserts that each one has a
  ``.grad`` after backward. A value this stage uses without a differentiable path to its outputs
  (say through ``argmax``) is tied to an output by a node that adds a zero gradient
  ([Note: gradient anchor]).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from pipedialect import StageWrapper, WireError
from pipedialect.sdk import leaf_paths

__all__ = ["DeepSpeedStageWrapper"]

logger = logging.getLogger(__name__)

#: DeepSpeed 0.19's PipelineEngine.ID_TO_DTYPE: the dtypes its tensor meta can describe.
DEEPSPEED_WIRE_DTYPES = frozenset(
    {
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
        torch.float16,
        torch.bfloat16,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
    }
)
#: DeepSpeed 0.19's TENSOR_META_SIZE (int32 entries describing one send).
TENSOR_META_SIZE = 256


def tensor_meta_size(wire: Sequence[torch.Tensor]) -> int:
    """Return how many int32 entries DeepSpeed needs to describe sending ``wire``."""
    return 2 + sum(2 + t.dim() for t in wire)


class _GradAnchor(torch.autograd.Function):
    """[Note: gradient anchor] Pass ``carrier`` through; give each anchored tensor a zero grad.

    The true gradient of the loss with respect to a value no output depends on differentiably is
    zero, so sending zeros upstream is exact, and it satisfies DeepSpeed's assertion that every
    received float has a gradient.
    """

    @staticmethod
    def forward(ctx: Any, carrier: torch.Tensor, *anchored: torch.Tensor) -> torch.Tensor:
        ctx.shapes = [(a.shape, a.dtype, a.device) for a in anchored]
        return carrier.view_as(carrier)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        zeros = [torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.shapes]
        return (grads[0], *zeros)


class DeepSpeedStageWrapper(StageWrapper):
    """A stage as DeepSpeed's ``PipelineModule`` calls it: a tuple of tensors in and out.

    Built like any :class:`~pipedialect.StageWrapper` (``mod, spec, *, codec,
    dynamic_shapes``); the seed's constructor is
    :class:`~pipedialect.dialects.deepspeed.pipeline.DeepSpeedPipeStageWrapper`'s.
    """

    #: Whether the DeepSpeed-specific wire checks have run (once, unless shapes are dynamic).
    _wire_checked: bool = False
    #: Received gradient tensors no output reaches, found at the first training micro-batch.
    _unreached: tuple[int, ...] | None = None

    def reset_wire_state(self) -> None:
        """Forget the frozen wire state, and the DeepSpeed checks made on it, too."""
        super().reset_wire_state()
        self._wire_checked = False
        self._unreached = None

    def send(self, received: Sequence[Any], out: Any) -> tuple[torch.Tensor, ...]:
        """Encode as the generic wire does, check DeepSpeed's rules, anchor unused gradients."""
        # Point-to-point sends need contiguous memory; a no-op for most tensors.
        wire = tuple(
            t if t.is_contiguous() else t.contiguous() for t in super().send(received, out)
        )
        if not self._wire_checked or self.dynamic_shapes:
            self._check_wire(wire)
            self._wire_checked = True
        roots = [t for t in wire if t.requires_grad]
        carrier = wire[0] if roots and wire[0] is roots[0] else None
        anchored: tuple[torch.Tensor, ...] = self._anchor(
            wire, carrier, roots, lambda t: (t, *wire[1:])
        )
        return anchored

    def after_run(self, received: Sequence[Any], out: Any) -> Any:
        """On the last stage, make sure every received float that needs a gradient gets one."""
        if not self.last:
            return out
        roots = [t for t in _iter_tensors(out) if t.is_floating_point() and t.requires_grad]
        carrier = roots[0] if roots else None
        return self._anchor(out, carrier, roots, lambda t: _replace_first_grad_tensor(out, t))

    def _anchor(
        self,
        value: Any,
        carrier: torch.Tensor | None,
        roots: Sequence[torch.Tensor],
        rebuild: Callable[[torch.Tensor], Any],
    ) -> Any:
        grads = self._decoder.grad_leaves if self.stage_id > 0 else []
        if not grads or not torch.is_grad_enabled():
            return value
        if self._unreached is None or self.dynamic_shapes:
            self._unreached = self._find_unreached(grads, roots)
        if not self._unreached:
            return value
        if carrier is None:
            raise WireError(
                f"{self.log_prefix} receives values that need a gradient but produces no output "
                "that needs one, so DeepSpeed cannot send their gradients back. Detach them in the "
                "previous stage, or make this stage's output depend on them."
            )
        anchored = _GradAnchor.apply(  # type: ignore[no-untyped-call]
            carrier, *(grads[i] for i in self._unreached)
        )
        return rebuild(anchored)

    def _find_unreached(
        self, grads: Sequence[torch.Tensor], roots: Sequence[torch.Tensor]
    ) -> tuple[int, ...]:
        seen = _autograd_nodes(roots)
        missing = []
        for i, t in enumerate(grads):
            node = t.grad_fn
            if node is not None:
                reached = node in seen
            else:
                reached = any(getattr(n, "variable", None) is t for n in seen)
            if not reached:
                missing.append(i)
        if missing:
            logger.info(
                "%s %d received value(s) reach no output differentiably; they get zero gradients",
                self.log_prefix,
                len(missing),
            )
        return tuple(missing)

    def _check_wire(self, wire: Sequence[torch.Tensor]) -> None:
        layout = self._encoder.last_layout
        metadata = layout.codec_metadata if layout is not None else ""
        order = layout.order if layout is not None else tuple(range(len(wire) - 1))
        paths = leaf_paths(self.codec, metadata, len(order))
        for p, t in enumerate(wire[:-1]):
            if t.dtype not in DEEPSPEED_WIRE_DTYPES:
                known = sorted(str(d).removeprefix("torch.") for d in DEEPSPEED_WIRE_DTYPES)
                raise WireError(
                    f"{self.log_prefix} value at {paths[order[p]]} is a {t.dtype} tensor, which "
                    f"DeepSpeed's pipeline engine cannot send (it knows {', '.join(known)}). "
                    "Convert it before the stage boundary."
                )
        needed = tensor_meta_size(wire)
        if needed > TENSOR_META_SIZE:
            biggest = sorted(
                ((2 + t.dim(), paths[order[p]]) for p, t in enumerate(wire[:-1])), reverse=True
            )[:3]
            raise WireError(
                f"{self.log_prefix} the {len(wire)} tensors sent to stage {self.stage_id + 1} "
                f"need {needed} int32 entries of tensor metadata, but DeepSpeed's buffer holds "
                f"{TENSOR_META_SIZE}. Fewer values must cross this boundary (largest: "
                f"{', '.join(f'{path} ({n})' for n, path in biggest)}); move the split point or "
                "concatenate small tensors."
            )


def _autograd_nodes(roots: Sequence[torch.Tensor]) -> set[Any]:
    seen: set[Any] = set()
    stack = [r.grad_fn for r in roots if r.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(n for n, _ in node.next_functions if n is not None and n not in seen)
    return seen


def _iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _iter_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _iter_tensors(item)


def _replace_first_grad_tensor(obj: Any, new: torch.Tensor) -> Any:
    done = False

    def walk(o: Any) -> Any:
        nonlocal done
        if done:
            return o
        if isinstance(o, torch.Tensor):
            if o.is_floating_point() and o.requires_grad:
                done = True
                return new
            return o
        if isinstance(o, tuple) and not hasattr(o, "_fields"):
            return tuple(walk(i) for i in o)
        if isinstance(o, list):
            return [walk(i) for i in o]
        if type(o) is dict:
            return {k: walk(v) for k, v in o.items()}
        return o

    return walk(obj)
