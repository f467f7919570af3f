"""SchemaCodec's machinery: the metadata grammar, its parser and per-structure compiled coders.

The public face is :class:`pipedialect.runtime.codec.SchemaCodec`; its module docstring describes
the metadata format. This module holds:

* :func:`walk`, the generic (slow) encoder: it checks every value, collects the tensor leaves
  and writes the metadata text;
* :func:`parse`, which turns metadata text back into a tree of :class:`Node` and refuses
  anything the encoder could not have written, with :class:`~pipedialect.MetadataError`;
* :func:`compile_encoder` and :func:`compile_decoder`, which turn one structure into straight-
  line Python source (as ``dataclasses`` does for ``__init__``) so that a structure seen before
  costs one call: the encoder checks types, lengths, dict keys and constants while it picks out
  the leaves, and answers ``None`` when the value does not have this structure;
* :func:`interpret`, the tree-walking decoder used the first time a metadata string is seen;
* :func:`tensor_paths` and :func:`explain_difference`, which word error messages.

[Note: codec nesting limit] Values nested deeper than :data:`MAX_DEPTH` containers are refused
on both sides. It keeps the generated decoder expression well inside Python's parser limit on
nested brackets (200) and every recursive walk far from the interpreter's recursion limit.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

import torch

from ..errors import MetadataError, UnsupportedValueError

__all__: list[str] = []

#: The metadata format version, the first element of every metadata string.
VERSION: Final = 1
#: How deeply containers may nest (see [Note: codec nesting limit]).
MAX_DEPTH: Final = 100

TENSOR: Final = "tensor"
CONST: Final = "const"
LIST: Final = "list"
TUPLE: Final = "tuple"
DICT: Final = "dict"

_TAG_OF_KIND: Final = {LIST: "l", TUPLE: "t", DICT: "d"}
_KIND_OF_TAG: Final = {"l": LIST, "t": TUPLE, "d": DICT}
_TENSOR_TEXT: Final = '"T"'

#: What a compiled encoder returns: the tensor leaves and the metadata, or None on a mismatch.
Encoded = tuple[tuple[torch.Tensor, ...], str]
Encoder = Callable[[object], Encoded | None]
Decoder = Callable[[Sequence[torch.Tensor]], Any]

PathKey = int | str | float | bool | None
Path = tuple[PathKey, ...]


class Node:
    """One position of a structure: a tensor leaf, a constant, or a list/tuple/dict."""

    __slots__ = ("children", "keys", "kind", "value")

    def __init__(
        self,
        kind: str,
        value: object = None,
        children: tuple[Node, ...] = (),
        keys: tuple[PathKey, ...] = (),
    ) -> None:
        self.kind = kind
        self.value = value
        self.children = children
        self.keys = keys

    def child_keys(self) -> Sequence[PathKey]:
        """The path element of each child: its index, or its key for a dict."""
        return self.keys if self.kind == DICT else range(len(self.children))


def format_path(path: Path) -> str:
    """Render a path Python-style, e.g. ``[1]['mask']``; the whole value is ``<root>``."""
    if not path:
        return "<root>"
    return "".join(f"[{key!r}]" for key in path)


# -- encoding: the generic walk -------------------------------------------------------------


def float_text(x: float) -> str:
    """JSON text of a float that reads back bit for bit (nan and infinities as JSON5 names)."""
    if x != x:
        return "NaN"
    if x == math.inf:
        return "Infinity"
    if x == -math.inf:
        return "-Infinity"
    return float.__repr__(x)


def walk(obj: object) -> tuple[list[torch.Tensor], str]:
    """Check ``obj`` and return its tensor leaves (depth first) and its metadata string."""
    leaves: list[torch.Tensor] = []
    out: list[str] = [f"[{VERSION},"]
    _walk(obj, leaves, out, (), set())
    out.append("]")
    return leaves, "".join(out)


def _walk(
    obj: Any, leaves: list[torch.Tensor], out: list[str], path: Path, active: set[int]
) -> None:
    cls = obj.__class__
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        out.append(_TENSOR_TEXT)
    elif obj is None:
        out.append("null")
    elif cls is bool:
        out.append("true" if obj else "false")
    elif cls is int:
        out.append(_int_text(obj, path))
    elif cls is float:
        out.append(float_text(obj))
    elif cls is str:
        out.append(f'["s",{json.dumps(obj)}]')
    elif cls is torch.Size:
        out.append("".join(['["z"', *(f",{n}" for n in obj), "]"]))
    elif cls is list or cls is tuple or cls is dict:
        if len(path) >= MAX_DEPTH:
            raise UnsupportedValueError(
                f"the value at {format_path(path)} nests containers more than {MAX_DEPTH} deep; "
                "SchemaCodec refuses deeper values. Flatten the structure."
            )
        ident = id(obj)
        if ident in active:
            raise UnsupportedValueError(
                f"the {cls.__name__} at {format_path(path)} contains itself; a boundary value "
                "must be a tree. Break the cycle before returning it from the stage."
            )
        active.add(ident)
        if cls is dict:
            out.append('["d"')
            for key, value in obj.items():
                out.append(",")
                out.append(_key_text(key, path))
                out.append(",")
                _walk(value, leaves, out, (*path, key), active)
        else:
            out.append('["l"' if cls is list else '["t"')
            for index, value in enumerate(obj):
                out.append(",")
                _walk(value, leaves, out, (*path, index), active)
        out.append("]")
        active.discard(ident)
    else:
        raise UnsupportedValueError(_unsupported_message(obj, path))


def _int_text(x: int, path: Path) -> str:
    try:
        return int.__repr__(x)
    except ValueError as exc:  # beyond sys.get_int_max_str_digits()
        raise UnsupportedValueError(
            f"the int at {format_path(path)} is too large to write as text ({exc}); send it as "
            "a tensor or a str"
        ) from None


def _key_text(key: object, path: Path) -> str:
    cls = key.__class__
    if cls is str:
        return json.dumps(key)
    if key is None:
        return "null"
    if cls is bool:
        return "true" if key else "false"
    if cls is int:
        return _int_text(key, path)  # type: ignore[arg-type]
    if cls is float and key == key:
        return float_text(key)  # type: ignore[arg-type]
    what = "a NaN float" if cls is float else f"of type {_type_name(key)}"
    raise UnsupportedValueError(
        f"the dict at {format_path(path)} has a key {what} ({key!r}); SchemaCodec restores "
        "only str, int, bool, float (not NaN) and None keys exactly. Use such keys, or a list "
        "of (key, value) pairs."
    )


def _type_name(obj: object) -> str:
    cls = obj.__class__
    return (
        cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    )


def _unsupported_message(obj: object, path: Path) -> str:
    name = _type_name(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        hint = "Convert the namedtuple to a tuple or a dict (value._asdict())."
    elif isinstance(obj, dict):
        hint = "Convert it to a plain dict (dict(value)); its class cannot be restored."
    elif isinstance(obj, (list, tuple)):
        hint = f"Convert it to a plain {'list' if isinstance(obj, list) else 'tuple'}."
    elif isinstance(obj, (bool, int, float, str)):
        hint = "Convert it to the plain builtin type (e.g. int(value)); its class is lost."
    elif hasattr(obj, "item") and hasattr(obj, "dtype"):
        hint = "Convert it with .item() or torch.as_tensor(value)."
    else:
        hint = "Send its tensors and plain values instead, and rebuild it in the next stage."
    return (
        f"SchemaCodec cannot encode the {name} at {format_path(path)}: a boundary value may "
        "hold tensors, None, bool, int, float, str, torch.Size, and lists, tuples and dicts of "
        f"these. {hint}"
    )


# -- decoding: parsing metadata ---------------------------------------------------------------


def parse(metadata: str) -> tuple[Node, int]:
    """Parse SchemaCodec metadata into its structure and its number of tensor leaves."""
    if not isinstance(metadata, str):
        raise MetadataError(f"SchemaCodec metadata must be a str, got {type(metadata).__name__}")
    try:
        raw = json.loads(metadata)
    except (ValueError, RecursionError) as exc:
        raise MetadataError(
            f"SchemaCodec metadata is not valid JSON ({exc}): {_excerpt(metadata)}"
        ) from None
    if (
        not isinstance(raw, list)
        or len(raw) != 2
        or raw[0].__class__ is not int
        or raw[0] != VERSION
    ):
        raise MetadataError(
            f"not SchemaCodec metadata of version {VERSION} (expected [{VERSION},<value>]): "
            f"{_excerpt(metadata)}. Was it written by another codec?"
        )
    counter = itertools.count()
    node = _parse_node(raw[1], (), counter)
    return node, next(counter)


def _excerpt(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _bad(piece: object, path: Path, why: str) -> MetadataError:
    try:
        shown = json.dumps(piece)
    except (ValueError, TypeError, RecursionError):
        shown = repr(piece)
    if len(shown) > 60:
        shown = shown[:60] + "..."
    return MetadataError(f"malformed SchemaCodec metadata at {format_path(path)}: {why}: {shown}")


def _parse_node(raw: object, path: Path, counter: Iterator[int]) -> Node:
    cls = raw.__class__
    if cls is str:
        if raw != "T":
            raise _bad(raw, path, 'a bare string must be "T" (a tensor)')
        next(counter)
        return Node(TENSOR)
    if raw is None or cls is bool or cls is int or cls is float:
        return Node(CONST, raw)
    if cls is not list or not raw:
        raise _bad(raw, path, 'expected a tagged array, a number, true, false, null or "T"')
    items: list[Any] = raw  # type: ignore[assignment]
    tag = items[0]
    if tag == "s":
        if len(items) != 2 or items[1].__class__ is not str:
            raise _bad(raw, path, 'a str is ["s",<text>]')
        return Node(CONST, items[1])
    if tag == "z":
        dims = items[1:]
        if any(d.__class__ is not int for d in dims):
            raise _bad(raw, path, 'a torch.Size is ["z",<int>,...]')
        try:
            return Node(CONST, torch.Size(dims))
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise _bad(raw, path, f"not a valid torch.Size ({exc})") from None
    kind = _KIND_OF_TAG.get(tag) if tag.__class__ is str else None
    if kind is None:
        raise _bad(raw, path, "unknown tag (expected one of s, z, l, t, d)")
    if len(path) >= MAX_DEPTH:
        raise _bad(raw, path, f"containers nest more than {MAX_DEPTH} deep")
    if kind != DICT:
        return Node(
            kind,
            children=tuple(
                _parse_node(item, (*path, i), counter) for i, item in enumerate(items[1:])
            ),
        )
    if len(items) % 2 != 1:
        raise _bad(raw, path, 'a dict is ["d",<key>,<value>,...] with as many keys as values')
    keys = tuple(items[1::2])
    for key in keys:
        if not (
            key is None
            or key.__class__ in (str, int, bool)
            or (key.__class__ is float and key == key)
        ):
            raise _bad(raw, path, f"dict key {key!r} is not a str, int, bool, float or null")
    if len(set(keys)) != len(keys):  # as a dict would, this merges 1, 1.0 and True
        raise _bad(raw, path, "a dict key appears twice")
    return Node(
        DICT,
        keys=keys,
        children=tuple(
            _parse_node(v, (*path, k), counter) for k, v in zip(keys, items[2::2], strict=True)
        ),
    )


# -- decoding: the interpreter ------------------------------------------------------------------


def interpret(root: Node, count: int, tensors: Sequence[torch.Tensor]) -> Any:
    """Rebuild a value by walking its structure (no code generation)."""
    leaves = list(tensors)
    if len(leaves) != count:
        raise count_error(count, leaves)
    return _build(root, iter(leaves))


def _build(node: Node, leaves: Iterator[torch.Tensor]) -> Any:
    kind = node.kind
    if kind == TENSOR:
        return next(leaves)
    if kind == CONST:
        return node.value
    if kind == LIST:
        return [_build(c, leaves) for c in node.children]
    if kind == TUPLE:
        return tuple(_build(c, leaves) for c in node.children)
    return {k: _build(c, leaves) for k, c in zip(node.keys, node.children, strict=True)}


def count_error(expected: int, tensors: object) -> MetadataError:
    """The error for a tensor list whose length does not match the metadata."""
    try:
        got: object = len(tensors)  # type: ignore[arg-type]
    except TypeError:
        got = f"a {type(tensors).__name__}"
    return MetadataError(
        f"SchemaCodec metadata describes {expected} tensor leaves but {got} were given; the "
        "tensors and the metadata do not belong together"
    )


# -- code generation ----------------------------------------------------------------------------


class _Source:
    """Names constants for generated code: literals when exact, namespace entries otherwise."""

    def __init__(self) -> None:
        self.namespace: dict[str, Any] = {
            "_T": torch.Tensor,
            "_Size": torch.Size,
            "_copysign": math.copysign,
            "_inf": math.inf,
            "_count_error": count_error,
        }
        self._names = itertools.count()

    def name(self, value: object, prefix: str = "_c") -> str:
        """Store ``value`` in the namespace and return its name."""
        name = f"{prefix}{next(self._names)}"
        self.namespace[name] = value
        return name

    def literal(self, value: Any) -> str:
        """Python source that evaluates to ``value`` exactly."""
        cls = value.__class__
        if value is None or cls in (bool, int, str):
            return repr(value)
        if cls is float and math.isfinite(value):
            return float.__repr__(value)
        return self.name(value)

    def compile(self, source: str, label: str, func: str) -> Any:
        """Execute ``source`` and return the function named ``func`` it defines."""
        code = compile(source, f"<SchemaCodec {label}>", "exec")
        exec(code, self.namespace)
        return self.namespace[func]


def _const_mismatch(src: _Source, var: str, value: object) -> str:
    """A condition that is true when ``var`` is not exactly the constant ``value``."""
    if value is None or value is True or value is False:
        return f"{var} is not {value!r}"
    cls = value.__class__
    if cls is float:
        x: float = value  # type: ignore[assignment]
        head = f"{var}.__class__ is not float or "
        if x != x:
            return head + f"{var} == {var}"
        if x == 0.0:
            sign = "1.0" if math.copysign(1.0, x) > 0 else "-1.0"
            return head + f"{var} != 0.0 or _copysign(1.0, {var}) != {sign}"
        return head + f"{var} != {src.literal(x)}"
    if cls is torch.Size:
        return f"{var}.__class__ is not _Size or {var} != {src.name(value)}"
    return f"{var}.__class__ is not {cls.__name__} or {var} != {src.literal(value)}"


def compile_encoder(root: Node, metadata: str) -> Encoder:
    """Generate the fast encoder of one structure (see the module docstring)."""
    src = _Source()
    src.namespace["_MD"] = metadata
    lines = ["def _encode(v0):"]
    pending: list[str] = []
    leaves: list[str] = []
    names = itertools.count(1)

    def flush() -> None:
        if pending:
            lines.append(f"    if {' or '.join(pending)}:")
            lines.append("        return None")
            pending.clear()

    def visit(var: str, node: Node) -> None:
        kind = node.kind
        if kind == TENSOR:
            pending.append(f"not isinstance({var}, _T)")
            leaves.append(var)
            return
        if kind == CONST:
            pending.append(_const_mismatch(src, var, node.value))
            return
        size = len(node.children)
        pending.append(f"{var}.__class__ is not {kind} or len({var}) != {size}")
        source = var
        if kind == DICT:
            keys = src.name(node.keys, "_K")
            types = src.name(tuple(type(k) for k in node.keys), "_KT")
            pending.append(f"tuple({var}) != {keys} or tuple(map(type, {var})) != {types}")
            source = f"{var}.values()"
        flush()
        if not size:
            return
        children = [f"v{next(names)}" for _ in node.children]
        lines.append(f"    {', '.join(children)}, = {source}")
        for child_var, child in zip(children, node.children, strict=True):
            visit(child_var, child)

    visit("v0", root)
    flush()
    lines.append(f"    return ({''.join(f'{v}, ' for v in leaves)}), _MD")
    fn: Encoder = src.compile("\n".join(lines) + "\n", "encoder", "_encode")
    return fn


def compile_decoder(root: Node, count: int) -> Decoder:
    """Generate the fast decoder of one structure: unpack the tensors, build the value."""
    src = _Source()
    names = iter([f"t{i}" for i in range(count)])

    def expr(node: Node) -> str:
        kind = node.kind
        if kind == TENSOR:
            return next(names)
        if kind == CONST:
            return src.literal(node.value)
        items = [expr(c) for c in node.children]
        if kind == LIST:
            return f"[{', '.join(items)}]"
        if kind == TUPLE:
            return f"({''.join(f'{i}, ' for i in items)})"
        pairs = (f"{src.literal(k)}: {v}" for k, v in zip(node.keys, items, strict=True))
        return f"{{{', '.join(pairs)}}}"

    body = expr(root)
    lines = ["def _decode(t):", "    try:"]
    if count:
        lines.append(f"        {', '.join(f't{i}' for i in range(count))}, = t")
    else:
        lines.append("        if len(t):")
        lines.append(f"            raise _count_error({count}, t)")
    lines += [
        "    except (TypeError, ValueError):",
        f"        raise _count_error({count}, t) from None",
        f"    return {body}",
    ]
    fn: Decoder = src.compile("\n".join(lines) + "\n", "decoder", "_decode")
    return fn


# -- wording errors -----------------------------------------------------------------------------


def tensor_paths(metadata: str) -> list[str]:
    """The path of every tensor leaf of ``metadata``, in leaf order."""
    root, _ = parse(metadata)
    paths: list[str] = []

    def visit(node: Node, path: Path) -> None:
        if node.kind == TENSOR:
            paths.append(format_path(path))
        for key, child in zip(node.child_keys(), node.children, strict=True):
            visit(child, (*path, key))

    visit(root, ())
    return paths


def describe(node: Node) -> str:
    """A few words for what sits at one position: "a tensor", "the int 3", "a list of 2 items"."""
    kind = node.kind
    if kind == TENSOR:
        return "a tensor"
    if kind == CONST:
        value = node.value
        if value is None:
            return "None"
        if value.__class__ is torch.Size:
            return repr(value)
        return f"the {type(value).__name__} {value!r}"
    if kind == DICT:
        return f"a dict with keys {list(node.keys)!r}"
    size = len(node.children)
    return f"a {kind} of {size} item{'' if size == 1 else 's'}"


def _same_leaf(a: Node, b: Node) -> bool:
    if a.kind != b.kind:
        return False
    if a.kind != CONST:
        return True
    x, y = a.value, b.value
    if x.__class__ is not y.__class__:
        return False
    if x.__class__ is float:
        return float_text(x) == float_text(y)  # type: ignore[arg-type]
    return bool(x == y)


def _first_difference(a: Node, b: Node, path: Path) -> str | None:
    if a.kind != b.kind or a.kind in (TENSOR, CONST):
        if _same_leaf(a, b):
            return None
        return f"{format_path(path)}: was {describe(a)}, now {describe(b)}"
    if a.kind == DICT:
        for ka, kb, ca, cb in zip(a.keys, b.keys, a.children, b.children, strict=False):
            if ka.__class__ is not kb.__class__ or ka != kb:
                return f"{format_path(path)}: was {describe(a)}, now {describe(b)}"
            found = _first_difference(ca, cb, (*path, ka))
            if found:
                return found
        if len(a.keys) == len(b.keys):
            return None
        return f"{format_path(path)}: was {describe(a)}, now {describe(b)}"
    for i, (ca, cb) in enumerate(zip(a.children, b.children, strict=False)):
        found = _first_difference(ca, cb, (*path, i))
        if found:
            return found
    if len(a.children) == len(b.children):
        return None
    return f"{format_path(path)}: was {describe(a)}, now {describe(b)}"


def explain_difference(old_metadata: str, new_metadata: str) -> str:
    """Say where two structures first differ, and what was and is there."""
    try:
        old, _ = parse(old_metadata)
        new, _ = parse(new_metadata)
    except MetadataError as exc:
        return f"the metadata cannot be compared: {exc}"
    found = _first_difference(old, new, ())
    if found is None:
        return "the structures are the same"
    return f"first difference at {found}"
