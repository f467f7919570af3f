"""torch.fx mechanics behind :func:`pipedialect.partition`: capture one flat graph, cut it.

[Note: own splitter]
``torch.fx.passes.split_module`` flattens every target it copies into a stage (``blocks.3.fc1``
becomes ``blocks_3_fc1``), so stage parameters would no longer carry the original model's names,
and it has no notion of "this stage must return the model's output". The splitter here copies
nodes into one ``fx.Graph`` per stage and builds each stage's GraphModule with the original
model as root, so ``call_module``/``get_attr`` targets, and therefore parameter names, stay
exactly the original qualified names (``blocks.3.fc1.weight``). ``get_attr`` nodes are copied
into every stage that uses them, so a parameter never crosses a boundary as a value; a parameter
used by two stages becomes a tie between them. The last stage computes the model's output
structure itself, so it returns exactly what the unsplit model returns.

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
stage graph, so it runs on every dialect, on the value the stage received.

[Note: checkpointed calls]
``partition(..., checkpoint=["blocks.*"])`` keeps each matched module as one ``call_module``
node during capture (like a split point), and after the cut rewrites that node in its stage
graph into ``call_function(checkpointed, (get_attr module, *args), kwargs)``: the module is
still an attribute of the stage under its own path, so parameter names, ties and the stage's
``named_parameters`` do not change, and the call runs through non-reentrant
``torch.utils.checkpoint`` with the RNG state preserved (dropout draws the same mask when
recomputed) and the module's state replayed: the recomputation starts from the buffers and
attributes the forward started from and leaves them as the forward left them (BatchNorm counts
each batch once; ``stage`` [Note: recomputation and module state]). Being part of the stage
graph, it behaves alike on every dialect; the generated code names the helper and the module,
so fingerprints stay deterministic.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import operator
import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint
from torch import fx, nn

from .errors import ActivationCheckpointError, CaptureError
from .stage import checkpoint_with_state

__all__: list[str] = []

logger = logging.getLogger(__name__)

_COMPUTE_OPS = frozenset({"call_module", "call_function", "call_method"})

#: Python values a split point's output may hold as recorded constants.
_CONSTANT_TYPES = (type(None), bool, int, float, str)
#: What a value the trace held as a Proxy may be at run time (besides containers of them).
_NUMBER_TYPES = (bool, int, float, complex)

_EXPORT_HINT = (
    "pass example_inputs={parameter name: tensor, ...} (one micro-batch) to partition() to "
    "capture the model with torch.export, which runs forward's Python on the real structure"
)


class SplitTracer(fx.Tracer):
    """An ``fx.Tracer`` that keeps split points and user-named modules as single calls.

    At a split point it learns the output's structure ([Note: split-point outputs]) and
    records what the guard has to check. It also remembers the innermost module whose forward
    was being traced when tracing failed, so that the error can suggest making exactly that
    module a leaf.
    """

    def __init__(
        self,
        leaf_ids: frozenset[int],
        leaf_types: tuple[type[nn.Module], ...],
        split_ids: frozenset[int] = frozenset(),
        checkpoint_ids: frozenset[int] = frozenset(),
    ) -> None:
        super().__init__()
        self._leaf_ids = leaf_ids
        self._leaf_types = leaf_types
        self._split_ids = split_ids
        self._checkpoint_ids = checkpoint_ids - split_ids
        self._stack: list[str] = []
        self.failed_in: str | None = None
        #: One record per split-point call, in call order.
        self.splits: list[SplitOutput] = []
        # Nodes whose value comes from a split point whose structure is unknown.
        self._opaque: dict[fx.Node, SplitOutput] = {}

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        """Split points, ``leaf_modules`` and fx's default leaves are called, not traced."""
        if id(m) in self._leaf_ids or (self._leaf_types and isinstance(m, self._leaf_types)):
            return True
        return bool(super().is_leaf_module(m, module_qualified_name))

    def call_module(
        self,
        m: nn.Module,
        forward: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Trace a module call, recording where a failure happened."""
        try:
            path = self.path_of_module(m)
        except Exception:  # a module outside the hierarchy: fx reports it itself below
            path = f"<{type(m).__name__}>"
        self._stack.append(path)
        try:
            out = super().call_module(m, forward, args, kwargs)
            if id(m) in self._split_ids and isinstance(out, fx.Proxy):
                out = self._split_output(m, path, out, args, kwargs)
            elif id(m) in self._checkpoint_ids and isinstance(out, fx.Proxy):
                self._check_checkpointed_output(m, path, out, args, kwargs)
            return out
        except Exception:
            if self.failed_in is None:
                self.failed_in = path
            raise
        finally:
            self._stack.pop()

    def _split_output(
        self,
        m: nn.Module,
        path: str,
        call: fx.Proxy,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """What the caller of split point ``path`` sees: its output's structure, or an opaque
        Proxy ([Note: split-point outputs])."""
        result, spec, reason = _probe(self, m, call.node, args, kwargs)
        record = SplitOutput(call.node, path, spec, reason)
        self.splits.append(record)
        if spec is None:
            logger.debug("split point %r: output structure unknown (%s)", path, reason)
            self._opaque[call.node] = record
            return _OpaqueProxy(call.node, self)
        return _build(result, call, ())

    def _check_checkpointed_output(
        self,
        m: nn.Module,
        path: str,
        call: fx.Proxy,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        """Refuse a checkpointed module whose output is not one traced value.

        A checkpointed module runs as one opaque call, so the code after it would see its output
        as a single Proxy: ``None``, numbers and containers in it would be traced wrongly
        ([Note: checkpointed calls]). Only a module that returns one tensor is safe.
        """
        _, spec, reason = _probe(self, m, call.node, args, kwargs)
        if spec == _LEAF:
            return
        what = (
            f"its output's structure is unknown ({reason})"
            if spec is None
            else ("it returns a container or a Python value, not one tensor")
        )
        raise ActivationCheckpointError(
            f"checkpointed module {path!r} cannot be recomputed in backward: {what}, and the "
            "code after an opaque checkpointed call could not see None, numbers or containers "
            f"in it. Drop {path!r} from checkpoint=, checkpoint the modules inside it that "
            "return a tensor, or make it a split point."
        )

    def proxy(self, node: fx.Node) -> fx.Proxy:
        """Items and attributes of an opaque split-point output are opaque too."""
        if (
            node.op == "call_function"
            and node.target in (operator.getitem, getattr)
            and isinstance(node.args[0], fx.Node)
            and node.args[0] in self._opaque
        ):
            self._opaque[node] = self._opaque[node.args[0]]
            return _OpaqueProxy(node, self)
        return super().proxy(node)

    def to_bool(self, obj: fx.Proxy) -> bool:
        """``bool()`` of an opaque output: a :class:`CaptureError` naming the split point."""
        if obj.node in self._opaque:
            raise CaptureError(self._opaque[obj.node].unknown("tests the truth (if/and/or/not) of"))
        return bool(super().to_bool(obj))

    def iter(self, obj: fx.Proxy) -> Iterator[Any]:
        """Iterating over an opaque output: a :class:`CaptureError` naming the split point."""
        if obj.node in self._opaque:
            raise CaptureError(self._opaque[obj.node].unknown("iterates over"))
        return iter(super().iter(obj))


class _ProbeTracer(SplitTracer):
    """Traces one split-point module by itself, called exactly as the model calls it."""

    def __init__(
        self,
        module: nn.Module,
        leaf_ids: frozenset[int],
        leaf_types: tuple[type[nn.Module], ...],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        super().__init__(leaf_ids, leaf_types)
        self._module = module
        self._call = (args, kwargs)
        #: The Python value the module returned, with this tracer's Proxies as leaves.
        self.result: Any = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        """The probed module itself is traced through, whatever its kind."""
        return m is not self._module and super().is_leaf_module(m, module_qualified_name)

    def create_args_for_root(
        self,
        root_fn: Callable[..., Any],
        is_module: bool,
        concrete_args: dict[str, Any] | tuple[Any, ...] | None = None,
    ) -> tuple[Any, list[Any]]:
        """Call the module with the model's arguments, Proxies replaced by placeholders."""
        counter = itertools.count()

        def swap(value: Any) -> Any:
            if isinstance(value, fx.Proxy):
                return self.create_proxy("placeholder", f"arg_{next(counter)}", (), {})
            if type(value) in (tuple, list):
                return type(value)(swap(v) for v in value)
            if isinstance(value, tuple) and hasattr(value, "_fields"):
                return type(value)(*(swap(v) for v in value))
            if type(value) is dict:
                return {k: swap(v) for k, v in value.items()}
            return value

        args, kwargs = swap(self._call[0]), swap(self._call[1])
        module = self._module

        def run() -> None:
            self.result = module(*args, **kwargs)

        return run, []


class _OpaqueProxy(fx.Proxy):
    """The output (or a part of it) of a split point whose structure the capture cannot know."""

    def __len__(self) -> int:
        raise CaptureError(self._record().unknown("takes the len() of"))

    def __contains__(self, item: Any) -> bool:
        raise CaptureError(self._record().unknown(f"tests {item!r} in"))

    def _record(self) -> SplitOutput:
        tracer = self.tracer
        if not isinstance(tracer, SplitTracer):  # made by SplitTracer.proxy only
            raise TypeError(f"{self!r} belongs to a {type(tracer).__name__}")
        return tracer._opaque[self.node]


class _LeafProxy(fx.Proxy):
    """One leaf of a split point's output, read from the call's result where it is used.

    Each use makes its own ``getitem`` chain at the point of use, as the model's own
    ``out["h"]`` would, so a leaf used by a later stage rides there inside the output.
    """

    def __init__(self, call: fx.Proxy, path: tuple[Any, ...]) -> None:
        self.tracer = call.tracer
        self._call = call
        self._path = path

    @property
    def node(self) -> fx.Node:  # type: ignore[override]
        value: fx.Proxy = self._call
        for key in self._path:
            value = self.tracer.create_proxy("call_function", operator.getitem, (value, key), {})
        return value.node

    def __repr__(self) -> str:
        return f"Proxy({self._call.node.name}{_path_text(self._path)})"


@dataclass
class Captured:
    """The flat graph of a whole model and what tracing added to the model."""

    graph: fx.Graph
    #: Attribute names fx's tracer set on the root module (tensor constants); removed again
    #: once the stages hold them.
    added_attrs: list[str]
    #: The split-point guards in the graph ([Note: split-point outputs]).
    guards: list[fx.Node] = field(default_factory=list)


def _attr_names(model: nn.Module) -> set[str]:
    return set(model.__dict__) | set(model._parameters) | set(model._buffers) | set(model._modules)


def remove_attrs(model: nn.Module, names: Iterable[str]) -> None:
    """Delete the attributes fx's tracer added to ``model``."""
    for name in names:
        if hasattr(model, name):
            delattr(model, name)


def capture(
    model: nn.Module,
    *,
    leaf_ids: frozenset[int],
    leaf_types: tuple[type[nn.Module], ...],
    concrete_args: Mapping[str, Any] | None,
    split_ids: frozenset[int] = frozenset(),
    checkpoint_ids: frozenset[int] = frozenset(),
) -> Captured:
    """Trace ``model`` into one flat graph; failures become :class:`CaptureError`.

    ``split_ids`` are the split-point modules (also in ``leaf_ids``): their outputs get the
    treatment of [Note: split-point outputs]; ``checkpoint_ids`` (also leaves) must return one
    tensor.
    """
    accepted = list(inspect.signature(model.forward).parameters)
    unknown = sorted(set(concrete_args or {}) - set(accepted))
    if unknown:
        raise CaptureError(
            f"concrete_args names {unknown}, which {type(model).__name__}.forward does not take "
            f"(its parameters: {accepted})"
        )
    tracer = SplitTracer(leaf_ids, leaf_types, split_ids, checkpoint_ids)
    before = _attr_names(model)
    try:
        graph = tracer.trace(model, dict(concrete_args) if concrete_args else None)
    except (CaptureError, ActivationCheckpointError):
        remove_attrs(model, _attr_names(model) - before)
        raise
    except Exception as exc:
        remove_attrs(model, _attr_names(model) - before)
        raise CaptureError(_capture_message(model, exc, tracer.failed_in)) from exc
    added = sorted(_attr_names(model) - before)
    try:
        _drop_specialised_inputs(model, graph, concrete_args or {})
    except CaptureError:
        remove_attrs(model, added)
        raise
    guards = _insert_guards(graph, tracer.splits)
    graph.lint()
    return Captured(graph, added, guards)


def _capture_message(model: nn.Module, exc: Exception, failed_in: str | None) -> str:
    where = f" while tracing the forward of {failed_in!r}" if failed_in else ""
    leaf_hint = (
        f"leaf_modules=[{failed_in!r}] to run that module as one opaque call"
        if failed_in
        else "leaf_modules=[...] naming the module whose code fx cannot trace, to run it as one "
        "opaque call"
    )
    return (
        f"torch.fx could not capture {type(model).__name__}.forward{where}: "
        f"{type(exc).__name__}: {exc}. "
        "Try concrete_args={...} to fix the value of arguments that steer control flow "
        f"(flags, None defaults), or {leaf_hint}, or {_EXPORT_HINT} (the route for "
        "transformers models and for control flow on shapes)."
    )


def _drop_specialised_inputs(
    model: nn.Module, graph: fx.Graph, concrete_args: Mapping[str, Any]
) -> None:
    """Remove placeholders fixed by ``concrete_args`` (and fx's checks on them) and unused varargs.

    fx keeps a placeholder for every concrete argument (renamed, e.g. ``mask_1``) and asserts
    its value at run time; the plan's inputs are the remaining ones, so the placeholder is
    replaced by its fixed value. Placeholders follow forward's signature, in order.
    """
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    params = list(inspect.signature(model.forward).parameters.values())
    if len(params) == len(placeholders):
        names = [p.name for p in params]
    else:  # a signature fx saw differently: fall back to the placeholder targets
        names = [str(n.target).lstrip("*") for n in placeholders]
    for node, name in zip(placeholders, names, strict=True):
        if str(node.target).startswith("*"):
            if node.users:
                raise CaptureError(
                    f"forward uses its variadic parameter {node.target!r}; pipeline stages need "
                    "named inputs. Give forward explicit parameters, or fix it with concrete_args."
                )
            graph.erase_node(node)
            continue
        if name not in concrete_args:
            continue
        _erase_checks(graph, node)
        _replace_with_constant(node, concrete_args[name])
        graph.erase_node(node)


def _replace_with_constant(placeholder: fx.Node, value: Any) -> None:
    def swap(n: fx.Node) -> Any:
        return value if n is placeholder else n

    for user in list(placeholder.users):
        user.args = tuple(fx.node.map_arg(user.args, swap))
        user.kwargs = dict(fx.node.map_arg(user.kwargs, swap))


def _erase_checks(graph: fx.Graph, placeholder: fx.Node) -> None:
    for user in list(placeholder.users):
        if user.op != "call_function":
            continue
        if getattr(user.target, "__name__", "") == "_assert_is_none" and not user.users:
            graph.erase_node(user)
        elif user.target is operator.eq and all(
            u.op == "call_function" and u.target is torch._assert and not u.users
            for u in user.users
        ):
            for u in list(user.users):
                graph.erase_node(u)
            graph.erase_node(user)


# -- split-point outputs: the probe, the structure handed to the caller, the guard -------------

#: The spec of a value the trace held as a Proxy ([Note: split-point outputs]).
_LEAF = "T"


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
            f"point, or {_EXPORT_HINT}."
        )


