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
"""

from __future__ import annotations

import inspect
import logging
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from .errors import CaptureError

__all__: list[str] = []

logger = logging.getLogger(__name__)

_COMPUTE_OPS = frozenset({"call_module", "call_function", "call_method"})


class SplitTracer(fx.Tracer):
    """An ``fx.Tracer`` that keeps split points and user-named modules as single calls.

    It also remembers the innermost module whose forward was being traced when tracing failed,
    so that the error can suggest making exactly that module a leaf.
    """

    def __init__(
        self,
        leaf_ids: frozenset[int],
        leaf_types: tuple[type[nn.Module], ...],
    ) -> None:
        super().__init__()
        self._leaf_ids = leaf_ids
        self._leaf_types = leaf_types
        self._stack: list[str] = []
        self.failed_in: str | None = None

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
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                self.failed_in = path
            raise
        finally:
            self._stack.pop()


@dataclass
class Captured:
    """The flat graph of a whole model and what tracing added to the model."""

    graph: fx.Graph
    #: Attribute names fx's tracer set on the root module (tensor constants); removed again
    #: once the stages hold them.
    added_attrs: list[str]


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
) -> Captured:
    """Trace ``model`` into one flat graph; failures become :class:`CaptureError`."""
    accepted = list(inspect.signature(model.forward).parameters)
    unknown = sorted(set(concrete_args or {}) - set(accepted))
    if unknown:
        raise CaptureError(
            f"concrete_args names {unknown}, which {type(model).__name__}.forward does not take "
            f"(its parameters: {accepted})"
        )
    tracer = SplitTracer(leaf_ids, leaf_types)
    before = _attr_names(model)
    try:
        graph = tracer.trace(model, dict(concrete_args) if concrete_args else None)
    except Exception as exc:
        remove_attrs(model, _attr_names(model) - before)
        raise CaptureError(_capture_message(model, exc, tracer.failed_in)) from exc
    added = sorted(_attr_names(model) - before)
    try:
        _drop_specialised_inputs(model, graph, concrete_args or {})
    except CaptureError:
        remove_attrs(model, added)
        raise
    return Captured(graph, added)


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
        f"(flags, None defaults), or {leaf_hint}."
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
