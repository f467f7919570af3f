"""The torch.fx tracer of the capture: split points kept as single calls whose outputs it probes
([Note: split-point outputs] in ``_guards``), buffers traced like parameters, and where
tracing failed remembered for the error.
"""

from __future__ import annotations

import itertools
import logging
import operator
import re
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import fx, nn

from ...errors import CaptureError, RecomputeError
from .. import _state
from . import _regions
from ._guards import LEAF, SplitOutput, path_text, spec_of

__all__: list[str] = []

logger = logging.getLogger(__name__)


class SplitTracer(fx.Tracer):
    """An ``fx.Tracer`` that keeps split points and user-named modules as single calls.

    At a split point it learns the output's structure ([Note: split-point outputs] in
    ``_guards``) and records what the guard has to check. It also remembers the innermost
    module whose forward was being traced when tracing failed, so that the error can suggest
    making exactly that module a leaf.
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
        self._buffer_names: dict[int, str] | None = None
        #: For each probed call (a split point, a recomputed module), the ids of the buffers
        #: its module's traced code writes ([Note: module state] in ``_state``).
        self.buffer_writes: dict[fx.Node, frozenset[int]] = {}
        #: The ``copy_`` nodes that record ``self.buf = value`` ([Note: buffer assignment] in
        #: ``_state``), in graph order.
        self.assignments: list[fx.Node] = []
        self._proxy_cache: dict[str, Any] | None = None
        self._shared_slots: dict[tuple[int, str], list[str]] | None = None

    def trace(
        self,
        root: nn.Module | Callable[..., Any],
        concrete_args: dict[str, Any] | None = None,
    ) -> fx.Graph:
        """Trace ``root``; grad-mode and autocast regions entered meanwhile are recorded in this
        tracer's graph ([Note: grad-mode regions] in ``_regions``)."""
        with (
            _regions.recording_into(self),
            _state.assignments_in_place(self._assign_buffer),
        ):
            return super().trace(root, concrete_args)

    def _assign_buffer(self, module: nn.Module, name: str, value: Any) -> bool:
        """Record ``module.name = value`` for a buffer as an in-place copy into it, which the
        reads after it then see ([Note: buffer assignment] in ``_state``)."""
        if _regions.tracing() is not self:
            return False
        buffer = module._buffers[name]
        if self._shared_slots is None:
            self._shared_slots = _state.shared_buffer_slots(self.root)
        shared = self._shared_slots.get((id(module), name))
        if shared is not None:
            _state.refuse_shared_assignment(shared)
        old = getattr(module, name)  # the buffer's Proxy (or the value an earlier one left)
        if not isinstance(old, fx.Proxy) or self._proxy_cache is None or buffer is None:
            return False
        found = next((k for k, v in self._proxy_cache.items() if v is old), None)
        if found is None:
            return False
        checked = self.create_proxy("call_function", _state.assigned_value, (value, old, found), {})
        held = buffer
        copied = self.create_proxy(
            "call_method",
            "copy_",
            (old, checked),
            {},
            proxy_factory_fn=lambda node: _BufferProxy(node, self, held),
        )
        self.assignments.append(copied.node)
        self._proxy_cache[found] = copied
        return True

    def module_path(self) -> str:
        """The module whose forward is being traced ("" for the root)."""
        return self._stack[-1] if self._stack else ""

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        """Buffers are traced like parameters, so in-place updates of them are in the graph
        ([Note: module state] in ``_state``); their shapes stay concrete."""
        if isinstance(attr_val, torch.Tensor) and not isinstance(attr_val, nn.Parameter):
            self._proxy_cache = parameter_proxy_cache
            if self._buffer_names is None:
                self._buffer_names = {}
                for name, buffer in self.root.named_buffers():
                    self._buffer_names.setdefault(id(buffer), name)
            found = self._buffer_names.get(id(attr_val))
            if found is not None:
                if found not in parameter_proxy_cache:
                    parameter_proxy_cache[found] = self.create_proxy(
                        "get_attr",
                        found,
                        (),
                        {},
                        proxy_factory_fn=lambda node: _BufferProxy(node, self, attr_val),
                    )
                return parameter_proxy_cache[found]
        return super().getattr(attr, attr_val, parameter_proxy_cache)

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
                self._check_recomputed_output(m, path, out, args, kwargs)
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
        Proxy ([Note: split-point outputs] in ``_guards``)."""
        result, spec, reason = _probe(self, m, call.node, args, kwargs)
        record = SplitOutput(call.node, path, spec, reason)
        self.splits.append(record)
        if spec is None:
            logger.debug("split point %r: output structure unknown (%s)", path, reason)
            self._opaque[call.node] = record
            return _OpaqueProxy(call.node, self)
        return _build(result, call, ())

    def _check_recomputed_output(
        self,
        m: nn.Module,
        path: str,
        call: fx.Proxy,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        """Refuse a recomputed module whose output is not one traced value.

        A recomputed module runs as one opaque call, so the code after it would see its output
        as a single Proxy: ``None``, numbers and containers in it would be traced wrongly
        ([Note: recomputed calls] in ``_recompute``). Only a module that returns one tensor is safe.
        """
        _, spec, reason = _probe(self, m, call.node, args, kwargs)
        if spec == LEAF:
            return
        what = (
            f"its output's structure is unknown ({reason})"
            if spec is None
            else ("it returns a container or a Python value, not one tensor")
        )
        raise RecomputeError(
            f"recomputed module {path!r} cannot be recomputed in backward: {what}, and the "
            "code after an opaque recomputed call could not see None, numbers or containers "
            f"in it. Drop {path!r} from recompute=, recompute the modules inside it that "
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


class _BufferProxy(fx.Proxy):
    """A buffer read by traced code: its shape is the buffer's, as fx's ``ParameterProxy``
    keeps a parameter's, so that code sizing things by a buffer still traces."""

    def __init__(self, node: fx.Node, tracer: fx.Tracer, buffer: torch.Tensor) -> None:
        super().__init__(node, tracer)
        self._buffer = buffer

    @property
    def shape(self) -> torch.Size:
        return self._buffer.shape

    def size(self, dim: int | None = None) -> Any:
        return self._buffer.size() if dim is None else self._buffer.size(dim)

    def dim(self) -> int:
        return self._buffer.dim()

    @property
    def ndim(self) -> int:
        return self._buffer.ndim

    def numel(self) -> int:
        return self._buffer.numel()

    def nelement(self) -> int:
        return self._buffer.nelement()

    def __len__(self) -> int:
        return len(self._buffer)


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
        return f"Proxy({self._call.node.name}{path_text(self._path)})"


