"""Measuring a model for :mod:`pipedialect.cost.balance`: module calls, and what runs between them.

[Note: balance trace]
A *trace* is one forward (and, where costs need it, one backward) of the model with a hook on
every module. Each module call's entry and exit is an *event*, numbered in execution order;
an operation that runs after ``g`` events sits in *gap* ``g``. A split point after module ``M``
puts everything up to ``M``'s exit event ``x`` in the earlier stage, so with the chosen split
points' exit events ``x_0 < x_1 < ...``, gap ``g`` belongs to stage ``bisect_left(xs, g)``, the
same cut the fx and export splitters make (graph order is execution order). Everything is
recorded per gap, so one trace serves every choice of split points.

Three ways to take a trace:

- on fake tensors (``torch._subclasses.fake_tensor``) given example inputs: the model's own
  parameters are never read or written (each is replaced by a fake tensor of its shape for the
  run through ``torch.func.functional_call``), so a model built on the meta device works too.
  A dispatch mode counts each aten operation, its FLOPs (``torch.utils.flop_counter``'s
  formulas), which parameters it reads, and which tensors it consumes (for the bytes that cross
  each cut); a saved-tensor hook counts the bytes kept for backward;
- with torch.fx, without example inputs: the same events from the tracer's module calls, graph
  nodes as operations; parameters only (no shapes, so no FLOPs or bytes);
- for time, on the real tensors: timestamps at every event, repeated, the median per gap. The
  model's buffers are cloned for the run and the RNG state restored, so nothing changes.

Backward work is attributed by tagging autograd nodes: at each module's exit, the not yet
tagged nodes its outputs depend on get that exit's gap, and a pre-hook on each node tells the
recorder whose backward is running. A node computed in one gap but first used by a module
exiting later is charged to that later gap: a side value's backward can land one stage late.
"""

from __future__ import annotations

import bisect
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import CaptureError, PartitionError

__all__: list[str] = []


@dataclass
class ModuleCalls:
    """How forward called one module: how often, and its first call's entry and exit events."""

    path: str
    calls: int = 0
    enter: int = -1
    exit: int = -1
    #: Why the module cannot be a split point whatever it computes (inside a leaf), or None.
    hidden: str | None = None


@dataclass
class StateItem:
    """A parameter or buffer: its size and whether the optimizer keeps state for it."""

    numel: int
    nbytes: int
    trainable: bool
    is_parameter: bool


@dataclass
class Trace:
    """What one traced forward recorded ([Note: balance trace]); lists are indexed by gap."""

    num_events: int
    #: Event paths in order (``+path`` entry, ``-path`` exit): the time run must match them.
    events: list[str]
    modules: dict[str, ModuleCalls]
    #: Forward operations per gap (aten ops, or fx compute nodes).
    ops: list[int]
    #: Parameters and buffers (canonical names) read per gap.
    state_used: list[set[str]]
    state: dict[str, StateItem]
    #: Forward and backward FLOPs per gap (None for an fx trace).
    forward_flops: list[float] | None = None
    backward_flops: list[float] | None = None
    #: Bytes saved for backward per gap: {storage key: bytes} (None for an fx trace).
    saved: list[dict[int, int]] | None = None
    #: crossing[x]: bytes of the tensors a cut right after event x carries (None for fx).
    crossing: list[int] | None = None
    #: Bytes of the example inputs and of the forward's outputs (0 for an fx trace).
    input_bytes: int = 0
    output_bytes: int = 0
    #: Measured forward and backward seconds per gap (None until timed).
    forward_time: list[float] | None = None
    backward_time: list[float] | None = None
    #: The part of each gap's forward and backward seconds that does not shrink with the
    #: micro-batch ([Note: seconds that do not scale with the micro-batch]); None: not
    #: measured (every second is taken to be proportional to the samples).
    forward_fixed: list[float] | None = None
    backward_fixed: list[float] | None = None
    #: How the times were taken ([Note: timing a model]): None until timed.
    timing: Timing | None = None


