"""The tensor-only wire format every stage boundary uses.

[Note: wire layout]
A boundary value goes through a :class:`~pipedialect.TensorCodec` first, which yields its tensor
leaves and a metadata string. Pipeline runtimes then decide who gets a gradient by dtype:
DeepSpeed gives one to every floating-point tensor it sends or receives and to no other. So the
leaves are laid out as

1. float tensors that need a gradient, in leaf order;
2. float tensors that need none, bit-cast (``Tensor.view``, no copy) to the integer dtype of the
   same width, so the runtime sees a non-float and gives them no gradient;
3. every other tensor (int, bool, complex without gradient), as it is;
4. one ``uint8`` tensor holding the layout and the codec's metadata.

The receiver restores the bit-cast views and the leaf order and decodes. The layout of a
boundary is decided by its first training micro-batch and then frozen: a later micro-batch whose
layout would differ (a value that needed no gradient now needs one, a new structure, a new shape
when shapes are static) is refused with an error naming the value's path. Under ``no_grad``
(evaluation) the frozen layout is reused, so evaluation sends what training sent.

[Note: wire state]
The metadata tensor always describes the layout it travels with: it is cached per layout (and
device), never per codec metadata alone, because under ``no_grad`` every float looks alike and
the same structure gets another order and other kinds. A layout says whether it is *final* (the
sender froze it and sends nothing else until :meth:`WireEncoder.reset`); the receiver keeps
only a final layout and then stops reading the metadata tensor (no device-to-host copy per
micro-batch). Any other layout (dynamic shapes, or a layout worked out under ``no_grad`` before
the first training micro-batch) is read from every micro-batch. So the receiver never decodes
with a layout other than the sender's, whatever the order of training and evaluation. A reset
must reach both ends of a boundary at once (an engine's ``reset_activation_shape`` resets
every stage it runs; every rank calls it).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from ..contracts import TensorCodec
from ..errors import MetadataError, StructureChangedError, WireError

__all__ = ["pass_through", "read_layout"]

_BITCAST = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_WIRE_VERSION = 2


@dataclass(frozen=True)
class WireLayout:
    """Where each codec leaf sits on the wire and how it is disguised."""

    #: The codec's metadata string.
    codec_metadata: str
    #: ``order[p]`` is the codec leaf index carried at wire position ``p``.
    order: tuple[int, ...]
    #: ``kinds[p]``: ``g`` float needing a gradient, ``f`` bit-cast float, ``o`` other.
    kinds: str
    #: ``casts[p]`` is the original dtype of a bit-cast leaf, else None.
    casts: tuple[torch.dtype | None, ...]
    #: Whether the sender froze this layout: it sends no other until reset ([Note: wire state]).
    final: bool = False

    def dumps(self) -> str:
        """Serialise the layout (the receiver needs nothing else)."""
        return json.dumps(
            {
                "v": _WIRE_VERSION,
                "c": self.codec_metadata,
                "o": list(self.order),
                "k": self.kinds,
                "d": [None if d is None else str(d).removeprefix("torch.") for d in self.casts],
                "f": self.final,
            },
            separators=(",", ":"),
        )

    @classmethod
    def loads(cls, text: str) -> WireLayout:
        """Parse :meth:`dumps` output; malformed input raises :class:`MetadataError`."""
        try:
            raw = json.loads(text)
            if raw.get("v") != _WIRE_VERSION:
                raise MetadataError(f"wire layout version {raw.get('v')!r} is not supported")
            order = tuple(int(i) for i in raw["o"])
            kinds = str(raw["k"])
            casts = tuple(None if d is None else _dtype(d) for d in raw["d"])
            codec_md = str(raw["c"])
            final = raw["f"]
            if not isinstance(final, bool):
                raise MetadataError(f"wire layout field 'f' must be a bool, got {final!r}")
        except MetadataError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise MetadataError(f"malformed wire layout {text[:80]!r}: {exc}") from exc
        if not (len(order) == len(kinds) == len(casts)) or sorted(order) != list(range(len(order))):
            raise MetadataError(f"inconsistent wire layout {text[:80]!r}")
        return cls(codec_md, order, kinds, casts, final)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise MetadataError(f"unknown dtype {name!r} in wire layout")
    return dtype


def leaf_paths(codec: TensorCodec, metadata: str, count: int) -> list[str]:
    """Best-effort human-readable paths of the tensor leaves, for error messages."""
    describe = getattr(codec, "tensor_paths", None)
    if callable(describe):
        try:
            paths = list(describe(metadata))
            if len(paths) == count:
                return [str(p) for p in paths]
        except Exception:  # only used to word an error; never hide the real one
            pass
    return [f"tensor #{i}" for i in range(count)]


class WireEncoder:
    """Sender side of one boundary: values -> wire tensors, with the layout frozen."""

    def __init__(
        self, codec: TensorCodec, *, prefix: str, frozen: bool = True, static_shapes: bool = True
    ) -> None:
        self.codec = codec
        self.prefix = prefix
        self.frozen = frozen
        self.static_shapes = static_shapes
        #: The frozen layout (set by the first training micro-batch when ``frozen``).
        self.layout: WireLayout | None = None
        #: The layout of the latest :meth:`encode`, frozen or not.
        self.last_layout: WireLayout | None = None
        self.shapes: tuple[torch.Size, ...] | None = None
        self._md_key: tuple[WireLayout, torch.device] | None = None
        self._md_tensor: torch.Tensor | None = None

    def reset(self) -> None:
        """Forget the frozen layout and shapes: the next training micro-batch sets them anew."""
        self.layout = None
        self.last_layout = None
        self.shapes = None

    def encode(self, value: Any, device: torch.device | None) -> tuple[torch.Tensor, ...]:
        """Encode ``value`` into wire tensors (the metadata tensor last)."""
        leaves, md = self.codec.encode(value, device)
        layout = self.layout
        if layout is None or not self.frozen:
            freeze = self.frozen and torch.is_grad_enabled()
            layout = self._new_layout(leaves, md, final=freeze)
            if freeze:
                self.layout = layout
        else:
            self._check(layout, leaves, md)
        self.last_layout = layout
        wire = [self._disguise(leaves[i], layout.casts[p]) for p, i in enumerate(layout.order)]
        if self.static_shapes and self.frozen and self.layout is not None:
            shapes = tuple(t.shape for t in wire)
            if self.shapes is None:
                self.shapes = shapes
            elif shapes != self.shapes:
                self._shape_error(layout, wire)
        wire.append(self._metadata_tensor(layout, device or _device_of(leaves)))
        return tuple(wire)

    @staticmethod
    def _disguise(t: torch.Tensor, cast: torch.dtype | None) -> torch.Tensor:
        if cast is None:
            return t
        return t.detach().view(_BITCAST[t.element_size()])

    def _new_layout(self, leaves: Sequence[torch.Tensor], md: str, *, final: bool) -> WireLayout:
        grads: list[int] = []
        floats: list[int] = []
        others: list[int] = []
        for i, t in enumerate(leaves):
            if t.is_floating_point():
                # Under no_grad nothing requires a gradient; a float is then sent as a float
                # (the runtime gives it a buffer that would carry a gradient in training).
                if t.requires_grad or not torch.is_grad_enabled():
                    grads.append(i)
                else:
                    floats.append(i)
            else:
                if t.requires_grad:
                    path = leaf_paths(self.codec, md, len(leaves))[i]
                    raise WireError(
                        f"{self.prefix} value at {path} is a {t.dtype} tensor that needs a "
                        "gradient; pipeline runtimes only carry gradients for real floating-point "
                        "tensors. Split it into real and imaginary parts, or detach it."
                    )
                others.append(i)
        order = tuple(grads + floats + others)
        kinds = "g" * len(grads) + "f" * len(floats) + "o" * len(others)
        casts = tuple(
            leaves[i].dtype if k == "f" else None for i, k in zip(order, kinds, strict=True)
        )
        return WireLayout(md, order, kinds, casts, final)

    def _check(self, layout: WireLayout, leaves: Sequence[torch.Tensor], md: str) -> None:
        if md != layout.codec_metadata:
            explain = getattr(self.codec, "explain_difference", None)
            detail = explain(layout.codec_metadata, md) if callable(explain) else None
            raise StructureChangedError(
                f"{self.prefix} the value sent to the next stage changed structure since the "
                f"first micro-batch ({detail or 'metadata differs'}). The runtime sizes its "
                "buffers from the first micro-batch: keep the structure constant, or enable "
                "dynamic shapes."
            )
        if not torch.is_grad_enabled():
            return
        for p, i in enumerate(layout.order):
            t = leaves[i]
            needs = t.is_floating_point() and t.requires_grad
            if needs != (layout.kinds[p] == "g"):
                path = leaf_paths(self.codec, md, len(leaves))[i]
                was = "needed" if layout.kinds[p] == "g" else "did not need"
                now = "needs" if needs else "does not need"
                raise WireError(
                    f"{self.prefix} value at {path} {was} a gradient in the first training "
                    f"micro-batch but {now} one now; the wire layout is fixed by the first "
                    "micro-batch. Keep requires_grad of boundary values constant."
                )

    def _shape_error(self, layout: WireLayout, wire: Sequence[torch.Tensor]) -> None:
        assert self.shapes is not None
        paths = leaf_paths(self.codec, layout.codec_metadata, len(layout.order))
        for p, (old, t) in enumerate(zip(self.shapes, wire, strict=True)):
            if old != t.shape:
                raise StructureChangedError(
                    f"{self.prefix} tensor at {paths[layout.order[p]]} changed shape from "
                    f"{tuple(old)} to {tuple(t.shape)}; the runtime fixes boundary shapes at the "
                    "first micro-batch. Pad to a constant shape, enable dynamic shapes, or call "
                    "the engine's reset_activation_shape() (on every rank) before the change."
                )

    def _metadata_tensor(self, layout: WireLayout, device: torch.device) -> torch.Tensor:
        # Keyed by the whole layout ([Note: wire state]); a frozen layout is the same object
        # every time, so the comparison is an identity check on the hot path.
        key = self._md_key
        if (
            self._md_tensor is None
            or key is None
            or key[1] != device
            or (key[0] is not layout and key[0] != layout)
        ):
            data = layout.dumps().encode()
            self._md_tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
            self._md_key = (layout, device)
        return self._md_tensor


class WireDecoder:
    """Receiver side of one boundary: wire tensors -> values.

    With ``frozen``, a layout the sender marked final is kept and the metadata tensor is not read
    again until :meth:`reset`; any other layout is read from every micro-batch
    ([Note: wire state]).
    """

    def __init__(self, codec: TensorCodec, *, prefix: str, frozen: bool = True) -> None:
        self.codec = codec
        self.prefix = prefix
        self.frozen = frozen
        #: The kept (final) layout, or None while every micro-batch's metadata is read.
        self.layout: WireLayout | None = None
        #: The tensors of the last decode that carry a gradient (kind ``g``), in wire order.
        self.grad_leaves: list[torch.Tensor] = []

    def reset(self) -> None:
        """Forget the kept layout: the next micro-batch's metadata is read again."""
        self.layout = None
        self.grad_leaves = []

    def decode(self, wire: Sequence[torch.Tensor]) -> Any:
        """Rebuild the value from ``wire`` (as :meth:`WireEncoder.encode` produced it)."""
        if not wire:
            raise MetadataError(f"{self.prefix} received no tensors; expected at least metadata")
        layout = self.layout
        if layout is None:
            layout = read_layout(wire[-1], self.prefix)
            if self.frozen and layout.final:
                self.layout = layout
        body = wire[:-1]
        if len(body) != len(layout.order):
            raise MetadataError(
                f"{self.prefix} received {len(body)} tensors but the layout describes "
                f"{len(layout.order)}; sender and receiver disagree about the boundary (was "
                "reset_activation_shape() called on some ranks only? Every rank must call it)"
            )
        leaves: list[torch.Tensor] = list(body)
        grads: list[torch.Tensor] = []
        grad_enabled = torch.is_grad_enabled()
        for p, i in enumerate(layout.order):
            t = body[p]
            cast = layout.casts[p]
            if cast is not None:
                t = t.view(cast)
            elif grad_enabled and layout.kinds[p] == "g":
                if not t.requires_grad:
                    # A runtime marks received floats as needing a gradient; do the same for a
                    # detached value, so which outputs need one is decided as in training.
                    t = t.detach().requires_grad_()
                if t.is_leaf or t._is_view():
                    # In-place operations on it must work as in the unsplit model
                    # (stage [Note: received tensors updated in place]); a hook of the
                    # runtime's (FSDP's on a sharded stage) may hand it over as a view a
                    # custom Function returned, which autograd refuses to update in place too.
                    t = pass_through(t)
            if layout.kinds[p] == "g":
                grads.append(t)
            leaves[i] = t
        self.grad_leaves = grads
        return self.codec.decode(leaves, layout.codec_metadata)


