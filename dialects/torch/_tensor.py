"""Tensor parallelism inside the stages on the torch dialect: modules sharded over the tensor axis.

[Note: tensor parallel on torch]
``pipe_engine(..., tensor_parallel={"<module path glob>": "colwise" | "rowwise"})`` with a
topology whose ``tensor`` axis has ``t`` ranks (``make_topology(num_stages, data_parallel=d,
tensor_parallel=t)``) shards the matched modules of each stage over the ``"tensor"`` dimension
of the one process mesh (``_replicas`` [Note: the process mesh]) with DTensor's
``ColwiseParallel`` and ``RowwiseParallel``. What is sharded, and why it stays equal to the
unsplit model:

- *The plan.* A glob is matched (``fnmatch``, ``*`` crossing dots) against the module paths
  of every stage, which are the model's (``blocks.3.attn.q``). ``nn.Linear`` takes either
  style: colwise shards ``weight`` and ``bias`` by output feature, rowwise shards ``weight``
  by input feature and keeps ``bias`` whole. ``nn.Embedding``: rowwise shards the vocabulary
  (the output is summed over the axis), colwise the embedding dimension. Everything else is
  refused by name before any rank builds anything, as is a glob that matches nothing, a module
  matched with two styles, a sharded dimension that does not divide by ``t`` (the local shapes
  must be exact: a view over them would otherwise be wrong), a parameter several modules of a
  stage hold that they would shard differently (sharded alike, it is tied again after
  sharding), a weight tied across stages whose copies are sharded differently, and a glob that
  matches a module no stage graph calls or reads the parameters of (a torch.export capture
  inlines its modules and is sharded in the graph: [Note: tensor parallel in an exported
  graph]).
- *Activations.* Every module's output is a plain tensor. A colwise module's output stays
  sharded (the local shard, as torchtitan's plans do: the attention and MLP in between run on
  the local heads and features) when the code it flows through, together with the colwise
  outputs it meets, is the shards' own up to rowwise calls: no other module, no tensor from
  outside but sizes (a whole parameter times a shard would get a partial gradient,
  torchtitan#1373), nothing reaching the stage's output. Any other colwise output is gathered
  whole. A rowwise module that such a shard reaches takes it as its input; any other cuts its
  own slice of a whole input. Rowwise outputs are summed over the axis. So what crosses a
  stage boundary, and what the loss sees, is whole on every rank of the axis: each rank of one
  ``(pipe, data)`` position runs the same pipeline on the same micro-batches, and each
  ``(data, tensor)`` coordinate is one line of ``PipelineStage`` objects.
- *The first step checks the layout.* What the code between a colwise and a rowwise module does
  with the local shard is the user's: an attention that reshapes with the global head count
  (``view(B, S, heads, -1)``), a contraction over the sharded features (single-head
  attention), dropout on a shard (other masks). None of these raises by itself. So the
  first batch runs every stage once both ways on the real boundary values, sharded and as an
  unsharded reference ([Note: the layout check's reference]): the outputs (and, without FSDP,
  the gradients of every parameter and input for a fixed cotangent) must agree within the
  precision's rounding, else :class:`~pipedialect.PlanMismatchError` names the stage and the
  first value that differs, on every rank (they agree on the outcome before any schedule runs,
  so the process group stays usable; later batches are refused too). Stages built on the meta
  device are checked alike, on the weights ``init_weights`` gave their shards.
- *Gradients.* A sharded parameter's gradient is its shard's, complete (DTensor's backward sums
  over the axis where the forward did). A parameter outside the plan is whole on every rank of
  the axis and gets the same whole gradient there (checked on the first step). With data
  parallelism the replicas sum each rank's local gradient over the data axis (DDP) or FSDP
  shards the tensor-parallel ``DTensor`` s again over the data axis (applied after the tensor
  plan, on the same mesh). Clipping counts every element of the model once over the whole mesh.
- *Ties.* A weight tied across stages is sharded alike on every stage holding it (an embedding
  sharded rowwise and an LM head colwise both shard the vocabulary, ``Shard(0)``), so the
  tie's gradient sum and broadcast run on the local shards.
- *Checkpoints.* Portable checkpoints read and write through the shards by name, so they move
  between this and every other layout; the engine's own checkpoint is per rank and needs the
  same layout.

[Note: the layout check's reference]
The reference a stage is checked against is the stage's own code, unsharded, on the sharded
stage's values gathered whole. Before sharding, each rank copies its stages' modules with every
parameter and buffer replaced by a placeholder on the meta device (``reference_skeletons``: no
memory, and a meta-device build has one too). At the first batch, just before a stage's check,
the placeholders are filled with the parameters gathered from their shards and copies of the
live buffers (``materialise_reference``); the reference runs forward (and backward, without
FSDP), keeps its outputs and gradients, and puts placeholders back (``release_reference``)
before the sharded stage runs. So no rank holds a second copy of its stages while it builds,
and during the check the whole values of one stage live only while the reference runs, never
beside the sharded stage's gathered parameters and activations. Gathering cannot hide a wrong
layout: what the check looks for is code that computes something else on shards (the values
are DTensor's, and ``full_tensor`` is the inverse of the shards it cut).

[Note: tensor parallel in an exported graph]
A plan captured with torch.export (``partition(..., example_inputs=...)``, every Hugging Face
model) calls no module: its graph reads each parameter with a ``get_attr`` named by the model's
path (``model.layers.0.self_attn.q_proj.weight``) and applies ``aten.linear`` itself. So when
no module a stage calls matches the plan, the globs are matched against the owners of the
parameters the graph reads, whose type is the model's module at that path (nn.Linear,
nn.Embedding, checked as above), and the stage is sharded at the graph level:

- the matched parameters become ``DTensor`` s on the tensor axis, laid out as the module styles
  lay them out (colwise: weight and bias ``Shard(0)``; rowwise: weight ``Shard(1)``, bias
  replicated), so FSDP, ties, clipping and checkpoints treat them as they treat a sharded
  module's;
- the stage's forward runs under :class:`_ShardedRegion`: an operation that meets a sharded
  value runs with DTensor's semantics on *global* shapes, every plain tensor it meets joining
  as a replicated ``DTensor`` whose gradient is summed over the axis where the operation leaves
  it partial (Megatron's identity-forward, all-reduce-backward operator, and what keeps a whole
  parameter combined with a shard right, torchtitan#1373); a result that is no longer sharded
  (a rowwise projection's partial sum, summed over the axis; a replicated value) leaves as a
  plain tensor, and a sharded value reaching the stage's output is gathered whole;
- so the shapes export wrote into the graph stay right: a capture records the global head
  counts as constants (Llama's ``repeat_kv`` expands to ``[B, kv_heads, n_rep, S, D]`` and
  reshapes to ``[B, heads, S, D]``), which are the DTensor's global shapes, not the shard's;
- attention (``scaled_dot_product_attention`` with queries, keys and values sharded by heads
  and no dropout) runs on each rank's heads, the mask cut alike when it has a head dimension;
  otherwise they are gathered and attention runs whole;
- an operation that draws random numbers (dropout, ``randn_like``) gets its sharded arguments
  gathered whole, so every rank draws what the unsharded stage draws from the stage's stream;
- a recomputed region (an outlined graph a checkpoint runs again in backward) enters the same
  mode when it runs outside the stage's forward.

The first batch's layout check compares such a stage with its unsharded reference as any other.
An operation DTensor has no rule for raises there, and is refused by name
(:class:`~pipedialect.PlanMismatchError`); leave the modules around it out of the plan.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch import fx, nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from pipedialect import ConfigError, PlanMismatchError, StageWrapper, TieError

__all__: list[str] = []

logger = logging.getLogger(__name__)

#: The styles a plan may name.
STYLES = ("colwise", "rowwise")


def _root(stage: nn.Module) -> nn.Module:
    return stage.mod if isinstance(stage, StageWrapper) else stage


@dataclass(frozen=True)
class TensorLayout:
    """The tensor plan resolved against the stages ([Note: tensor parallel on torch])."""

    #: Ranks on the tensor axis.
    size: int
    #: For each stage, ``{module path: style}`` of its sharded modules.
    styles: Mapping[int, Mapping[str, str]]
    #: For each stage, the colwise modules whose output stays sharded (it reaches a rowwise
    #: module); the other colwise outputs are gathered whole.
    local_outputs: Mapping[int, frozenset[str]]
    #: For each stage, the rowwise modules such an output reaches (they take their input
    #: sharded); the other rowwise modules take a whole input and cut their shard of it.
    local_inputs: Mapping[int, frozenset[str]]
    #: For each stage, ``{module path: "linear" | "embedding"}``.
    kinds: Mapping[int, Mapping[str, str]]
    #: The stages whose graph reads the matched modules' parameters itself (a torch.export
    #: capture inlines every module): sharded at the graph level ([Note: tensor parallel in
    #: an exported graph]).
    graph_stages: frozenset[int] = frozenset()

    def sharded_dim(self, stage: int, name: str) -> int | None:
        """The dimension of parameter ``name`` (a stage's name) the plan shards, or None."""
        path, _, leaf = name.rpartition(".")
        style = self.styles.get(stage, {}).get(path)
        return None if style is None else _param_dim(style, leaf, self.kinds[stage][path])


def _param_dim(style: str, leaf: str, kind: str) -> int | None:
    """The dimension of a Linear's or Embedding's parameter ``leaf`` that ``style`` shards."""
    if kind == "embedding":
        return 0 if style == "rowwise" else 1
    if leaf == "bias":
        return 0 if style == "colwise" else None
    return 0 if style == "colwise" else 1


def auto_plan(model: nn.Module | None) -> dict[str, str]:
    """A Hugging Face model's own tensor plan (its config's ``base_model_tp_plan``), keyed by
    the model's module paths (the base model's prefix added).

    Raises:
        ConfigError: the model has no such plan, or it names a style this dialect does not run.
    """
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if not base:
        raise ConfigError(
            "tensor_parallel='auto' reads the model's config.base_model_tp_plan (Hugging Face "
            f"models such as Llama, Qwen2, Mistral), which {type(model).__name__} does not "
            "have; pass the plan yourself: tensor_parallel={'<module path glob>': 'colwise' | "
            "'rowwise', ...}"
        )
    prefix = ""
    assert model is not None
    base_name = getattr(model, "base_model_prefix", "")
    if base_name and isinstance(getattr(model, base_name, None), nn.Module):
        prefix = base_name + "."
    plan: dict[str, str] = {}
    for glob, style in dict(base).items():
        if style not in STYLES:
            raise ConfigError(
                f"the model's base_model_tp_plan shards {glob!r} as {style!r}, which the torch "
                f"dialect does not run (it runs {', '.join(map(repr, STYLES))}); pass "
                "tensor_parallel={glob: style} without that entry"
            )
        plan[prefix + glob] = style
    return plan


def _called_modules(stage: nn.Module) -> tuple[list[str], list[str]] | None:
    """The module paths a stage's graph runs, and the modules among them it runs whole (a
    split point's module, a recomputed one: their own forward runs, not the graph); None: not
    a graph."""
    root = _root(stage)
    graph = getattr(root, "graph", None)
    if not isinstance(graph, fx.Graph):
        return None
    called: list[str] = []
    whole: list[str] = []
    for node in graph.nodes:
        if node.op not in ("call_module", "get_attr"):
            continue
        try:
            module = root.get_submodule(str(node.target))
        except AttributeError:
            continue
        called.append(str(node.target))
        children = [f"{node.target}.{name}" for name, _ in module.named_modules() if name]
        if children:
            whole.append(str(node.target))
            called.extend(children)
    return called, whole


def _read_owners(stage: nn.Module) -> list[str]:
    """The owners' paths of the parameters a stage's graph reads itself (``get_attr`` of
    ``model.layers.0.mlp.up_proj.weight``: ``model.layers.0.mlp.up_proj``), in graph order."""
    root = _root(stage)
    graph = getattr(root, "graph", None)
    if not isinstance(graph, fx.Graph):
        return []
    owners: list[str] = []
    for node in graph.nodes:
        if node.op != "get_attr":
            continue
        path, _, leaf = str(node.target).rpartition(".")
        if path and leaf in ("weight", "bias"):
            owners.append(path)
    return list(dict.fromkeys(owners))


#: Calls whose result is a size, not a tensor: they may feed a shard's reshape.
_SIZE_METHODS = frozenset({"size", "dim", "numel"})


def _is_size(node: Any, memo: dict[fx.Node, bool]) -> bool:
    """Whether ``node`` computes a Python size (``x.shape[0]``, ``x.size(1) // 2``), not a
    tensor: such a value may enter the code between a colwise and a rowwise module."""
    if not isinstance(node, fx.Node):
        return True
    if node in memo:
        return memo[node]
    memo[node] = False
    if node.op == "call_method" and node.target in _SIZE_METHODS:
        found = True
    elif node.op == "call_function" and getattr(node.target, "__name__", "") == "getattr":
        found = node.args[1] in ("shape", "ndim", "dtype", "device")
    elif node.op == "call_function" and getattr(node.target, "__module__", "") in (
        "_operator",
        "operator",
    ):
        found = all(_is_size(arg, memo) for arg in node.all_input_nodes) and any(
            _is_size(arg, memo) for arg in node.all_input_nodes
        )
    else:
        found = False
    memo[node] = found
    return found


def _closure(graph: fx.Graph, path: str, rowwise: set[str]) -> tuple[set[fx.Node], bool]:
    """The nodes the output of the call of ``path`` flows through up to rowwise calls (those
    included), and whether it reaches only code and rowwise calls (not the stage's output,
    another module, a rowwise call with other inputs)."""
    starts = [n for n in graph.nodes if n.op == "call_module" and str(n.target) == path]
    region: set[fx.Node] = set(starts)
    todo = list(starts)
    pure = True
    while todo:
        node = todo.pop()
        for user in node.users:
            if user in region:
                continue
            region.add(user)
            if user.op == "call_module" and str(user.target) in rowwise:
                pure = pure and len(user.all_input_nodes) == 1
            elif user.op in ("output", "call_module", "get_attr", "placeholder") or _draws(user):
                pure = False
            else:
                todo.append(user)
    return region, pure


#: Random operations: on a shard they draw other numbers than on the whole tensor (a
#: dropout mask over a slice of the features is not the slice of the whole mask).
_RANDOM_FUNCTIONS = frozenset(
    {
        "dropout",
        "dropout1d",
        "dropout2d",
        "dropout3d",
        "alpha_dropout",
        "feature_alpha_dropout",
        "bernoulli",
        "rand_like",
        "randn_like",
        "randint_like",
        "normal",
        "multinomial",
        "rrelu",
    }
)
_RANDOM_METHODS = frozenset({"bernoulli", "bernoulli_", "uniform_", "normal_", "random_"})


@contextlib.contextmanager
def _one_stream(stage: nn.Module, reference: nn.Module) -> Iterator[None]:
    """Both copies of a stage draw from the stage's random stream at the micro-batch it is at
    (``pipedialect.runtime.randomness`` [Note: random streams]); afterwards the stage's count
    is as it was: the check's forwards are no micro-batch of the run."""
    live, twin = getattr(stage, "random", None), getattr(reference, "random", None)
    if live is None or twin is None:
        yield
        return
    vars(twin).update(vars(live))
    with live.not_counted():
        yield


def _draws(node: fx.Node) -> bool:
    """Whether ``node`` draws random numbers: a region holding one is gathered whole, never
    kept sharded (``[Note: tensor parallel on torch]``)."""
    if node.op == "call_function":
        return getattr(node.target, "__name__", "") in _RANDOM_FUNCTIONS
    return node.op == "call_method" and node.target in _RANDOM_METHODS


def _reached_rowwise(graph: fx.Graph, paths: set[str], rowwise: set[str]) -> dict[str, set[str]]:
    """For each colwise module of ``paths`` whose output stays sharded, the rowwise modules it
    feeds.

    Colwise outputs whose code meets (attention's queries and keys) form one region. A
    region's outputs stay sharded only when the code is the shards' own: every path ends at a
    rowwise module's call (none reaches the stage's output or another module), and no node on
    the way takes a tensor from outside (a whole tensor combined with a shard is wrong there),
    sizes aside. Otherwise they are gathered whole, and a rowwise module no shard reaches cuts
    its own slice of its input.
    """
    regions: list[tuple[set[str], set[fx.Node], bool]] = []
    for path in sorted(paths):
        names, nodes, pure = {path}, *_closure(graph, path, rowwise)
        rest = []
        for other_names, other_nodes, other_pure in regions:
            if nodes & other_nodes:
                names, nodes, pure = names | other_names, nodes | other_nodes, pure and other_pure
            else:
                rest.append((other_names, other_nodes, other_pure))
        regions = [*rest, (names, nodes, pure)]
    out: dict[str, set[str]] = {}
    memo: dict[fx.Node, bool] = {}
    for names, nodes, pure in regions:
        if not pure:
            continue
        starts = {n for n in nodes if n.op == "call_module" and str(n.target) in names}
        ends = {n for n in nodes if n.op == "call_module" and str(n.target) in rowwise}
        if any(
            arg not in nodes and not _is_size(arg, memo)
            for node in nodes - starts
            for arg in node.all_input_nodes
        ):
            continue
        for name in names:
            out[name] = {str(n.target) for n in ends}
    return out


def _local_layout(
    root: nn.Module, colwise: set[str], rowwise: set[str], whole: Sequence[str]
) -> tuple[set[str], set[str]]:
    """The colwise modules of a stage whose outputs stay sharded, and the rowwise modules that
    take those shards (:func:`_reached_rowwise`). Inside a module the stage runs whole (a split
    point's, a recomputed one) that module is traced on its own; one that cannot be traced
    feeds nothing (every output gathered: correct, slower)."""
    local: set[str] = set()
    fed: set[str] = set()
    owners: dict[str | None, set[str]] = {}
    for path in colwise:
        owner = next((w for w in whole if path.startswith(w + ".")), None)
        owners.setdefault(owner, set()).add(path)
    for owner, group in owners.items():
        if owner is None:
            graph = getattr(root, "graph", None)
            if isinstance(graph, fx.Graph):
                for name, reached in _reached_rowwise(graph, group, rowwise).items():
                    local.add(name)
                    fed |= reached
            continue
        cut = len(owner) + 1
        inner = {r[cut:] for r in rowwise if r.startswith(owner + ".")}
        try:
            traced = fx.symbolic_trace(root.get_submodule(owner))
        except Exception:  # any tracing failure: every output gathered
            continue
        for name, reached in _reached_rowwise(
            traced.graph, {p[cut:] for p in group}, inner
        ).items():
            local.add(f"{owner}.{name}")
            fed |= {f"{owner}.{r}" for r in reached}
    return local, fed


def resolve_layout(
    given: object,
    stages: Sequence[nn.Module],
    model: nn.Module | None,
    size: int,
    tie_groups: Sequence[Any] = (),
) -> TensorLayout | None:
    """Check ``given`` (the ``tensor_parallel`` option) against every stage of the plan; return
    the layout, or None without tensor parallelism. Runs on every rank alike, before anything
    is built ([Note: tensor parallel on torch]).

    Raises:
        ConfigError: a malformed plan, a glob matching nothing, a module that cannot take its
            style, a shape that does not divide by ``size``, a plan without a tensor axis.
        TieError: a module holding a parameter another module of its stage holds, or a weight
            tied across stages sharded differently on its stages.
    """
    if given is None or (isinstance(given, Mapping) and not given):
        return None
    if given == "auto":
        plan = auto_plan(model)
    elif isinstance(given, Mapping):
        plan = {}
        for glob, style in given.items():
            if not isinstance(glob, str) or style not in STYLES:
                raise ConfigError(
                    f"tensor_parallel maps module path globs to 'colwise' or 'rowwise'; got "
                    f"{glob!r}: {style!r}"
                )
            plan[glob] = style
    else:
        raise ConfigError(
            "tensor_parallel must be a mapping {'<module path glob>': 'colwise' | 'rowwise'} "
            f"or 'auto' (a Hugging Face model's own plan), got {given!r}"
        )
    if size < 2:
        raise ConfigError(
            f"tensor_parallel={plan!r} shards modules over the topology's tensor axis, which "
            "has 1 rank here; build the topology with make_topology(num_stages, "
            "data_parallel=..., tensor_parallel=t) with t > 1"
        )
    styles: dict[int, dict[str, str]] = {}
    kinds: dict[int, dict[str, str]] = {}
    local_outputs: dict[int, frozenset[str]] = {}
    local_inputs: dict[int, frozenset[str]] = {}
    matched: set[str] = set()
    graph_stages: set[int] = set()
    for k, stage in enumerate(stages):
        root = _root(stage)
        found = _called_modules(stage)
        paths = found[0] if found is not None else [n for n, _ in root.named_modules() if n]
        whole = found[1] if found is not None else []
        mine = _match(k, paths, plan, matched)
        owners = root
        if not mine and found is not None and model is not None:
            # An exported graph calls no module: it reads the parameters of the modules it
            # inlined, named by the model's paths ([Note: tensor parallel in an exported graph]).
            mine = _match(k, _read_owners(stage), plan, matched)
            if mine:
                graph_stages.add(k)
                owners = model
        kinds[k] = {
            path: _check_module(k, path, owners.get_submodule(path), style, size)
            for path, style in mine.items()
        }
        _check_shared(k, root, mine)
        styles[k] = mine
        if k in graph_stages:
            local_outputs[k] = local_inputs[k] = frozenset()
            continue
        _check_direct_reads(k, root, mine)
        rowwise = {p for p, s in mine.items() if s == "rowwise" and kinds[k][p] == "linear"}
        colwise = {p for p, s in mine.items() if s == "colwise" and kinds[k][p] == "linear"}
        local, fed = _local_layout(root, colwise, rowwise, whole)
        local_outputs[k] = frozenset(local)
        local_inputs[k] = frozenset(fed)
    unmatched = [glob for glob in plan if glob not in matched]
    modules = [n for n, _ in model.named_modules() if n] if model is not None else []
    inlined = [
        (glob, path) for glob in unmatched for path in modules if fnmatch.fnmatchcase(path, glob)
    ]
    if inlined:
        glob, path = inlined[0]
        raise ConfigError(
            f"tensor_parallel glob {glob!r} matches the model's module {path!r}, but no stage "
            "graph calls it or reads its parameters (a module the graph runs whole, such as a "
            "split point's or a recomputed one, is sharded by its own module path only when "
            "the graph calls it); narrow the glob to modules the stages run"
        )
    if unmatched:
        raise ConfigError(
            f"tensor_parallel glob {unmatched[0]!r} matches no module the stages call; the "
            "globs match module paths of the model such as 'blocks.*.attn.q' (see "
            "model.named_modules())"
        )
    layout = TensorLayout(size, styles, local_outputs, local_inputs, kinds, frozenset(graph_stages))
    _check_ties(layout, tie_groups)
    return layout


def _match(
    stage: int, paths: Sequence[str], plan: Mapping[str, str], matched: set[str]
) -> dict[str, str]:
    """``{path: style}`` of the ``paths`` the plan's globs match (each glob that matches is
    added to ``matched``).

    Raises:
        ConfigError: a path matched with two styles.
    """
    mine: dict[str, str] = {}
    for path in dict.fromkeys(paths):
        for glob, style in plan.items():
            if not fnmatch.fnmatchcase(path, glob):
                continue
            matched.add(glob)
            if mine.setdefault(path, style) != style:
                raise ConfigError(
                    f"[Stage {stage}] module {path!r} is matched as {mine[path]!r} and as "
                    f"{style!r} (glob {glob!r}); make the globs of tensor_parallel disjoint"
                )
    return mine


def _check_module(stage: int, path: str, module: nn.Module, style: str, size: int) -> str:
    if isinstance(module, nn.Linear):
        kind, dim, what = "linear", 0, "out_features"
        if style == "rowwise":
            dim, what = 1, "in_features"
    elif isinstance(module, nn.Embedding):
        kind, dim, what = "embedding", 0, "num_embeddings"
        if style == "colwise":
            dim, what = 1, "embedding_dim"
    else:
        raise ConfigError(
            f"[Stage {stage}] tensor_parallel shards {path!r} as {style!r}, but it is a "
            f"{type(module).__name__}; the torch dialect shards nn.Linear (colwise or "
            "rowwise) and nn.Embedding: narrow the glob to those modules"
        )
    extent = int(module.weight.shape[dim])
    if extent % size:
        raise ConfigError(
            f"[Stage {stage}] {path!r} ({type(module).__name__}) has {what}={extent}, which "
            f"does not divide by the tensor axis of {size} ranks ({style}); choose a "
            "tensor_parallel size that divides it, or leave this module out of the plan"
        )
    return kind


def _shared(root: nn.Module) -> list[list[str]]:
    """The names of each parameter a stage holds under several names."""
    names: dict[int, list[str]] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [same for same in names.values() if len(same) > 1]


def _check_shared(stage: int, root: nn.Module, styles: Mapping[str, str]) -> None:
    """A parameter several modules of one stage hold is sharded only if all of them take the
    same style (it is then one sharded parameter again after sharding, ``apply_layout``)."""
    for same in _shared(root):
        how = {
            (styles.get(n.rpartition(".")[0]), type(root.get_submodule(n.rpartition(".")[0])))
            for n in same
        }
        sharded = [n for n in same if n.rpartition(".")[0] in styles]
        if sharded and len(how) > 1:
            raise TieError(
                f"[Stage {stage}] parameter {sharded[0]!r} is also held as "
                f"{next(n for n in same if n != sharded[0])!r} in the same stage, sharded "
                "otherwise there or not at all; a parameter several modules hold must be "
                "sharded alike by all of them (the same style of the same module type) or by "
                "none"
            )


def _check_direct_reads(stage: int, root: nn.Module, styles: Mapping[str, str]) -> None:
    """Refuse a sharded module's parameter that the stage's code reads itself (a ``get_attr``
    of ``lin.weight``, say ``self.lin.weight.norm()``): outside the module's call it is a shard
    (a ``DTensor``) meeting whole tensors."""
    graph = getattr(root, "graph", None)
    if not isinstance(graph, fx.Graph):
        return
    for node in graph.nodes:
        if node.op != "get_attr":
            continue
        path, _, _ = str(node.target).rpartition(".")
        if path in styles:
            raise ConfigError(
                f"[Stage {stage}] the stage's code reads {node.target!r} itself, outside the "
                f"call of {path!r}, which tensor_parallel shards ({styles[path]}): there it "
                "would be this rank's shard meeting whole tensors. Leave that module out of "
                "tensor_parallel, or read the value through the module's call"
            )


def _check_ties(layout: TensorLayout, tie_groups: Sequence[Any]) -> None:
    for group in tie_groups:
        dims = {(name, stage): layout.sharded_dim(stage, name) for name, stage in group.members}
        if len(set(dims.values())) > 1:
            shown = ", ".join(
                f"{name} on stage {stage}: " + ("whole" if dim is None else f"sharded on dim {dim}")
                for (name, stage), dim in dims.items()
            )
            raise TieError(
                f"the tied weight {group.members[0][0]!r} would be sharded differently on its "
                f"stages ({shown}); the copies of a tie must be sharded alike (an embedding "
                "'rowwise' with an LM head 'colwise', both sharding the vocabulary), or all "
                "left out of tensor_parallel"
            )


def apply_layout(stage_id: int, stage: nn.Module, layout: TensorLayout, mesh: Any) -> None:
    """Shard this stage's matched modules over ``mesh`` (the tensor dimension), in place."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    styles = layout.styles.get(stage_id, {})
    if not styles:
        return
    if stage_id in layout.graph_stages:
        _shard_graph_stage(stage_id, _root(stage), layout, mesh)
        return
    kinds = layout.kinds[stage_id]
    plan: dict[str, Any] = {}
    for path, style in styles.items():
        if style == "colwise":
            keep = path in layout.local_outputs.get(stage_id, frozenset())
            plan[path] = ColwiseParallel(output_layouts=Shard(-1) if keep else Replicate())
        elif kinds[path] == "embedding" or path not in layout.local_inputs.get(stage_id, ()):
            plan[path] = RowwiseParallel(input_layouts=Replicate())
        else:
            plan[path] = RowwiseParallel()
    root = _root(stage)
    shared = _shared(root)
    parallelize_module(root, mesh, plan)
    for same in shared:  # sharded alike (``_check_shared``): one parameter again
        first = root.get_parameter(same[0])
        for other in same[1:]:
            path, _, leaf = other.rpartition(".")
            setattr(root.get_submodule(path), leaf, first)
    logger.debug("[Stage %d] tensor parallel: %s", stage_id, styles)


def _shard_graph_stage(stage_id: int, root: nn.Module, layout: TensorLayout, mesh: Any) -> None:
    """Shard the parameters an exported stage graph reads, and run its forward under
    :class:`_ShardedRegion` ([Note: tensor parallel in an exported graph])."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    shared = _shared(root)
    for name, param in sorted(root.named_parameters()):
        path, _, leaf = name.rpartition(".")
        if path not in layout.styles[stage_id]:
            continue
        dim = layout.sharded_dim(stage_id, name)
        placement = Replicate() if dim is None else Shard(dim)
        sharded = nn.Parameter(
            distribute_tensor(param.detach(), mesh, [placement]),
            requires_grad=param.requires_grad,
        )
        setattr(root.get_submodule(path), leaf, sharded)
    for same in shared:  # sharded alike (``_check_shared``): one parameter again
        first = root.get_parameter(same[0])
        for other in same[1:]:
            path, _, leaf = other.rpartition(".")
            setattr(root.get_submodule(path), leaf, first)
    original = root.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        with _ShardedRegion(mesh):
            out = original(*args, **kwargs)
        return pytree.tree_map(_whole, out)

    root.forward = forward
    # A recomputed region (an outlined graph run through a checkpoint) runs its forward again
    # in backward, outside the stage's forward: it enters the region itself there.
    for child in root.children():
        if isinstance(child, fx.GraphModule):
            child.forward = _in_region(child.forward, mesh)
    logger.debug("[Stage %d] tensor parallel in the graph: %s", stage_id, layout.styles[stage_id])


def _draws_op(func: Any) -> bool:
    """Whether the operation ``func`` (an ATen overload of an exported graph) draws random
    numbers."""
    packet = getattr(func, "overloadpacket", func)
    name = str(getattr(packet, "__name__", "")).rstrip("_")
    return name in _RANDOM_FUNCTIONS or name in _RANDOM_OPS


#: Random ATen operations beyond :data:`_RANDOM_FUNCTIONS` (in-place ones without their ``_``).
_RANDOM_OPS = frozenset(
    {"native_dropout", "uniform", "exponential", "geometric", "cauchy", "log_normal", "random"}
)


def _in_region(run: Any, mesh: Any) -> Any:
    """``run`` under :class:`_ShardedRegion` unless one is active already."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        stack = torch.overrides._get_current_function_mode_stack()  # type: ignore[no-untyped-call]
        if any(isinstance(mode, _ShardedRegion) for mode in stack):
            return run(*args, **kwargs)
        with _ShardedRegion(mesh):
            return run(*args, **kwargs)

    return forward


def _whole(value: Any) -> Any:
    """A sharded value leaving the stage, gathered whole (autograd keeps the shard's part)."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


class _ShardedRegion(TorchFunctionMode):
    """Runs a stage graph's operations on sharded parameters with ``DTensor``'s semantics.

    An operation none of whose arguments is a ``DTensor`` runs as it is. Otherwise every
    plain tensor argument joins it as a ``DTensor`` replicated over the tensor axis
    (``from_local``: its gradient is summed over the axis where the operation leaves it
    partial), the operation runs on global shapes (so a reshape that names the model's head
    count is right), and a result that is not sharded leaves as a plain tensor, summed over
    the axis first if it is partial. Attention runs on each rank's heads
    (:func:`_attention`); an operation that draws random numbers runs on whole values (so it
    draws what the unsharded stage draws)."""

    def __init__(self, mesh: Any) -> None:
        super().__init__()
        self.mesh = mesh

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        from torch.distributed.tensor import DTensor, Replicate

        kwargs = dict(kwargs or {})
        if not any(isinstance(t, DTensor) for t in pytree.tree_leaves((args, kwargs))):
            return func(*args, **kwargs)
        if func is torch.ops.aten.scaled_dot_product_attention.default:
            return _attention(self.mesh, *args, **kwargs)
        if _draws_op(func):  # on whole values: a shard's draw is not the whole draw's slice
            args, kwargs = pytree.tree_map(_whole, (tuple(args), kwargs))
            return func(*args, **kwargs)

        def join(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                return DTensor.from_local(value, self.mesh, [Replicate()], run_check=False)
            return value

        args, kwargs = pytree.tree_map(join, (tuple(args), kwargs))
        return pytree.tree_map(self._leave, func(*args, **kwargs))

    def _leave(self, value: Any) -> Any:
        from torch.distributed.tensor import DTensor, Replicate

        if isinstance(value, DTensor) and not any(p.is_shard() for p in value.placements):
            return value.redistribute(self.mesh, [Replicate()]).to_local()
        return value


def _attention(mesh: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
    """``scaled_dot_product_attention`` on sharded values: with the queries, keys and values
    sharded alike by heads (dim 1) and no dropout, each rank attends over its own heads (a
    mask with a head dimension cut alike) -- what DTensor's own rule does, which on the CPU
    propagates through the decomposition (minutes per call). Otherwise all three are gathered
    and attention runs whole on every rank."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    op = torch.ops.aten.scaled_dot_product_attention.default
    names = ("attn_mask", "dropout_p", "is_causal")
    options = {**dict(zip(names, args, strict=False)), **kwargs}
    mask = options.pop("attn_mask", None)
    heads = [Shard(1)]

    def laid(t: Any, placements: list[Any]) -> Any:
        if not isinstance(t, DTensor):
            t = DTensor.from_local(t, mesh, [Replicate()], run_check=False)
        return t.redistribute(mesh, placements).to_local()

    by_heads = all(
        isinstance(t, DTensor) and list(t.placements) == heads for t in (query, key, value)
    )
    if by_heads and not options.get("dropout_p"):
        if isinstance(mask, torch.Tensor):
            mask = laid(mask, heads if mask.dim() == 4 and mask.shape[1] > 1 else [Replicate()])
        out = op(query.to_local(), key.to_local(), value.to_local(), mask, **options)
        return DTensor.from_local(out, mesh, heads, run_check=False)
    whole = [laid(t, [Replicate()]) for t in (query, key, value)]
    if isinstance(mask, torch.Tensor):
        mask = laid(mask, [Replicate()])
    return op(*whole, mask, **options)


def retie_sharded(
    tie_groups: Sequence[Any], stages: Sequence[nn.Module], local: Sequence[int]
) -> None:
    """Make every member of a tie group this rank holds the first local member's sharded
    parameter again: sharding each stage replaced its copy, and the stages a rank does not
    run still hold the whole one (every rank holds the plan's stage modules)."""
    for group in tie_groups:
        mine = [(name, k) for name, k in group.members if k in local]
        if not mine:
            continue
        name, k = mine[0]
        param = _root(stages[k]).get_parameter(name)
        for other, stage in group.members:
            path, _, leaf = other.rpartition(".")
            owner = _root(stages[stage]).get_submodule(path)
            setattr(owner, leaf, param)


def reference_skeletons(stages: Mapping[int, nn.Module]) -> dict[int, nn.Module]:
    """Copies of this rank's stages before they are sharded, for the first batch's layout
    check, holding no tensor: every parameter and buffer is a placeholder on the meta device
    ([Note: the layout check's reference]). :func:`materialise_reference` fills one in from
    the sharded stage when its check comes."""
    out: dict[int, nn.Module] = {}
    for k, stage in stages.items():
        memo: dict[int, Any] = {}
        for param in stage.parameters():
            memo[id(param)] = nn.Parameter(param.to("meta"), param.requires_grad)
        for buffer in stage.buffers():
            memo.setdefault(id(buffer), buffer.to("meta"))
        out[k] = copy.deepcopy(stage, memo)
    return out


def materialise_reference(reference: nn.Module, stage: nn.Module) -> None:
    """Give ``reference`` (a skeleton of ``stage`` from :func:`reference_skeletons`) the whole
    values of the sharded ``stage``'s parameters (gathered from their shards: a collective
    per parameter that every rank holding the stage runs alike, in the same order) and copies
    of its buffers as they are now (the loop may have set one since the engine was built).
    A tensor tied at several paths stays one tensor."""
    from pipedialect.sdk import gathered

    live: dict[str, torch.Tensor] = {
        **dict(_root(stage).named_parameters(remove_duplicate=False)),
        **dict(_root(stage).named_buffers(remove_duplicate=False)),
    }
    made: dict[int, torch.Tensor] = {}
    root = _root(reference)
    names = [n for n, _ in root.named_parameters(remove_duplicate=False)]
    buffers = [n for n, _ in root.named_buffers(remove_duplicate=False)]
    for name in [*names, *buffers]:
        source = live[name]
        if id(source) not in made:
            with torch.no_grad():
                whole = gathered(source).detach().clone()
            made[id(source)] = nn.Parameter(whole, source.requires_grad) if name in names else whole
        path, _, leaf = name.rpartition(".")
        owner = root.get_submodule(path)
        if name in names:
            owner._parameters[leaf] = made[id(source)]  # type: ignore[assignment]
        else:
            owner._buffers[leaf] = made[id(source)]


def _tolerance(stage: nn.Module) -> float:
    """The relative difference (to the largest value) the sharded sums' other order may make:
    by the lowest precision among the stage's parameters (an fp64 value computed from fp32
    weights carries fp32 rounding; fp32 allows for a bf16 autocast region in the stage's code).
    What the check looks for is wrong by tens of percent: a misplaced head, a partial sum."""
    dtypes = {p.dtype for p in stage.parameters() if p.is_floating_point()}
    if dtypes & {torch.bfloat16, torch.float16}:
        return 5e-2
    if dtypes and dtypes <= {torch.float64}:
        return 1e-9
    return 1e-2


def _differs(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> str | None:
    from pipedialect.sdk import gathered

    got = gathered(got).detach()
    want = want.detach()
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} instead of {tuple(want.shape)}"
    if not got.is_floating_point():
        return None if torch.equal(got, want) else "different values"
    scale = float(want.double().abs().max()) if want.numel() else 0.0
    gap = float((got.double() - want.double()).abs().max()) if want.numel() else 0.0
    if gap > tolerance * max(scale, 1e-6):
        return f"max difference {gap:.3g} (largest value {scale:.3g})"
    return None


def _leaves(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def check_stage(
    stage_id: int,
    run: Any,
    run_reference: Any,
    reference: nn.Module,
    stage: nn.Module,
    args: Sequence[Any],
    *,
    gradients: bool,
) -> None:
    """Run the unsharded ``reference`` (through ``run_reference(args)``), then ``stage``
    (through ``run(args)``) on ``args``; raise at the first output or gradient that differs
    ([Note: tensor parallel on torch]). The reference runs first, forward and backward, and
    gives its whole values back (:func:`release_reference`) before the sharded stage runs, so
    the two never hold memory at once ([Note: the layout check's reference]).

    Raises:
        PlanMismatchError: the sharded stage computes something else than the unsharded one.
    """
    from pipedialect.sdk import preserved_state

    def fresh() -> list[Any]:
        return [
            t.detach().clone().requires_grad_(t.requires_grad and gradients)
            if isinstance(t, torch.Tensor)
            else copy.deepcopy(t)
            for t in args
        ]

    ref_args, got_args = fresh(), fresh()
    # The reference runs in the stage's modes (evaluation first, say), module by module.
    modes = {n: m.training for n, m in stage.named_modules()}
    for name, module in reference.named_modules():
        module.training = modes.get(name, module.training)
    tol = _tolerance(reference)
    grad_mode = torch.enable_grad() if gradients else torch.no_grad()
    # The reference is thrown away after the check: only the stage's state is put back.
    with preserved_state([stage]), grad_mode, _one_stream(stage, reference):
        state = torch.random.get_rng_state()
        with _raw_outputs(reference) as ref_raw:
            ref_out = _leaves(run_reference(ref_args))
        # The values the stage computed, before the wire encodes them (a float that needs no
        # gradient crosses bit-cast to an integer dtype, which rounding would make "differ").
        ref_values = [t.detach() for t in (_leaves(ref_raw) if ref_raw else ref_out)]
        cotangents = _cotangents(stage_id, ref_out) if gradients else {}
        if cotangents:
            torch.autograd.backward(
                [w for i, w in enumerate(ref_out) if i in cotangents],
                [c.to(ref_out[i].dtype) for i, c in cotangents.items()],
            )
        ref_grads = {
            name: p.grad for name, p in _root(reference).named_parameters() if p.grad is not None
        }
        ref_in_grads = [t.grad if isinstance(t, torch.Tensor) else None for t in ref_args]
        del ref_out, ref_raw
        release_reference(reference)
        torch.random.set_rng_state(state)
        with _raw_outputs(stage) as got_raw:
            try:
                got_out = _leaves(run(got_args))
            except PlanMismatchError:
                raise
            except Exception as exc:  # the unsharded reference ran: the sharding broke it
                _mismatch(stage_id, "its forward", f"it raised {type(exc).__name__}: {exc}")
        torch.random.set_rng_state(state)
        got_values = _leaves(got_raw) if got_raw else got_out
        if len(ref_values) != len(got_values):
            _mismatch(
                stage_id, "its output", f"{len(got_values)} tensors instead of {len(ref_values)}"
            )
        for i, (got, want) in enumerate(zip(got_values, ref_values, strict=True)):
            problem = _differs(got, want, tol)
            if problem:
                _mismatch(stage_id, f"output tensor {i}", problem)
        if not gradients:
            return
        if cotangents:
            try:
                torch.autograd.backward(
                    [g for i, g in enumerate(got_out) if i in cotangents],
                    [c.to(got_out[i].dtype) for i, c in cotangents.items()],
                )
            except Exception as exc:  # as above, for the backward
                _mismatch(stage_id, "its backward", f"it raised {type(exc).__name__}: {exc}")
    try:
        for name, param in _root(stage).named_parameters():
            want_grad = ref_grads.get(name)
            got_grad = param.grad
            if want_grad is None or got_grad is None:
                if (want_grad is None) != (got_grad is None):
                    _mismatch(stage_id, f"the gradient of {name!r}", "present on one side only")
                continue
            problem = _differs(got_grad, want_grad, tol)
            if problem:
                _mismatch(stage_id, f"the gradient of {name!r}", problem)
        for i, (got, want_in) in enumerate(zip(got_args, ref_in_grads, strict=True)):
            if want_in is not None:
                problem = _differs(got.grad, want_in, tol)
                if problem:
                    _mismatch(stage_id, f"the gradient of input {i}", problem)
    finally:
        for param in _root(stage).parameters():
            param.grad = None


def _cotangents(stage_id: int, outputs: Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
    """A fixed random cotangent (float64, by the stage's seed) for each output that carries a
    gradient, by position: both runs' backwards start from the same ones."""
    gen = torch.Generator().manual_seed(1234 + stage_id)
    return {
        i: torch.randn(w.shape, generator=gen, dtype=torch.float64)
        for i, w in enumerate(outputs)
        if w.is_floating_point() and w.requires_grad
    }


def release_reference(reference: nn.Module) -> None:
    """Put placeholders on the meta device back in place of ``reference``'s parameters and
    buffers, so that its whole values are freed now (the stage's check keeps only what it
    compares with)."""
    root = _root(reference)
    for module in root.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                module._parameters[name] = nn.Parameter(param.to("meta"), param.requires_grad)
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = buffer.to("meta")


@contextlib.contextmanager
def _raw_outputs(stage: nn.Module) -> Iterator[list[Any]]:
    """Record what a stage wrapper hands its encoder (its output, before the wire)."""
    seen: list[Any] = []
    if not isinstance(stage, StageWrapper):
        yield seen
        return
    original = stage.send

    def send(received: Sequence[Any], out: Any) -> tuple[torch.Tensor, ...]:
        seen.append(out)
        return original(received, out)

    stage.send = send  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        del stage.send


def _mismatch(stage_id: int, what: str, problem: str) -> NoReturn:
    raise PlanMismatchError(
        f"[Stage {stage_id}] under tensor_parallel, {what} differs from the unsharded stage's "
        f"on the first micro-batch: {problem}. The code between a colwise and a rowwise module "
        "runs on this rank's shard: reshape with the local head count (view(B, S, -1, "
        "head_dim), never the model's number of heads), do not contract over the sharded "
        "features (single-head attention), do not combine a shard with a whole tensor of the "
        "model, and keep dropout outside; or leave those modules out of tensor_parallel",
        stage=stage_id,
    )
