"""Filling the stages of a meta-device plan with real weights, one rank's stages at a time.

A model built under ``with torch.device("meta")`` is partitioned without any memory; each rank
then calls :func:`materialise_stages` on the stages it runs: they get storage on the rank's
device (``to_empty``), the parameters they share are one Parameter again, and an
``init_weights(stage_module)`` callable fills every parameter and buffer by its original name.
This module provides ready loaders:

- :func:`from_state_dict`: from a ``{name: tensor}`` mapping (the unsplit model's
  ``state_dict()``, say);
- :func:`from_safetensors`: from one or more ``.safetensors`` files, or a sharded checkpoint's
  ``*.safetensors.index.json``; each stage opens only the files that hold its tensors and reads
  only those tensors (``safe_open``), never the whole checkpoint;
- :func:`from_pretrained`: a Hugging Face checkpoint directory written by ``save_pretrained``
  (``model.safetensors`` or ``model.safetensors.index.json``).

[Note: tied and missing names]
``save_pretrained`` writes a tied weight once (``lm_head.weight`` is absent, tied to
``transformer.wte.weight``), and a stage may hold only the absent name. Given the plan, a loader
treats every name of a tie group as an alias of the others and reads whichever the file has;
``ties={"lm_head.weight": "transformer.wte.weight"}`` adds aliases by hand. Non-persistent
buffers (rotary frequency tables, position ids) are in no file; see [Note: non-persistent
buffers]. Every other name a stage holds must be found (the error lists all that are not);
names in the file that no stage holds are ignored, so each rank reads its own part.

[Note: checkpoint names]
transformers 5 may store a tensor under another name than the model gives it (GPT-NeoX's
``lm_head.weight`` is ``embed_out.weight`` in its files; old checkpoints say
``LayerNorm.gamma``), and renames while loading. :func:`from_pretrained` applies the model's
own renaming rules (``transformers.conversion_mapping``) to the file's names, so each stage reads
the tensor ``from_pretrained`` would put there. Tensors transformers converts rather than
renames (experts merged into one tensor, permuted rotary projections) cannot be read one name
at a time: a stage that needs one is refused by name. A tie is taken from the model itself (two
names of one tensor), never from what a class declares, so an untied head is never read from
the embedding.

[Note: non-persistent buffers]
A buffer registered with ``persistent=False`` is computed by its module's ``__init__`` (Llama's
``inv_freq`` from the config's rope parameters) and written to no checkpoint; built on the meta
device, it holds no value. The loader takes it from ``buffers={name: tensor}`` when given;
otherwise, given the plan, it re-creates every buffer the plan's table
(:attr:`~pipedialect.PipelinePlan.buffers`) marks as not persistent the way the model's own
initialisation does: a CPU copy of the module that owns it (its own tensors only, on the CPU,
its children left out) goes through the model's per-module initialiser, and the buffer is
taken from the copy. transformers models have one, ``_init_weights(module)``, which is what
their own ``from_pretrained`` runs on these buffers after building on meta and computes them as
the owner's ``__init__`` does; it draws no random numbers from the caller (the RNG is forked).
A buffer the initialiser leaves unwritten, or a model without one, is refused by name.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from ..errors import WeightsError
from ..runtime.sharded import copy_full_into, is_sharded, local_part
from ..runtime.stage import stage_root
from .partition import MODEL_NAMES, PipelinePlan

__all__ = [
    "InitWeights",
    "from_pretrained",
    "from_safetensors",
    "from_state_dict",
    "materialise_stages",
    "prepare_local_stages",
]

logger = logging.getLogger(__name__)


class InitWeights(Protocol):
    """Fills every parameter and buffer of one materialised stage module, by name."""

    def __call__(self, stage_module: nn.Module) -> None: ...


class _Source(Protocol):
    def keys(self) -> Iterable[str]: ...

    def read(self, names: Sequence[str]) -> dict[str, torch.Tensor]: ...


def _alias_groups(
    plan: PipelinePlan | None, ties: Mapping[str, str] | None
) -> dict[str, tuple[str, ...]]:
    """For every tied name, all the names that hold the same weight (itself first): the
    plan's tie groups, the model's own names of one tensor, and ``ties``."""
    groups: list[set[str]] = []
    if plan is not None:
        groups.extend({name for name, _ in g.members} for g in plan.tie_groups)
        for stage in plan.stages:
            groups.extend(set(names) for names in stage.meta.get(MODEL_NAMES, {}).values())
    for a, b in (ties or {}).items():
        groups.append({a, b})
    merged: dict[str, set[str]] = {}
    for group in groups:
        union = set(group)
        for name in group:
            union |= merged.get(name, set())
        for name in union:
            merged[name] = union
    return {n: (n, *sorted(g - {n})) for n, g in merged.items()}


class _Loader:
    """An :class:`InitWeights` reading from ``source``, honouring aliases and given buffers."""

    def __init__(
        self,
        source: _Source,
        plan: PipelinePlan | None,
        ties: Mapping[str, str] | None,
        buffers: Mapping[str, torch.Tensor] | None,
        what: str,
    ) -> None:
        self._source = source
        self._aliases = _alias_groups(plan, ties)
        self._buffers = dict(buffers or {})
        self._what = what
        self._stage_of: dict[int, int] = {}
        self._model = plan.model if plan is not None else None
        self._non_persistent: frozenset[str] = frozenset()
        self._recreated: dict[str, torch.Tensor | None] = {}
        if plan is not None:
            self._stage_of = {id(s): k for k, s in enumerate(plan.stages)}
            self._non_persistent = frozenset(b.name for b in plan.buffers if not b.persistent)

    def __call__(self, stage_module: nn.Module) -> None:
        module = stage_root(stage_module)
        stage = self._stage_of.get(id(module))
        where = f"[Stage {stage}] " if stage is not None else ""
        targets = _named_state(module)
        available = set(self._source.keys())
        wanted: dict[str, str] = {}
        given: dict[str, torch.Tensor] = {}
        missing: list[str] = []
        for name in targets:
            key = next((a for a in self._aliases.get(name, (name,)) if a in available), None)
            if key is not None:
                wanted[name] = key
            elif name in self._buffers:
                given[name] = self._buffers[name]
            elif self._is_non_persistent(module, name):
                value = self._recreate(name)
                if value is None:
                    missing.append(name)
                else:
                    given[name] = value
            else:
                missing.append(name)
        if missing:
            raise WeightsError(
                f"{where}{self._what} has no tensor for {missing}"
                + self._hint(module, missing, targets),
                stage=stage,
                parameter=missing[0],
            )
        sharded = any(is_sharded(t) for t in targets.values())
        # A sharded stage reads one whole tensor at a time: only the shards stay.
        values = {} if sharded else self._source.read(sorted(set(wanted.values())))
        with torch.no_grad():
            for name, tensor in targets.items():
                if name in wanted:
                    key = wanted[name]
                    value = values[key] if key in values else self._source.read([key])[key]
                else:
                    value = given[name]
                if tuple(value.shape) != tuple(tensor.shape):
                    raise WeightsError(
                        f"{where}{name!r} has shape {tuple(tensor.shape)} in the stage but "
                        f"{tuple(value.shape)} in {self._what}"
                        + (f" (as {wanted[name]!r})" if wanted.get(name, name) != name else ""),
                        stage=stage,
                        parameter=name,
                    )
                copy_full_into(tensor, value)
        logger.debug("%sloaded %d tensors from %s", where, len(targets), self._what)

    def _is_non_persistent(self, module: nn.Module, name: str) -> bool:
        """Whether ``name`` is a buffer no checkpoint holds: the plan's table says so, or the
        stage (which mirrors the model's persistence) does."""
        return name in self._non_persistent or _is_non_persistent(module, name)

    def _recreate(self, name: str) -> torch.Tensor | None:
        """The non-persistent buffer ``name`` as the model's own initialisation computes it,
        or None ([Note: non-persistent buffers])."""
        if name not in self._recreated:
            self._recreated[name] = (
                None if self._model is None else _initialised_buffer(self._model, name)
            )
        return self._recreated[name]

    def _hint(
        self, module: nn.Module, missing: Sequence[str], targets: Mapping[str, torch.Tensor]
    ) -> str:
        """What to do about ``missing``: tied parameters, and non-persistent buffers."""
        buffers = [n for n in missing if self._is_non_persistent(module, n)]
        others = [n for n in missing if n not in buffers]
        parts = []
        if others:
            parts.append(
                "Tied names need the plan (plan=) or ties={name: name in the file}"
                if any(isinstance(targets[n], nn.Parameter) for n in others)
                else "the file does not hold every persistent tensor of the stage"
            )
        if buffers:
            if self._model is None:
                how = (
                    "pass plan= to re-create them as the model's own initialisation does, or "
                    "buffers={name: tensor}"
                )
            else:
                how = (
                    f"{type(self._model).__name__} has no per-module initialiser that computes "
                    f"them (transformers' _init_weights); pass buffers={{name: tensor}} "
                    "(computed on the CPU by the module that owns them)"
                )
            parts.append(f"{buffers} are not persistent, so no checkpoint holds them: {how}")
        return ". " + "; ".join(parts) + "."


def _initialised_buffer(model: nn.Module, name: str) -> torch.Tensor | None:
    """Buffer ``name`` of ``model`` computed on the CPU by the model's per-module initialiser,
    or None when it has none or leaves the buffer unwritten ([Note: non-persistent buffers])."""
    owner_path, _, attr = name.rpartition(".")
    try:
        owner = model.get_submodule(owner_path)
    except AttributeError:
        return None
    # The initialiser of the innermost model on the path (a composite model's part has its own).
    init = None
    parts = owner_path.split(".") if owner_path else []
    for depth in range(len(parts), -1, -1):
        candidate = getattr(model.get_submodule(".".join(parts[:depth])), "_init_weights", None)
        if callable(candidate):
            init = candidate
            break
    if init is None or owner._buffers.get(attr) is None:
        return None
    shell = copy.copy(owner)  # the owner's attributes, but tables of its own:
    shell._modules = {}
    shell._parameters = {
        n: nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad)
        for n, p in owner._parameters.items()
        if p is not None
    }
    empty = {
        n: torch.empty_like(b, device="cpu") for n, b in owner._buffers.items() if b is not None
    }
    shell._buffers = dict(empty)
    before = _mark(empty[attr])
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        try:
            init(shell)
        except Exception as exc:  # the initialiser needed what the shell lacks
            logger.debug("%s could not re-create %r: %s", type(model).__name__, name, exc)
            return None
    value = shell._buffers.get(attr)
    if value is None or value.is_meta or _mark(value) == before:
        return None
    return value


