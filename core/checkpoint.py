"""Portable checkpoints: save on one dialect and pipeline layout, resume on any other.

[Note: portable checkpoints]
A dialect's own ``save_checkpoint`` writes what its runtime holds (DeepSpeed's layer files, one
file per rank on torch), so it only loads into the same plan, world size and dialect.
:func:`save` writes instead what the *model* holds, keyed by the unsplit model's parameter names
(FQNs: stage modules keep them, see :mod:`pipedialect.plan.partition`), with
``torch.distributed.checkpoint`` (DCP): every rank writes the tensors of its own stages, DCP
writes one copy of a key several ranks hold (data-parallel replicas, the copies of a tied
weight), and :func:`load` reads, on every rank, just the keys its stages need, whatever layout
wrote them. What one checkpoint directory holds:

- DCP's files (``.metadata`` and ``__<rank>_0.distcp``) with the keys ``model.<name>`` (each
  parameter once, under its canonical name; each persistent buffer) and
  ``optim.<name>.<state>`` (the optimizer's per-parameter state, e.g. Adam's ``exp_avg``,
  ``exp_avg_sq`` and ``step``, under the parameter's canonical name);
- ``pipedialect_index.pt`` (rank 0): the format, every FQN and the key it is stored under (a
  tied weight's names all point to one key), each key's shape and dtype, the buffers, the
  optimizer's parameter groups (hyper-parameters, and which group each parameter is in), the
  layout that saved it and the step counters;
- ``state_rank<r>.pt`` (every rank): its step counters, LR scheduler state and data-loader
  position; ``rng_rank<r>.pt``: its random number generators;
- ``MANIFEST.json``: size and sha256 of every file above.

The canonical name of a parameter is the name it has on the lowest stage holding it (the
alphabetically first there): for a GPT's tied embedding and LM head, ``wte.weight``. Loading
never recomputes it: each name the model has is looked up in the index, so a checkpoint loads
into any plan of the same model.

Saving and publishing are those of the dialects' own checkpoints
(:mod:`pipedialect.engine.checkpoint_files` [Note: crash-safe checkpoints]): files go to
``.<tag>.partial``, which is renamed to ``<tag>`` once every rank finished, ``latest`` only names
a published checkpoint, and every file is checked against the manifest before anything is read.

What an engine holds -- its stage modules and their stage ids, the optimizer, the LR scheduler,
the step counters and the tie groups -- comes from the dialect that built it, through its
``engine_state`` hook (``pipedialect.dialect`` [Note: features through the contract]); an engine
whose dialect does not declare ``portable-checkpoints`` is refused by name.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from .contracts import Capability
from .dialect import require_capability
from .engine import checkpoint_files as _files
from .errors import CheckpointError, ConfigError
from .plan.partition import MODEL_NAMES
from .runtime.agreement import agree_on_error, agreed, is_connection_error
from .runtime.sharded import is_sharded

__all__ = [
    "FORMAT",
    "INDEX_FILE",
    "consolidate",
    "consolidate_optimizer",
    "export_hf",
    "load",
    "read_index",
    "save",
]

logger = logging.getLogger(__name__)

#: The format tag recorded in the index; a different one is refused on load.
FORMAT = "pipedialect-portable/1"
#: The file (written by rank 0) that lists every name, key, shape and parameter group.
INDEX_FILE = "pipedialect_index.pt"
_LATEST = _files.LATEST_FILE
_MODEL = "model."
_OPTIM = "optim."
#: At most this many names are listed in a mismatch error.
_SHOW = 5


def _rank_file(rank: int) -> str:
    return f"state_rank{rank}.pt"


# -- what an engine holds -------------------------------------------------------------------


@dataclass
class _Holdings:
    """What one engine trains in this process: its dialect's ``engine_state``, checked."""

    #: The name of the dialect that built the engine.
    kind: str
    #: ``(stage id, module whose parameter names are the model's)`` for each local stage.
    stages: list[tuple[int, nn.Module]]
    #: ``id(parameter) -> tie group key`` for the parameters of cross-stage tie groups.
    ties: dict[int, str]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    #: The number of stages of the whole pipeline.
    num_stages: int
    #: Buffer name -> the stage that writes it: its value is taken from that stage only.
    buffer_owners: dict[str, int] = field(default_factory=dict)
    #: The engine's step counters, live (:attr:`~pipedialect.contracts.EngineState.counters`).
    counters: MutableMapping[str, int] = field(default_factory=dict)
    gradient_accumulation_steps: int = 1
    train_batch_size: int = 0