class _Unknown(Exception):
    """The probe cannot describe a split point's output."""


def _probe(
    outer: SplitTracer,
    m: nn.Module,
    call: fx.Node,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[Any, Any, str]:
    """Trace ``m`` by itself on the call's arguments: ``(result, spec, "")`` or ``(None, None,
    reason)``. Leaves nothing behind on ``m`` or in the outer graph."""
    before = _attr_names(m)
    probe = _ProbeTracer(m, outer._leaf_ids, outer._leaf_types, args, kwargs)
    result: Any = None
    spec: Any = None
    reason = ""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            probe.trace(m)
        result = probe.result
        spec = _spec_of(result, probe)
    except Exception as exc:
        # The reason is written into the stage code, which every rank must build identically:
        # no object addresses, one short line.
        lines = str(exc).strip().splitlines()
        first = re.sub(r" (object )?at 0x[0-9a-fA-F]+", "", lines[0] if lines else "")[:200]
        reason = f"{type(exc).__name__}: {first}".rstrip(": ")
    finally:
        remove_attrs(m, _attr_names(m) - before)
    # Proxies of the outer trace hidden in an argument object would have recorded operations
    # in the outer graph: those are not the model's, and the structure is not trustworthy.
    stray: list[fx.Node] = []
    node = call.next
    while node.op != "root":
        stray.append(node)
        node = node.next
    if stray:
        for node in reversed(stray):
            outer.graph.erase_node(node)
        return None, None, "its arguments hold traced values inside an object the probe cannot see"
    if spec is None:
        return None, None, reason
    return result, spec, ""


def _type_name(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def _spec_of(value: Any, probe: fx.Tracer) -> Any:
    """The guard's spec of the probe's result; :class:`_Unknown` for what it cannot hold."""
    if isinstance(value, fx.Proxy):
        if value.tracer is not probe:
            raise _Unknown("it returns a traced value it did not compute")
        return _LEAF
    if isinstance(value, torch.Tensor):  # a tensor the module holds (not a parameter/buffer)
        return _LEAF
    kind = type(value)
    if kind in _CONSTANT_TYPES:
        return ("C", value)
    if kind in (tuple, list):
        return (kind.__name__, tuple(_spec_of(v, probe) for v in value))
    if isinstance(value, tuple) and hasattr(kind, "_fields"):
        return ("namedtuple", _type_name(kind), tuple(_spec_of(v, probe) for v in value))
    if kind is dict:
        keys = tuple(value)
        if any(type(k) not in (str, int) for k in keys):
            raise _Unknown("it returns a dict with a key that is neither a str nor an int")
        return ("dict", keys, tuple(_spec_of(v, probe) for v in value.values()))
    raise _Unknown(f"it returns a {kind.__qualname__}, which the capture cannot take apart")


def _build(value: Any, call: fx.Proxy, path: tuple[Any, ...]) -> Any:
    """The caller's view of a probed output: same containers, real constants, leaves reading
    ``call``."""
    if isinstance(value, fx.Proxy | torch.Tensor):  # a tensor is read from the call too
        return _LeafProxy(call, path) if path else call
    kind = type(value)
    if kind in (tuple, list):
        return kind(_build(v, call, (*path, i)) for i, v in enumerate(value))
    if isinstance(value, tuple):  # a namedtuple: _spec_of admits no other tuple subclass
        return kind(*(_build(v, call, (*path, i)) for i, v in enumerate(value)))
    if kind is dict:
        return {k: _build(v, call, (*path, k)) for k, v in value.items()}
    return value


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
        return _LEAF
    return ("R", tuple(steps), whole)


def _insert_guards(graph: fx.Graph, splits: Sequence[SplitOutput]) -> list[fx.Node]:
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
    problem = _mismatch(value, spec, ())
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
        f"{_EXPORT_HINT[0].upper()}{_EXPORT_HINT[1:]}."
    )


def _path_text(path: Iterable[Any]) -> str:
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


def _mismatch(value: Any, spec: Any, path: tuple[Any, ...]) -> tuple[str, str] | None:
    """Where and how ``value`` differs from ``spec``; ``None`` when it agrees."""
    if spec == _LEAF:
        bad = _not_tensor_like(value, path)
        if bad is None:
            return None
        what = f"is {_describe(bad[1])}, but the torch.fx capture treated it as a tensor"
        return _path_text(bad[0]), what
    where = _path_text(path)
    kind = spec[0]
    if kind == "C":
        if _same_constant(value, spec[1]):
            return None
        return where, (
            f"is {_describe(value)}, but the torch.fx capture recorded {spec[1]!r} and built "
            "the code after it on that value"
        )
    if kind == "R":
        return _mismatch_reads(value, spec, path)
    recorded = {"tuple": "a tuple", "list": "a list", "dict": "a dict"}.get(kind, "")
    if kind == "namedtuple":
        recorded = f"a {spec[1].rsplit('.', 1)[-1]}"
        same_type = _type_name(type(value)) == spec[1]
    else:
        same_type = type(value).__name__ == kind and type(value) in (tuple, list, dict)
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
        problem = _mismatch(item, child, (*path, key))
        if problem is not None:
            return problem
    return None


def _mismatch_reads(value: Any, spec: Any, path: tuple[Any, ...]) -> tuple[str, str] | None:
    _, steps, whole = spec
    if whole:
        problem = _mismatch(value, _LEAF, path)
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
            read = _path_text([key] if op == "[]" else [(op, key)])
            return _path_text(path), (
                f"is {_describe(value)}, from which the torch.fx capture read {read} "
                f"({type(exc).__name__}: {exc})"
            )
        problem = _mismatch(item, child, (*path, key if op == "[]" else (op, key)))
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


@dataclass
class Split:
    """The result of cutting a flat graph into stages."""

    stages: list[fx.GraphModule]
    #: The top-level GraphModule calling ``submod_k`` in order.
    top: fx.GraphModule
    input_names: list[str]
    #: For every stage, the names of its arguments in call order.
    arg_names: list[list[str]]
    #: For every value name, the stage that defines it (-1: a model input).
    defined_by: dict[str, int]


def checkpointed(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Call ``module`` under non-reentrant activation checkpointing ([Note: checkpointed calls]);
    its recomputation sees and leaves the module's buffers and attributes as the first run did
    (``stage`` [Note: recomputation and module state])."""
    return checkpoint_with_state(module, (module,), *args, **kwargs)


def checkpoint_calls(stage: fx.GraphModule, paths: frozenset[str]) -> None:
    """Route ``stage``'s calls of the modules at ``paths`` through :func:`checkpointed`."""
    graph = stage.graph
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_module" or str(node.target) not in paths:
            continue
        with graph.inserting_before(node):
            module = graph.get_attr(str(node.target))
            call = graph.call_function(checkpointed, (module, *node.args), dict(node.kwargs))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        graph.erase_node(node)
        changed = True
    if changed:
        graph.lint()
        stage.recompile()


def assign_stages(graph: fx.Graph, split_nodes: Sequence[fx.Node]) -> dict[fx.Node, int]:
    """Give every compute node its stage: nodes up to and including split point i go to stage i."""
    boundaries = {node: i for i, node in enumerate(split_nodes)}
    stage_of: dict[fx.Node, int] = {}
    current = 0
    for node in graph.nodes:
        if node.op in _COMPUTE_OPS:
            stage_of[node] = current
            if node in boundaries:
                current = boundaries[node] + 1
    return stage_of


def split(
    model: nn.Module,
    graph: fx.Graph,
    stage_of: Mapping[fx.Node, int],
    num_stages: int,
) -> Split:
    """Cut ``graph`` into GraphModules following ``stage_of`` ([Note: own splitter])."""
    nodes = list(graph.nodes)
    output = next(n for n in nodes if n.op == "output")
    placeholders = [n for n in nodes if n.op == "placeholder"]
    last = num_stages - 1

    def owner(node: fx.Node) -> int:
        return last if node is output else stage_of[node]

    members: list[list[fx.Node]] = [[] for _ in range(num_stages)]
    for node in nodes:
        if node.op in _COMPUTE_OPS:
            members[stage_of[node]].append(node)
    members[last].append(output)

    # What each stage takes from outside (inputs or earlier stages), in first-use order, and
    # which of its values later stages use.
    external: list[dict[fx.Node, None]] = [{} for _ in range(num_stages)]
    exported: list[dict[fx.Node, None]] = [{} for _ in range(num_stages)]
    for k, stage_nodes in enumerate(members):
        for node in stage_nodes:
            for src in node.all_input_nodes:
                if src.op == "get_attr":
                    continue
                if src.op == "placeholder":
                    external[k][src] = None
                elif stage_of[src] != k:
                    external[k][src] = None
                    exported[stage_of[src]][src] = None
    position = {node: i for i, node in enumerate(nodes)}
    producers = [sorted(exported[k], key=position.__getitem__) for k in range(num_stages)]

    name_of: dict[fx.Node, str] = {p: str(p.target) for p in placeholders}
    defined_by: dict[str, int] = {}
    for k in range(last):
        outs = producers[k]
        for i, node in enumerate(outs):
            name = f"submod_{k}" if len(outs) == 1 else f"submod_{k}.{i}"
            name_of[node] = name
            defined_by[name] = k

    stages = [
        _build_stage(model, k, members[k], list(external[k]), producers[k], k == last, owner)
        for k in range(num_stages)
    ]
    top = _build_top(graph, placeholders, stages, external, producers, type(model).__name__)
    return Split(
        stages=stages,
        top=top,
        input_names=[name_of[p] for p in placeholders],
        arg_names=[[name_of[v] for v in external[k]] for k in range(num_stages)],
        defined_by=defined_by,
    )


def _build_stage(
    model: nn.Module,
    k: int,
    stage_nodes: Sequence[fx.Node],
    args: Sequence[fx.Node],
    outs: Sequence[fx.Node],
    is_last: bool,
    owner: Callable[[fx.Node], int],
) -> fx.GraphModule:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for src in args:
        ph = g.placeholder(src.name)
        ph.meta = dict(src.meta)
        env[src] = ph
    for node in stage_nodes:
        for src in node.all_input_nodes:
            if src.op == "get_attr" and src not in env:
                env[src] = g.node_copy(src)
        if node.op == "output":
            g.output(fx.node.map_arg(node.args[0], env.__getitem__))
        else:
            env[node] = g.node_copy(node, env.__getitem__)
    if not is_last:
        if len(outs) == 1:
            g.output(env[outs[0]])
        else:
            g.output(tuple(env[o] for o in outs))
    g.lint()
    gm = fx.GraphModule(model, g, class_name=f"{type(model).__name__}Stage{k}")
    gm.train(model.training)
    return gm


def _build_top(
    graph: fx.Graph,
    placeholders: Sequence[fx.Node],
    stages: Sequence[fx.GraphModule],
    external: Sequence[Mapping[fx.Node, None]],
    producers: Sequence[Sequence[fx.Node]],
    model_name: str,
) -> fx.GraphModule:
    top = fx.Graph()
    env: dict[fx.Node, fx.Node] = {p: top.node_copy(p) for p in placeholders}
    last = len(stages) - 1
    for k in range(len(stages)):
        call = top.call_module(f"submod_{k}", tuple(env[v] for v in external[k]))
        if k == last:
            top.output(call)
        elif len(producers[k]) == 1:
            env[producers[k][0]] = call
        else:
            for i, node in enumerate(producers[k]):
                env[node] = top.call_function(operator.getitem, (call, i))
    top.lint()
    root = {f"submod_{k}": stage for k, stage in enumerate(stages)}
    return fx.GraphModule(root, top, class_name=f"{model_name}Pipeline")
