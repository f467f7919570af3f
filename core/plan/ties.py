"""Tied parameters: which parameters stages share and which ranks must keep them equal.

A tie group is the set of ``(parameter name, stage id)`` pairs that name one ``nn.Parameter``
object, for example a GPT's token embedding on stage 0 and its LM head on the last stage. In one
process the shared object is the tie; across processes each rank holds a copy, and the runtime
keeps the copies equal (same start, gradients summed every step). :func:`find_tie_groups`
finds the groups in one pass over the parameters; :func:`analyze_tie_ranks` maps them onto the
global ranks of a process topology, as Slapo's function of the same name does, but pairing
ranks by their coordinates rather than by sorting.

[Note: re-tying stages in one process]
Anything that gives each stage module its own tensors gives each holder of a tied weight its own
``Parameter``: ``to_empty()`` on stages of a model built on the meta device, ``copy.deepcopy``
of one stage, ``load_state_dict(assign=True)``. In one process that silently unties the weight
(two gradients, two optimizer states, two values drifting apart). The plan records which names
are one parameter in the model, so every dialect calls :func:`retie_parameters` on the stages a
process runs before building its engine: every member of a group there is rebound to one
object, the copy of the group's lowest stage (ignoring copies still on the meta device). That
is the copy the distributed dialects broadcast to the other ranks, so every dialect starts from
the same value. Copies that cannot be one parameter (shape, dtype, device or ``requires_grad``
differ) raise :class:`~pipedialect.TieError` naming both.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from ..contracts import TieAnalyzer, TieGroup, TieRanks, Topology
from ..errors import TieError, TopologyError
from ..runtime.stage import stage_root
from ..runtime.topology import check_topology_object

__all__ = [
    "DefaultTieAnalyzer",
    "analyze_tie_ranks",
    "check_tie_objects",
    "check_tied_unwritten",
    "find_tie_groups",
    "retie_parameters",
    "tie_keys",
    "written_in_forward",
]

logger = logging.getLogger(__name__)


def _key_part(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def find_tie_groups(stages: Sequence[nn.Module]) -> tuple[TieGroup, ...]:
    """Return the parameters shared between stages (index = stage id), in a deterministic order.

    One pass over every stage's parameters, grouped by object identity. ``named_parameters()``
    hides repeats, so ``remove_duplicate=False`` is used: a parameter held twice within one
    stage is listed under both names, so that a runtime can see and refuse what it cannot
    honour. Only groups spanning at least two stages are returned; a tie inside a single stage
    needs nothing (the stage holds one object). Names are relative to the stage's GraphModule,
    that is the original model's names (a :class:`~pipedialect.StageWrapper` is looked through).
    """
    held: dict[int, list[tuple[str, int]]] = {}
    keep: dict[int, nn.Parameter] = {}
    for stage_id, stage in enumerate(stages):
        for name, param in stage_root(stage).named_parameters(remove_duplicate=False):
            held.setdefault(id(param), []).append((name, stage_id))
            keep[id(param)] = param
    spans = [
        tuple(sorted(set(members), key=lambda m: (m[1], m[0])))
        for members in held.values()
        if len({stage for _, stage in members}) > 1
    ]
    spans.sort(key=lambda members: (members[0][1], members[0][0]))
    groups = tuple(
        TieGroup(key=f"tie{i}_{_key_part(members[0][0])}", members=members)
        for i, members in enumerate(spans)
    )
    for group in groups:
        logger.debug("tie group %s", group)
    return groups


def _axis_values(coord: Any) -> dict[str, int]:
    """Return a coordinate's ``{axis: value}`` (DeepSpeed's ProcessCoord is a named tuple)."""
    as_dict = getattr(coord, "_asdict", None)
    if callable(as_dict):
        return {str(k): int(v) for k, v in as_dict().items()}
    fields = getattr(coord, "_fields", None)
    if fields is not None:
        return {str(f): int(getattr(coord, f)) for f in fields}
    known = ("pipe", "data", "model", "tensor", "sequence", "expert")
    values = {axis: int(getattr(coord, axis)) for axis in known if hasattr(coord, axis)}
    if "pipe" not in values:
        raise TopologyError(f"topology coordinate {coord!r} has no 'pipe' field")
    return values


def analyze_tie_ranks(
    tie_weight_groups: Iterable[Iterable[tuple[str, int]]], topology: Topology
) -> TieRanks:
    """Map tie groups to the global ranks that must keep each tied parameter equal.

    For each group, the ranks holding its stages are paired by their coordinates on every axis
    but ``pipe`` (same data-parallel replica, same tensor-parallel shard, ...). Returns
    ``(tie_ranks, tie_stages)``: ``tie_ranks[g]`` is a list of rank lists, one per such
    coordinate, each in stage order; ``tie_stages[g]`` is the sorted stage ids of group ``g``,
    so ``tie_stages[g][j]`` is the stage of rank ``tie_ranks[g][c][j]``. With pipe as the
    outermost axis this equals Slapo's result (PP=4 x TP=2, ties 0/3 and 1/2:
    ``[[0, 6], [1, 7]]`` and ``[[2, 4], [3, 5]]``).

    Raises:
        TopologyError: the topology lacks one of the calls above, a member's stage is outside
            the topology's pipe axis, or the stages hold different sets of coordinates.
    """
    num_pipe = check_topology_object(topology)
    tie_ranks: list[list[list[int]]] = []
    tie_stages: list[list[int]] = []
    for group in tie_weight_groups:
        members = list(group)
        stages = sorted({int(stage) for _, stage in members})
        for name, stage in members:
            if not 0 <= int(stage) < num_pipe:
                raise TopologyError(
                    f"tied parameter {name!r} is on stage {stage}, outside the topology's pipe "
                    f"axis of size {num_pipe}; the topology must have one pipe coordinate per stage"
                )
        by_stage: list[dict[tuple[tuple[str, int], ...], int]] = []
        for stage in stages:
            table: dict[tuple[tuple[str, int], ...], int] = {}
            for rank in topology.filter_match(pipe=stage):
                axes = _axis_values(topology.get_coord(rank))
                axes.pop("pipe", None)
                table[tuple(sorted(axes.items()))] = rank
            by_stage.append(table)
        first = by_stage[0]
        for stage, table in zip(stages[1:], by_stage[1:], strict=True):
            if table.keys() != first.keys():
                raise TopologyError(
                    f"stages {stages[0]} and {stage} of tie group {members} are held by "
                    "different sets of data/model coordinates; cannot pair their ranks"
                )
        order = sorted(first, key=first.__getitem__)
        tie_ranks.append([[table[coord] for table in by_stage] for coord in order])
        tie_stages.append(stages)
    return TieRanks(tie_ranks, tie_stages)


class DefaultTieAnalyzer(TieAnalyzer):
    """Ties by parameter identity (:func:`find_tie_groups`), ranks by topology coordinates."""

    def find_groups(self, stages: Sequence[nn.Module]) -> tuple[TieGroup, ...]:
        """Return :func:`find_tie_groups` of ``stages``."""
        return find_tie_groups(stages)

    def analyze_ranks(self, groups: Sequence[TieGroup], topology: Topology) -> TieRanks:
        """Return :func:`analyze_tie_ranks` of ``groups`` on ``topology``."""
        return analyze_tie_ranks(groups, topology)


def check_tie_objects(
    groups: Iterable[TieGroup], stages: Sequence[nn.Module], *, where: str = ""
) -> None:
    """Raise :class:`TieError` unless each group's names resolve to one Parameter object.

    For runtimes that hold every stage in one process: stages built separately (not from one
    plan) may hold different copies of what the plan ties, which would silently untie them.
    """
    for group in groups:
        objects: dict[int, str] = {}
        for name, stage in group:
            if not 0 <= stage < len(stages):
                raise TieError(
                    f"{where}tie group {group.key} names stage {stage}, but there are "
                    f"{len(stages)} stage modules"
                )
            try:
                param = stage_root(stages[stage]).get_parameter(name)
            except AttributeError:
                raise TieError(
                    f"{where}[Stage {stage}] has no parameter {name!r} of tie group "
                    f"{group.key}; the stage modules do not match the plan"
                ) from None
            objects.setdefault(id(param), f"{name}@{stage}")
        if len(objects) > 1:
            raise TieError(
                f"{where}tie group {group.key} ({', '.join(f'{n}@{s}' for n, s in group)}) "
                f"is held as {len(objects)} different Parameter objects "
                f"({', '.join(objects.values())}); build the stage modules from one model "
                "(dialect.wrap_stages(plan)) so that tied parameters stay one object"
            )


@dataclass(frozen=True)
class _Slot:
    """Where one member of a tie group lives: ``getattr(module, attr)`` is its parameter."""

    name: str
    stage: int
    module: nn.Module
    attr: str
    param: nn.Parameter

    @property
    def label(self) -> str:
        return f"{self.name}@{self.stage}"


def _slot(stages: Sequence[nn.Module], name: str, stage: int, key: str) -> _Slot:
    if not 0 <= stage < len(stages):
        raise TieError(
            f"tie group {key} names stage {stage}, but there are {len(stages)} stage modules"
        )
    root = stage_root(stages[stage])
    prefix, _, attr = name.rpartition(".")
    try:
        module = root.get_submodule(prefix) if prefix else root
    except AttributeError:
        module = None
    param = None if module is None else module._parameters.get(attr)
    if module is None or not isinstance(param, nn.Parameter):
        raise TieError(
            f"[Stage {stage}] has no parameter {name!r} of tie group {key}; the stage modules "
            "do not match the plan (build them with dialect.wrap_stages(plan))"
        )
    return _Slot(name, stage, module, attr, param)


def _mismatch(keep: _Slot, other: _Slot) -> str | None:
    """Why ``other``'s parameter cannot become ``keep``'s, or None if it can."""
    a, b = keep.param, other.param
    if a.shape != b.shape:
        return f"shape {tuple(b.shape)} instead of {tuple(a.shape)}"
    if a.dtype != b.dtype:
        return f"dtype {b.dtype} instead of {a.dtype}"
    if b.device.type != "meta" and a.device != b.device:
        return f"device {b.device} instead of {a.device}"
    if a.requires_grad != b.requires_grad:
        return f"requires_grad={b.requires_grad} instead of {a.requires_grad}"
    return None


def retie_parameters(groups: Iterable[TieGroup], stages: Sequence[nn.Module]) -> int:
    """Make the members of each tie group one Parameter object across ``stages``.

    See [Note: re-tying stages in one process]: a member whose parameter is another object
    than the group's canonical copy (its lowest stage's, skipping copies on the meta device)
    is rebound to that copy; return how many were. A multi-process dialect passes every stage
    module it was given, as every rank is: the ranks then all do (and fail) alike, and the
    stages a rank does not run are only rebound, never run.

    Raises:
        TieError: a member names no parameter of its stage, or two copies differ in shape,
            dtype, device or ``requires_grad`` (they could not be one parameter).
    """
    rebound = 0
    for group in groups:
        slots = [_slot(stages, name, stage, group.key) for name, stage in group]
        if len({id(slot.param) for slot in slots}) <= 1:
            continue
        keep = next((s for s in slots if s.param.device.type != "meta"), slots[0])
        changed: list[str] = []
        differed: list[str] = []
        for slot in slots:
            if slot.param is keep.param:
                continue
            why = _mismatch(keep, slot)
            if why is not None:
                raise TieError(
                    f"[Stage {slot.stage}] tied parameter {slot.name!r} (tie group {group.key}) "
                    f"has {why} of {keep.label}; in the model they are one parameter, so their "
                    "copies must agree. Materialise and convert every stage the same way."
                )
            if slot.param.device.type != "meta" and keep.param.device.type != "meta":
                with torch.no_grad():
                    if not torch.equal(slot.param, keep.param):
                        differed.append(slot.label)
            setattr(slot.module, slot.attr, keep.param)
            changed.append(slot.label)
        rebound += len(changed)
        logger.info(
            "tie group %s: %s rebound to the parameter of %s%s",
            group.key,
            ", ".join(changed),
            keep.label,
            f" (whose values replace those of {', '.join(differed)})" if differed else "",
        )
    return rebound


def tie_keys(groups: Iterable[TieGroup], stages: Iterable[tuple[int, nn.Module]]) -> dict[int, str]:
    """``id(parameter) -> group key`` for the members of ``groups`` that ``stages`` hold.

    ``stages`` are ``(stage id, module)`` pairs, each module named as the unsplit model (a
    stage wrapper's ``mod``); what an engine reports in
    :attr:`pipedialect.contracts.EngineState.tie_keys`.
    """
    held = dict(stages)
    keys: dict[int, str] = {}
    for group in groups:
        for name, stage_id in group.members:
            module = held.get(stage_id)
            if module is None:
                continue
            try:
                keys[id(module.get_parameter(name))] = str(group.key)
            except AttributeError:
                continue
    return keys


#: Tensor methods and torch functions that return a view of (or the same tensor as) their
#: first argument: an in-place operation on the result writes the parameter.
_ALIASING = frozenset(
    {
        "view",
        "view_as",
        "reshape",
        "flatten",
        "unflatten",
        "squeeze",
        "unsqueeze",
        "t",
        "transpose",
        "permute",
        "expand",
        "expand_as",
        "narrow",
        "select",
        "detach",
        "data",
        "__getitem__",
        "as_strided",
        "unbind",
        "split",
        "chunk",
        "movedim",
        "diagonal",
        "T",
        "contiguous",
        "to",
        "type_as",
        "float",
    }
)


def _target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    return str(getattr(target, "__name__", target)).split(".")[0]


def _writes_first_argument(node: fx.Node) -> bool:
    """Whether the node is an in-place operation on its first argument."""
    schema = getattr(node.target, "_schema", None)
    if schema is not None:  # an aten operator (the export path): its schema says so
        first = schema.arguments[0] if schema.arguments else None
        return bool(
            first is not None and first.alias_info is not None and first.alias_info.is_write
        )
    name = _target_name(node.target)
    return name.endswith("_") and not name.endswith("__")


def written_in_forward(stage: nn.Module) -> set[str]:
    """The parameters (by name) a stage's graph writes in place: an in-place operation on the
    parameter or a view of it, ``torch.embedding_renorm_``, an ``nn.Embedding`` with
    ``max_norm`` called as a module."""
    root = stage_root(stage)
    graph = getattr(root, "graph", None)
    if not isinstance(graph, fx.Graph):
        return set()
    params = {n for n, _ in root.named_parameters(remove_duplicate=False)}
    origin: dict[fx.Node, str] = {}
    written: set[str] = set()
    for node in graph.nodes:
        if node.op == "get_attr" and node.target in params:
            origin[node] = str(node.target)
            continue
        if node.op == "call_module":
            module = root.get_submodule(str(node.target))
            if isinstance(module, nn.Embedding) and module.max_norm is not None:
                written.add(f"{node.target}.weight")
            continue
        if node.op not in ("call_method", "call_function") or not node.args:
            continue
        first = node.args[0]
        source = origin.get(first) if isinstance(first, fx.Node) else None
        name = _target_name(node.target)
        if name == "embedding" and node.kwargs.get("max_norm") is not None:
            weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
            if isinstance(weight, fx.Node) and weight in origin:
                written.add(origin[weight])
        if source is None:
            continue
        if _writes_first_argument(node):
            written.add(source)
            origin[node] = source
        elif name in _ALIASING:
            origin[node] = source
    return written


def check_tied_unwritten(stages: Sequence[nn.Module], groups: Sequence[TieGroup]) -> None:
    """Refuse a plan whose forward writes in place a parameter that several stages share
    (``pipedialect.runtime.stage`` [Note: tied parameters written in forward]); every rank
    computes the same answer from the same plan, before anything runs.

    Raises:
        TieError: naming the parameter, the stage that writes it and what to do.
    """
    tied = {(name, stage) for g in groups if len(g.stages) > 1 for name, stage in g.members}
    for k, stage in enumerate(stages):
        for name in sorted(written_in_forward(stage)):
            if (name, k) in tied:
                raise TieError(
                    f"[Stage {k}] forward writes the tied parameter {name!r} in place "
                    "(nn.Embedding(max_norm=...) renormalising it, or running state kept in an "
                    "nn.Parameter); the stages sharing it would each keep their own copy and "
                    "drift apart. Untie it (give the other stage its own parameter), keep "
                    "running state in a buffer (register_buffer), renormalise outside forward "
                    "(with torch.no_grad() between steps), or choose split points that keep "
                    "every user of the parameter on one stage"
                )