@dataclass(frozen=True)
class Timing:
    """How :func:`measure_time` timed a model ([Note: timing a model])."""

    #: Intra-op threads torch was pinned to while timing.
    threads: int
    #: Timed runs (after the warm-up).
    runs: int
    #: The interquartile range of the runs' forward + backward seconds over their median.
    spread: float
    #: The median forward + backward seconds of one run.
    seconds: float
    #: The share of those seconds the process kept its ``threads`` busy computing: the CPU
    #: seconds of the runs (``time.process_time``, every thread of the process) over their wall
    #: seconds times ``threads``, at most 1, the wall seconds without those the timing thread
    #: waited for a core (other processes' load); None where the model ran on an accelerator.
    #: Work that waits (sleeps, I/O) adds wall seconds but no CPU seconds, so it does not
    #: count ([Note: ranks sharing cores] in ``cost._simulate``).
    cpu_share: float | None = None
    #: Samples of the smaller micro-batch timed as well, which tells the seconds that do not
    #: shrink with the micro-batch from those that do ([Note: seconds that do not scale with
    #: the micro-batch]); None: not timed (a micro-batch of one sample, or inputs without a
    #: batch dimension).
    half_batch: int | None = None
    #: Timed runs at ``half_batch`` samples (after their own warm-up).
    half_runs: int = 0

    def describe(self) -> str:
        """One line for tables: ``timed with 4 threads: 12 runs, 3.1% spread``."""
        line = (
            f"timed with {self.threads} thread(s): {self.runs} runs of "
            f"{self.seconds * 1e3:.2f} ms, {self.spread:.1%} spread (interquartile / median)"
        )
        if self.half_batch is not None:
            line += f", and at {self.half_batch} samples"
        return line


def _gaps(num_events: int) -> int:
    # Gaps 0..E, plus E + 1 for "used by the model's output".
    return num_events + 2


def _canonical_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return list(model.named_modules())


def _state_items(model: nn.Module) -> tuple[dict[int, str], dict[str, StateItem]]:
    names: dict[int, str] = {}
    items: dict[str, StateItem] = {}
    for name, p in model.named_parameters():
        names[id(p)] = name
        items[name] = StateItem(p.numel(), p.numel() * p.element_size(), p.requires_grad, True)
    for name, b in model.named_buffers():
        if id(b) not in names:
            names[id(b)] = name
            items[name] = StateItem(b.numel(), b.numel() * b.element_size(), False, False)
    return names, items


def _hidden_modules(
    model: nn.Module, leaf_ids: frozenset[int], leaf_types: tuple[type[nn.Module], ...]
) -> dict[str, str]:
    """Modules inside a module that runs as one call (an fx leaf): never a split point."""
    default = fx.Tracer()
    hidden: dict[str, str] = {}

    def walk(module: nn.Module, prefix: str, inside: str | None) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if inside is not None:
                hidden.setdefault(path, inside)
            # Containers are never called, so fx never treats them as leaves.
            is_leaf = not isinstance(child, nn.ModuleList | nn.ModuleDict) and (
                id(child) in leaf_ids
                or (bool(leaf_types) and isinstance(child, leaf_types))
                or default.is_leaf_module(child, path)
            )
            walk(child, path, inside if inside is not None else (path if is_leaf else None))

    walk(model, "", None)
    return {path: f"it is inside {leaf!r}, which runs as one call" for path, leaf in hidden.items()}


class _Events:
    """Module entry/exit hooks that number events and keep per-module call records."""

    def __init__(self, model: nn.Module, hidden: Mapping[str, str]) -> None:
        self.count = 0
        self.paths: list[str] = []
        self.modules: dict[str, ModuleCalls] = {}
        self._model = model
        self._hidden = hidden
        self._handles: list[Any] = []
        self.on_exit: Callable[[int, Any], None] | None = None
        self.on_event: Callable[[int], None] | None = None

    def _enter(self, path: str) -> None:
        if self.on_event is not None:
            self.on_event(self.count)
        record = self.modules.setdefault(path, ModuleCalls(path, hidden=self._hidden.get(path)))
        record.calls += 1
        if record.calls == 1:
            record.enter = self.count
        self.paths.append("+" + path)
        self.count += 1

    def _exit(self, path: str, output: Any) -> None:
        if self.on_event is not None:
            self.on_event(self.count)
        record = self.modules[path]
        if record.calls == 1:
            record.exit = self.count
        if self.on_exit is not None:
            self.on_exit(self.count, output)
        self.paths.append("-" + path)
        self.count += 1

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        try:
            for path, module in _canonical_modules(self._model):
                self._handles.append(
                    module.register_forward_pre_hook(lambda _m, _a, p=path: self._enter(p))
                )
                self._handles.append(
                    module.register_forward_hook(lambda _m, _a, out, p=path: self._exit(p, out))
                )
            yield
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()


