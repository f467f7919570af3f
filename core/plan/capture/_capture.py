"""Capture a whole model into one flat torch.fx graph: :func:`capture`, and the constants two
captures (one per mode) share.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from ...errors import CaptureError, RecomputeError
from .. import _state
from ._guards import EXPORT_HINT, insert_guards
from ._regions import _drop_empty_regions, recording_regions
from ._tracer import SplitTracer, attr_names, remove_attrs

__all__: list[str] = []


@dataclass
class Captured:
    """The flat graph of a whole model and what tracing added to the model."""

    graph: fx.Graph
    #: Attribute names fx's tracer set on the root module (tensor constants); removed again
    #: once the stages hold them.
    added_attrs: list[str]
    #: The split-point guards in the graph ([Note: split-point outputs] in ``_guards``).
    guards: list[fx.Node] = field(default_factory=list)
    #: For the module calls whose code was traced by itself, the ids of the buffers it writes.
    buffer_writes: dict[fx.Node, frozenset[int]] = field(default_factory=dict)


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
    treatment of [Note: split-point outputs] in ``_guards``; ``checkpoint_ids`` (also leaves)
    must return one tensor.
    """
    accepted = list(inspect.signature(model.forward).parameters)
    unknown = sorted(set(concrete_args or {}) - set(accepted))
    if unknown:
        raise CaptureError(
            f"concrete_args names {unknown}, which {type(model).__name__}.forward does not take "
            f"(its parameters: {accepted})"
        )
    tracer = SplitTracer(leaf_ids, leaf_types, split_ids, checkpoint_ids)
    before = attr_names(model)
    try:
        with recording_regions():
            graph = tracer.trace(model, dict(concrete_args) if concrete_args else None)
    except (CaptureError, RecomputeError):
        remove_attrs(model, attr_names(model) - before)
        raise
    except Exception as exc:
        remove_attrs(model, attr_names(model) - before)
        raise CaptureError(_capture_message(model, exc, tracer.failed_in)) from exc
    added = sorted(attr_names(model) - before)
    try:
        _drop_specialised_inputs(model, graph, concrete_args or {})
    except CaptureError:
        remove_attrs(model, added)
        raise
    _drop_empty_regions(graph)
    _state.isolate_earlier_reads(graph, tracer.assignments)
    guards = insert_guards(graph, tracer.splits)
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
        f"(flags, None defaults), or {leaf_hint}, or {EXPORT_HINT} (the route for "
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
