"""Boundary codecs: :class:`SchemaCodec`, the lossless default.

Between two pipeline stages only tensors travel. :class:`SchemaCodec` splits any boundary value
into its tensor leaves, which go on the wire as they are (same objects: no copy, no cast, no
device move), and a metadata string that holds everything else. ``decode`` puts them back
together; a fresh instance decodes what any other encoded, because the metadata describes the
whole value.

What it carries exactly
    tensors of every dtype (``torch.Tensor`` and its subclasses, passed through); ``None``;
    ``bool`` (kept apart from ``int``); ``int`` of any size; ``float`` bit for bit, including
    ``-0.0``, the infinities and NaN (a NaN's sign and payload bits are not kept); ``str``;
    ``torch.Size``; ``list``, ``tuple`` and ``dict`` (keys and their order), nested and empty.
    Dict keys may be ``str``, ``int``, ``bool``, ``float`` (not NaN) or ``None``.

What it refuses
    With :class:`~pipedialect.UnsupportedValueError` naming the value's path (e.g.
    ``[1]['mask']``): subclasses of the builtin containers and scalars (namedtuples,
    ``OrderedDict``, Hugging Face ``ModelOutput``, ``IntEnum``, numpy scalars), any other
    object, a container that contains itself, and containers nested more than 100 deep. Their
    class could not be restored.

Metadata format (version 1)
    Compact ASCII JSON: ``[1,<value>]``, where ``<value>`` is

    =============================  ====================================================
    ``"T"``                        a tensor: the next tensor leaf, in depth-first order
    ``null``, ``true``, ``false``  ``None``, ``True``, ``False``
    a JSON integer                 an ``int``
    a JSON float                   a ``float``, written with ``float.__repr__``;
                                   ``NaN``, ``Infinity``, ``-Infinity`` as JSON5 names
    ``["s",<text>]``               a ``str``
    ``["z",<int>,...]``            a ``torch.Size``
    ``["l",<value>,...]``          a ``list``
    ``["t",<value>,...]``          a ``tuple``
    ``["d",<key>,<value>,...]``    a ``dict``; each key is a JSON string, integer,
                                   float, ``true``, ``false`` or ``null``
    =============================  ====================================================

    For example ``(hidden, None, (mask, pos), 0.5, 3, True)`` is
    ``[1,["t","T",null,["t","T","T"],0.5,3,true]]`` with the tensor leaves
    ``(hidden, mask, pos)``. Non-tensor values live in the metadata, so a change of such a value
    changes the metadata. Anything else is refused with :class:`~pipedialect.MetadataError`
    naming the bad piece and where it sits.

Speed
    A structure is analysed once. The first ``encode`` of a structure walks the value; from the
    second on, a generated function (straight-line Python, one per structure) checks types,
    lengths, dict keys and constants while it picks out the leaves. The function of the last
    structure is tried first; when the value does not fit it, the value is walked and the
    function of its own structure, if known, takes over. ``decode`` of a metadata
    string seen before is a dict lookup plus one call of a generated function; the first time,
    the string is parsed and interpreted. Neither direction touches tensor data, so neither
    forces a device-to-host sync. Caches are bounded (``SchemaCodec.MAX_STRUCTURES``).

Frozen structures
    ``SchemaCodec(freeze=True)`` fixes the structure (including the non-tensor values) at the
    first ``encode``; a later value whose metadata differs raises
    :class:`~pipedialect.StructureChangedError` naming the first differing path and what was
    and is there. Runtimes that size their buffers from the first micro-batch need this.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from . import _codec_schema as _schema
from .errors import StructureChangedError
from .interfaces import TensorCodec

__all__ = ["SchemaCodec"]

logger = logging.getLogger(__name__)


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
