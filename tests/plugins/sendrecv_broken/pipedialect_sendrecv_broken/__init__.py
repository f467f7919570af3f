"""Four plausible bugs in the example ``sendrecv`` dialect, one dialect each.

- ``sendrecv-notiesync``: forgets to all-reduce the gradients of tied copies, so a GPT's
  embedding and LM head drift apart (what Slapo's dialect does to ties it cannot place).
- ``sendrecv-nokeys``: a codec that sends a dict's values but numbers the keys on arrival.
- ``sendrecv-reorder``: sends a boundary's tensors in reverse order (the metadata tensor stays
  last), so two same-shaped values swap places silently.
- ``sendrecv-lossy``: a codec that sends float tensors of 64 elements or more as bfloat16 (to
  halve the bytes), so activations arrive rounded; small test values survive a round trip.

Each must fail the conformance suite with a message that names the broken contract.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from pipedialect_sendrecv import SendRecvDialect, SendRecvPipeline

import pipedialect
from pipedialect import Dialect, SchemaCodec, TensorCodec

__all__ = [
    "KeyLosingCodec",
    "LossyCodec",
    "LossyDialect",
    "NoKeysDialect",
    "NoTieSyncDialect",
    "ReorderDialect",
    "register_dialects",
]


class NoTieSyncPipeline(SendRecvPipeline):
    """Never sums the gradients of tied copies."""

    def sync_tied_gradients(self) -> None:
        """The bug: each copy keeps only its own stage's gradient."""


class NoTieSyncDialect(SendRecvDialect):
    """``sendrecv`` without the tied-gradient all-reduce."""

    name = "sendrecv-notiesync"
    pipeline_class = NoTieSyncPipeline


def _renumbered(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(i): _renumbered(v) for i, v in enumerate(value.values())}
    if isinstance(value, list):
        return [_renumbered(v) for v in value]
    if type(value) is tuple:
        return tuple(_renumbered(v) for v in value)
    return value


class KeyLosingCodec(SchemaCodec):
    """Sends a dict's values only; the receiver knows them as ``'0'``, ``'1'``, ..."""

    def encode(
        self, obj: object, device: torch.device | None = None
    ) -> tuple[tuple[torch.Tensor, ...], str]:
        """The bug: the keys are replaced by positions before encoding."""
        return super().encode(_renumbered(obj), device)


class NoKeysDialect(SendRecvDialect):
    """``sendrecv`` with a codec that loses dict keys."""

    name = "sendrecv-nokeys"

    @property
    def codec(self) -> TensorCodec:
        """A :class:`KeyLosingCodec`."""
        return KeyLosingCodec()


class ReorderPipeline(SendRecvPipeline):
    """Sends a boundary's tensors last to first (the metadata tensor stays last)."""

    def outgoing(self, wire: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The bug: the values go out reversed."""
        body = list(wire[:-1])
        return [*reversed(body), wire[-1]]


class ReorderDialect(SendRecvDialect):
    """``sendrecv`` that reorders each boundary's values."""

    name = "sendrecv-reorder"
    pipeline_class = ReorderPipeline


def _rounded(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() >= 64:
        return value.to(torch.bfloat16).to(value.dtype)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    if type(value) is tuple:
        return tuple(_rounded(v) for v in value)
    return value


class LossyCodec(SchemaCodec):
    """Sends floats of 64 elements or more at bfloat16 precision."""

    def encode(
        self, obj: object, device: torch.device | None = None
    ) -> tuple[tuple[torch.Tensor, ...], str]:
        """The bug: large float tensors are rounded to bfloat16 before they are sent."""
        return super().encode(_rounded(obj), device)


class LossyDialect(SendRecvDialect):
    """``sendrecv`` whose codec rounds large float tensors."""

    name = "sendrecv-lossy"

    @property
    def codec(self) -> TensorCodec:
        """A :class:`LossyCodec`."""
        return LossyCodec()


@pipedialect.hookimpl
def register_dialects(register: Callable[[type[Dialect]], None]) -> None:
    """Register the four broken dialects."""
    for dialect in (NoTieSyncDialect, NoKeysDialect, ReorderDialect, LossyDialect):
        register(dialect)
