"""The guard on split-point outputs: the structure the torch.fx capture assumed, checked on every
micro-batch.

[Note: split-point outputs]
A split point runs as one ``call_module`` node, so plain fx would hand the code after it one
``Proxy`` for the whole output. Python that inspects that value (``out["aux"] is not None``,
``isinstance``, ``len``, ``in``, ``.get``, arithmetic on a number in it) would then see a Proxy
instead of the model's ``None`` or ``0.5``, and the trace would silently follow another branch
than the model does. So at each split-point call the tracer also traces that module's forward
by itself (a probe: the call's Proxy arguments become placeholders of a throw-away graph, the
other arguments keep their values) to learn the output's structure, and hands the caller a
structure of the same containers whose constants (``None``, numbers, strings) are the real
values and whose other leaves read the call's result (``getitem`` nodes made where they are
used, so boundaries carry what they carried before). If the probe fails (the module's own code
is not fx-traceable), the caller gets an opaque Proxy that refuses ``bool``, ``len``, iteration
and ``in`` with a :class:`CaptureError`.

Either way the trace assumed something about a value it never saw, so a guard checks it where
the value is first used, on every micro-batch (a few ``isinstance`` tests): the containers and
constants equal the recorded ones, and every value the trace held as a Proxy is a tensor, a
number, or tuples/lists/dicts of those (never ``None``, a string or another object, which the
trace would have answered ``is None``/``isinstance`` for wrongly). The guard is a node of the
stage graph, so it runs on every dialect, on the value the stage received. That value went
through the stage's codec, so the guard judges its structure as that codec defines it (the stage
wrapper names the codec, :func:`~pipedialect.runtime.codec.decoded_by`): a container the codec
does not keep (``TensorCodec.keeps_containers``; the seed's path codec keeps only tuples) may
arrive as a plain tuple, which the code after the split point reads alike by position; a dict
or namedtuple that arrives so although that code reads it by key or attribute is refused with
an :class:`UnsupportedValueError` naming the codec, the real cause.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from ...errors import CaptureError, UnsupportedValueError
from ...runtime.codec import decoding_codec

__all__: list[str] = []

#: Python values a split point's output may hold as recorded constants.
_CONSTANT_TYPES = (type(None), bool, int, float, str)


#: What a value the trace held as a Proxy may be at run time (besides containers of them).
_NUMBER_TYPES = (bool, int, float, complex)


EXPORT_HINT = (
    "pass example_inputs={parameter name: tensor, ...} (one micro-batch) to partition() to "
    "capture the model with torch.export, which runs forward's Python on the real structure"
)


#: The spec of a value the trace held as a Proxy ([Note: split-point outputs]).
LEAF = "T"


@dataclass
class SplitOutput:
    """What the capture knows about one split-point call's output."""

    node: fx.Node
    path: str
    #: The structure the guard checks ([Note: split-point outputs]); ``None`` while unknown.
    spec: Any
    #: Why the structure is unknown (the probe's failure); empty when known.
    reason: str = ""

    def unknown(self, what: str) -> str:
        """The message for Python that inspects an output of unknown structure."""
        return (
            f"forward {what} the output of split point {self.path!r}, whose structure the "
            f"torch.fx capture cannot know: tracing {self.path!r} by itself failed "
            f"({self.reason}). Make {self.path!r}'s forward fx-traceable, choose another split "
            f"point, or {EXPORT_HINT}."
        )


class _Unknown(Exception):
    """The probe cannot describe a split point's output."""