class _Tagger:
    """Tags autograd nodes with the gap whose backward they belong to ([Note: balance trace])."""

    def __init__(self) -> None:
        self.tags: dict[Any, int] = {}
        self.current = -1
        self.on_switch: Callable[[int], None] | None = None
        self._handles: list[Any] = []

    def tag(self, gap: int, output: Any) -> None:
        stack: list[Any] = [
            t.grad_fn
            for t in pytree.tree_leaves(output)
            if isinstance(t, torch.Tensor) and t.grad_fn is not None
        ]
        while stack:
            node = stack.pop()
            if node is None or node in self.tags:
                continue
            self.tags[node] = gap
            self._handles.append(node.register_prehook(self._prehook(gap)))
            stack.extend(next_node for next_node, _ in node.next_functions)

    def release(self) -> None:
        """Remove the hooks and forget the nodes ([Note: timing on warm memory])."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.tags.clear()

    def _prehook(self, gap: int) -> Callable[[Any], None]:
        def hook(_grad_outputs: Any) -> None:
            if self.on_switch is not None:
                self.on_switch(gap)
            self.current = gap

        return hook


def _float_outputs(output: Any) -> list[torch.Tensor]:
    return [
        t
        for t in pytree.tree_leaves(output)
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()
    ]


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel() * t.element_size())


def _storage_key(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts operations, FLOPs, state reads and tensor uses per gap (fake trace)."""

    def __init__(self, events: _Events, tagger: _Tagger, state_ids: Mapping[int, str]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        from torch.utils.flop_counter import flop_registry

        self._flops = flop_registry
        self._events = events
        self._tagger = tagger
        self._state_ids = state_ids
        self.backward = False
        self.ops: dict[int, int] = {}
        self.forward_flops: dict[int, float] = {}
        self.backward_flops: dict[int, float] = {}
        self.state_used: dict[int, set[str]] = {}
        #: id(tensor) -> [gap produced, last gap used, bytes]
        self.tensors: dict[int, list[int]] = {}
        self._alive: list[torch.Tensor] = []

    def produced(self, t: torch.Tensor, gap: int) -> None:
        if id(t) not in self.tensors and id(t) not in self._state_ids:
            self.tensors[id(t)] = [gap, gap, t.numel() * t.element_size()]
            self._alive.append(t)

    def used(self, t: torch.Tensor, gap: int) -> None:
        entry = self.tensors.get(id(t))
        if entry is not None:
            entry[1] = max(entry[1], gap)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace != "aten":
            return out
        packet = func._overloadpacket
        flops = (
            float(self._flops[packet](*args, **kwargs, out_val=out))
            if packet in self._flops
            else 0.0
        )
        if self.backward:
            gap = self._tagger.current
            self.backward_flops[gap] = self.backward_flops.get(gap, 0.0) + flops
            return out
        gap = self._events.count
        self.ops[gap] = self.ops.get(gap, 0) + 1
        if flops:
            self.forward_flops[gap] = self.forward_flops.get(gap, 0.0) + flops
        for a in pytree.tree_leaves((args, kwargs)):
            if isinstance(a, torch.Tensor):
                name = self._state_ids.get(id(a))
                if name is not None:
                    self.state_used.setdefault(gap, set()).add(name)
                else:
                    self.used(a, gap)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.produced(t, gap)
        return out


def _fake_state(
    model: nn.Module, mode: Any, device: torch.device
) -> tuple[dict[str, torch.Tensor], dict[int, str]]:
    """One fake tensor per parameter and buffer (shared ones stay shared), on ``device``."""
    by_object: dict[int, torch.Tensor] = {}
    swapped: dict[str, torch.Tensor] = {}
    ids: dict[int, str] = {}
    canonical, _ = _state_items(model)
    named = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    with mode:
        for name, t in named:
            if id(t) not in by_object:
                fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
                if isinstance(t, nn.Parameter) and t.requires_grad:
                    fake.requires_grad_(True)
                by_object[id(t)] = fake
                ids[id(fake)] = canonical[id(t)]
            swapped[name] = by_object[id(t)]
    return swapped, ids


def _device_of(example_inputs: Mapping[str, Any]) -> torch.device:
    for t in pytree.tree_leaves(dict(example_inputs)):
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def trace_fake(
    model: nn.Module,
    example_inputs: Mapping[str, Any],
    fixed: Mapping[str, Any],
    hidden: Mapping[str, str],
) -> Trace:
    """Trace forward and backward on fake tensors ([Note: balance trace])."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    events = _Events(model, hidden)
    tagger = _Tagger()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    swapped, state_ids = _fake_state(model, mode, _device_of(example_inputs))
    _, items = _state_items(model)
    recorder = _Recorder(events, tagger, state_ids)
    state_storages = {_storage_key(t) for t in swapped.values()}
    saved: dict[int, dict[int, int]] = {}

    # Storages are numbered in the order forward first saves them (not by address), so the
    # trace is the same in every process.
    numbers: dict[int, int] = {}
    keep: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in state_storages and not recorder.backward:
            if key not in numbers:
                numbers[key] = len(numbers)
                keep.append(t)  # keeps the storage, and so its address, alive
            saved.setdefault(events.count, {})[numbers[key]] = int(t.untyped_storage().nbytes())
        return t

    events.on_exit = tagger.tag
    with mode:
        kwargs = pytree.tree_map(
            lambda v: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v,
            {**dict(example_inputs), **dict(fixed)},
        )
    for t in pytree.tree_leaves(kwargs):
        if isinstance(t, torch.Tensor):
            recorder.produced(t, 0)
    input_bytes = sum(
        _nbytes(t) for t in pytree.tree_leaves(dict(example_inputs)) if isinstance(t, torch.Tensor)
    )
    output_bytes = 0
    try:
        with mode, recorder, events.installed(), _numeric_momentum(model):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                output = torch.func.functional_call(
                    model, swapped, (), kwargs, tie_weights=False, strict=False
                )
            end = events.count
            for t in pytree.tree_leaves(output):
                if isinstance(t, torch.Tensor):
                    recorder.used(t, end + 1)
                    output_bytes += _nbytes(t)
            tagger.tag(end, output)
            tagger.current = end
            outs = _float_outputs(output)
            inputs = [t for t in dict.fromkeys(swapped.values()) if t.requires_grad]
            if outs and inputs:
                recorder.backward = True
                torch.autograd.grad(
                    [o.sum() for o in outs], inputs, allow_unused=True, materialize_grads=False
                )
    except PartitionError:
        raise
    except Exception as exc:
        raise CaptureError(
            f"could not run {type(model).__name__}.forward on fake tensors of the example inputs "
            f"to measure it: {type(exc).__name__}: {exc}. The forward must run without reading "
            "tensor values (no .item(), no data-dependent branches); balance='parameters' "
            "without example_inputs needs only a torch.fx trace."
        ) from exc
    finally:
        tagger.release()
    num_events = events.count
    gaps = _gaps(num_events)
    crossing_diff = [0] * (gaps + 1)
    for produced_at, last_used, nbytes in recorder.tensors.values():
        if last_used > produced_at:
            crossing_diff[produced_at] += nbytes
            crossing_diff[last_used] -= nbytes
    crossing: list[int] = []
    running = 0
    for g in range(gaps):
        running += crossing_diff[g]
        crossing.append(running)
    return Trace(
        num_events=num_events,
        events=events.paths,
        modules=events.modules,
        ops=[recorder.ops.get(g, 0) for g in range(gaps)],
        state_used=[recorder.state_used.get(g, set()) for g in range(gaps)],
        state=items,
        forward_flops=[recorder.forward_flops.get(g, 0.0) for g in range(gaps)],
        backward_flops=[recorder.backward_flops.get(g, 0.0) for g in range(gaps)],
        saved=[saved.get(g, {}) for g in range(gaps)],
        crossing=crossing,
        input_bytes=input_bytes,
        output_bytes=output_bytes,
    )


@contextlib.contextmanager
def _numeric_momentum(model: nn.Module) -> Iterator[None]:
    """Give norm layers with ``momentum=None`` a number while forward runs on fake tensors.

    Their forward divides by ``float(num_batches_tracked)`` (the cumulative average), a value a
    fake tensor does not have; the costs do not depend on the momentum.
    """
    changed = [
        m
        for m in model.modules()
        if isinstance(m, _NormBase) and m.momentum is None and m.track_running_stats
    ]
    for m in changed:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m in changed:
            m.momentum = None


class _RecordingTracer(fx.Tracer):
    """An fx tracer that records module entry/exit events and the graph size at each."""

    def __init__(
        self,
        leaf_ids: frozenset[int],
        leaf_types: tuple[type[nn.Module], ...],
        hidden: Mapping[str, str],
    ) -> None:
        super().__init__()
        self._leaf_ids = leaf_ids
        self._leaf_types = leaf_types
        self._hidden = hidden
        self.marks: list[int] = []
        self.paths: list[str] = []
        self.modules: dict[str, ModuleCalls] = {}

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        """User leaves and fx's default leaves, as :func:`pipedialect.partition` traces."""
        if id(m) in self._leaf_ids or (self._leaf_types and isinstance(m, self._leaf_types)):
            return True
        return bool(super().is_leaf_module(m, module_qualified_name))

    def _event(self, sign: str, path: str) -> None:
        record = self.modules.setdefault(path, ModuleCalls(path, hidden=self._hidden.get(path)))
        count = len(self.marks)
        if sign == "+":
            record.calls += 1
            if record.calls == 1:
                record.enter = count
        elif record.calls == 1:
            record.exit = count
        self.marks.append(len(self.graph.nodes))
        self.paths.append(sign + path)

    def call_module(
        self,
        m: nn.Module,
        forward: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Record the call's entry and exit around fx's own handling of it."""
        try:
            path = self.path_of_module(m)
        except NameError:
            return super().call_module(m, forward, args, kwargs)
        self._event("+", path)
        out = super().call_module(m, forward, args, kwargs)
        self._event("-", path)
        return out


def trace_fx(
    model: nn.Module,
    concrete_args: Mapping[str, Any] | None,
    leaf_ids: frozenset[int],
    leaf_types: tuple[type[nn.Module], ...],
    hidden: Mapping[str, str],
) -> Trace:
    """Trace with torch.fx: events, operations and parameter reads, no shapes."""
    tracer = _RecordingTracer(leaf_ids, leaf_types, hidden)
    before = set(model.__dict__)
    try:
        graph = tracer.trace(model, dict(concrete_args) if concrete_args else None)
    except Exception as exc:
        raise CaptureError(
            f"torch.fx could not trace {type(model).__name__}.forward to find its module calls: "
            f"{type(exc).__name__}: {exc}. Pass example_inputs to measure it on fake tensors "
            "instead, or leaf_modules=[...] naming the module fx cannot trace."
        ) from exc
    finally:
        for name in set(model.__dict__) - before:
            delattr(model, name)
    ids, items = _state_items(model)
    by_path: dict[str, str] = {}
    for name, t in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        by_path[name] = ids[id(t)]
    num_events = len(tracer.marks)
    gaps = _gaps(num_events)
    ops = [0] * gaps
    used: list[set[str]] = [set() for _ in range(gaps)]
    for index, node in enumerate(graph.nodes):
        if node.op not in ("call_module", "call_function", "call_method"):
            continue
        gap = bisect.bisect_right(tracer.marks, index)
        ops[gap] += 1
        for src in node.all_input_nodes:
            if src.op == "get_attr" and str(src.target) in by_path:
                used[gap].add(by_path[str(src.target)])
        if node.op == "call_module":
            leaf = model.get_submodule(str(node.target))
            for t in [*leaf.parameters(), *leaf.buffers()]:
                used[gap].add(ids[id(t)])
    return Trace(
        num_events=num_events,
        events=tracer.paths,
        modules=tracer.modules,
        ops=ops,
        state_used=used,
        state=items,
    )


class _Stopwatch:
    """Charges the time between consecutive events to gaps, forward and backward.

    On the CPU the seconds charged leave out those the timing thread spent waiting for a core
    that another process held (its run delay, :func:`_run_delay`): the model's time with its
    threads to itself, which is what the simulator shares among the ranks of a layout
    ([Note: ranks sharing cores] in ``cost._simulate``). On a quiet machine that is nothing.
    """

    def __init__(self, gaps: int, sync: Callable[[], None] | None) -> None:
        self.forward = [0.0] * gaps
        self.backward = [0.0] * gaps
        #: CPU seconds of the process (all its threads) per gap, beside the wall seconds.
        self.forward_cpu = [0.0] * gaps
        self.backward_cpu = [0.0] * gaps
        self._sync = sync
        self._stamp()

    def _stamp(self) -> None:
        self._last = time.perf_counter()
        self._last_cpu = time.process_time()
        self._last_delay = _run_delay() if self._sync is None else 0.0

    def restart(self) -> None:
        """Start the next interval now (leaving out the recorder's own work)."""
        if self._sync is not None:
            self._sync()
        self._stamp()

    def charge(self, into: list[float], gap: int) -> None:
        """Add the time since the last stamp to ``into[gap]`` (``forward`` or ``backward``),
        and the CPU seconds to the matching ``forward_cpu`` or ``backward_cpu``."""
        if self._sync is not None:
            self._sync()
        last, last_cpu, last_delay = self._last, self._last_cpu, self._last_delay
        self._stamp()
        waited = self._last_delay - last_delay
        into[gap] += max(0.0, self._last - last - waited)
        cpu = self.forward_cpu if into is self.forward else self.backward_cpu
        cpu[gap] += self._last_cpu - last_cpu


def _timed_run(
    model: nn.Module,
    kwargs: Mapping[str, Any],
    trace: Trace,
    trainable: Sequence[nn.Parameter],
    device: torch.device,
) -> _Stopwatch:
    """One timed forward and backward ([Note: timing a model]).

    [Note: timing on warm memory]
    A run tags the autograd nodes of its forward with pre-hooks that close over the tagger,
    and the tagger maps those nodes to gaps: a reference cycle through autograd's nodes. Where
    a node is a custom autograd Function's, the cycle passes through memory that C++ owns and
    the garbage collector cannot free it, so each run's graph, with what its nodes still held,
    stayed alive for good, and the next run's forward wrote to memory the process had never
    touched. On a model of 8 blocks with 8 MiB activations (2 shared cores, one thread) the
    resident set grew by about 160 MiB per timed run, each run took 16,000-43,000 minor page
    faults, and the forward timed 70-250 ms against 25-65 ms once the runs freed their graphs
    (4,000-12,000 faults: glibc trimming and re-growing its heap, as the same forward and
    backward called by hand does too): the timing measured page faults, not the model. A
    pipeline in its steady state reuses the memory its previous micro-batches freed, as the
    runs do now: each removes its hooks and forgets its nodes when it ends
    (:meth:`_Tagger.release`; the fake-tensor trace too), and
    ``test_measure_time_frees_every_timed_run_before_the_next`` checks that no node of a timed
    run outlives it. The warm-up run is the one that pays for first touching the memory.
    """
    gaps = _gaps(trace.num_events)
    watch = _Stopwatch(gaps, torch.cuda.synchronize if device.type == "cuda" else None)
    events = _Events(model, {})
    tagger = _Tagger()

    def on_exit(gap: int, output: Any) -> None:
        tagger.tag(gap, output)
        watch.restart()

    events.on_event = lambda gap: watch.charge(watch.forward, gap)
    events.on_exit = on_exit
    tagger.on_switch = lambda _gap: watch.charge(watch.backward, tagger.current)
    buffers = {name: b.clone() for name, b in model.named_buffers(remove_duplicate=False)}
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            with events.installed():
                watch.restart()
                output = torch.func.functional_call(model, buffers, (), dict(kwargs), strict=False)
                watch.charge(watch.forward, events.count)
            if events.paths != trace.events:
                raise PartitionError(
                    "the module calls of a real forward differ from those of the fake-tensor "
                    "trace (forward's control flow depends on tensor values), so times cannot "
                    "be attributed to split points; use balance='flops' instead"
                )
            tagger.tag(events.count, output)
            tagger.current = events.count
            outs = _float_outputs(output)
            if outs and trainable:
                watch.restart()
                torch.autograd.grad(
                    [o.sum() for o in outs],
                    list(trainable),
                    allow_unused=True,
                    materialize_grads=False,
                )
                watch.charge(watch.backward, tagger.current)
    finally:
        tagger.release()  # [Note: timing on warm memory]
    return watch


def _run_delay() -> float:
    """Seconds the calling thread has spent ready to run but waiting for a core (Linux's
    ``/proc/thread-self/schedstat``; 0 where there is none): on a loaded machine the wall
    seconds of a run include this, which is neither the model's work nor its waiting."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


#: The spread (interquartile range over median of a run's seconds) below which
#: :func:`measure_time` stops adding runs, and the most runs it takes for each requested one.
STABLE_SPREAD = 0.05
MAX_RUNS_PER_REPEAT = 5


def timing_threads(ranks: int | None = None) -> int:
    """The intra-op threads :func:`measure_time` pins torch to: one rank's share of the
    machine's cores: the cores over the ranks on this host under ``torch.distributed``, else
    over ``ranks`` (the ranks that will share this machine; default 1)."""
    import os

    import torch.distributed as dist

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    local = ranks or 1
    if dist.is_available() and dist.is_initialized():
        local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return max(1, (cores or 1) // max(1, local))


def measure_time(
    model: nn.Module,
    example_inputs: Mapping[str, Any],
    fixed: Mapping[str, Any],
    trace: Trace,
    repeats: int,
    threads: int | None = None,
) -> None:
    """Time forward and backward per gap on the real tensors; fill ``trace``'s time lists.

    [Note: timing a model]
    A CPU timing depends on the intra-op threads more than on anything else (the same model can
    take ten times longer with more threads than cores, several ranks each using all of them),
    so torch is pinned to ``threads`` (default :func:`timing_threads`: this process's share of
    the cores) while timing and restored after. One warm-up run, then at least ``repeats`` runs,
    more until the runs' spread (interquartile range over median) is under
    :data:`STABLE_SPREAD`, at most ``MAX_RUNS_PER_REPEAT * repeats``; the median per gap.
    On the CPU each gap's seconds leave out those the timing thread waited for a core another
    process held (Linux's run delay), so a loaded machine does not inflate them.
    ``trace.timing`` records the threads, the runs and the spread, which the planner reports,
    and on the CPU the share of the time the threads computed (CPU seconds over wall seconds
    times threads), which the simulator uses when ranks share cores ([Note: ranks sharing
    cores] in ``cost._simulate``).

    [Note: seconds that do not scale with the micro-batch]
    The planner times one micro-batch (the example inputs) and predicts other micro-batch
    sizes from it; scaling every second by the samples holds for work on the activations, but
    not for work on the parameters, which a micro-batch of any size does once: reading the
    weights, writing the weight gradient, a clone of a parameter, a kernel's launch. On a model
    whose blocks hold 16 MiB of trainable weights each and compute 0.5 ms per sample (the
    ``dp`` workload of ``benchmarks/planner.py``, 8 blocks, one thread), the forward took 50 ms
    at 8 samples and 42 ms at 4, the backward 95 and 62 ms: scaled from 8 samples the model said
    25 and 47 ms at 4, and predicted its pipelined steps 30-70% fast. So the model is timed
    again at half its samples (``trace.timing.half_batch``; inputs whose first dimension is the
    micro-batch's are cut to half), and each gap's seconds at both sizes give a line: its
    intercept (:func:`fixed_seconds`) is the gap's ``forward_fixed`` and ``backward_fixed``,
    which :func:`pipedialect.cost.predict` keeps whole at every micro-batch size while it scales
    the rest. A micro-batch of one sample cannot be halved: its seconds all scale, as before.
    """
    device = _device_of(example_inputs)
    kwargs = {**dict(example_inputs), **dict(fixed)}
    trainable = [p for p in model.parameters() if p.requires_grad]
    pinned = threads if threads is not None else timing_threads()
    previous = torch.get_num_threads()
    torch.set_num_threads(pinned)
    batch, half = _halved(example_inputs)
    smaller: list[_Stopwatch] = []
    try:
        runs = _timed_runs(model, kwargs, trace, trainable, device, repeats)
        if half is not None:
            try:
                smaller = _timed_runs(
                    model, {**half, **dict(fixed)}, trace, trainable, device, repeats
                )
            except (RuntimeError, ValueError, PartitionError):
                # A model bound to its micro-batch size (a view to a fixed shape, control
                # flow on the size) cannot run at half of it: its seconds all scale, as
                # before, and ``timing.half_batch`` stays None to say so.
                smaller = []
    finally:
        torch.set_num_threads(previous)
    gaps = range(_gaps(trace.num_events))
    trace.forward_time = [statistics.median(r.forward[g] for r in runs) for g in gaps]
    trace.backward_time = [statistics.median(r.backward[g] for r in runs) for g in gaps]
    if smaller:
        # [Note: seconds that do not scale with the micro-batch]
        forward_half = [statistics.median(r.forward[g] for r in smaller) for g in gaps]
        backward_half = [statistics.median(r.backward[g] for r in smaller) for g in gaps]
        trace.forward_fixed = [
            fixed_seconds(f, h, batch, batch // 2)
            for f, h in zip(trace.forward_time, forward_half, strict=True)
        ]
        trace.backward_fixed = [
            fixed_seconds(b, h, batch, batch // 2)
            for b, h in zip(trace.backward_time, backward_half, strict=True)
        ]
    totals = [sum(r.forward) + sum(r.backward) for r in runs]
    share = None
    if device.type == "cpu":
        cpu = [sum(r.forward_cpu) + sum(r.backward_cpu) for r in runs]
        share = min(
            1.0,
            statistics.median(
                c / (w * pinned) if w > 0 else 0.0 for c, w in zip(cpu, totals, strict=True)
            ),
        )
    trace.timing = Timing(
        pinned,
        len(runs),
        _spread(runs),
        statistics.median(totals),
        share,
        batch // 2 if smaller else None,
        len(smaller),
    )


def _timed_runs(
    model: nn.Module,
    kwargs: Mapping[str, Any],
    trace: Trace,
    trainable: Sequence[nn.Parameter],
    device: torch.device,
    repeats: int,
) -> list[_Stopwatch]:
    """One warm-up run, then at least ``repeats`` timed runs, more until their spread is
    under :data:`STABLE_SPREAD` ([Note: timing a model])."""
    _timed_run(model, kwargs, trace, trainable, device)  # warm-up
    runs = [_timed_run(model, kwargs, trace, trainable, device) for _ in range(repeats)]
    while len(runs) < MAX_RUNS_PER_REPEAT * repeats and _spread(runs) > STABLE_SPREAD:
        runs.append(_timed_run(model, kwargs, trace, trainable, device))
    return runs


def _halved(example_inputs: Mapping[str, Any]) -> tuple[int, dict[str, Any] | None]:
    """The micro-batch's samples (the first dimension of its first tensor that has one) and
    the inputs cut to half of them ([Note: seconds that do not scale with the
    micro-batch]): every tensor whose first dimension is that size, cut there. None when the
    micro-batch has fewer than 2 samples or no tensor with a batch dimension."""
    leaves = pytree.tree_leaves(dict(example_inputs))
    sizes = [t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0]
    if not sizes or sizes[0] < 2:
        return (int(sizes[0]) if sizes else 1), None
    batch = int(sizes[0])

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch:
            return value[: batch // 2]
        return value

    return batch, pytree.tree_map(cut, dict(example_inputs))


def fixed_seconds(full: float, half: float, batch: int, half_batch: int) -> float:
    """The seconds of a computation that do not shrink with the micro-batch, from its seconds
    at ``batch`` and at ``half_batch`` samples: the intercept of the line through both
    ([Note: seconds that do not scale with the micro-batch]), within ``[0, min(full,
    half)]`` (timing noise can put the line's intercept below 0 or above what was measured).

    >>> fixed_seconds(0.028, 0.024, 8, 4)  # 20 ms per micro-batch plus 1 ms per sample
    0.02
    """
    per_sample = (full - half) / (batch - half_batch)
    intercept = full - per_sample * batch
    return min(max(0.0, round(intercept, 12)), full, half)


def _spread(runs: Sequence[_Stopwatch]) -> float:
    """Interquartile range over median of the runs' forward + backward seconds."""
    totals = [sum(r.forward) + sum(r.backward) for r in runs]
    if len(totals) < 2:
        return float("inf")
    low, middle, high = statistics.quantiles(totals, n=4, method="inclusive")
    return (high - low) / middle if middle > 0 else 0.0


#: Seconds a rank that measured waits for every other rank to reach the agreement before it
#: refuses ([Note: measurements agree across ranks]).
ARRIVAL_TIMEOUT = 300.0
_AGREEMENTS = [0]


def agree_across_ranks(trace: Trace) -> None:
    """Replace the measured times with rank 0's, so that every rank chooses the same cuts.

    [Note: measurements agree across ranks]
    Timings differ between ranks, and ranks that chose different split points would build
    different pipelines; so under ``torch.distributed`` every rank measures and takes rank 0's
    times (a broadcast). A broadcast that only some ranks join waits forever, so first every
    rank checks in on the process group's store and waits, at most :data:`ARRIVAL_TIMEOUT`
    seconds, for the others: a call on rank 0 alone (``if rank == 0: plan_layout(...)``) is
    refused with a :class:`~pipedialect.PlanDisagreementError` naming the ranks that never
    came, instead of hanging. A measurement meant for one rank passes ``every_rank=False``
    and skips all this.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    _wait_for_every_rank(dist)
    payload: list[Any] = [
        (
            trace.num_events,
            trace.forward_time,
            trace.backward_time,
            trace.timing,
            trace.forward_fixed,
            trace.backward_fixed,
        )
    ]
    dist.broadcast_object_list(payload, src=0)
    num_events, forward, backward, timing, forward_fixed, backward_fixed = payload[0]
    if num_events != trace.num_events:
        raise PartitionError(
            f"rank 0 traced {num_events} module events, rank {dist.get_rank()} traced "
            f"{trace.num_events}: the ranks do not run the same model"
        )
    trace.forward_time, trace.backward_time, trace.timing = forward, backward, timing
    trace.forward_fixed, trace.backward_fixed = forward_fixed, backward_fixed


@dataclass(frozen=True)
class Atoms:
    """A trace folded onto a list of candidate cuts (exit events ``xs``): per-atom sums."""

    xs: tuple[int, ...]
    ops: tuple[int, ...]
    state: tuple[frozenset[str], ...]
    gaps: tuple[range, ...] = field(repr=False)


def fold(trace: Trace, xs: Sequence[int]) -> Atoms:
    """Group the trace's gaps into atoms separated by the cuts after events ``xs``."""
    bounds = [-1, *xs, _gaps(trace.num_events) - 1]
    gap_ranges = tuple(range(bounds[a] + 1, bounds[a + 1] + 1) for a in range(len(bounds) - 1))
    return Atoms(
        xs=tuple(xs),
        ops=tuple(sum(trace.ops[g] for g in r) for r in gap_ranges),
        state=tuple(frozenset().union(*(trace.state_used[g] for g in r)) for r in gap_ranges),
        gaps=gap_ranges,
    )


def _wait_for_every_rank(dist: Any) -> None:
    """Check in on the default store and wait for every rank's check-in ([Note: measurements
    agree across ranks])."""
    import time

    from ..errors import PlanDisagreementError

    store = dist.distributed_c10d._get_default_store()
    _AGREEMENTS[0] += 1
    prefix = f"pipedialect/measurement/{_AGREEMENTS[0]}"
    rank, world = dist.get_rank(), dist.get_world_size()
    store.set(f"{prefix}/{rank}", "1")
    keys = [f"{prefix}/{r}" for r in range(world)]
    deadline = time.monotonic() + ARRIVAL_TIMEOUT
    while True:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise PlanDisagreementError(
                f"[rank {rank}] a measured plan (plan_layout or profile_model with "
                f"measure_time=True, balance='time') shares rank 0's times with every rank, so "
                f"every rank must call it; rank(s) {missing} did not within "
                f"{ARRIVAL_TIMEOUT:.0f} s. Call it on every rank (they all get the same "
                "layout), or pass every_rank=False to measure on this rank alone and send the "
                "result to the others yourself",
                field="measurement",
                ranks=tuple(missing),
            )
        time.sleep(0.02)
