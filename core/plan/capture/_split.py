"""Cut a flat graph into one GraphModule per stage that keeps the model's parameter names.

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

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from ...errors import CaptureError
from .. import _state
from ._modal import ModalGraphModule
from ._regions import StageTracer

__all__: list[str] = []

_COMPUTE_OPS = frozenset({"call_module", "call_function", "call_method"})


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
    becomes a :class:`ModalGraphModule` ([Note: stage modes] in ``_modal``); both modes must
    send the same values. ``training`` is the stages' initial mode.

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
    two modes need not compute the same values there ([Note: stage modes] in ``_modal``).
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
