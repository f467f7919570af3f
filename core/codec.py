"""Boundary codecs: :class:`SchemaCodec`, the lossless default.

(Stub: the codec issue implements this module.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .interfaces import TensorCodec

__all__ = ["SchemaCodec"]


class SchemaCodec(TensorCodec):
    """Lossless codec: only tensor leaves travel; everything else lives in the metadata."""

    def __init__(self, *, freeze: bool = False) -> None:
        self.freeze = freeze

    def encode(
        self, obj: object, device: torch.device | None = None
    ) -> tuple[tuple[torch.Tensor, ...], str]:
        """Return ``obj``'s tensor leaves and the metadata that restores ``obj``."""
        raise NotImplementedError

    def decode(self, tensors: Sequence[torch.Tensor], metadata: str) -> Any:
        """Rebuild the value from its tensor leaves and metadata."""
        raise NotImplementedError
