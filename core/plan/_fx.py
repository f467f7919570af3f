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
stage graph, so it runs on every dialect, on the value the stage received. That value went
through the stage's codec, so the guard judges its structure as that codec defines it (the stage
wrapper names the codec, :func:`~pipedialect.runtime.codec.decoded_by`): a container the codec
does not keep (``TensorCodec.keeps_containers``; the seed's path codec keeps only tuples) may
arrive as a plain tuple, which the code after the split point reads alike by position; a dict
or namedtuple that arrives so although that code reads it by key or attribute is refused with
an :class:`UnsupportedValueError` naming the codec, the real cause.

[Note: recomputed calls]
``partition(..., recompute=["blocks.*"])`` keeps each matched module as one ``call_module``
node during capture (like a split point), and after the cut rewrites that node in its stage
graph into ``call_function(recomputed, (get_attr module, *args), kwargs)``: the module is
still an attribute of the stage under its own path, so parameter names, ties and the stage's
``named_parameters`` do not change, and the call runs through non-reentrant
``torch.utils.checkpoint`` with the RNG state preserved (dropout draws the same mask when
recomputed) and the module's state replayed: the recomputation starts from the buffers and
attributes the forward started from and leaves them as the forward left them (BatchNorm counts
each batch once; ``module_state`` [Note: recomputation and module state]). Being part of the stage
graph, it behaves alike on every dialect; the generated code names the helper and the module,
so fingerprints stay deterministic.

[Note: grad-mode regions]
``with torch.no_grad():``, ``torch.enable_grad()``, ``torch.set_grad_enabled(b)`` and
``torch.autocast(...)`` change the process's state, not a value, so plain fx would run them
once while tracing and leave no trace in the graph: ``n = w.norm()`` under ``no_grad`` would get
gradients in every stage. While :func:`capture` traces, :func:`recording_regions` makes entering
and leaving such a region inside traced code record ``enter_grad_mode(mode)`` /
``exit_grad_mode(previous)`` (and ``enter_autocast(...)`` / ``exit_autocast(region)``) nodes,
so each stage sets and restores the mode around exactly the nodes the model ran in it, on every
dialect. The previous mode is a value of the graph, so a region entered under ``eval_batch``'s
``no_grad`` restores ``no_grad``. A region must lie inside one stage (a stage runs on one rank;
it cannot leave the mode set for another): one that ends right after a split point's call is
closed in that stage, any other that contains a split point is refused by name
(:func:`place_regions`), and so is ``set_grad_enabled(b)`` called without being restored, and
``inference_mode``. Regions inside a module called as one op (a split point, a leaf) run for
real in its forward. torch.export keeps regions itself, as higher-order ops over a subgraph
(``wrap_with_set_grad_enabled``, ``wrap_with_autocast``), which stay single nodes.

[Note: stage modes]
Python reads ``self.training`` while it is traced (``F.dropout(x, p, training=self.training)``,
``if self.training:`` running statistics), and torch.export records BatchNorm and dropout as
they ran: one capture is one mode. So ``partition`` captures the model twice, in train and in
eval mode, cuts both with the same split points, and a stage whose two graphs differ becomes a
:class:`ModalGraphModule`: one module holding the parameters and buffers once, whose
``forward`` runs the train-mode graph when the stage is in train mode and the eval-mode graph
otherwise, so ``stage.train()``/``stage.eval()`` (which every engine calls in ``train_batch``
and ``eval_batch``) switch it. A stage whose two graphs compile to the same code stays a plain
``GraphModule``. Each mode's stages agree among themselves on what every boundary value is; what
both modes must share is the plan's tables: the same number of values per boundary, taken by
the same stages in the same order (and, where the capture recorded them, of the same shapes and
dtypes: the wire layout is frozen by the first training micro-batch). A model whose eval path
sends something else across a boundary is refused by name. Buffer ownership is decided on both
modes together ([Note: module state] in ``_state``).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import operator
import re
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.autograd.grad_mode as grad_mode
import torch.utils._pytree as pytree
import torch.utils.checkpoint
from torch import fx, nn
from torch.fx.graph_module import reduce_graph_module

from ..errors import CaptureError, RecomputeError, UnsupportedValueError
from ..runtime.codec import decoding_codec
from ..runtime.module_state import recompute_with_state
from . import _state

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
        tracer's graph ([Note: grad-mode regions])."""
        _ACTIVE.append(self)
        try:
            with _state.assignments_in_place(self._assign_buffer):
                return super().trace(root, concrete_args)
        finally:
            _ACTIVE.pop()

    def _assign_buffer(self, module: nn.Module, name: str, value: Any) -> bool:
        """Record ``module.name = value`` for a buffer as an in-place copy into it, which the
        reads after it then see ([Note: buffer assignment] in ``_state``)."""
        if not _ACTIVE or _ACTIVE[-1] is not self:
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
        Proxy ([Note: split-point outputs])."""
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
        ([Note: recomputed calls]). Only a module that returns one tensor is safe.
        """
        _, spec, reason = _probe(self, m, call.node, args, kwargs)
        if spec == _LEAF:
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
    #: For the module calls whose code was traced by itself, the ids of the buffers it writes.
    buffer_writes: dict[fx.Node, frozenset[int]] = field(default_factory=dict)


# -- grad-mode and autocast regions ([Note: grad-mode regions]) -------------------------------

#: The tracers whose ``trace`` is running, innermost last.
_ACTIVE: list[SplitTracer] = []
#: Node meta keys: the module whose forward entered a region, and how it reads.
_REGION_PATH = "pipedialect_region_path"
_REGION_KIND = "pipedialect_region_kind"


#: The :class:`StageTracer` tracing a stage's code again, innermost last.
_RETRACING: list[fx.Tracer] = []


def _replay(fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """While a stage's code is traced again, record ``fn(*args)`` instead of running it."""
    if not _RETRACING:
        return None
    return _RETRACING[-1].create_proxy("call_function", fn, args, {})


def enter_grad_mode(enabled: bool) -> bool:
    """Enter a ``no_grad``/``enable_grad``/``set_grad_enabled`` region; return the mode to
    restore ([Note: grad-mode regions])."""
    recorded = _replay(enter_grad_mode, (enabled,))
    if recorded is not None:
        return recorded  # type: ignore[no-any-return]
    previous = torch.is_grad_enabled()
    torch._C._set_grad_enabled(enabled)
    return previous


def exit_grad_mode(previous: bool) -> None:
    """Leave a region entered by :func:`enter_grad_mode`."""
    if _replay(exit_grad_mode, (previous,)) is None:
        torch._C._set_grad_enabled(previous)


def enter_autocast(
    device_type: str, dtype: torch.dtype | None, enabled: bool, cache_enabled: bool | None
) -> torch.autocast:
    """Enter a ``torch.autocast`` region as the model entered it; return it, to leave."""
    recorded = _replay(enter_autocast, (device_type, dtype, enabled, cache_enabled))
    if recorded is not None:
        return recorded  # type: ignore[no-any-return]
    region = torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
    region.__enter__()  # type: ignore[no-untyped-call]
    return region


def exit_autocast(region: torch.autocast) -> None:
    """Leave a region entered by :func:`enter_autocast`."""
    if _replay(exit_autocast, (region,)) is None:
        region.__exit__(None, None, None)


_ENTERS = (enter_grad_mode, enter_autocast)
_EXITS = (exit_grad_mode, exit_autocast)


class StageTracer(fx.Tracer):
    """The tracer fx traces a stage's code again with when it unpickles it: the region helpers
    record themselves then instead of changing the tracing process's grad mode."""

    def trace(
        self,
        root: nn.Module | Callable[..., Any],
        concrete_args: dict[str, Any] | None = None,
    ) -> fx.Graph:
        """Trace ``root`` with the region helpers recording themselves."""
        _RETRACING.append(self)
        try:
            return super().trace(root, concrete_args)
        finally:
            _RETRACING.pop()


def _tracing() -> SplitTracer | None:
    return _ACTIVE[-1] if _ACTIVE else None


def _record(tracer: SplitTracer, fn: Callable[..., Any], args: tuple[Any, ...], kind: str) -> Any:
    proxy = tracer.create_proxy("call_function", fn, args, {})
    proxy.node.meta[_REGION_PATH] = tracer.module_path()
    proxy.node.meta[_REGION_KIND] = kind
    return proxy


def _real_mode(region: Any, enabled: bool | None) -> None:
    """Mirror a region's grad mode while tracing, so that forward reads it as it will run."""
    if enabled is None:
        torch._C._set_grad_enabled(region.__dict__.pop("_pipedialect_real"))
    else:
        region.__dict__["_pipedialect_real"] = torch.is_grad_enabled()
        torch._C._set_grad_enabled(enabled)


@contextlib.contextmanager
def recording_regions() -> Iterator[None]:
    """While active, a region entered inside a :class:`SplitTracer`'s trace becomes nodes of
    its graph instead of only changing the tracing process's state."""
    originals: list[tuple[type, str, Any]] = []

    def patch(cls: type, name: str, make: Callable[[Any], Callable[..., Any]]) -> None:
        original = cls.__dict__[name]
        originals.append((cls, name, original))
        setattr(cls, name, make(original))

    def entering(enabled: bool, kind: str) -> Callable[[Any], Callable[..., Any]]:
        def make(original: Any) -> Callable[..., Any]:
            def enter(region: Any) -> None:
                tracer = _tracing()
                if tracer is None:
                    return original(region)  # type: ignore[no-any-return]
                region.prev = _record(tracer, enter_grad_mode, (enabled,), kind)
                _real_mode(region, enabled)
                return None

            return enter

        return make

    def leaving(original: Any) -> Callable[..., Any]:
        def leave(region: Any, *exc: Any) -> Any:
            tracer = _tracing()
            if tracer is None or not isinstance(region.prev, fx.Proxy):
                return original(region, *exc)
            _record(tracer, exit_grad_mode, (region.prev,), "")
            _real_mode(region, None)
            return None

        return leave

    def set_init(original: Any) -> Callable[..., Any]:
        def init(region: Any, mode: bool) -> None:
            tracer = _tracing()
            if tracer is None:
                original(region, mode)
                return
            region.mode = mode
            region.prev = _record(
                tracer, enter_grad_mode, (mode,), f"torch.set_grad_enabled({mode!r})"
            )
            _real_mode(region, bool(mode))

        return init

    def set_enter(original: Any) -> Callable[..., Any]:
        def enter(region: Any) -> None:
            if not isinstance(getattr(region, "prev", None), fx.Proxy):
                original(region)

        return enter

    def autocast_enter(original: Any) -> Callable[..., Any]:
        def enter(region: Any) -> Any:
            tracer = _tracing()
            if tracer is None:
                return original(region)
            args = (region.device, region.fast_dtype, region._enabled, region._cache_enabled)
            region.__dict__["_pipedialect_region"] = _record(
                tracer, enter_autocast, args, f"torch.autocast({region.device!r})"
            )
            return region

        return enter

    def autocast_exit(original: Any) -> Callable[..., Any]:
        def leave(region: Any, *exc: Any) -> Any:
            recorded = region.__dict__.pop("_pipedialect_region", None)
            tracer = _tracing()
            if tracer is None or recorded is None:
                return original(region, *exc)
            _record(tracer, exit_autocast, (recorded,), "")
            return False

        return leave

    def inference_enter(original: Any) -> Callable[..., Any]:
        def enter(region: Any) -> Any:
            tracer = _tracing()
            if tracer is None or not region.mode:
                return original(region)
            path = tracer.module_path()
            where = repr(path) if path else "the model"
            raise CaptureError(
                f"the forward of {where} enters torch.inference_mode(), which the torch.fx "
                "capture does not keep (and whose tensors autograd refuses in training); use "
                "torch.no_grad() there, which the stages keep"
            )

        return enter

    def function_apply(original: Any) -> Any:
        def apply(cls: type[torch.autograd.Function], *args: Any, **kwargs: Any) -> Any:
            tracer = _tracing()
            traced = tracer is not None and any(
                isinstance(v, fx.Proxy) for v in pytree.tree_leaves((args, kwargs))
            )
            if tracer is None or not traced or _torch_function(cls):
                return original.__get__(None, cls)(*args, **kwargs)
            return tracer.create_proxy("call_function", function_call(cls), args, kwargs)

        return classmethod(apply)

    grad_enabled = torch.is_grad_enabled()
    try:
        patch(torch.autograd.function.Function, "apply", function_apply)
        patch(grad_mode.no_grad, "__enter__", entering(False, "torch.no_grad()"))
        patch(grad_mode.no_grad, "__exit__", leaving)
        patch(grad_mode.enable_grad, "__enter__", entering(True, "torch.enable_grad()"))
        patch(grad_mode.enable_grad, "__exit__", leaving)
        patch(grad_mode.set_grad_enabled, "__init__", set_init)
        patch(grad_mode.set_grad_enabled, "__enter__", set_enter)
        patch(grad_mode.set_grad_enabled, "__exit__", leaving)
        patch(grad_mode.inference_mode, "__enter__", inference_enter)
        patch(torch.amp.autocast_mode.autocast, "__enter__", autocast_enter)
        patch(torch.amp.autocast_mode.autocast, "__exit__", autocast_exit)
        yield
    finally:
        for cls, name, original in reversed(originals):
            setattr(cls, name, original)
        torch._C._set_grad_enabled(grad_enabled)  # a region left open by a failed trace


#: The graph target that applies each custom autograd Function ([Note: custom autograd
#: Functions]).
_APPLIES: weakref.WeakKeyDictionary[type, Callable[..., Any]] = weakref.WeakKeyDictionary()


def function_call(cls: type[torch.autograd.Function]) -> Callable[..., Any]:
    """The function a stage graph calls to apply the custom autograd Function ``cls``.

    [Note: custom autograd Functions]
    fx traces ``MyFunction.apply(x)`` by running ``MyFunction.forward`` on proxies: the graph
    gets the forward's operations (``x.view_as(x)`` for a gradient reversal) and autograd then
    differentiates those, so ``MyFunction.backward`` is lost and the gradients are wrong with
    no error. While the torch.fx capture traces, ``apply`` of a Function defined outside torch
    called on traced values becomes one node calling this function instead, which calls
    ``cls.apply`` at run time: forward and backward run as in the unsplit model. Functions of
    torch itself (reentrant checkpointing) are traced as before. torch.export records the
    forward's operations too; that capture refuses such a Function by name
    (``_export.refuse_functions``).
    """
    found = _APPLIES.get(cls)
    if found is None:

        def apply(*args: Any, **kwargs: Any) -> Any:
            return cls.apply(*args, **kwargs)  # type: ignore[no-untyped-call]

        apply.__name__ = apply.__qualname__ = f"{cls.__name__}_apply"
        found = _APPLIES[cls] = apply
    return found


def _torch_function(cls: type) -> bool:
    """Whether ``cls`` is an autograd Function of torch itself."""
    return cls.__module__.split(".")[0] == "torch"


def _drop_empty_regions(graph: fx.Graph) -> None:
    """Erase regions that enclose no node (entered by library code on real values)."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _ENTERS:
            following = node.next
            if (
                following.op == "call_function"
                and following.target in _EXITS
                and following.args == (node,)
                and len(node.users) == 1
            ):
                graph.erase_node(following)
                graph.erase_node(node)


def place_regions(
    graph: fx.Graph,
    stage_of: dict[fx.Node, int],
    split_nodes: Sequence[fx.Node],
    split_points: Sequence[str],
) -> None:
    """Keep every grad-mode or autocast region inside one stage, or refuse it.

    A region that ends right after a split point's call (``with torch.no_grad(): h =
    self.block(h)`` split after ``block``) is closed in the split point's stage.

    Raises:
        CaptureError: a region that encloses a stage boundary, naming the module whose forward
            entered it and the split point inside.
    """
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _ENTERS:
            continue
        path = node.meta.get(_REGION_PATH, "")
        kind = node.meta.get(_REGION_KIND, "a grad-mode region")
        where = f"the forward of {path!r}" if path else "the model's forward"
        exits = [u for u in node.users if u.op == "call_function" and u.target in _EXITS]
        if not exits:
            raise CaptureError(
                f"{where} calls {kind} without restoring the mode: the stages could not tell "
                "where it ends. Use it as a context manager (with ...:), which restores it"
            )
        start = stage_of[node]
        for end in exits:
            if stage_of[end] == start:
                continue
            cursor = split_nodes[start].next
            while cursor is not end and cursor.op == "call_function" and cursor.target in _EXITS:
                cursor = cursor.next
            if cursor is end and stage_of[end] == start + 1:
                stage_of[end] = start
                continue
            raise CaptureError(
                f"the {kind} region in {where} contains split point "
                f"{split_points[start]!r}, where stage {start} ends: a grad-mode or "
                "autocast region must lie inside one stage (each stage runs on its own "
                "rank). Choose a split point outside the region, or one that ends it"
            )


def _attr_names(model: nn.Module) -> set[str]:
    return set(model.__dict__) | set(model._parameters) | set(model._buffers) | set(model._modules)


def remove_attrs(model: nn.Module, names: Iterable[str]) -> None:
    """Delete the attributes fx's tracer added to ``model``."""
    for name in names:
        if hasattr(model, name):
            delattr(model, name)


def share_constants(
    model: nn.Module, graph: fx.Graph, added: Sequence[str], earlier: Sequence[str]
) -> list[str]:
    """Point ``graph`` at an equal constant an earlier capture added, instead of its own.

    Each capture of a mode adds its tensor constants (and export's subgraphs) to ``model`` under
    fresh names; an equal one of the other mode is used instead, so that two captures that
    compute the same give the same code. Returns the names of ``added`` still in use.
    """
    kept: list[str] = []
    for name in added:
        value = getattr(model, name, None)
        twin = next(
            (e for e in earlier if _same_constant_value(getattr(model, e, None), value)), None
        )
        if twin is None:
            kept.append(name)
            continue
        for node in graph.nodes:
            if node.op == "get_attr" and node.target == name:
                node.target = twin
        remove_attrs(model, [name])
    return kept


def _same_constant_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (
            type(a) is type(b)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and a.device == b.device
            and (a.is_meta or bool(torch.equal(a, b)))
        )
    if isinstance(a, fx.GraphModule) and isinstance(b, fx.GraphModule):
        return (
            a.code == b.code
            and all(
                _same_constant_value(x, y)
                for (n, x), (m, y) in zip(a.named_children(), b.named_children(), strict=False)
                if n == m
            )
            and [n for n, _ in a.named_children()] == [n for n, _ in b.named_children()]
        )
    return False


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
        with recording_regions():
            graph = tracer.trace(model, dict(concrete_args) if concrete_args else None)
    except (CaptureError, RecomputeError):
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
    _drop_empty_regions(graph)
    _state.isolate_earlier_reads(graph, tracer.assignments)
    guards = _insert_guards(graph, tracer.splits)
    graph.lint()
    return Captured(graph, added, guards, tracer.buffer_writes)


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
        spec = _spec_of(result, probe)
    except Exception as exc:
        # The reason is written into the stage code, which every rank must build identically:
        # no object addresses, one short line.
        lines = str(exc).strip().splitlines()
        first = re.sub(r" (object )?at 0x[0-9a-fA-F]+", "", lines[0] if lines else "")[:200]
        reason = f"{type(exc).__name__}: {first}".rstrip(": ")
    finally:
        remove_attrs(m, _attr_names(m) - before)
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


def _mismatch(
    value: Any, spec: Any, path: tuple[Any, ...], keeps: frozenset[str] = _ALL_CONTAINERS
) -> tuple[str, str] | None:
    """Where and how ``value`` differs from ``spec``; ``None`` when it agrees.

    ``keeps`` are the containers the codec that decoded ``value`` gives back as they were; any
    other arrives as a plain tuple, and that is no difference.
    """
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
        problem = _mismatch(value, _LEAF, path, keeps)
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
                raise _LostByCodec(_path_text(path), lost) from None
            read = _path_text([key] if op == "[]" else [(op, key)])
            return _path_text(path), (
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
    #: Buffer name -> the value name its owner sends it as ([Note: module state] in ``_state``).
    buffer_values: dict[str, str] = field(default_factory=dict)


class ModalGraphModule(fx.GraphModule):
    """A stage that runs :attr:`graph` in train mode and :attr:`eval_graph` in eval mode.

    See [Note: stage modes]. Parameters, buffers and submodules are held once, under the
    model's names, whichever graph uses them; ``forward`` picks the graph by ``self.training``
    at every call, so ``train()``/``eval()`` switch it. Deep copies and pickles keep both.
    """

    #: The eval-mode graph (:attr:`graph` is the train-mode one).
    eval_graph: fx.Graph
    #: The generated code of :attr:`eval_graph` (:attr:`code` is the train-mode one).
    eval_code: str

    def __init__(
        self,
        root: nn.Module,
        graph: fx.Graph,
        eval_graph: fx.Graph,
        class_name: str = "GraphModule",
    ) -> None:
        super().__init__(root, graph, class_name)
        for node in eval_graph.nodes:
            if node.op in ("get_attr", "call_module"):
                _copy_missing(root, self, str(node.target))
        self.eval_graph = eval_graph
        self.recompile()

    def recompile(self) -> Any:
        """Compile both graphs; ``forward`` runs the one of the current mode."""
        code = super().recompile()
        eval_graph = self.__dict__.get("eval_graph")
        if eval_graph is None:  # inside GraphModule.__init__
            return code
        cls = type(self)
        train_forward = cls.forward
        generated = eval_graph.python_code(root_module="self")
        namespace = dict(generated.globals)
        exec(compile(generated.src, f"<{cls.__name__} eval mode>", "exec"), namespace)
        eval_forward = namespace["forward"]
        self.eval_code = generated.src

        def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            run = train_forward if module.training else eval_forward
            return run(module, *args, **kwargs)

        cls.forward = forward
        return code

    def _deepcopy_init(self) -> Callable[..., None]:
        def init(module: Any, root: nn.Module, graph: fx.Graph) -> None:
            ModalGraphModule.__init__(module, root, graph, root.__dict__["eval_graph"])

        return init

    def __copy__(self) -> ModalGraphModule:
        copied = ModalGraphModule(self, self.graph, self.eval_graph, type(self).__name__)
        copied.meta = getattr(self, "meta", {})
        return copied

    def __reduce__(self) -> tuple[Any, ...]:
        _, (body, import_block) = super().__reduce__()
        body = dict(body)
        eval_graph = body.pop("eval_graph")
        body.pop("eval_code", None)
        helper = fx.GraphModule(self, eval_graph)
        eval_graph.owning_module = self
        _, (eval_body, eval_imports) = helper.__reduce__()
        return (_rebuild_modal, (body, import_block, eval_body["_code"], eval_imports))


def _rebuild_modal(
    body: dict[str, Any], import_block: str, eval_code: str, eval_imports: str
) -> ModalGraphModule:
    """Unpickle a :class:`ModalGraphModule`: re-trace both codes, as fx does for one."""
    train = reduce_graph_module(dict(body), import_block)
    evaluated = reduce_graph_module({**body, "_code": eval_code}, eval_imports)
    return ModalGraphModule(
        train,
        train.graph,  # type: ignore[arg-type]
        evaluated.graph,  # type: ignore[arg-type]
        type(train).__name__,
    )


def stage_graphs(stage: nn.Module) -> list[fx.Graph]:
    """The graphs a stage runs: its graph, and its eval-mode graph when it has one."""
    if isinstance(stage, ModalGraphModule):
        return [stage.graph, stage.eval_graph]
    return [stage.graph] if isinstance(stage, fx.GraphModule) else []


def mode_graph(stage: fx.GraphModule, training: bool) -> fx.Graph:
    """The graph ``stage`` runs in train mode (``training``) or in eval mode."""
    if isinstance(stage, ModalGraphModule) and not training:
        return stage.eval_graph
    return stage.graph


def stage_code(stage: fx.GraphModule) -> str:
    """A stage's generated code; both modes' for a :class:`ModalGraphModule`."""
    if isinstance(stage, ModalGraphModule):
        return f"{stage.code}\n# eval mode\n{stage.eval_code}"
    return stage.code


def _copy_missing(root: nn.Module, module: nn.Module, target: str) -> None:
    """Install ``root``'s attribute at ``target`` in ``module`` unless it is there already."""
    *prefix, attr = target.split(".")
    source, dest = root, module
    for atom in prefix:
        found, held = getattr(source, atom), getattr(dest, atom, None)
        if held is found:
            return
        if held is None:
            held = nn.Module()
            dest.add_module(atom, held)
        source, dest = found, held
    if attr in dest.__dict__ or attr in dest._parameters or attr in dest._buffers:
        return
    if attr in dest._modules:
        return
    value = getattr(source, attr)
    if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
        dest.register_buffer(attr, value, persistent=attr not in source._non_persistent_buffers_set)
    else:
        setattr(dest, attr, value)


def _mirror_persistence(model: nn.Module, stage: nn.Module) -> None:
    """A buffer the model does not save is not saved by the stage either (fx registers every
    ``get_attr`` tensor as a persistent buffer)."""
    for name, _ in stage.named_buffers(remove_duplicate=False):
        owner_path, _, attr = name.rpartition(".")
        holder = stage.get_submodule(owner_path)
        try:
            original = model.get_submodule(owner_path)
        except AttributeError:
            continue
        if holder is not original and attr in original._non_persistent_buffers_set:
            holder._non_persistent_buffers_set.add(attr)


def recomputed(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Call ``module`` under non-reentrant activation recomputation ([Note: recomputed calls]);
    its recomputation sees and leaves the module's buffers and attributes as the first run did
    (``module_state`` [Note: recomputation and module state])."""
    return recompute_with_state(module, (module,), *args, **kwargs)


def checkpoint_calls(stage: fx.GraphModule, paths: frozenset[str]) -> None:
    """Route ``stage``'s calls of the modules at ``paths`` through :func:`recomputed`."""
    changed = False
    for graph in stage_graphs(stage):
        for node in list(graph.nodes):
            if node.op != "call_module" or str(node.target) not in paths:
                continue
            with graph.inserting_before(node):
                module = graph.get_attr(str(node.target))
                call = graph.call_function(recomputed, (module, *node.args), dict(node.kwargs))
            call.meta = dict(node.meta)
            node.replace_all_uses_with(call)
            graph.erase_node(node)
            changed = True
        graph.lint()
    if changed:
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


@dataclass
class _Cut:
    """One mode's flat graph cut into one GraphModule per stage ([Note: own splitter])."""

    modules: list[fx.GraphModule]
    placeholders: list[fx.Node]
    #: What each stage takes from outside (inputs or earlier stages), in first-use order.
    external: list[list[fx.Node]]
    #: The values of each stage that later stages use, in graph order.
    producers: list[list[fx.Node]]
    input_names: list[str]
    arg_names: list[list[str]]
    defined_by: dict[str, int]
    buffer_values: dict[str, str]


def _cut(
    model: nn.Module, graph: fx.Graph, stage_of: Mapping[fx.Node, int], num_stages: int
) -> _Cut:
    nodes = list(graph.nodes)
    output = next(n for n in nodes if n.op == "output")
    placeholders = [n for n in nodes if n.op == "placeholder"]
    last = num_stages - 1

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

    modules = [
        _build_stage(model, k, members[k], list(external[k]), producers[k], k == last)
        for k in range(num_stages)
    ]
    buffer_values = {
        str(node.args[1]): name_of[node]
        for outs in producers
        for node in outs
        if _state.is_buffer_value(node)
    }
    return _Cut(
        modules=modules,
        placeholders=placeholders,
        external=[list(e) for e in external],
        producers=producers,
        input_names=[name_of[p] for p in placeholders],
        arg_names=[[name_of[v] for v in external[k]] for k in range(num_stages)],
        defined_by=defined_by,
        buffer_values=buffer_values,
    )


def split(
    model: nn.Module,
    graph: fx.Graph,
    stage_of: Mapping[fx.Node, int],
    num_stages: int,
    *,
    eval_mode: tuple[fx.Graph, Mapping[fx.Node, int]] | None = None,
    split_points: Sequence[str] = (),
    training: bool = True,
) -> Split:
    """Cut ``graph`` into GraphModules following ``stage_of`` ([Note: own splitter]).

    With ``eval_mode`` (the eval-mode capture and its stages), a stage whose two graphs differ
    becomes a :class:`ModalGraphModule` ([Note: stage modes]); both modes must send the same
    values. ``training`` is the stages' initial mode.

    Raises:
        CaptureError: a boundary carries other values in eval mode than in train mode.
    """
    cut = _cut(model, graph, stage_of, num_stages)
    evaluated = None if eval_mode is None else _cut(model, *eval_mode, num_stages)
    if evaluated is not None:
        _check_same_boundaries(cut, evaluated, split_points)
    stages: list[fx.GraphModule] = []
    for k, stage in enumerate(cut.modules):
        other = None if evaluated is None else evaluated.modules[k]
        if other is not None and other.code != stage.code:
            stage = ModalGraphModule(model, stage.graph, other.graph, type(stage).__name__)
        stage.train(training)
        _mirror_persistence(model, stage)
        stages.append(stage)
    top = _build_top(
        graph, cut.placeholders, stages, cut.external, cut.producers, type(model).__name__
    )
    return Split(
        stages=stages,
        top=top,
        input_names=cut.input_names,
        arg_names=cut.arg_names,
        defined_by=cut.defined_by,
        buffer_values=cut.buffer_values,
    )


def _check_same_boundaries(train: _Cut, evaluated: _Cut, split_points: Sequence[str]) -> None:
    """Both modes must fit one plan: the same values per boundary, taken by the same stages in
    the same order, of the same shapes and dtypes where the capture knows them.

    Each mode's stages agree among themselves on what the i-th value of a boundary is, so the
    two modes need not compute the same values there ([Note: stage modes]).
    """
    for k in range(len(train.modules) - 1):
        sent, other = train.producers[k], evaluated.producers[k]
        same = len(sent) == len(other) and all(
            _same_meta(a, b) for a, b in zip(sent, other, strict=True)
        )
        takes = [
            train.arg_names[j] == evaluated.arg_names[j] for j in range(k + 1, len(train.modules))
        ]
        if same and all(takes):
            continue
        shown = [_state.describe_value(n) for n in sent]
        shown_eval = [_state.describe_value(n) for n in other]
        raise CaptureError(
            f"[Stage {k}] sends {shown} in train mode but {shown_eval} in eval mode, after split "
            f"point {split_points[k]!r}: forward takes another path in eval mode (self.training, "
            "or a module that behaves differently) across that boundary, so the later stages "
            "would take other values in one mode. A stage must send the same number of values, "
            "of the same kinds, in both modes: choose split points that keep such branches "
            "inside one stage"
        )


def _same_meta(a: fx.Node, b: fx.Node) -> bool:
    """Whether two boundary values may cross one wire layout (where the capture knows)."""
    x, y = a.meta.get("val"), b.meta.get("val")
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        return x.shape == y.shape and x.dtype == y.dtype
    return (
        not (isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor)) or x is None or y is None
    )


def _build_stage(
    model: nn.Module,
    k: int,
    stage_nodes: Sequence[fx.Node],
    args: Sequence[fx.Node],
    outs: Sequence[fx.Node],
    is_last: bool,
) -> fx.GraphModule:
    g = fx.Graph(tracer_cls=StageTracer)
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
    return fx.GraphModule(model, g, class_name=f"{type(model).__name__}Stage{k}")


def _build_top(
    graph: fx.Graph,
    placeholders: Sequence[fx.Node],
    stages: Sequence[fx.GraphModule],
    external: Sequence[Sequence[fx.Node]],
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
