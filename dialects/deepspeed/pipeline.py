"""The API of Slapo's ``slapo.framework_dialect.deepspeed.pipeline``, under the same names.

Code written against the seed's documentation keeps working: the names and signatures below are
the seed's. This module does not import deepspeed.

The path codec
==============

:func:`flatten` turns a list of boundary values into one tensor per leaf plus metadata
``[(<path>, <type>), ...]``; :func:`encode_metadata` writes it as the string
``"<path>,<type>|<path>,<type>|..."`` that travels as the last wire tensor;
:func:`decode_metadata` and :func:`unflatten` undo both. ``<path>`` is the leaf's position,
one index per level joined with dots (the paths of ``t1`` and ``t2`` are ``"0.0"``, ``"0.1"`` in
``[[t1, t2]]`` and ``"0.0"``, ``"1.0"`` in ``[[t1], [t2]]``); ``<type>`` is a
:class:`WrappedTypeCode` value. For example ``[t0, (t1, None), 3]`` gives
``"0,0|1.0,0|1.1,2|2,1"`` and the wire tensors ``(t0, t1, tensor(0), tensor(3))``.

Compatibility with Slapo 0.0.3
    On every value Slapo 0.0.3 accepts (lists, tuples and dict values, nested, of tensors,
    ``None``, ``bool``, ``int`` and ``float``) the metadata string is Slapo's, byte for byte,
    and the wire tensors are Slapo's, except that a Python ``float`` travels as a float64
    tensor instead of float32 (the metadata does not change), so it keeps its precision. The
    one exception: Slapo iterates a *top-level* dict over its keys; :func:`flatten` takes its
    values, as it does for nested dicts.

Fixed Slapo bugs
    An empty output encodes to ``""``, which decodes to ``[]`` and round-trips (Slapo failed);
    floats keep float64 precision; an int outside int64, a str or any other object raises
    :class:`~pipedialect.UnsupportedValueError` naming its path (e.g. ``"1.0"``); malformed
    metadata (a bad piece, a path given twice, a path through a leaf, a tensor count that does
    not match) raises :class:`~pipedialect.MetadataError` naming the bad piece, never an
    ``IndexError`` or ``KeyError``; :func:`get_simple_nested_list_str` prints every value
    (dicts and strings included) instead of raising; :func:`flat_and_name_tensor_list`
    itemises every list, tuple and dict.

What the seed format cannot express (use :class:`~pipedialect.SchemaCodec` instead)
    Every list, tuple, ``torch.Size`` and dict comes back as a tuple; dict keys are lost; an
    empty container comes back as ``()`` when a later sibling has a path, and vanishes at the
    end of its parent (``[t0, []]`` comes back as ``(t0,)``); the whole empty output is the
    only empty value that survives. ``bool``, ``int`` and ``float`` keep their type; every
    scalar and every ``None`` costs one wire tensor; the receiver must read the metadata
    tensor (a device-to-host copy) to decode.

:class:`PathCodec` puts this codec behind the :class:`~pipedialect.TensorCodec` interface
(the top level decodes as a list, nested sequences as tuples).
"""

from __future__ import annotations

# ---- codec (the seed's path codec; owned by the codec issue) -------------------------------
from pipedialect._codec_path import (
    PathCodec,
    WrappedTypeCode,
    decode_metadata,
    encode_metadata,
    flat_and_name_tensor_list,
    flatten,
    get_simple_nested_list_str,
    unflatten,
)

__all__ = [
    "PathCodec",
    "WrappedTypeCode",
    "decode_metadata",
    "encode_metadata",
    "flat_and_name_tensor_list",
    "flatten",
    "get_simple_nested_list_str",
    "unflatten",
]
# ---- end of codec section ------------------------------------------------------------------
