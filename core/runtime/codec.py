"""Boundary codecs: :class:`SchemaCodec`, the lossless default.

Between two pipeline stages only tensors travel. :class:`SchemaCodec` splits any boundary value
into its tensor leaves, which go on the wire as they are (same objects: no copy, no cast, no
device move), and a metadata string that holds everything else. ``decode`` puts them back
together; a fresh instance decodes what any other encoded, because the metadata describes the
whole value. What it carries and refuses, the metadata format and how it stays fast are in
docs/codec.rst ("The boundary codec").
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import torch

from ..contracts import TensorCodec
from ..errors import StructureChangedError
from . import _codec_schema as _schema

__all__ = ["SchemaCodec"]

logger = logging.getLogger(__name__)

#: The codec that decoded the values the running stage received; None outside a stage wrapper.
_DECODED_BY: contextvars.ContextVar[TensorCodec | None] = contextvars.ContextVar(
    "pipedialect_decoded_by", default=None
)


@contextlib.contextmanager
def decoded_by(codec: TensorCodec | None) -> Iterator[None]:
    """Let the split-point guards in this block judge values as ``codec`` decodes them.

    The stage wrapper sets it around a stage's forward; the guards the capture wrote into the
    stage graph read it (:func:`decoding_codec`), so a value is judged by what its codec keeps.
    """
    token = _DECODED_BY.set(codec)
    try:
        yield
    finally:
        _DECODED_BY.reset(token)


def decoding_codec() -> TensorCodec | None:
    """The codec :func:`decoded_by` named for the running stage; None outside a stage."""
    return _DECODED_BY.get()


def _no_encoder(obj: object) -> None:
    """The fast encoder before any structure has been learnt: never matches."""


class _FirstDecoder:
    """Decoder of a metadata string seen once: interprets, and compiles on the second use."""

    __slots__ = ("cache", "count", "metadata", "root", "uses")

    def __init__(
        self, root: _schema.Node, count: int, metadata: str, cache: dict[str, _schema.Decoder]
    ) -> None:
        self.root = root
        self.count = count
        self.metadata = metadata
        self.cache = cache
        self.uses = 0

    def __call__(self, tensors: Sequence[torch.Tensor]) -> Any:
        self.uses += 1
        if self.uses < 2:
            return _schema.interpret(self.root, self.count, tensors)
        try:
            decoder = _schema.compile_decoder(self.root, self.count)
        except (SyntaxError, RecursionError, MemoryError, ValueError) as exc:
            logger.debug("SchemaCodec keeps interpreting %s: %s", self.metadata[:200], exc)
            decoder = functools.partial(_schema.interpret, self.root, self.count)
        if self.cache.get(self.metadata) is self:
            self.cache[self.metadata] = decoder
        return decoder(tensors)


class SchemaCodec(TensorCodec):
    """Lossless codec: only tensor leaves travel; everything else lives in the metadata.

    Args:
        freeze: fix the structure at the first :meth:`encode` and refuse any other with
            :class:`~pipedialect.StructureChangedError`.
    """

    #: How many structures each direction keeps compiled; the oldest is dropped first.
    MAX_STRUCTURES: ClassVar[int] = 64

    def __init__(self, *, freeze: bool = False) -> None:
        self.freeze = freeze
        self._frozen: str | None = None
        self._fast: _schema.Encoder = _no_encoder
        # metadata -> compiled encoder, or None for a structure seen once and not compiled.
        self._encoders: dict[str, _schema.Encoder | None] = {}
        self._decoders: dict[str, _schema.Decoder] = {}

    @property
    def frozen_metadata(self) -> str | None:
        """The metadata fixed by the first :meth:`encode` when ``freeze`` is set, else None."""
        return self._frozen

    def encode(
        self, obj: object, device: torch.device | None = None
    ) -> tuple[tuple[torch.Tensor, ...], str]:
        """Return ``obj``'s tensor leaves (depth first) and the metadata that restores ``obj``.

        ``device`` is accepted for the :class:`~pipedialect.TensorCodec` interface; this codec
        creates no tensors.
        """
        encoded = self._fast(obj)
        if encoded is not None:
            return encoded
        return self._encode_new(obj)

    def _encode_new(self, obj: object) -> tuple[tuple[torch.Tensor, ...], str]:
        leaves, metadata = _schema.walk(obj)
        if self.freeze:
            if self._frozen is None:
                self._frozen = metadata
            elif metadata != self._frozen:
                raise StructureChangedError(
                    "SchemaCodec(freeze=True): the value's structure changed since the first "
                    f"encode ({_schema.explain_difference(self._frozen, metadata)}). Keep the "
                    "structure and the non-tensor values constant, or use freeze=False."
                )
        encoders = self._encoders
        if metadata not in encoders:
            _bounded_put(encoders, metadata, None, self.MAX_STRUCTURES)
            return tuple(leaves), metadata
        encoder = encoders[metadata]
        if encoder is None:
            root, _ = _schema.parse(metadata)
            try:
                encoder = _schema.compile_encoder(root, metadata)
            except (SyntaxError, RecursionError, MemoryError, ValueError) as exc:
                logger.debug("SchemaCodec keeps walking %s: %s", metadata[:200], exc)
                encoder = _no_encoder
            encoders[metadata] = encoder
        self._fast = encoder
        return tuple(leaves), metadata

    def decode(self, tensors: Sequence[torch.Tensor], metadata: str) -> Any:
        """Rebuild the value from its tensor leaves and metadata.

        Raises :class:`~pipedialect.MetadataError` when ``metadata`` is malformed or describes
        another number of tensors.
        """
        decoder = self._decoders.get(metadata)
        if decoder is None:
            decoder = self._learn(metadata)
        return decoder(tensors)

    def _learn(self, metadata: str) -> _schema.Decoder:
        root, count = _schema.parse(metadata)
        decoder = _FirstDecoder(root, count, metadata, self._decoders)
        _bounded_put(self._decoders, metadata, decoder, self.MAX_STRUCTURES)
        return decoder

    def tensor_paths(self, metadata: str) -> list[str]:
        """The path of each tensor leaf, in leaf order, e.g. ``[1]['mask']`` (for messages)."""
        return _schema.tensor_paths(metadata)

    def explain_difference(self, old_metadata: str, new_metadata: str) -> str:
        """Where two metadata strings' structures first differ, and what was and is there."""
        return _schema.explain_difference(old_metadata, new_metadata)

    def __repr__(self) -> str:
        return f"SchemaCodec(freeze={self.freeze})"


def _bounded_put(cache: dict[str, Any], key: str, value: Any, limit: int) -> None:
    while len(cache) >= limit:
        del cache[next(iter(cache))]
    cache[key] = value