def _type_name(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def spec_of(value: Any, probe: fx.Tracer) -> Any:
    """The guard's spec of the probe's result; :class:`_Unknown` for what it cannot hold."""
    if isinstance(value, fx.Proxy):
        if value.tracer is not probe:
            raise _Unknown("it returns a traced value it did not compute")
        return LEAF
    if isinstance(value, torch.Tensor):  # a tensor the module holds (not a parameter/buffer)
        return LEAF
    kind = type(value)
    if kind in _CONSTANT_TYPES:
        return ("C", value)
    if kind in (tuple, list):
        return (kind.__name__, tuple(spec_of(v, probe) for v in value))
    if isinstance(value, tuple) and hasattr(kind, "_fields"):
        return ("namedtuple", _type_name(kind), tuple(spec_of(v, probe) for v in value))
    if kind is dict:
        keys = tuple(value)
        if any(type(k) not in (str, int) for k in keys):
            raise _Unknown("it returns a dict with a key that is neither a str nor an int")
        return ("dict", keys, tuple(spec_of(v, probe) for v in value.values()))
    raise _Unknown(f"it returns a {kind.__qualname__}, which the capture cannot take apart")


def _read_step(node: fx.Node, user: fx.Node) -> tuple[Any, ...] | None:
    """``user`` as one step of reading ``node`` by a constant key, or ``None``."""
    args = user.args
    if not args or args[0] is not node:
        return None
    if user.op == "call_function" and len(args) == 2 and not user.kwargs:
        if user.target is operator.getitem and type(args[1]) in (str, int):
            return ("[]", args[1])
        if user.target is getattr and type(args[1]) is str:
            return (".", args[1])
    if (
        user.op == "call_method"
        and user.target == "get"
        and not user.kwargs
        and len(args) in (2, 3)
        and type(args[1]) in (str, int)
    ):
        default = args[2] if len(args) == 3 else None
        if type(default) in _CONSTANT_TYPES:
            return ("get", args[1], default)
    return None


def _reads(node: fx.Node) -> Any:
    """The guard's spec of an opaque output: the keys the trace read from it, recursively, and
    a deep check of every value the trace used without taking it apart."""
    steps: list[tuple[Any, ...]] = []
    seen: set[tuple[Any, ...]] = set()
    whole = False
    for user in node.users:
        step = _read_step(node, user)
        if step is None:
            whole = whole or user.op in ("call_function", "call_method")
        elif step not in seen:
            seen.add(step)
            steps.append((*step, _reads(user)))
    if not steps:
        return LEAF
    return ("R", tuple(steps), whole)


def insert_guards(graph: fx.Graph, splits: Sequence[SplitOutput]) -> list[fx.Node]:
    """Put one :func:`check_split_output` before the first use of every split-point output."""
    guards: list[fx.Node] = []
    position = {node: i for i, node in enumerate(graph.nodes)}
    for record in splits:
        spec = record.spec if record.spec is not None else _reads(record.node)
        users = sorted(record.node.users, key=position.__getitem__)
        context = graph.inserting_before(users[0]) if users else graph.inserting_after(record.node)
        with context:
            guard = graph.call_function(
                check_split_output, (record.node, -1, record.path, spec, record.reason)
            )
        guards.append(guard)
    return guards


def label_guards(guards: Iterable[fx.Node], stage_of: Mapping[fx.Node, int]) -> None:
    """Write into each guard the stage it runs in, for its message."""
    for guard in guards:
        guard.args = (guard.args[0], stage_of[guard], *guard.args[2:])


def is_guard(node: fx.Node) -> bool:
    """Whether ``node`` is a split-point guard (it computes nothing of the model's)."""
    return node.op == "call_function" and node.target is check_split_output


#: Every container kind a spec records: what a value that no codec decoded keeps.
_ALL_CONTAINERS = frozenset({"tuple", "list", "dict", "namedtuple"})


class _LostByCodec(Exception):
    """A container the code after a split point reads by key arrived as the codec's tuple."""

    def __init__(self, where: str, kind: str) -> None:
        super().__init__(where, kind)
        self.where = where
        self.kind = kind


def check_split_output(value: Any, stage: int, split_point: str, spec: Any, reason: str) -> None:
    """Refuse a split-point output that differs from what the torch.fx capture assumed.

    Runs where the output is first used, on every micro-batch ([Note: split-point outputs]);
    a :class:`CaptureError` names the split point and the value's path. Traced again (fx
    re-traces a GraphModule it unpickles), it records itself instead.
    """
    if isinstance(value, fx.Proxy):
        value.tracer.create_proxy(
            "call_function", check_split_output, (value, stage, split_point, spec, reason), {}
        )
        return
    codec = decoding_codec()
    keeps = _ALL_CONTAINERS if codec is None else frozenset(codec.keeps_containers)
    try:
        problem = _mismatch(value, spec, (), keeps)
    except _LostByCodec as lost:
        at = f" at {lost.where}" if lost.where else ""
        what = "dict keys" if lost.kind == "dict" else "namedtuple fields"
        raise UnsupportedValueError(
            f"[Stage {stage}] the output of split point {split_point!r}{at} is a {lost.kind} "
            f"in the model, but this stage's codec {codec!r} gives a {lost.kind} back as a "
            f"plain tuple of its values: the {what} that the code after {split_point!r} reads "
            "are lost. Use a codec that keeps them (SchemaCodec, the default), or return a "
            f"tuple from {split_point!r}."
        ) from None
    if problem is None:
        return
    where, what = problem
    value_text = f"the output of split point {split_point!r}" + (f" at {where}" if where else "")
    unknown = (
        f" (its structure was unknown: tracing {split_point!r} by itself failed: {reason})"
        if reason
        else ""
    )
    raise CaptureError(
        f"[Stage {stage}] {value_text} {what}{unknown}, so Python code in forward that tested "
        f"it (is None, isinstance, ==) may have taken another branch than the model. "
        f"{EXPORT_HINT[0].upper()}{EXPORT_HINT[1:]}."
    )


def path_text(path: Iterable[Any]) -> str:
    parts = []
    for step in path:
        if isinstance(step, tuple):  # an attribute or .get step of an opaque output
            op, key = step[0], step[1]
            parts.append(f".{key}" if op == "." else f".get({key!r})")
        else:
            parts.append(f"[{step!r}]")
    return "".join(parts)


def _describe(value: Any) -> str:
    if value is None or type(value) in _CONSTANT_TYPES:
        return repr(value)
    return f"a {type(value).__qualname__}"


def _same_constant(value: Any, expected: Any) -> bool:
    if type(value) is not type(expected):
        return False
    if isinstance(expected, float) and expected != expected:
        return bool(value != value)
    return bool(value == expected)


def _mismatch(
    value: Any, spec: Any, path: tuple[Any, ...], keeps: frozenset[str] = _ALL_CONTAINERS
) -> tuple[str, str] | None:
    """Where and how ``value`` differs from ``spec``; ``None`` when it agrees.

    ``keeps`` are the containers the codec that decoded ``value`` gives back as they were; any
    other arrives as a plain tuple, and that is no difference.
    """
    if spec == LEAF:
        bad = _not_tensor_like(value, path)
        if bad is None:
            return None
        what = f"is {_describe(bad[1])}, but the torch.fx capture treated it as a tensor"
        return path_text(bad[0]), what
    where = path_text(path)
    kind = spec[0]
    if kind == "C":
        if _same_constant(value, spec[1]):
            return None
        return where, (
            f"is {_describe(value)}, but the torch.fx capture recorded {spec[1]!r} and built "
            "the code after it on that value"
        )
    if kind == "R":
        return _mismatch_reads(value, spec, path, keeps)
    recorded = {"tuple": "a tuple", "list": "a list", "dict": "a dict"}.get(kind, "")
    if kind == "namedtuple":
        recorded = f"a {spec[1].rsplit('.', 1)[-1]}"
        same_type = _type_name(type(value)) == spec[1]
    else:
        same_type = type(value).__name__ == kind and type(value) in (tuple, list, dict)
    if not same_type and kind not in keeps and type(value) is tuple:
        if kind == "dict":  # the code after the split point reads it by key
            raise _LostByCodec(where, kind)
        same_type = True  # read by position, which the tuple keeps
    if not same_type:
        return where, f"is {_describe(value)}, but the torch.fx capture recorded {recorded}"
    if kind == "dict":
        keys, children = spec[1], spec[2]
        if tuple(value) != keys:
            return where, (
                f"has the keys {list(value)}, but the torch.fx capture recorded {list(keys)}"
            )
        items: Iterable[tuple[Any, Any]] = zip(keys, (value[k] for k in keys), strict=True)
    else:
        children = spec[-1]
        if len(value) != len(children):
            return where, (
                f"has {len(value)} items, but the torch.fx capture recorded {len(children)}"
            )
        items = enumerate(value)
    for (key, item), child in zip(items, children, strict=True):
        problem = _mismatch(item, child, (*path, key), keeps)
        if problem is not None:
            return problem
    return None


def _mismatch_reads(
    value: Any, spec: Any, path: tuple[Any, ...], keeps: frozenset[str]
) -> tuple[str, str] | None:
    _, steps, whole = spec
    if whole:
        problem = _mismatch(value, LEAF, path, keeps)
        if problem is not None:
            return problem
    for step in steps:
        op, key, child = step[0], step[1], step[-1]
        try:
            if op == "[]":
                item = value[key]
            elif op == ".":
                item = getattr(value, key)
            else:
                item = value.get(key, step[2])
        except Exception as exc:
            lost = "namedtuple" if op == "." else "dict" if isinstance(key, str) else ""
            if lost and lost not in keeps and type(value) is tuple:
                raise _LostByCodec(path_text(path), lost) from None
            read = path_text([key] if op == "[]" else [(op, key)])
            return path_text(path), (
                f"is {_describe(value)}, from which the torch.fx capture read {read} "
                f"({type(exc).__name__}: {exc})"
            )
        problem = _mismatch(item, child, (*path, key if op == "[]" else (op, key)), keeps)
        if problem is not None:
            return problem
    return None


def _not_tensor_like(value: Any, path: tuple[Any, ...]) -> tuple[tuple[Any, ...], Any] | None:
    """The first part of ``value`` that is not a tensor, a number, or a container of them."""
    if isinstance(value, torch.Tensor) or type(value) in _NUMBER_TYPES:
        return None
    if isinstance(value, (tuple, list)):
        items: Iterable[tuple[Any, Any]] = enumerate(value)
    elif isinstance(value, dict):
        items = value.items()
    else:
        return path, value
    for key, item in items:
        bad = _not_tensor_like(item, (*path, key))
        if bad is not None:
            return bad
    return None
