"""Grad-mode and autocast regions recorded as nodes of the graph, each kept inside one stage.

[Note: grad-mode regions]
``with torch.no_grad():``, ``torch.enable_grad()``, ``torch.set_grad_enabled(b)`` and
``torch.autocast(...)`` change the process's state, not a value, so plain fx would run them
once while tracing and leave no trace in the graph: ``n = w.norm()`` under ``no_grad`` would get
gradients in every stage. While ``_capture.capture`` traces, :func:`recording_regions` makes
entering and leaving such a region inside traced code record ``enter_grad_mode(mode)`` /
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
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.autograd.grad_mode as grad_mode
import torch.utils._pytree as pytree
from torch import fx, nn

from ...errors import CaptureError
from ._functions import _torch_function, function_call

__all__: list[str] = []


class RegionRecorder(Protocol):
    """What a tracer that records regions offers them: proxies, and the module being traced."""

    def create_proxy(
        self, kind: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> fx.Proxy:
        """A node of the tracer's graph, as a Proxy."""

    def module_path(self) -> str:
        """The module whose forward is being traced ("" for the root)."""


#: The tracers whose ``trace`` is running, innermost last.
_ACTIVE: list[RegionRecorder] = []


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


@contextlib.contextmanager
def recording_into(tracer: RegionRecorder) -> Iterator[None]:
    """While active, regions entered in traced code are recorded in ``tracer``'s graph (the
    innermost such tracer's, when tracers nest)."""
    _ACTIVE.append(tracer)
    try:
        yield
    finally:
        _ACTIVE.pop()


def tracing() -> RegionRecorder | None:
    """The tracer regions are recorded in now, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


def _record(
    tracer: RegionRecorder, fn: Callable[..., Any], args: tuple[Any, ...], kind: str
) -> Any:
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
    """While active, a region entered inside a ``_tracer.SplitTracer``'s trace becomes nodes of
    its graph instead of only changing the tracing process's state."""
    originals: list[tuple[type, str, Any]] = []

    def patch(cls: type, name: str, make: Callable[[Any], Callable[..., Any]]) -> None:
        original = cls.__dict__[name]
        originals.append((cls, name, original))
        setattr(cls, name, make(original))

    def entering(enabled: bool, kind: str) -> Callable[[Any], Callable[..., Any]]:
        def make(original: Any) -> Callable[..., Any]:
            def enter(region: Any) -> None:
                tracer = tracing()
                if tracer is None:
                    return original(region)  # type: ignore[no-any-return]
                region.prev = _record(tracer, enter_grad_mode, (enabled,), kind)
                _real_mode(region, enabled)
                return None

            return enter

        return make

    def leaving(original: Any) -> Callable[..., Any]:
        def leave(region: Any, *exc: Any) -> Any:
            tracer = tracing()
            if tracer is None or not isinstance(region.prev, fx.Proxy):
                return original(region, *exc)
            _record(tracer, exit_grad_mode, (region.prev,), "")
            _real_mode(region, None)
            return None

        return leave

    def set_init(original: Any) -> Callable[..., Any]:
        def init(region: Any, mode: bool) -> None:
            tracer = tracing()
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
            tracer = tracing()
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
            tracer = tracing()
            if tracer is None or recorded is None:
                return original(region, *exc)
            _record(tracer, exit_autocast, (recorded,), "")
            return False

        return leave

    def inference_enter(original: Any) -> Callable[..., Any]:
        def enter(region: Any) -> Any:
            tracer = tracing()
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
            tracer = tracing()
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