def _holdings(engine: Any) -> _Holdings:
    """What ``engine`` trains, from its dialect's ``engine_state`` hook.

    Raises:
        ConfigError: no dialect built ``engine``, or its optimizer is not a plain
            ``torch.optim.Optimizer`` over the stages' parameters.
        MissingCapabilityError: the engine's dialect does not declare portable-checkpoints.
    """
    what = "pipedialect.checkpoint"
    dialect = require_capability(engine, Capability.PORTABLE_CHECKPOINTS, what)
    state = dialect.engine_state(engine)
    kind = dialect.name
    stages = [(int(held.stage_id), held.module) for held in state.stages]
    optimizer = state.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"the {kind} engine's optimizer is {type(optimizer).__name__}, not a "
            "torch.optim.Optimizer: portable checkpoints save a plain fp32 optimizer's "
            "per-parameter state (no ZeRO, no fp16/bf16 optimizer wrapper); use the dialect's "
            "own save_checkpoint for this run"
        )
    params = {id(p) for _, m in stages for p in m.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in params:
                raise ConfigError(
                    f"the {kind} engine's optimizer steps a tensor of shape {tuple(p.shape)} that "
                    "no local stage holds (an optimizer over copies of the parameters, as ZeRO "
                    "or a mixed-precision wrapper keeps): portable checkpoints cannot name its "
                    "state; use the dialect's own save_checkpoint"
                )
    return _Holdings(
        kind=kind,
        stages=sorted(stages, key=lambda s: s[0]),
        ties=dict(state.tie_keys),
        optimizer=optimizer,
        scheduler=state.lr_scheduler,
        num_stages=int(state.num_stages),
        buffer_owners=dict(state.buffer_owners),
        counters=state.counters,
        gradient_accumulation_steps=int(state.gradient_accumulation_steps),
        train_batch_size=int(state.train_batch_size),
    )


# -- the names of what is saved -------------------------------------------------------------


@dataclass
class _Param:
    """One parameter object of this rank, with every name it has on the local stages."""

    param: nn.Parameter
    #: ``(stage id, name)``, sorted.
    names: list[tuple[int, str]]
    tie: str | None
    #: ``name -> (stage id, position among that stage's parameters)``: the model's order.
    places: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass
class _Buffer:
    tensor: torch.Tensor
    stage: int
    name: str
    order: tuple[int, int]


@dataclass
class _Local:
    """This rank's parameters and persistent buffers, by object."""

    params: list[_Param] = field(default_factory=list)
    buffers: list[_Buffer] = field(default_factory=list)
    #: Stage name -> every name the model's ``state_dict`` has for that tensor, where it has
    #: several (:data:`pipedialect.plan.partition.MODEL_NAMES`).
    model_names: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def names(self) -> list[str]:
        """Every name a local parameter or buffer has."""
        return [n for p in self.params for _, n in p.names] + [b.name for b in self.buffers]

    def device(self) -> torch.device:
        """Where this rank's tensors live (what its collectives run on)."""
        return self.params[0].param.device if self.params else torch.device("cpu")


def _local(held: _Holdings) -> _Local:
    by_id: dict[int, _Param] = {}
    out = _Local()
    buffer_names: set[str] = set()
    for stage_id, module in held.stages:
        recorded = getattr(module, "meta", {}).get(MODEL_NAMES, {})
        out.model_names.update({str(n): tuple(all_) for n, all_ in recorded.items()})
        params = list(module.named_parameters(remove_duplicate=False))
        for position, (name, param) in enumerate(params):
            record = by_id.get(id(param))
            if record is None:
                record = _Param(param, [], held.ties.get(id(param)))
                by_id[id(param)] = record
                out.params.append(record)
            record.names.append((stage_id, name))
            record.places.setdefault(name, (stage_id, position))
        param_names = {n for n, _ in params}
        for position, (name, value) in enumerate(module.state_dict(keep_vars=True).items()):
            if name in param_names or name in buffer_names or not isinstance(value, torch.Tensor):
                continue
            if held.buffer_owners.get(name, stage_id) != stage_id:
                continue  # a written buffer's value is its owner's ([Note: module state])
            buffer_names.add(name)
            out.buffers.append(_Buffer(value, stage_id, name, (stage_id, len(params) + position)))
    for record in out.params:
        record.names.sort()
    return out


def _summary(local: _Local) -> dict[str, Any]:
    """What this rank tells the others about its parameters and buffers (picklable)."""
    return {
        "params": [
            {
                "names": list(p.names),
                "tie": p.tie,
                "shape": tuple(p.param.shape),
                "dtype": str(p.param.dtype),
                "places": dict(p.places),
            }
            for p in local.params
        ],
        "buffers": [
            {
                "name": b.name,
                "shape": tuple(b.tensor.shape),
                "dtype": str(b.tensor.dtype),
                "order": b.order,
            }
            for b in local.buffers
        ],
        "model_names": dict(local.model_names),
    }


def _canonical(summaries: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """``name -> stored key`` for every parameter name of every rank.

    Names are one parameter when one rank holds them as one object or when a tie group joins
    them; a union over names finds the parameters, and each is stored under the name it has on
    its lowest stage (alphabetically first there), the same on every rank.
    """
    parent: dict[str, str] = {}

    def find(name: str) -> str:
        while parent.setdefault(name, name) != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    def union(a: str, b: str) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    first_of_tie: dict[str, str] = {}
    where: dict[str, tuple[int, str]] = {}
    for summary in summaries:
        for record in summary["params"]:
            names = [(int(s), str(n)) for s, n in record["names"]]
            for stage, name in names:
                find(name)
                where[name] = min(where.get(name, (stage, name)), (stage, name))
                union(names[0][1], name)
            tie = record["tie"]
            if tie is not None:
                if tie in first_of_tie:
                    union(first_of_tie[tie], names[0][1])
                else:
                    first_of_tie[tie] = names[0][1]
    best: dict[str, tuple[int, str]] = {}
    for name, place in where.items():
        root = find(name)
        best[root] = min(best.get(root, place), place)
    return {name: best[find(name)][1] for name in where}


def _gather(value: Any) -> list[Any]:
    """``value`` from every rank (just this one without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Silence DCP's warning that it runs in one process: here that is asked for (no_dist)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
        yield


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


# -- the optimizer ---------------------------------------------------------------------------


def _hyper(group: Mapping[str, Any]) -> dict[str, Any]:
    """A parameter group's hyper-parameters (everything but ``params``), picklable as saved."""
    out: dict[str, Any] = {}
    for key, value in group.items():
        if key == "params":
            continue
        out[key] = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
    return out


def _same_hyper(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for key, value in a.items():
        other = b[key]
        if isinstance(value, torch.Tensor) or isinstance(other, torch.Tensor):
            if not torch.equal(torch.as_tensor(value), torch.as_tensor(other)):
                return False
        elif value != other:
            return False
    return True


def _optimizer_summary(held: _Holdings, local: _Local, keys: Mapping[int, str]) -> dict[str, Any]:
    """This rank's parameter groups and which stored key is in which (picklable)."""
    groups = []
    for group in held.optimizer.param_groups:
        groups.append(
            {"hyper": _hyper(group), "keys": sorted({keys[id(p)] for p in group["params"]})}
        )
    state: dict[str, dict[str, dict[str, Any]]] = {}
    for record in local.params:
        saved = held.optimizer.state.get(record.param, {})
        entries: dict[str, dict[str, Any]] = {}
        for name, value in saved.items():
            kind = _KINDS.get(type(value), "tensor" if isinstance(value, torch.Tensor) else None)
            if kind is None:
                raise ConfigError(
                    f"the optimizer's state {name!r} of parameter {record.names[0][1]!r} is a "
                    f"{type(value).__name__}; portable checkpoints save tensors and numbers only"
                )
            tensor = _state_tensor(value)
            entries[name] = {"kind": kind, "shape": tuple(tensor.shape), "dtype": str(tensor.dtype)}
        if entries:
            state[keys[id(record.param)]] = entries
    return {"groups": groups, "state": state}


def _optimizer_index(summaries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Every rank's parameter groups merged: distinct hyper-parameter sets, and each key's."""
    groups: list[dict[str, Any]] = []
    group_of: dict[str, int] = {}
    state: dict[str, dict[str, dict[str, Any]]] = {}
    for summary in summaries:
        for group in summary["groups"]:
            index = next(
                (i for i, g in enumerate(groups) if _same_hyper(g, group["hyper"])), len(groups)
            )
            if index == len(groups):
                groups.append(group["hyper"])
            for key in group["keys"]:
                group_of.setdefault(key, index)
        for key, kinds in summary["state"].items():
            state.setdefault(key, dict(kinds))
    return {"groups": groups, "group_of": group_of, "state": state}


#: How a number in an optimizer's state is saved (as a 0-d tensor) and given back.
_KINDS: dict[type, str] = {bool: "bool", int: "int", float: "float"}


def _from_state_tensor(value: torch.Tensor, kind: str) -> Any:
    if kind == "bool":
        return bool(value.item())
    if kind == "int":
        return int(value.item())
    if kind == "float":
        return float(value.item())
    return value


def _like(saved: Any, current: Any) -> Any:
    """A saved hyper-parameter in the type the current group holds it (a tuple, a tensor)."""
    if isinstance(current, torch.Tensor):
        return torch.as_tensor(saved, dtype=current.dtype, device=current.device).clone()
    if isinstance(current, tuple) and isinstance(saved, list | tuple):
        return tuple(saved)
    return saved


def _state_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach()
    return torch.tensor(value)


# -- save -----------------------------------------------------------------------------------


def save(
    engine: Any,
    path: str | Path,
    *,
    tag: str | None = None,
    dataloader: Any = None,
    save_latest: bool = True,
) -> Path:
    """Save ``engine``'s training state as ``path/tag``, loadable by any dialect and layout.

    Every rank calls it (a collective); without a process group (the local dialect) it runs in
    this process alone. ``tag`` defaults to ``global_step<N>``; ``latest`` is set to it once the
    checkpoint is complete (unless ``save_latest=False``). ``dataloader``: an object with
    ``state_dict()``, whose state each rank saves. See [Note: portable checkpoints] for what is
    saved. Returns the published directory.

    Raises:
        ConfigError: no dialect built the engine, or its optimizer is not a plain
            ``torch.optim.Optimizer`` over the stage parameters.
        MissingCapabilityError: the engine's dialect does not declare portable-checkpoints.
        CheckpointError: ``tag`` is not a valid tag.
    """
    held = _holdings(engine)
    with agreed(f"pipedialect.checkpoint.save to {path}"):
        return _save(held, path, tag=tag, dataloader=dataloader, save_latest=save_latest)


def _save(
    held: _Holdings, path: str | Path, *, tag: str | None, dataloader: Any, save_latest: bool
) -> Path:
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    local = _local(held)
    summaries = _gather(_summary(local))
    canonical = _canonical(summaries)
    keys = {id(p.param): canonical[p.names[0][1]] for p in local.params}
    optimizer = _gather(_optimizer_summary(held, local, keys))
    counters = _counters(held)
    tag = tag or f"global_step{counters.get('global_steps', 0)}"
    staged = _files.stage(path, tag)

    state: dict[str, torch.Tensor] = {}
    for record in local.params:
        key = keys[id(record.param)]
        state[_MODEL + key] = record.param.detach()
        for name, value in held.optimizer.state.get(record.param, {}).items():
            state[f"{_OPTIM}{key}.{name}"] = _state_tensor(value)
    for buffer in local.buffers:
        state[_MODEL + buffer.name] = buffer.tensor.detach()
    try:
        with _single_process_quiet():
            dcp_save(state, checkpoint_id=str(staged), no_dist=not _distributed())
    except (Exception, CheckpointException) as exc:
        raise _dcp_failure(exc, f"cannot be written to {staged}") from exc

    rank = _rank()
    if rank == 0:
        torch.save(_index(held, summaries, canonical, optimizer, counters), staged / INDEX_FILE)
    torch.save(
        {
            "counters": counters,
            "scheduler": _scheduler_state(held.scheduler),
            "dataloader": None if dataloader is None else dataloader.state_dict(),
            "stages": [s for s, _ in held.stages],
        },
        staged / _rank_file(rank),
    )
    _files.save_rng_state(staged)
    return _files.publish(path, tag, save_latest=save_latest)


def _counters(held: _Holdings) -> dict[str, int]:
    out = {name: int(value) for name, value in held.counters.items()}
    out["gradient_accumulation_steps"] = held.gradient_accumulation_steps
    out["train_batch_size"] = held.train_batch_size
    return out


def _scheduler_state(scheduler: Any) -> Any:
    if scheduler is None or not hasattr(scheduler, "state_dict"):
        return None
    return scheduler.state_dict()


def _index(
    held: _Holdings,
    summaries: Sequence[Mapping[str, Any]],
    canonical: Mapping[str, str],
    optimizer: Sequence[Mapping[str, Any]],
    counters: Mapping[str, int],
) -> dict[str, Any]:
    params: dict[str, dict[str, Any]] = {}
    buffers: dict[str, dict[str, Any]] = {}
    order: dict[str, tuple[int, int]] = {}
    for summary in summaries:
        for record in summary["params"]:
            key = canonical[record["names"][0][1]]
            params.setdefault(key, {"shape": tuple(record["shape"]), "dtype": record["dtype"]})
            for name, place in record["places"].items():
                order[name] = min(order.get(name, tuple(place)), tuple(place))
        for record in summary["buffers"]:
            buffers.setdefault(
                record["name"], {"shape": tuple(record["shape"]), "dtype": record["dtype"]}
            )
            order[record["name"]] = min(order.get(record["name"], record["order"]), record["order"])
    return {
        "format": FORMAT,
        "aliases": dict(sorted(canonical.items())),
        "params": params,
        "buffers": buffers,
        "other_names": _other_names(summaries, canonical, buffers),
        "order": sorted(order, key=lambda n: (order[n], n)),
        "optimizer": {"type": type(held.optimizer).__name__, **_optimizer_index(optimizer)},
        "counters": dict(counters),
        "layout": {
            "dialect": held.kind,
            "world_size": dist.get_world_size() if _distributed() else 1,
            "num_stages": held.num_stages,
        },
    }


def _other_names(
    summaries: Sequence[Mapping[str, Any]],
    canonical: Mapping[str, str],
    buffers: Mapping[str, Any],
) -> dict[str, str]:
    """``name -> stored key`` for the model's names of a saved tensor that no stage holds
    (T5's ``shared.weight``, which the stages hold as ``encoder.embed_tokens.weight``)."""
    held = set(canonical) | set(buffers)
    out: dict[str, str] = {}
    for summary in summaries:
        for name, names in summary.get("model_names", {}).items():
            key = canonical.get(name, name if name in buffers else None)
            if key is None:
                continue
            for other in names:
                if other not in held:
                    out.setdefault(other, key)
    return dict(sorted(out.items()))


# -- finding and reading a checkpoint -------------------------------------------------------


def _locate(path: str | Path, tag: str | None) -> Path:
    """The verified directory of the checkpoint ``path`` names (see :func:`load`)."""
    root = Path(path)
    if tag is None and not (root / _LATEST).is_file():
        # One checkpoint's directory (or one a save died publishing: its .old is complete).
        marked = (root / INDEX_FILE).is_file() or (root / _files.MANIFEST_FILE).is_file()
        if marked or (not root.exists() and (root.parent / f"{root.name}.old").is_dir()):
            return _files.resolve(root.parent, root.name, from_latest=False)
        raise CheckpointError(
            f"{root} holds no {_LATEST} file and is not a checkpoint directory; pass the "
            "directory given to pipedialect.checkpoint.save (with tag= if latest is gone) or "
            "one checkpoint's directory"
        )
    from_latest = tag is None
    if tag is None:
        tag = (root / _LATEST).read_text().strip()
    return _files.resolve(root, tag, from_latest=from_latest)


def read_index(path: str | Path, tag: str | None = None) -> dict[str, Any]:
    """The index of a verified portable checkpoint (names, keys, shapes, groups, counters).

    Raises:
        CheckpointError: the checkpoint is missing, incomplete or corrupted, or it is not a
            portable checkpoint.
    """
    return _read_index(_locate(path, tag))


def _read_index(directory: Path) -> dict[str, Any]:
    file = directory / INDEX_FILE
    if not file.is_file():
        raise CheckpointError(
            f"checkpoint {directory} has no {INDEX_FILE}: it is not a portable checkpoint (a "
            "dialect's own save_checkpoint wrote it?); load it with engine.load_checkpoint"
        )
    try:
        index: dict[str, Any] = torch.load(file, weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"checkpoint index {file} cannot be read ({exc})") from exc
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        found = index.get("format") if isinstance(index, dict) else type(index).__name__
        raise CheckpointError(
            f"checkpoint index {file} has format {found!r}, not {FORMAT!r}; it was written by "
            "another version of pipedialect"
        )
    return index


def _shaped_like(spec: Mapping[str, Any], param: torch.Tensor) -> dict[str, Any]:
    """``spec`` (a saved tensor's shape and dtype), to be read as ``param`` is laid out when
    ``param`` is sharded and of that shape: DCP then reads only this rank's slice
    (:mod:`pipedialect.runtime.sharded` [Note: sharded tensors])."""
    out = dict(spec)
    if is_sharded(param) and tuple(spec["shape"]) == tuple(param.shape):
        out["like"] = param
    return out


def _read_tensors(
    directory: Path, wanted: Mapping[str, Mapping[str, Any]], *, alone: bool = False
) -> dict[str, Any]:
    """Read the DCP keys ``wanted`` (``key -> {shape, dtype}``, and ``like``: a sharded tensor
    to read its slice of) into new tensors (on the CPU, or laid out as ``like``).

    Collective over the process group, if there is one, unless ``alone``.
    """
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    state = {
        key: torch.empty_like(spec["like"], dtype=_dtype(spec["dtype"]))
        if "like" in spec
        else torch.empty(tuple(spec["shape"]), dtype=_dtype(spec["dtype"]))
        for key, spec in wanted.items()
    }
    try:
        with _single_process_quiet():
            dcp_load(state, checkpoint_id=str(directory), no_dist=alone or not _distributed())
    except (Exception, CheckpointException) as exc:
        raise _dcp_failure(
            exc, f"{directory} cannot be read by torch.distributed.checkpoint", "; load another tag"
        ) from exc
    return state


def _dcp_failure(exc: BaseException, what: str, advice: str = "") -> Exception:
    """What a failure of ``torch.distributed.checkpoint`` is raised as.

    A lost peer is not the checkpoint's fault: it becomes a ``RuntimeError`` that the phase's
    agreement (:func:`~pipedialect.runtime.agreement.agreed`) names a lost connection on every
    rank, never a :class:`~pipedialect.CheckpointError` that would blame an intact checkpoint.
    DCP's own ``CheckpointException`` is a ``BaseException`` (it would slip past every
    ``except Exception``); anything else is a :class:`~pipedialect.CheckpointError`.
    """
    text = f"{type(exc).__name__}: {exc}"
    if is_connection_error(exc):
        return RuntimeError(f"torch.distributed.checkpoint lost a peer ({text})")
    return CheckpointError(f"checkpoint {what} ({text}){advice}")


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise CheckpointError(f"the checkpoint index names an unknown dtype {name!r}")
    return value


# -- load -----------------------------------------------------------------------------------


def load(
    engine: Any,
    path: str | Path,
    *,
    tag: str | None = None,
    dataloader: Any = None,
    load_optimizer_states: bool = True,
) -> Path:
    """Load a checkpoint :func:`save` wrote, from any dialect and layout, into ``engine``.

    ``path`` is the directory given to :func:`save` (then ``tag``, or the one ``latest`` names,
    is loaded) or one checkpoint's directory. Every rank calls it. Parameters, buffers, the
    optimizer's state and hyper-parameters, the LR scheduler, the step counters, the random
    number generators and, given ``dataloader`` (an object with ``load_state_dict``), its
    position are restored. Returns the directory loaded.

    The random number generators of rank ``r`` come from the saving run's rank ``r`` (a warning
    says so when the rank counts differ); the stages' dropout streams follow the restored step
    counter instead ([Note: random streams] in ``pipedialect.runtime.randomness``), so a run
    with dropout continues exactly with the same split points on any layout. A data loader's
    position comes from the same rank, or from rank 0 when the saving run had fewer ranks.

    Raises:
        CheckpointError: the checkpoint is missing, incomplete, corrupted or foreign; or the
            model's names or shapes differ from the checkpoint's (the message lists the first
            missing, unexpected and mismatched names); or ``dataloader`` is given and the
            checkpoint has no data-loader state.
        ConfigError: no dialect built the engine, or its optimizer is not a plain
            ``torch.optim.Optimizer`` over the stage parameters.
        MissingCapabilityError: the engine's dialect does not declare portable-checkpoints.
    """
    held = _holdings(engine)
    with agreed(f"pipedialect.checkpoint.load from {path}"):
        return _load(
            held,
            path,
            tag=tag,
            dataloader=dataloader,
            load_optimizer_states=load_optimizer_states,
        )


def _load(
    held: _Holdings,
    path: str | Path,
    *,
    tag: str | None,
    dataloader: Any,
    load_optimizer_states: bool,
) -> Path:
    local = _local(held)
    error: CheckpointError | None = None
    directory = Path(path)
    index: dict[str, Any] = {}
    try:
        directory = _locate(path, tag)
        index = _read_index(directory)
    except CheckpointError as exc:
        error = exc
    agree_on_error(error, device=local.device(), what="reading the checkpoint's index")
    everyone = _gather(local.names())
    plan: _LoadPlan | None = None
    extras: dict[str, Any] = {}
    try:
        plan = _load_plan(held, local, index, directory, everyone)
        extras = _read_extras(directory, dataloader is not None)
    except CheckpointError as exc:
        error = exc
    # every rank has checked everything before any collective read starts
    agree_on_error(error, device=local.device(), what="checking the checkpoint against the model")
    assert plan is not None
    loaded = _read_tensors(directory, plan.wanted)
    with torch.no_grad():
        for record in local.params:
            record.param.copy_(loaded[_MODEL + plan.keys[id(record.param)]])
        for buffer in local.buffers:
            buffer.tensor.copy_(loaded[_MODEL + buffer.name])
    if load_optimizer_states:
        _load_optimizer(held, index, plan, loaded)
    _restore_counters(held, extras["counters"])
    if held.scheduler is not None and extras["scheduler"] is not None:
        held.scheduler.load_state_dict(extras["scheduler"])
    if dataloader is not None:
        dataloader.load_state_dict(extras["dataloader"])
    saved_world = int(index["layout"]["world_size"])
    world = dist.get_world_size() if _distributed() else 1
    if saved_world != world:
        logger.warning(
            "checkpoint %s was saved by %d rank(s), this run has %d: rank %d restores the random "
            "number generators the saving rank %d had",
            directory,
            saved_world,
            world,
            _rank(),
            _rank(),
        )
    _files.load_rng_state(directory)
    return directory


@dataclass
class _LoadPlan:
    #: ``id(parameter) -> stored key``.
    keys: dict[int, str]
    #: The DCP keys this rank reads: ``key -> {shape, dtype}``.
    wanted: dict[str, dict[str, Any]]
    #: For each local parameter group, the saved hyper-parameters (None: none saved).
    hypers: list[dict[str, Any] | None]


def _load_plan(
    held: _Holdings,
    local: _Local,
    index: Mapping[str, Any],
    directory: Path,
    everyone: Sequence[Sequence[str]],
) -> _LoadPlan:
    """Map every local parameter to its stored key; refuse names or shapes that differ."""
    aliases: Mapping[str, str] = index["aliases"]
    params: Mapping[str, Mapping[str, Any]] = index["params"]
    buffers: Mapping[str, Mapping[str, Any]] = index["buffers"]
    missing: list[str] = []
    mismatched: list[str] = []
    split: list[str] = []
    keys: dict[int, str] = {}
    wanted: dict[str, dict[str, Any]] = {}
    for record in local.params:
        found = {aliases[n] for _, n in record.names if n in aliases}
        missing.extend(n for _, n in record.names if n not in aliases)
        if len(found) > 1:
            names = ", ".join(n for _, n in record.names)
            split.append(f"{names} (one parameter here, {len(found)} in the checkpoint)")
            continue
        if not found:
            continue
        key = found.pop()
        spec = params[key]
        if tuple(spec["shape"]) != tuple(record.param.shape):
            mismatched.append(
                f"{record.names[0][1]} (shape {tuple(spec['shape'])} in the checkpoint, "
                f"{tuple(record.param.shape)} here)"
            )
            continue
        keys[id(record.param)] = key
        wanted[_MODEL + key] = _shaped_like(spec, record.param)
    for buffer in local.buffers:
        saved = buffers.get(buffer.name)
        if saved is None:
            missing.append(buffer.name)
        elif tuple(saved["shape"]) != tuple(buffer.tensor.shape):
            mismatched.append(
                f"{buffer.name} (shape {tuple(saved['shape'])} in the checkpoint, "
                f"{tuple(buffer.tensor.shape)} here)"
            )
        else:
            wanted[_MODEL + buffer.name] = dict(saved)
    held_anywhere = {n for names in everyone for n in names}
    unexpected = sorted((set(aliases) | set(buffers)) - held_anywhere)
    if missing or unexpected or mismatched or split:
        parts = []
        for what, listed in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("mismatched", mismatched),
            ("tied differently", split),
        ):
            if listed:
                more = f" and {len(listed) - _SHOW} more" if len(listed) > _SHOW else ""
                parts.append(f"{what}: {', '.join(listed[:_SHOW])}{more}")
        culprits = missing or mismatched
        raise CheckpointError(
            f"checkpoint {directory} does not match this model ({'; '.join(parts)}); load a "
            "checkpoint of the same model (any plan, dialect or world size loads)",
            parameter=culprits[0].split(" ")[0] if culprits else None,
        )
    optim: Mapping[str, Any] = index["optimizer"]
    state: Mapping[str, Mapping[str, Mapping[str, Any]]] = optim["state"]
    for record in local.params:
        key = keys[id(record.param)]
        for name, spec in state.get(key, {}).items():
            entry = {"shape": spec["shape"], "dtype": spec["dtype"]}
            wanted[f"{_OPTIM}{key}.{name}"] = _shaped_like(entry, record.param)
    return _LoadPlan(keys, wanted, _group_hypers(held, optim, keys, directory))


def _group_hypers(
    held: _Holdings, optim: Mapping[str, Any], keys: Mapping[int, str], directory: Path
) -> list[dict[str, Any] | None]:
    """For each local parameter group, the saved hyper-parameters of its parameters' group.

    Raises:
        CheckpointError: a local group holds parameters saved in groups with different
            hyper-parameters.
    """
    saved: Sequence[Mapping[str, Any]] = optim["groups"]
    group_of: Mapping[str, int] = optim["group_of"]
    out: list[dict[str, Any] | None] = []
    for number, group in enumerate(held.optimizer.param_groups):
        found = sorted({group_of[keys[id(p)]] for p in group["params"] if keys[id(p)] in group_of})
        if not found:
            out.append(None)
            continue
        first = saved[found[0]]
        for other in found[1:]:
            if not _same_hyper(first, saved[other]):
                raise CheckpointError(
                    f"checkpoint {directory}: parameter group {number} of this optimizer holds "
                    f"parameters saved in groups with different hyper-parameters ({dict(first)} "
                    f"and {dict(saved[other])}); build the optimizer with the same parameter "
                    "groups (param_groups=) as the run that saved it"
                )
        out.append(dict(first))
    return out


def _read_extras(directory: Path, want_loader: bool) -> dict[str, Any]:
    """This rank's counters, scheduler and data-loader state (rank 0's where it saved none)."""
    own = directory / _rank_file(_rank())
    first = directory / _rank_file(0)
    try:
        base: dict[str, Any] = torch.load(first, weights_only=True)
        mine: dict[str, Any] = torch.load(own, weights_only=True) if own.is_file() else base
    except Exception as exc:
        raise CheckpointError(f"checkpoint {directory}: {own.name} cannot be read ({exc})") from exc
    if want_loader and mine.get("dataloader") is None:
        raise CheckpointError(
            f"checkpoint {directory} holds no data-loader state (it was saved without "
            "dataloader=); load it without dataloader= and position the data yourself"
        )
    return {
        "counters": base["counters"],
        "scheduler": base["scheduler"],
        "dataloader": mine.get("dataloader"),
    }


def _restore_counters(held: _Holdings, saved: Mapping[str, int]) -> None:
    """Set the engine's step counters; what the saving engine did not keep is derived."""
    steps = int(saved.get("global_steps", 0))
    gas = held.gradient_accumulation_steps
    batch = held.train_batch_size
    derived = {
        "global_steps": steps,
        "global_samples": int(saved.get("global_samples", steps * batch)),
        # Counted per micro-batch: the saved count holds only with the same accumulation.
        "micro_steps": int(saved["micro_steps"])
        if "micro_steps" in saved and saved.get("gradient_accumulation_steps") == gas
        else steps * gas,
        "skipped_steps": int(saved.get("skipped_steps", 0)),
    }
    for name in list(held.counters):
        if name in derived:
            held.counters[name] = derived[name]
        elif name in saved:  # a counter of the dialect's own
            held.counters[name] = int(saved[name])


def _load_optimizer(
    held: _Holdings, index: Mapping[str, Any], plan: _LoadPlan, loaded: Mapping[str, Any]
) -> None:
    """Give the optimizer the saved per-parameter state and hyper-parameters.

    Goes through ``optimizer.load_state_dict``, which puts each state tensor on its
    parameter's device and dtype as the optimizer wants it (Adam's ``step`` stays as saved).
    """
    optimizer = held.optimizer
    current = optimizer.state_dict()
    saved_state: Mapping[str, Mapping[str, Mapping[str, Any]]] = index["optimizer"]["state"]
    state: dict[int, dict[str, Any]] = {}
    number = 0
    groups: list[dict[str, Any]] = []
    for group, group_state, hyper in zip(
        optimizer.param_groups, current["param_groups"], plan.hypers, strict=True
    ):
        for p in group["params"]:
            key = plan.keys[id(p)]
            entries = saved_state.get(key, {})
            if entries:
                state[number] = {
                    name: _from_state_tensor(loaded[f"{_OPTIM}{key}.{name}"], spec["kind"])
                    for name, spec in entries.items()
                }
            number += 1
        merged = dict(group_state)
        for name, value in (hyper or {}).items():
            if name in merged and name != "params":
                merged[name] = _like(value, merged[name])
        groups.append(merged)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# -- consolidate and export ------------------------------------------------------------------


def consolidate(path: str | Path, tag: str | None = None) -> dict[str, torch.Tensor]:
    """The unsplit model's ``state_dict`` from a portable checkpoint (any layout saved it).

    Every name the model's own ``state_dict`` has is a key: each parameter name (a tied
    weight's names, and the other names of a parameter two modules hold, such as T5's
    ``shared.weight``, share one tensor) and each persistent buffer; non-persistent buffers
    are not, as in ``state_dict``. So ``model.load_state_dict(result, strict=True)`` loads it.
    The keys come stage by stage (each stage's parameters, then its buffers), which is the
    model's own order except for buffers registered before a module's parameters; names no
    stage holds come last. Runs in this process alone (no collective), with or without a
    process group.
    """
    directory = _locate(path, tag)
    index = _read_index(directory)
    specs = {_MODEL + k: v for k, v in index["params"].items()}
    specs.update({_MODEL + k: v for k, v in index["buffers"].items()})
    loaded = _read_tensors(directory, specs, alone=True)
    out: dict[str, torch.Tensor] = {}
    aliases: Mapping[str, str] = index["aliases"]
    for name in index["order"]:
        key = aliases.get(name, name)
        out[name] = loaded[_MODEL + key]
    for name, key in index.get("other_names", {}).items():
        out.setdefault(name, loaded[_MODEL + key])
    return out


def consolidate_optimizer(
    path: str | Path, tag: str | None = None
) -> dict[str, dict[str, dict[str, Any]]]:
    """The optimizer of a portable checkpoint by the unsplit model's parameter names.

    ``{"state": {name: {state name: value}}, "groups": {name: hyper-parameters}}``: every name
    of a saved parameter (a tied weight's names share one state) with its per-parameter state
    (Adam's ``exp_avg``, ``exp_avg_sq``, ``step``; absent for a parameter never stepped) and
    the hyper-parameters of the group it was in. What a loop that keeps one optimizer over the
    unsplit model (Hugging Face's ``Trainer``) needs to write its own optimizer file. Runs in
    this process alone, like :func:`consolidate`.
    """
    directory = _locate(path, tag)
    index = _read_index(directory)
    optim: Mapping[str, Any] = index["optimizer"]
    specs = {
        f"{_OPTIM}{key}.{name}": spec
        for key, entries in optim["state"].items()
        for name, spec in entries.items()
    }
    loaded = _read_tensors(directory, specs, alone=True)
    names = {**index.get("other_names", {}), **index["aliases"]}
    state: dict[str, dict[str, Any]] = {}
    groups: dict[str, dict[str, Any]] = {}
    for name, key in names.items():
        if key not in index["params"]:
            continue
        entries = optim["state"].get(key, {})
        state[name] = {
            state_name: _from_state_tensor(loaded[f"{_OPTIM}{key}.{state_name}"], spec["kind"])
            for state_name, spec in entries.items()
        }
        if key in optim["group_of"]:
            groups[name] = dict(optim["groups"][optim["group_of"][key]])
    return {"state": state, "groups": groups}


def export_hf(
    path: str | Path,
    out_dir: str | Path,
    *,
    config: Any,
    model_cls: Any = None,
    tag: str | None = None,
) -> Path:
    """Write a Hugging Face ``save_pretrained`` directory from a portable checkpoint.

    ``config`` is the model's ``transformers`` config; ``model_cls`` the model class
    (default: ``config.architectures[0]`` from ``transformers``). The model is built from the
    config on the meta device (no memory, no random initialisation), given
    :func:`consolidate`'s tensors (strictly: every name of its ``state_dict``, nothing else)
    and saved by its own ``save_pretrained``, so the directory holds what ``save_pretrained``
    of the trained model writes: ``model.safetensors`` without non-persistent buffers (the
    model re-creates them), tied weights once where the config ties them, ``config.json`` and
    ``generation_config.json``; ``from_pretrained(out_dir)`` loads it. Returns ``out_dir``.

    Raises:
        ConfigError: no model class can be found for ``config``.
        CheckpointError: the checkpoint does not hold exactly the model's state, or the config
            ties weights the checkpoint holds different values for.
    """
    state = consolidate(path, tag)
    if model_cls is None:
        import transformers

        names = list(getattr(config, "architectures", None) or [])
        model_cls = getattr(transformers, names[0], None) if names else None
        if model_cls is None:
            raise ConfigError(
                f"export_hf cannot tell which model class {type(config).__name__} is for (its "
                "architectures list is empty); pass model_cls=, e.g. GPT2LMHeadModel"
            )
    with torch.device("meta"):
        model = model_cls(config)
    _assign_state(model, state, f"checkpoint {path}")
    out = Path(out_dir)
    model.save_pretrained(out)
    return out


def _assign_state(model: nn.Module, state: Mapping[str, torch.Tensor], what: str) -> None:
    """Make ``state``'s tensors ``model``'s (a model on meta), keeping the model's own ties.

    The names the model holds as one tensor (the config ties them) must have equal values in
    ``state``, and get one tensor; tensors ``state`` shares between names the model keeps
    apart are copied, so that ``save_pretrained`` sees the ties the model has, no others.
    """
    expected = model.state_dict(keep_vars=True)
    missing = [n for n in expected if n not in state]
    unexpected = [n for n in state if n not in expected]
    if missing or unexpected:
        raise CheckpointError(
            f"{what} does not hold the state of a {type(model).__name__}: missing "
            f"{missing[:_SHOW]}, unexpected {unexpected[:_SHOW]}"
        )
    groups: dict[int, list[str]] = {}
    for name, tensor in expected.items():
        groups.setdefault(id(tensor), []).append(name)
    assigned: dict[str, torch.Tensor] = {}
    used: set[int] = set()
    for names in groups.values():
        value = state[names[0]]
        for other in names[1:]:
            if not torch.equal(state[other], value):
                raise CheckpointError(
                    f"{what}: the config makes {names} one tensor in a {type(model).__name__}, "
                    f"but the checkpoint holds different values for {names[0]!r} and "
                    f"{other!r} (the model trained them untied); export with a config that "
                    "does not tie them (e.g. tie_word_embeddings=False)"
                )
        if value.untyped_storage().data_ptr() in used:
            value = value.clone()
        used.add(value.untyped_storage().data_ptr())
        assigned.update(dict.fromkeys(names, value))
    model.load_state_dict(assigned, strict=True, assign=True)
    for names in groups.values():  # assign made one Parameter per name: one per tensor again
        holder, name = _owner(model, names[0])
        shared: Any = holder._parameters.get(name)
        if shared is None:
            shared = holder._buffers[name]
        for other in names[1:]:
            module, attr = _owner(model, other)
            table: Any = module._parameters if attr in module._parameters else module._buffers
            table[attr] = shared


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return model.get_submodule(path), attr
