"""The seed's path codec (Slapo's ``flatten``/``unflatten``), compatible and with its bugs fixed.

Re-exported, with its documentation, by :mod:`pipedialect.dialects.deepspeed.pipeline`; see
that module's docstring for the format and its limits. Nothing here imports deepspeed.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, Final

import torch

from pipedialect.contracts import TensorCodec
from pipedialect.errors import MetadataError, UnsupportedValueError

__all__: list[str] = []

#: How deeply containers may nest in a path-codec value (one path token per level).
MAX_DEPTH: Final = 100
#: How many missing positions ``unflatten`` fills with empty tuples, all paths together.
MAX_GAP_FILL: Final = 1 << 16

_INT64_MIN: Final = -(1 << 63)
_INT64_MAX: Final = (1 << 63) - 1
_TOKEN: Final = r"(?:0|[1-9][0-9]*)"
_PATH_RE: Final = re.compile(rf"{_TOKEN}(?:\.{_TOKEN})*", re.ASCII)


class WrappedTypeCode(enum.Enum):
    """Type code for wrapped tensor for inter-GPU communication.

    Each entry of the path codec's metadata says what the wire tensor at that position stands
    for.
    """

    #: A real tensor, passed as it is.
    TORCH_TENSOR = 0
    #: A Python bool, int or float, wrapped as a 0-dim tensor.
    SCALAR = 1
    #: ``None``, sent as ``tensor(0)``.
    TRUE_NONE = 2
    #: A list stored as one tensor (decoded, never produced by :func:`flatten`).
    LIST = 3
    #: A tuple stored as one tensor (decoded, never produced by :func:`flatten`).
    TUPLE = 4


_CODE_TEXTS: Final = {str(code.value): code for code in WrappedTypeCode}
_CODES: Final = {code.value: code for code in WrappedTypeCode}


def get_simple_nested_list_str(data: Any) -> str:
    """A helper function that prints a nested structure without printing tensor values.

    Lists and tuples print as ``[a,b]``, tensors as ``tensor(<shape>)`` (a one-element 1-D
    tensor as ``scalar(<value>)``, which reads it), dicts as ``{'key':value}``; it never raises,
    whatever the value holds, so DEBUG logging cannot stop training.
    """
    return _debug_str(data, 0)


def _debug_str(data: Any, depth: int) -> str:
    if data is None:
        return "None"
    if isinstance(data, torch.Tensor):
        if data.shape == torch.Size([1]) and data.device.type != "meta":
            return f"scalar({data.item()})"
        return f"tensor{tuple(data.shape)}"
    if depth >= MAX_DEPTH:
        return "..."
    if isinstance(data, (list, tuple)):
        return "[" + ",".join(_debug_str(item, depth + 1) for item in data) + "]"
    if isinstance(data, dict):
        items = (f"{key!r}:{_debug_str(value, depth + 1)}" for key, value in data.items())
        return "{" + ",".join(items) + "}"
    if isinstance(data, (bool, int, float)):
        return str(data)
    if isinstance(data, str):
        return repr(data)
    return f"<{type(data).__qualname__}>"


def flat_and_name_tensor_list(data: Any, name: str, suffix: str) -> list[tuple[str, Any]]:
    """Flat the given list and assign the itemized name to each tensor.

    This is mainly used for liveness: returns ``(name + suffix, data)`` and then, depth first,
    ``(name + suffix + ".i", item)`` for every item of a list or tuple and
    ``(name + suffix + ".key", value)`` for every item of a dict, at every level. (Slapo only
    itemised a list or tuple with a tensor directly inside it, and never a dict.)
    """
    named: list[tuple[str, Any]] = []
    _name_items(data, f"{name}{suffix}", named, 0)
    return named


def _name_items(data: Any, label: str, named: list[tuple[str, Any]], depth: int) -> None:
    named.append((label, data))
    if depth >= MAX_DEPTH:
        return
    if isinstance(data, (list, tuple)):
        for index, item in enumerate(data):
            _name_items(item, f"{label}.{index}", named, depth + 1)
    elif isinstance(data, dict):
        for key, item in data.items():
            _name_items(item, f"{label}.{key}", named, depth + 1)


def encode_metadata(metadata: Iterable[tuple[str, int]]) -> str:
    """Encode metadata to a string.

    ``[(<path>, <type>), (<path>, <type>), ...]`` becomes ``"<path>,<type>|<path>,<type>|..."``;
    an empty list becomes ``""``.
    """
    return "|".join(f"{path},{code}" for path, code in metadata)


def decode_metadata(metadata_str: str) -> list[list[str]]:
    """Decode metadata from a string.

    Returns ``[[<path>, <type>], ...]`` (both as strings, as the seed did); ``""`` decodes to
    ``[]``. A piece that is not ``<int>[.<int>...],<type code>`` raises
    :class:`~pipedialect.MetadataError` naming it.
    """
    if not isinstance(metadata_str, str):
        raise MetadataError(f"path-codec metadata must be a str, got {type(metadata_str).__name__}")
    if not metadata_str:
        return []
    pieces = _DECODED.get(metadata_str)
    if pieces is None:
        pieces = tuple(
            _check_piece(i, piece, metadata_str) for i, piece in enumerate(metadata_str.split("|"))
        )
        _remember(_DECODED, metadata_str, pieces)
    return [[path, code] for path, code in pieces]


def _check_piece(index: int, piece: str, metadata_str: str) -> tuple[str, str]:
    parts = piece.split(",")
    if len(parts) != 2 or not _valid_path(parts[0]) or parts[1] not in _CODE_TEXTS:
        raise MetadataError(
            f"malformed piece #{index} {_excerpt(piece)} in path-codec metadata "
            f"{_excerpt(metadata_str)}: expected '<path>,<type>' with a path such as "
            f"'1.0' (at most {MAX_DEPTH} levels) and a type code 0-4"
        )
    return parts[0], parts[1]


#: Caches of validated metadata, keyed by what the caller passed; bounded by _CACHE_SIZE.
_DECODED: dict[str, tuple[tuple[str, str], ...]] = {}
_ENTRIES: dict[tuple[str, object, type], tuple[list[int], WrappedTypeCode]] = {}
_CACHE_SIZE: Final = 4096


def _remember(cache: dict[Any, Any], key: Any, value: Any) -> None:
    if len(cache) >= _CACHE_SIZE:
        cache.clear()
    cache[key] = value


def _valid_path(path: str) -> bool:
    return _PATH_RE.fullmatch(path) is not None and path.count(".") < MAX_DEPTH


def _excerpt(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def flatten(
    outputs: Iterable[Any],
    device: torch.device | str | int | None,
    path: str = "",
    metadata: list[tuple[str, int]] | None = None,
    ret: list[torch.Tensor] | None = None,
) -> tuple[list[tuple[str, int]], list[torch.Tensor]]:
    """Flatten nested structure of outputs and make sure every output is a torch.Tensor.

    Returns ``(metadata, ret)``: ``ret`` holds one tensor per leaf, depth first, and
    ``metadata`` one ``(<path>, <type>)`` per tensor (``len(metadata) == len(ret)``).

    - ``<path>`` is the path to the tensor in the nested structure. For example, the paths of
      t1 and t2 in ``[[t1, t2]]`` are "0.0" and "0.1". The paths of t1 and t2 in
      ``[[t1], [t2]]`` are "0.0" and "1.0".
    - ``<type>`` is the :class:`WrappedTypeCode` value of the tensor.

    Lists, tuples (``torch.Size`` included) and dict values are walked; tensors pass as they
    are; ``None`` becomes ``tensor(0)``; a bool, int or float becomes a 0-dim tensor on
    ``device`` (bool, int64, float64). Anything else raises
    :class:`~pipedialect.UnsupportedValueError` naming its path. ``metadata`` and ``ret``, when
    given, are appended to.
    """
    if metadata is None:
        metadata = []
    if ret is None:
        ret = []
    if isinstance(outputs, dict):
        items: Iterable[Any] = outputs.values()
    else:
        items = outputs
    try:
        iterator = iter(items)
    except TypeError:
        where = f"at {path!r}" if path else "at the top level"
        raise UnsupportedValueError(
            f"flatten takes a list or tuple of values, got a {type(outputs).__name__} {where}; "
            "wrap a single value in a list"
        ) from None
    _flatten_items(iterator, device, path, metadata, ret, path.count(".") + 1 if path else 0)
    return metadata, ret


def _flatten_items(
    items: Iterable[Any],
    device: torch.device | str | int | None,
    path: str,
    metadata: list[tuple[str, int]],
    ret: list[torch.Tensor],
    depth: int,
) -> None:
    for index, value in enumerate(items):
        this_path = f"{path}.{index}" if path else str(index)
        if isinstance(value, torch.Tensor):
            ret.append(value)
            metadata.append((this_path, 0))
        elif isinstance(value, (list, tuple, dict)):
            if depth + 1 >= MAX_DEPTH:
                raise UnsupportedValueError(
                    f"the value at path {this_path!r} nests containers more than {MAX_DEPTH} "
                    "deep; flatten refuses deeper values"
                )
            children = value.values() if isinstance(value, dict) else value
            _flatten_items(children, device, this_path, metadata, ret, depth + 1)
        else:
            tensor, code = _wrap(value, device, this_path)
            ret.append(tensor)
            metadata.append((this_path, code.value))


def _wrap(
    value: Any, device: torch.device | str | int | None, path: str
) -> tuple[torch.Tensor, WrappedTypeCode]:
    if value is None:
        return torch.tensor(0, device=device), WrappedTypeCode.TRUE_NONE
    if isinstance(value, bool):
        return torch.tensor(bool(value), device=device), WrappedTypeCode.SCALAR
    if isinstance(value, int):
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise UnsupportedValueError(
                f"the int at path {path!r} ({value}) does not fit in int64, the type it would "
                "travel as; send it as a str with SchemaCodec, or as a tensor"
            )
        return torch.tensor(int(value), dtype=torch.int64, device=device), WrappedTypeCode.SCALAR
    if isinstance(value, float):
        tensor = torch.tensor(float(value), dtype=torch.float64, device=device)
        return tensor, WrappedTypeCode.SCALAR
    raise UnsupportedValueError(
        f"the path codec cannot carry the {type(value).__qualname__} at path {path!r}: it "
        "carries tensors, None, bool, int, float, and lists, tuples and dict values of these. "
        "Use SchemaCodec (it also carries str and keeps dict keys), or convert the value."
    )


class _Slot(list[Any]):
    """A container position rebuilt by ``unflatten`` (as opposed to a leaf value)."""

    __slots__ = ()


class _Leaf:
    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _parse_entry(index: int, entry: Any) -> tuple[str, list[int], WrappedTypeCode]:
    try:
        path, code = entry
    except (TypeError, ValueError):
        raise MetadataError(
            f"metadata entry #{index} {entry!r} is not a (<path>, <type>) pair"
        ) from None
    try:
        key = (path, code, type(code))
        known = _ENTRIES.get(key)
    except TypeError:  # unhashable: checked below, not cached
        key, known = None, None
    if known is not None:
        return path, *known
    if not isinstance(path, str) or not _valid_path(path):
        raise MetadataError(
            f"metadata entry #{index} has a malformed path {path!r}; expected e.g. '1.0'"
        )
    kind = _CODE_TEXTS.get(code) if isinstance(code, str) else None
    if kind is None and type(code) is int:
        kind = _CODES.get(code)
    if kind is None:
        raise MetadataError(
            f"metadata entry #{index} (path {path!r}) has an unknown type code {code!r}; "
            "expected 0-4"
        )
    tokens = [int(token) for token in path.split(".")]
    if key is not None:
        _remember(_ENTRIES, key, (tokens, kind))
    return path, tokens, kind


def _unwrap(value: Any, code: WrappedTypeCode, path: str) -> Any:
    if code is WrappedTypeCode.TORCH_TENSOR:
        return value
    if code is WrappedTypeCode.TRUE_NONE:
        return None
    if not isinstance(value, torch.Tensor):
        raise MetadataError(
            f"the value at path {path!r} has type code {code.value} ({code.name}) but is a "
            f"{type(value).__name__}, not a tensor"
        )
    unwrapped = value.tolist()
    if code is WrappedTypeCode.TUPLE:
        if not isinstance(unwrapped, list):
            raise MetadataError(
                f"the value at path {path!r} has type code 4 (TUPLE) but is a 0-dim tensor"
            )
        return tuple(unwrapped)
    return unwrapped


def unflatten(args: Sequence[Any], metadata: Sequence[Sequence[Any]]) -> tuple[Any, ...]:
    """The reverse function of 'flatten'.

    ``metadata`` is what :func:`flatten` returned or what :func:`decode_metadata` decoded.
    Every list, tuple and dict comes back as a tuple (the seed format records positions only);
    positions that no path names come back as empty tuples. Metadata that does not fit
    ``args``, or whose paths clash, raises :class:`~pipedialect.MetadataError`.
    """
    if len(args) != len(metadata):
        raise MetadataError(
            f"the metadata describes {len(metadata)} tensors but {len(args)} were given; the "
            "tensors and the metadata do not belong together"
        )
    root = _Slot()
    budget = MAX_GAP_FILL
    for index, (arg, entry) in enumerate(zip(args, metadata, strict=True)):
        path, tokens, code = _parse_entry(index, entry)
        node = root
        for depth, token in enumerate(tokens):
            if token - len(node) >= budget:
                raise MetadataError(
                    f"path {path!r} skips more than {MAX_GAP_FILL} positions; the metadata is "
                    "malformed"
                )
            while len(node) <= token:
                node.append(_Slot())
                budget -= 1
            child = node[token]
            if depth == len(tokens) - 1:
                if not isinstance(child, _Slot) or child:
                    raise MetadataError(
                        f"path {path!r} is given twice, or both as a value and as a container"
                    )
                node[token] = _Leaf(_unwrap(arg, code, path))
            elif isinstance(child, _Slot):
                node = child
            else:
                prefix = ".".join(map(str, tokens[: depth + 1]))
                raise MetadataError(
                    f"path {path!r} runs through the value at path {prefix!r}; the metadata "
                    "is malformed"
                )
    return _tupleize(root)  # type: ignore[no-any-return]


def _tupleize(data: Any) -> Any:
    if isinstance(data, _Leaf):
        data = data.value
        if isinstance(data, (list, tuple)):
            return tuple(_plain_tuple(item) for item in data)
        return data
    return tuple([_tupleize(item) for item in data])


def _plain_tuple(data: Any) -> Any:
    if isinstance(data, (list, tuple)):
        return tuple(_plain_tuple(item) for item in data)
    return data


def paths_of(metadata: str) -> list[str]:
    """The seed path of every wire tensor described by ``metadata``."""
    return [path for path, _ in decode_metadata(metadata)]


class PathCodec(TensorCodec):
    """The seed's codec behind the :class:`~pipedialect.TensorCodec` interface.

    ``encode(obj)`` is ``flatten(obj, device)`` with the seed's metadata string; ``decode``
    is ``unflatten`` with the top level returned as a list (what stage wrappers send and
    expect). Lossy as the seed format is: see :mod:`pipedialect.dialects.deepspeed.pipeline`.
    """

    #: How many parsed metadata strings are kept.
    MAX_STRUCTURES: Final = 64
    #: The seed format records positions only: every list and dict comes back as a tuple.
    keeps_containers: ClassVar[frozenset[str]] = frozenset({"tuple"})

    def __init__(self) -> None:
        self._parsed: dict[str, list[list[str]]] = {}

    def encode(
        self, obj: object, device: torch.device | None = None
    ) -> tuple[tuple[torch.Tensor, ...], str]:
        """Flatten ``obj`` (a list or tuple of values); scalars are wrapped on ``device``."""
        if not isinstance(obj, (list, tuple)):
            raise UnsupportedValueError(
                f"PathCodec encodes a list or tuple of values, got a {type(obj).__name__}; "
                "wrap it in a list"
            )
        metadata, ret = flatten(obj, device)
        return tuple(ret), encode_metadata(metadata)

    def decode(self, tensors: Sequence[torch.Tensor], metadata: str) -> list[Any]:
        """Unflatten; the top level comes back as a list, nested sequences as tuples."""
        parsed = self._parsed.get(metadata)
        if parsed is None:
            parsed = decode_metadata(metadata)
            while len(self._parsed) >= self.MAX_STRUCTURES:
                del self._parsed[next(iter(self._parsed))]
            self._parsed[metadata] = parsed
        return list(unflatten(tensors, parsed))

    def tensor_paths(self, metadata: str) -> list[str]:
        """The seed path of each wire tensor, e.g. ``1.0`` (for messages)."""
        return paths_of(metadata)

    def explain_difference(self, old_metadata: str, new_metadata: str) -> str:
        """The first entry where two seed metadata strings differ."""
        try:
            old = decode_metadata(old_metadata)
            new = decode_metadata(new_metadata)
        except MetadataError as exc:
            return f"the metadata cannot be compared: {exc}"
        for (old_path, old_code), (new_path, new_code) in zip(old, new, strict=False):
            if old_path != new_path:
                return f"first difference: path {old_path!r} is now {new_path!r}"
            if old_code != new_code:
                was = _CODE_TEXTS[old_code].name
                now = _CODE_TEXTS[new_code].name
                return f"first difference at path {old_path!r}: was {was}, now {now}"
        if len(old) != len(new):
            return f"{len(old)} wire tensors before, {len(new)} now"
        return "the structures are the same"

    def __repr__(self) -> str:
        return "PathCodec()"