def _named_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` under each of its names."""
    out: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        out[name] = p
    for name, b in module.named_buffers(remove_duplicate=False):
        out[name] = b
    return out


def _is_non_persistent(module: nn.Module, name: str) -> bool:
    owner_path, _, attr = name.rpartition(".")
    try:
        owner = module.get_submodule(owner_path)
    except AttributeError:
        return False
    return attr in owner._non_persistent_buffers_set


class _StateDictSource:
    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        self._state = state

    def keys(self) -> Iterable[str]:
        return self._state.keys()

    def read(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        return {n: self._state[n] for n in names}


class _SafetensorsSource:
    """Tensor names of several files, each file opened only when one of its tensors is read.

    ``renamed`` maps a model name to the name the file stores it under, where they differ
    ([Note: checkpoint names]).
    """

    def __init__(self, where: Mapping[str, Path], renamed: Mapping[str, str] | None = None):
        self._where = where
        self._renamed = dict(renamed or {})
        self.files_opened: list[Path] = []

    def keys(self) -> Iterable[str]:
        return [*self._where.keys(), *self._renamed]

    def read(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for name in names:
            stored = self._renamed.get(name, name)
            by_file.setdefault(self._where[stored], []).append(name)
        out: dict[str, torch.Tensor] = {}
        for path in sorted(by_file):
            self.files_opened.append(path)
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in by_file[path]:
                    out[name] = f.get_tensor(self._renamed.get(name, name))
        return out


def _index(paths: Sequence[Path]) -> dict[str, Path]:
    """Which file holds each tensor name (reading headers and index files only)."""
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for path in paths:
        if not path.is_file():
            raise WeightsError(f"weights file {str(path)!r} does not exist")
        if path.name.endswith(".index.json"):
            weight_map = json.loads(path.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise WeightsError(f"{str(path)!r} has no 'weight_map' of tensor names to files")
            for name, file in weight_map.items():
                where[name] = path.parent / file
        else:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                    where[name] = path
    return where


def from_state_dict(
    state: Mapping[str, torch.Tensor],
    *,
    plan: PipelinePlan | None = None,
    ties: Mapping[str, str] | None = None,
    buffers: Mapping[str, torch.Tensor] | None = None,
) -> InitWeights:
    """An ``init_weights`` copying each stage tensor from ``state[name]`` ([Note: tied and
    missing names])."""
    return _Loader(_StateDictSource(state), plan, ties, buffers, "the state dict")


def from_safetensors(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    *,
    plan: PipelinePlan | None = None,
    ties: Mapping[str, str] | None = None,
    buffers: Mapping[str, torch.Tensor] | None = None,
) -> InitWeights:
    """An ``init_weights`` reading each stage's tensors from ``.safetensors`` files (or a
    sharded checkpoint's ``.index.json``), only those of the stage ([Note: tied and missing
    names])."""
    items = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    files = [Path(p) for p in items]
    names = ", ".join(str(p) for p in files)
    return _Loader(_SafetensorsSource(_index(files)), plan, ties, buffers, names)


def _pretrained_source(files: Sequence[Path], plan: PipelinePlan | None) -> _SafetensorsSource:
    """The files of a ``save_pretrained`` directory, under the model's names ([Note:
    checkpoint names])."""
    where = _index(files)
    model = plan.model if plan is not None else None
    renamed, converted = _transformers_names(model, sorted(where))
    held = set()
    if plan is not None:
        held = {n for stage in plan.stages for n in _named_state(stage)}
    needed = sorted(n for n in converted if n in held)
    if needed:
        raise WeightsError(
            f"{type(model).__name__}'s checkpoint stores {needed[:5]} in another layout than "
            f"the model (transformers converts {sorted({converted[n] for n in needed})[:5]} "
            "while loading, beyond renaming), which per-stage loading by name cannot do: load "
            "the model with from_pretrained on the CPU once and pass init_weights="
            "pipedialect.plan.weights.from_state_dict(model.state_dict(), plan=plan)",
            parameter=needed[0],
        )
    return _SafetensorsSource(where, renamed)


def _transformers_names(
    model: nn.Module | None, stored: Sequence[str]
) -> tuple[dict[str, str], dict[str, str]]:
    """``({model name: stored name}, {model name: stored name})`` for the names transformers'
    loading renames, and for those it converts (merges, splits, permutes); empty for a model
    that is not a transformers model ([Note: checkpoint names])."""
    if model is None or "transformers" not in sys.modules:
        return {}, {}
    import transformers
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        rename_source_key,
    )

    if not isinstance(model, transformers.PreTrainedModel):
        return {}, {}
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    expected = model.state_dict()
    renamed: dict[str, str] = {}
    converted: dict[str, str] = {}
    for name in stored:
        target, pattern = rename_source_key(
            name, renamings, converters, model.base_model_prefix, expected
        )
        if pattern is not None:
            converted[target] = name
        elif target != name:
            renamed[target] = name
    return renamed, converted


def from_pretrained(
    directory: str | os.PathLike[str],
    *,
    plan: PipelinePlan | None = None,
    ties: Mapping[str, str] | None = None,
    buffers: Mapping[str, torch.Tensor] | None = None,
) -> InitWeights:
    """An ``init_weights`` for a Hugging Face ``save_pretrained`` directory: its
    ``model.safetensors``, or the shards listed in ``model.safetensors.index.json``.

    Pass the plan: its tie groups and the model's own ties (names of one tensor in the model)
    let a stage that holds only ``lm_head.weight`` read the embedding it is tied to (``ties``
    adds aliases by hand); the names the file stores under other names than the model's are
    found as transformers finds them ([Note: checkpoint names]); and the non-persistent buffers
    are re-created as the model's own initialisation computes them ([Note: non-persistent
    buffers]), so a meta model loads like ``from_pretrained`` with no other argument.
    """
    root = Path(directory)
    index = root / "model.safetensors.index.json"
    single = root / "model.safetensors"
    if index.is_file():
        target = index
    elif single.is_file():
        target = single
    else:
        found = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
        raise WeightsError(
            f"{str(root)!r} has neither model.safetensors nor model.safetensors.index.json "
            f"(it holds {found}); save the model with save_pretrained(safe_serialization=True)"
        )
    return _Loader(_pretrained_source([target], plan), plan, ties, buffers, str(target))


def materialise_stages(
    plan: PipelinePlan,
    stage_ids: Iterable[int],
    device: torch.device | str,
    init_weights: InitWeights | Callable[[nn.Module], None],
    *,
    after_empty: Callable[[], None] | None = None,
) -> None:
    """Give the stages ``stage_ids`` of ``plan`` storage on ``device`` and fill them.

    Only these stages are touched (the others stay on the meta device, costing nothing). After
    ``to_empty``, a Parameter or buffer the stages shared is one object again (``to_empty``
    makes a new one per owner), ``after_empty()`` runs if given, then ``init_weights(stage)``
    runs for each stage in order and must write every tensor (in place, or by assigning a new
    one).

    A stage sharded on the meta device (a dialect's FSDP or tensor parallelism) gets storage
    for its shards only: ``to_empty`` allocates each ``DTensor``'s local part, ``after_empty``
    is where the dialect re-binds its shards, and the loaders of this module write each rank's
    slice of every tensor, reading one whole tensor at a time
    (:mod:`pipedialect.runtime.sharded` [Note: sharded tensors]); a hand-written
    ``init_weights`` must then write the sharded parameters itself (``copy_full_into``).

    Raises:
        WeightsError: ``init_weights`` left a parameter or buffer of these stages unwritten or
            on the meta device (the message lists them), a loader's error with the stage
            named, or a stage id is out of range.
    """
    ids = sorted(set(stage_ids))
    bad = [k for k in ids if not 0 <= k < plan.num_stages]
    if bad:
        raise WeightsError(f"stage ids {bad} are not stages of a {plan.num_stages}-stage plan")
    stages = [plan.stages[k] for k in ids]
    owners = _owners(stages)
    for stage in stages:
        stage.to_empty(device=device)
    _retie(owners)
    if after_empty is not None:
        after_empty()
    for k, stage in zip(ids, stages, strict=True):
        empty = {n: _mark(t) for n, t in _named_state(stage).items()}
        try:
            init_weights(stage)
        except WeightsError as exc:
            if exc.stage is not None:
                raise
            raise WeightsError(f"[Stage {k}] {exc}", stage=k, parameter=exc.parameter) from exc
        state = _named_state(stage)
        left = [n for n, t in state.items() if t.is_meta or empty.get(n) == _mark(t)]
        if left:
            raise WeightsError(
                f"[Stage {k}] init_weights left {left} as to_empty made them (uninitialised "
                "memory) or on the meta device; it must fill every parameter and buffer of the "
                "stage",
                stage=k,
                parameter=left[0],
            )


def prepare_local_stages(
    plan: PipelinePlan,
    stage_ids: Iterable[int],
    device: torch.device | str,
    init_weights: InitWeights | Callable[[nn.Module], None] | None,
    *,
    after_empty: Callable[[], None] | None = None,
) -> None:
    """The step every dialect's ``pipe_engine(..., init_weights=fn)`` runs on its local stages.

    With ``init_weights``, :func:`materialise_stages` gives the stages ``stage_ids`` (the ones
    this rank runs) storage on ``device`` and fills them; the other stages stay on meta. Without
    it, a local stage still on the meta device is refused, as it could not run. Call it before
    the runtime builds anything from the stages and before ties are synchronised across ranks.

    Raises:
        WeightsError: a local stage holds meta tensors and no ``init_weights`` was given (the
            message lists them), ``init_weights`` is not callable, or
            :func:`materialise_stages` refused.
    """
    ids = sorted(set(stage_ids))
    if init_weights is not None:
        if not callable(init_weights):
            raise WeightsError(
                f"init_weights must be a callable(stage_module), got {init_weights!r}; see "
                "pipedialect.plan.weights.from_state_dict / from_safetensors / from_pretrained"
            )
        materialise_stages(plan, ids, device, init_weights, after_empty=after_empty)
        return
    for k in ids:
        on_meta = [n for n, t in _named_state(plan.stages[k]).items() if t.is_meta]
        if on_meta:
            raise WeightsError(
                f"[Stage {k}] {on_meta} are on the meta device and no init_weights was given; "
                "pass init_weights=<callable(stage_module)> to pipe_engine (e.g. "
                "pipedialect.plan.weights.from_state_dict(state)) so each rank materialises the "
                "stages it runs",
                stage=k,
                parameter=on_meta[0],
            )


def _mark(tensor: torch.Tensor) -> tuple[int, int, int]:
    """Identity, storage and in-place version: unchanged means nothing wrote the tensor (a
    sharded tensor's local part is what is written)."""
    local = local_part(tensor)
    return id(tensor), local.data_ptr(), local._version


def _owners(stages: Sequence[nn.Module]) -> list[list[tuple[nn.Module, str, bool]]]:
    """Groups of (module, attribute, is_parameter) that hold one tensor, in a stable order."""
    groups: dict[int, list[tuple[nn.Module, str, bool]]] = {}
    seen: set[tuple[int, str]] = set()
    for stage in stages:
        for module in stage.modules():
            for table, is_param in ((module._parameters, True), (module._buffers, False)):
                for attr, tensor in table.items():
                    if tensor is None or (id(module), attr) in seen:
                        continue
                    seen.add((id(module), attr))
                    groups.setdefault(id(tensor), []).append((module, attr, is_param))
    return [g for g in groups.values() if len(g) > 1]


def _retie(groups: Sequence[Sequence[tuple[nn.Module, str, bool]]]) -> None:
    for group in groups:
        module, attr, is_param = group[0]
        shared: Any = (module._parameters if is_param else module._buffers)[attr]
        for other, other_attr, other_is_param in group[1:]:
            (other._parameters if other_is_param else other._buffers)[other_attr] = shared