def _probe(
    outer: SplitTracer,
    m: nn.Module,
    call: fx.Node,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[Any, Any, str]:
    """Trace ``m`` by itself on the call's arguments: ``(result, spec, "")`` or ``(None, None,
    reason)``. Leaves nothing behind on ``m`` or in the outer graph."""
    before = attr_names(m)
    # The module runs as one call, its Python for real at every call: what its forward
    # changes while probed (a counter) is put back ([Note: module state] in ``_state``).
    state = _state.StateSnapshot(m)
    probe = _ProbeTracer(m, outer._leaf_ids, outer._leaf_types, args, kwargs)
    result: Any = None
    spec: Any = None
    reason = ""
    written: frozenset[int] | None = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph = probe.trace(m)
        written = _state.written_buffers(graph, m, m.training)
        result = probe.result
        spec = spec_of(result, probe)
    except Exception as exc:
        # The reason is written into the stage code, which every rank must build identically:
        # no object addresses, one short line.
        lines = str(exc).strip().splitlines()
        first = re.sub(r" (object )?at 0x[0-9a-fA-F]+", "", lines[0] if lines else "")[:200]
        reason = f"{type(exc).__name__}: {first}".rstrip(": ")
    finally:
        remove_attrs(m, attr_names(m) - before)
        state.restore()
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
    if written is not None:
        outer.buffer_writes[call] = written
    if spec is None:
        return None, None, reason
    return result, spec, ""


def _build(value: Any, call: fx.Proxy, path: tuple[Any, ...]) -> Any:
    """The caller's view of a probed output: same containers, real constants, leaves reading
    ``call``."""
    if isinstance(value, fx.Proxy | torch.Tensor):  # a tensor is read from the call too
        return _LeafProxy(call, path) if path else call
    kind = type(value)
    if kind in (tuple, list):
        return kind(_build(v, call, (*path, i)) for i, v in enumerate(value))
    if isinstance(value, tuple):  # a namedtuple: spec_of admits no other tuple subclass
        return kind(*(_build(v, call, (*path, i)) for i, v in enumerate(value)))
    if kind is dict:
        return {k: _build(v, call, (*path, k)) for k, v in value.items()}
    return value


def attr_names(model: nn.Module) -> set[str]:
    return set(model.__dict__) | set(model._parameters) | set(model._buffers) | set(model._modules)


def remove_attrs(model: nn.Module, names: Iterable[str]) -> None:
    """Delete the attributes fx's tracer added to ``model``."""
    for name in names:
        if hasattr(model, name):
            delattr(model, name)