class _PassThrough(torch.autograd.Function):
    """Identity whose output is a new tensor on the input's memory, not a leaf."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor) -> torch.Tensor:
        del ctx
        return value.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        del ctx
        return grad


def pass_through(value: torch.Tensor) -> torch.Tensor:
    """``value`` as a non-leaf tensor on the same memory whose gradient reaches ``value``: an
    in-place operation on it is allowed where autograd refuses one on a leaf that needs a
    gradient (stage [Note: received tensors updated in place]). Nothing is copied."""
    return cast(torch.Tensor, _PassThrough.apply(value))  # type: ignore[no-untyped-call]


def read_layout(metadata: torch.Tensor, prefix: str = "") -> WireLayout:
    """The layout the metadata tensor (the last wire tensor) describes; reading it copies it to
    the host. Raises :class:`MetadataError` if it is not a wire layout."""
    return WireLayout.loads(_read_text(metadata, prefix))


def _read_text(t: torch.Tensor, prefix: str) -> str:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
        raise MetadataError(
            f"{prefix} the last tensor received should be the uint8 metadata tensor, got "
            f"{getattr(t, 'dtype', type(t).__name__)}"
        )
    try:
        return bytes(t.detach().cpu().tolist()).decode()  # no numpy: torch works without it
    except UnicodeDecodeError as exc:
        raise MetadataError(f"{prefix} the metadata tensor is not UTF-8: {exc}") from exc


def _device_of(tensors: Sequence[torch.Tensor]) -> torch.device:
    for t in tensors:
        return t.device
    return torch.device("cpu")
