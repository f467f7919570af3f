"""Splitting a model into pipeline stages: :func:`partition` and the :class:`PipelinePlan`.

``partition(model, ["blocks.3", "blocks.7"])`` captures the model's forward with torch.fx as one
flat graph in which every split point is a single call (or, given ``example_inputs``, with
torch.export: [Note: export capture] in ``_export``), puts the stage boundary after each split
point's call (Slapo's ``cut_pipeline_stage``), and cuts the graph into one GraphModule per stage
whose parameters keep the original model's names (see ``capture._split`` [Note: own splitter]). The
plan also says what each stage receives and sends ([Note: liveness] in
:mod:`pipedialect.plan.liveness`) and which parameters stages share (:mod:`pipedialect.plan.ties`).
Everything is derived from the graph's node order, so every rank that partitions the same model gets
the same plan; :meth:`PipelinePlan.fingerprint` lets ranks check that. :meth:`PipelinePlan.verify`
runs the plan and the model on one set of inputs and names the first stage that differs ([Note: plan
verification] in ``_verify``); ``partition`` does it before returning when it has
``example_inputs``.

[Note: boundary values]
A value a stage sends is named ``submod_<k>.<i>`` (the ``i``-th output of stage ``k``), which
says nothing about what it is; :meth:`PipelinePlan.boundary_values` and ``describe()`` say where
it comes from. From the stage graphs (every node records the modules whose code computed it,
``nn_module_stack``, on both capture routes): the value is the output of the outermost of
those modules that some code outside it uses (a Llama layer's hidden state: ``model.layers.0``;
the rotary tables: ``model.rotary_emb``), or, when every use is inside all of them, it stays
inside the innermost one's forward (the causal mask ``LlamaModel.forward`` builds); a module
called as one op (a torch.fx split point) and the ``getitem``s on its result say where in its
output directly. Elsewhere :meth:`PipelinePlan.verify` (which ``partition`` runs with
``example_inputs``) records each origin module's output in the model's run and finds the sent
tensor among its leaves (``[0]``, ``['last_hidden_state']``); on the meta device only shapes
and dtypes can tell, so two leaves alike are both named (``[0] or [1]``). Shapes, dtypes and
bytes per micro-batch come from the export capture's metadata, or from what the check ran;
without either they are unknown, and said to be.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import inspect
import json
import logging
import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from ..contracts import StageSpec, TieGroup
from ..cost.balance import DEFAULT_BANDWIDTH, BalanceMethod, PlanCosts, balanced_split_points
from ..cost.module_paths import (
    check_execution_order,
    check_single_call,
    close_matches,
    resolve_leaves,
)
from ..errors import (
    CaptureError,
    ConfigError,
    PartitionError,
    RecomputeError,
    SplitPointError,
)
from ..runtime.module_state import apply_modes, mode_table
from . import _export, _state, _verify
from ._watch import ModelWatch, reading_attributes
from .capture import _guards, _modal, _recompute, _regions, _split, _tracer
from .capture._capture import Captured, capture, share_constants
from .liveness import compute_liveness
from .ties import find_tie_groups

__all__ = ["BoundaryValue", "BufferInfo", "PipelinePlan", "check_capture_dtype", "partition"]

logger = logging.getLogger(__name__)

#: ``stage.meta[MODEL_NAMES]``: for each parameter and persistent buffer of a stage that the
#: model's ``state_dict`` holds under several names, all of them (in the model's order). A
#: stage holds a tensor under one name, the one its using module has; a checkpoint of the
#: stages needs the others to be a state dict of the whole model (:mod:`pipedialect.checkpoint`).
MODEL_NAMES = "pipedialect_model_names"


@dataclass(frozen=True)
class BufferInfo:
    """One buffer of the model that the stages use, and which stage owns it.

    See [Note: module state] in ``_state``: the owner is the one stage that writes the buffer
    (running statistics, counters); a later stage that reads it receives the owner's value
    over the boundary as :attr:`value`; a buffer nobody writes is a constant each reader holds.
    """

    #: The model's name for it (the first of ``named_buffers``).
    name: str
    #: The stage that writes it, or None when no stage does.
    owner: int | None
    #: The stages other than the owner that read it (all of them when there is no owner).
    readers: tuple[int, ...]
    #: Whether it is in the model's ``state_dict`` (``register_buffer(..., persistent=...)``).
    persistent: bool
    #: The boundary value (``submod_k.i``) the owner sends it as, when a later stage reads it.
    value: str | None = None

    def describe(self) -> str:
        """One line: owner, readers, persistence."""
        owner = "no stage writes it" if self.owner is None else f"written by stage {self.owner}"
        readers = f", read by stages {list(self.readers)}" if self.readers else ""
        sent = f", sent as {self.value!r}" if self.value else ""
        kind = "persistent" if self.persistent else "not persistent"
        return f"{self.name}: {owner}{readers}{sent} ({kind})"


@dataclass(frozen=True)
class BoundaryValue:
    """One value a stage sends to the next, named by where it comes from.

    See [Note: boundary values]. ``kind`` says what :attr:`module` is: ``"output"``, the
    module's output (at :attr:`output`); ``"inside"``, a value its forward computes but does
    not return (a mask built in ``LlamaModel.forward``); ``"input"``, a plan input passed on;
    ``"buffer"``, a buffer's value its writer sends (:attr:`module` is the buffer's name).
    """

    #: The plan's name for it (``submod_0.3``, or an input's name).
    name: str
    #: ``"output"``, ``"inside"``, ``"input"`` or ``"buffer"``.
    kind: str
    #: The module path ('' for the model itself), the buffer's name, or None for an input.
    module: str | None
    #: The module's class name (``"output"`` and ``"inside"``).
    module_type: str | None
    #: Where in the module's output: ``""`` the whole output, ``"[0]"``, ``"['logits']"``;
    #: several when the check could not tell them apart (on meta: same shape and dtype); None
    #: when unknown (``plan.verify`` finds it).
    output: tuple[str, ...] | None
    #: Shape, dtype and bytes per micro-batch, when known (export capture, or a check ran).
    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    nbytes: int | None
    #: What it is when it is no tensor (``"None"``, ``"a tuple of 2 tensors"``), else None.
    other: str | None = None

    def source(self) -> str:
        """Where it comes from: ``model.layers.1 -> [0]``, ``input 'attention_mask'``, ..."""
        if self.kind == "input":
            return f"input {self.name!r}"
        if self.kind == "buffer":
            return f"buffer {self.module!r}"
        where = self.module or "the model"
        if self.kind == "inside":
            return f"inside {where}'s forward ({self.module_type})"
        if self.output is None:
            return f"{where} -> ? (plan.verify(...) finds where in its output)"
        paths = " or ".join(p or "output" for p in self.output)
        return f"{where} -> {paths}"

    def describe(self) -> str:
        """One line: name, source, shape, dtype and bytes per micro-batch."""
        if self.other is not None:
            what = self.other
        elif self.shape is None or self.dtype is None:
            what = "shape unknown (an export capture or plan.verify(...) records it)"
        else:
            dtype = str(self.dtype).removeprefix("torch.")
            size = "" if self.nbytes is None else f", {self.nbytes:,} B"
            what = f"{dtype} {list(self.shape)}{size}"
        return f"{self.name}: {self.source()}, {what}"


@dataclass(frozen=True, eq=False, repr=False)
class PipelinePlan:
    """A model cut into pipeline stages, and what flows between them.

    Stages share ``nn.Parameter`` objects with the partitioned model: deep-copy the model first
    if an untouched reference is needed.
    """

    #: One GraphModule per stage; ``dict(stage.named_parameters())`` has original names.
    stages: tuple[fx.GraphModule, ...]
    #: ``submod_<k>``: each stage's value name in :attr:`graph`.
    stage_names: tuple[str, ...]
    #: The model's inputs in forward-signature order (without ``concrete_args``): the order the
    #: data loader supplies them in.
    input_names: tuple[str, ...]
    #: For every stage, the names of its arguments in call order.
    stage_arg_names: tuple[tuple[str, ...], ...]
    #: For every stage, the names of the values it receives (``liveness[0] == input_names``).
    liveness: tuple[tuple[str, ...], ...]
    #: Parameters shared by several stages.
    tie_groups: tuple[TieGroup, ...]
    #: The split points as given.
    split_points: tuple[str, ...]
    #: The top-level GraphModule calling the stages in order; ``graph(*inputs)`` computes what
    #: the model computes.
    graph: fx.GraphModule
    #: The partitioned model, which :meth:`verify` runs as the reference.
    model: nn.Module | None = field(default=None, compare=False)
    #: The forward arguments fixed at capture time (``concrete_args``), passed to the model
    #: by :meth:`verify`.
    concrete_args: Mapping[str, Any] = field(default_factory=dict, compare=False)
    #: Predicted per-stage costs when ``partition`` measured the model (``balance=``), else None.
    costs: PlanCosts | None = field(default=None, compare=False)
    #: The modules whose activations are recomputed in backward (``recompute=``), outermost.
    recomputed: tuple[str, ...] = ()
    #: The model's buffers the stages use, in name order, with the stage that owns each
    #: ([Note: module state] in ``_state``).
    buffers: tuple[BufferInfo, ...] = ()
    #: The dtype of the floating-point parameters the stages were captured with by
    #: torch.export (``partition(..., dtype=)``), which the engine must train in; None for the
    #: torch.fx capture, whose stages compute in whatever dtype the parameters have.
    param_dtype: torch.dtype | None = None
    #: forward's default values of the inputs whose default a stage can take in place of a
    #: value (Python numbers and bools), by name: a batch may omit such trailing inputs. A
    #: ``None`` default is not here: the capture traced the input as a value, so an input that
    #: may be left out is fixed with ``concrete_args`` instead.
    input_defaults: Mapping[str, Any] = field(default_factory=dict)
    #: The dtype every stage runs its ops under ``torch.autocast`` in (``partition(...,
    #: autocast=)``: fp32 parameters, eligible ops in that dtype), or None.
    autocast: torch.dtype | None = None
    #: The model's modules whose train/eval flag is not the one ``train(mode)`` gives them:
    #: path -> (flag in the training pattern, flag in the evaluation pattern) ([Note:
    #: per-module modes] in ``runtime.module_state``).
    module_modes: Mapping[str, tuple[bool, bool]] = field(default_factory=dict)
    #: The same, per stage, by path inside the stage: what its wrapper applies at every
    #: ``train()``/``eval()``.
    stage_modes: tuple[Mapping[str, tuple[bool, bool]], ...] = ()
    #: What the training loop may change on the model, checked before every step ([Note:
    #: values the loop sets] in ``_watch``).
    _model_watch: ModelWatch | None = field(default=None, compare=False, repr=False)
    #: What :meth:`verify` saw of each boundary value: shape, dtype, bytes, output paths
    #: ([Note: boundary values]).
    _seen: dict[str, dict[str, Any]] = field(default_factory=dict, compare=False)

    @property
    def num_stages(self) -> int:
        """The number of stages (split points + 1)."""
        return len(self.stages)

    def buffer_owners(self) -> dict[str, int]:
        """Buffer name -> the stage that writes it, for the buffers one stage writes
        (what an engine reports in :attr:`pipedialect.contracts.EngineState.buffer_owners`)."""
        return {b.name: b.owner for b in self.buffers if b.owner is not None}

    def sends(self, stage_id: int) -> tuple[str, ...]:
        """The names of the values ``stage_id`` sends to the next stage."""
        return self.liveness[stage_id + 1] if stage_id + 1 < self.num_stages else ()

    def stage_spec(self, stage_id: int) -> StageSpec:
        """What the wrapper of ``stage_id`` receives, runs on and sends (see ``StageWrapper``)."""
        return StageSpec(
            stage_id=stage_id,
            num_stages=self.num_stages,
            name=self.stage_names[stage_id],
            input_names=self.input_names,
            arg_names=self.stage_arg_names[stage_id],
            receives=self.liveness[stage_id],
            sends=self.sends(stage_id),
            input_defaults=dict(self.input_defaults),
            module_modes=dict(self.stage_modes[stage_id]) if self.stage_modes else {},
            before_step=None if self._model_watch is None else self._model_watch.check,
            tied_parameters=tuple(
                name
                for group in self.tie_groups
                if len(group.stages) > 1
                for name, stage in group.members
                if stage == stage_id
            ),
        )

    def boundary_values(self, stage_id: int) -> tuple[BoundaryValue, ...]:
        """The values ``stage_id`` sends to the next stage, in :meth:`sends` order, each named
        by where it comes from, with its shape, dtype and bytes per micro-batch when known
        ([Note: boundary values])."""
        origins = _boundary_origins(self)
        return tuple(self._boundary_value(name, origins[name]) for name in self.sends(stage_id))

    def _boundary_value(self, name: str, origin: _Origin) -> BoundaryValue:
        seen = self._seen.get(name, {})
        shape, dtype, other = origin.shape, origin.dtype, None
        if "shape" in seen or "other" in seen:
            shape, dtype, other = seen.get("shape"), seen.get("dtype"), seen.get("other")
        nbytes = seen.get("nbytes")
        if nbytes is None and shape is not None and dtype is not None:
            nbytes = math.prod(shape) * dtype.itemsize
        output = origin.output if origin.output is not None else seen.get("output")
        return BoundaryValue(
            name=name,
            kind=origin.kind,
            module=origin.module,
            module_type=origin.module_type,
            output=output,
            shape=shape,
            dtype=dtype,
            nbytes=nbytes,
            other=other,
        )

    def _output_origins(self) -> dict[str, str]:
        """``value -> module`` for the boundary values that are a module's output at a place
        the graphs do not tell (:meth:`verify` finds it)."""
        return {
            name: origin.module
            for name, origin in _boundary_origins(self).items()
            if origin.kind == "output" and origin.output is None and origin.module is not None
        }

    def describe(self) -> str:
        """A readable summary: per stage, its parameters, arguments, what it receives and sends
        (each value by where it comes from, with its shape, dtype and bytes per micro-batch)."""
        lines = [
            f"PipelinePlan: {self.num_stages} stage(s), inputs {list(self.input_names)}, "
            f"split after {list(self.split_points)}"
        ]
        for k, stage in enumerate(self.stages):
            params = list(stage.parameters())
            numel = sum(p.numel() for p in params)
            cut = f", ends after {self.split_points[k]!r}" if k < len(self.split_points) else ""
            lines.append(
                f"[Stage {k}] {self.stage_names[k]}: {len(params)} parameter tensors "
                f"({numel:,} elements){cut}"
            )
            lines.append(f"    arguments: {list(self.stage_arg_names[k])}")
            lines.append(f"    receives:  {list(self.liveness[k])}")
            if k + 1 == self.num_stages:
                lines.append("    sends:     (the model's output)")
            else:
                values = self.boundary_values(k)
                sizes = [v.nbytes for v in values]
                total = (
                    f", {sum(n for n in sizes if n is not None):,} B per micro-batch"
                    + (" (some sizes unknown)" if None in sizes else "")
                    if any(n is not None for n in sizes)
                    else ""
                )
                lines.append(f"    sends:     {len(values)} value(s){total}")
                lines.extend(f"      {value.describe()}" for value in values)
            if isinstance(stage, _modal.ModalGraphModule):
                lines.append("    runs other code in eval mode than in train mode")
        if self.tie_groups:
            lines.append("Tied parameters:")
            lines.extend(f"    {group}" for group in self.tie_groups)
        if self.buffers:
            lines.append("Buffers:")
            lines.extend(f"    {buffer.describe()}" for buffer in self.buffers)
        if self.param_dtype is not None:
            lines.append(f"Captured with {self.param_dtype} parameters (torch.export)")
        if self.recomputed:
            lines.append(f"Recomputed in backward: {list(self.recomputed)}")
        if self.autocast is not None:
            lines.append(f"Every stage runs under torch.autocast({self.autocast})")
        if self.costs is not None:
            lines.extend(self.costs.describe_lines())
        return "\n".join(lines)

    def verify(self, *args: Any, **kwargs: Any) -> None:
        """Check that the stages compute what the model computes, on these inputs.

        ``args``/``kwargs`` are one micro-batch of the plan's inputs (:attr:`input_names`),
        on the device the model is on. The plan runs stage by stage and the model in one
        piece, under ``torch.no_grad()`` from the same RNG state, in train mode and then in
        eval mode; each split point's output and the final output are compared (tensors with
        tight tolerances, everything else exactly; on the meta device structure, shapes and
        dtypes only). The model is left as it was. Call it after partitioning without
        ``example_inputs``: ``partition`` checks plans built with them itself.

        Raises:
            PlanMismatchError: the first stage whose output differs from the model's, or that
                raised (the message ends "(in eval mode)" when only eval mode differs);
                ``.stage`` and ``.path`` name it.
            CaptureError: a split-point output differs from what the torch.fx capture assumed.
            PartitionError: the inputs do not fit the plan.
        """
        _verify.verify(self, args, kwargs)

    def fingerprint(self) -> str:
        """A hash of the plan's structure and code; equal on every rank that built the same plan."""
        data = {
            "inputs": self.input_names,
            "args": self.stage_arg_names,
            "liveness": self.liveness,
            "ties": [(g.key, g.members) for g in self.tie_groups],
            "split_points": self.split_points,
            "recomputed": self.recomputed,
            "buffers": [(b.name, b.owner, b.readers, b.persistent, b.value) for b in self.buffers],
            "param_dtype": None if self.param_dtype is None else str(self.param_dtype),
            "defaults": {k: repr(v) for k, v in self.input_defaults.items()},
            "code": [_modal.stage_code(stage) for stage in self.stages],
            "params": [
                [(n, list(p.shape)) for n, p in stage.named_parameters()] for stage in self.stages
            ],
        }
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()

    def __repr__(self) -> str:
        return (
            f"PipelinePlan(num_stages={self.num_stages}, input_names={list(self.input_names)}, "
            f"split_points={list(self.split_points)}, tie_groups={len(self.tie_groups)})"
        )


def partition(
    model: nn.Module,
    split_points: Sequence[str] | None = None,
    *,
    num_stages: int | None = None,
    balance: BalanceMethod | None = None,
    micro_batches: int | None = None,
    balance_inputs: Mapping[str, Any] | None = None,
    candidates: Sequence[str] | None = None,
    bandwidth: float | None = DEFAULT_BANDWIDTH,
    recompute: Sequence[str] | str | None = None,
    concrete_args: Mapping[str, Any] | None = None,
    leaf_modules: Sequence[str | type[nn.Module]] | None = None,
    example_inputs: Mapping[str, Any] | Sequence[Any] | None = None,
    dtype: torch.dtype | None = None,
    autocast: torch.dtype | None = None,
    verify: bool = True,
) -> PipelinePlan:
    """Cut ``model`` into pipeline stages, after the given or the chosen split points.

    Args:
        model: the model; its forward is captured with torch.fx.
        split_points: module paths (``"blocks.3"``, ``"encoder.layers.5"``), in the order forward
            calls them; each stage ends after its split point's call. A split point runs as one
            call even if fx could trace through its code; the code after it still sees its
            output's real structure and constants (``None``, numbers), which the stage using
            them checks on every micro-batch ([Note: split-point outputs] in ``capture._guards``).
            With ``num_stages``, the split points every answer must contain (default: none).
        num_stages: how many stages; the split points not given are chosen by ``balance``
            (:mod:`pipedialect.cost.balance`), the same on every rank.
        balance: the cost model that chooses split points for ``num_stages``: ``"parameters"``
            (the default), ``"flops"``, ``"memory"`` or ``"time"``; all but ``"parameters"``
            measure the model on ``balance_inputs`` (or ``example_inputs``). The plan's
            :attr:`~PipelinePlan.costs` then hold every stage's predicted costs.
        micro_batches: micro-batches per step, for the ``"memory"`` model (activations 1F1B
            keeps in flight) and the predicted bubble; default: ``num_stages``.
        balance_inputs: ``{parameter name: tensor}``, one micro-batch the cost model measures
            (on fake tensors) when the forward is captured with torch.fx; default:
            ``example_inputs``.
        candidates: with ``num_stages``, the modules the chosen split points must be among;
            default: the model's own blocks (the children of its outermost ``ModuleList`` or
            ``Sequential``, e.g. the decoder layers), or every module that can end a stage
            when they cannot make ``num_stages`` stages ([Note: blocks] in
            :mod:`pipedialect.cost.balance`).
        bandwidth: with ``num_stages``, the bytes per second between stages that price the
            bytes each cut sends for ``"flops"`` and ``"time"`` (default
            :data:`pipedialect.cost.balance.DEFAULT_BANDWIDTH`); None: boundaries are free.
        recompute: module paths or glob patterns (``"blocks.*"``) whose activations are
            recomputed in backward (non-reentrant ``torch.utils.checkpoint``, dropout masks
            replayed) instead of kept: the stage graphs call them through the checkpoint, so
            it works alike on every dialect. Nested matches count once, at the outermost
            module; each matched module runs as one call ([Note: recomputed calls] in
            ``capture._recompute``), or, with ``example_inputs``, its nodes of the exported graph as
            one region ([Note: recomputed regions] in ``_export``).
        concrete_args: values fixed at capture time for forward parameters that steer control
            flow (``{"use_cache": False}``); they are not plan inputs.
        leaf_modules: module paths or classes fx must call rather than trace through.
        example_inputs: ``{parameter name: tensor}`` (or a tuple of tensors in forward's
            parameter order, as ``torch.export`` takes them), one micro-batch of the model's
            inputs. Given, the forward is captured with ``torch.export`` (non-strict) instead of
            torch.fx: the plan's inputs are exactly these names, in forward's signature order,
            every other parameter keeps its default unless ``concrete_args`` fixes it (a
            forward taking ``**kwargs`` accepts other names there, e.g. ``return_dict``), and
            the stages are specialised to these shapes and dtypes (stage 0 checks them); each
            mode is captured ([Note: stage modes] in ``capture._modal``). This is the route for code
            fx cannot trace, such as transformers models ([Note: export capture] in
            ``_export``); it does not take ``leaf_modules``. The plan is then checked against
            the model on them (:meth:`PipelinePlan.verify`) before it is returned.
        dtype: with ``example_inputs``, the dtype the floating-point parameters have while
            the forward is captured and checked (buffers keep theirs), which must be the one
            the engine trains in: ``torch.bfloat16`` for ``"bf16": {"enabled": true}``
            (torch.export writes dtypes into the graphs, [Note: export precision] in
            ``_export``). Default: the parameters' own. The torch.fx capture ignores it: its
            stages follow the parameters' dtype.
        autocast: with ``example_inputs``, a dtype (``torch.bfloat16``) every stage runs its
            ops under ``torch.autocast`` in, over fp32 parameters: mixed precision as
            accelerate and Hugging Face's ``Trainer`` mean it, where ``dtype=`` is DeepSpeed's
            ([Note: stages under autocast] in ``_export``). The plan is checked against the
            model run under the same autocast.
        verify: with ``example_inputs``, whether to check the plan on them (default: yes).

    The model is left exactly as it was: buffers, Python attributes and train/eval flags of
    every module are restored after capture, also when it raises ([Note: module state] in
    ``_state``). Both capture paths keep in-place buffer updates, ``no_grad``/autocast regions
    ([Note: grad-mode regions] in ``capture._regions``) and both modes' code (each stage runs its
    train-mode code under ``train()`` and its eval-mode code under ``eval()``).

    Raises:
        SplitPointError: a split point is unknown, never called, called more than once, out of
            execution order, or leaves the last stage empty; or neither ``split_points`` nor
            ``num_stages`` is given.
        ConfigError: ``balance`` or ``micro_batches`` without ``num_stages``, an unknown
            method, or one that needs inputs it was not given.
        RecomputeError: a ``recompute`` pattern matches no module, a recomputed
            module contains a split point, or it writes a buffer (``example_inputs``).
        CaptureError: torch.fx or torch.export cannot capture the forward (the message says
            what to try); forward changes a Python attribute while it is traced; a grad-mode
            or autocast region contains a split point; the two modes send different values
            across a boundary; a buffer is written by two stages, read before a later stage
            writes it, or read inside a module called as one op in another stage than its
            writer.
        PartitionError: ``leaf_modules`` given together with ``example_inputs``; no partition
            into ``num_stages`` stages exists.
        PlanMismatchError: the plan built with ``example_inputs`` computes something else than
            the model on them; the message names the first stage that differs.
    """
    if split_points is None and num_stages is None:
        raise SplitPointError(
            "partition needs split_points=[module paths], or num_stages=N (with balance=) to "
            "choose them"
        )
    fixed = _normalise_split_points(split_points if split_points is not None else [])
    named_inputs = None if example_inputs is None else _export.named(model, example_inputs)
    if named_inputs is not None and leaf_modules:
        raise PartitionError(
            "leaf_modules steers the torch.fx capture; with example_inputs the forward is "
            "captured with torch.export, which has no leaf modules. Drop one of them."
        )
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ConfigError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    if autocast is not None and not (
        isinstance(autocast, torch.dtype) and autocast.is_floating_point and named_inputs
    ):
        raise ConfigError(
            f"autocast= takes a floating-point torch.dtype together with example_inputs (the "
            f"torch.export capture), got {autocast!r}"
            + ("" if named_inputs is not None else " without example_inputs")
        )
    recompute_paths = _resolve_recompute(model, recompute)
    capture_dtype = dtype if named_inputs is not None else None
    snapshot = _state.StateSnapshot(model)
    try:
        with _state.parameters_as(model, capture_dtype):
            plan = _partition(
                model,
                snapshot,
                fixed,
                num_stages=num_stages,
                balance=balance,
                micro_batches=micro_batches,
                balance_inputs=balance_inputs,
                candidates=candidates,
                bandwidth=bandwidth,
                recompute_paths=recompute_paths,
                concrete_args=concrete_args,
                leaf_modules=leaf_modules,
                named_inputs=named_inputs,
                capture_dtype=capture_dtype,
                autocast=autocast,
            )
    finally:
        snapshot.restore()
    logger.info("partitioned %s:\n%s", type(model).__name__, plan.describe())
    if named_inputs is not None and verify:
        plan.verify(**named_inputs)
    return plan


def _partition(
    model: nn.Module,
    snapshot: _state.StateSnapshot,
    fixed: Sequence[str],
    *,
    num_stages: int | None,
    balance: BalanceMethod | None,
    micro_batches: int | None,
    balance_inputs: Mapping[str, Any] | None,
    candidates: Sequence[str] | None,
    bandwidth: float | None,
    recompute_paths: Sequence[str],
    concrete_args: Mapping[str, Any] | None,
    leaf_modules: Sequence[str | type[nn.Module]] | None,
    named_inputs: Mapping[str, Any] | None,
    capture_dtype: torch.dtype | None,
    autocast: torch.dtype | None = None,
) -> PipelinePlan:
    """:func:`partition` once its arguments are checked; the caller restores the model."""
    training = model.training
    costs = None
    if num_stages is None:
        if balance is not None or micro_batches is not None or candidates is not None:
            raise ConfigError(
                "balance=, micro_batches= and candidates= choose split points for num_stages "
                "stages; pass num_stages=N too"
            )
        points = list(fixed)
    else:
        points, costs = _balanced(
            model,
            num_stages,
            balance or "parameters",
            fixed,
            micro_batches,
            balance_inputs if balance_inputs is not None else named_inputs,
            concrete_args,
            [*(leaf_modules or ()), *recompute_paths],
            candidates,
            bandwidth,
        )
        # The cost model's torch.fx trace runs forward's Python (counters, in-place updates of
        # buffers fx does not trace): the captures below start from the model as it was.
        snapshot.restore()
    canonical = {id(m): name for name, m in model.named_modules()}
    point_modules = [_resolve_split_point(model, path) for path in points]
    targets = [canonical[id(m)] for m in point_modules]
    _check_recompute_nesting(points, targets, recompute_paths)
    count = len(points) + 1
    names = _state.BufferNames(model)
    # Each mode is captured with the flags the unsplit model has in it ([Note: per-module
    # modes] in ``runtime.module_state``).
    table = mode_table(model)
    added: list[str] = []
    modes: dict[bool, tuple[fx.Graph, dict[fx.Node, int], list[fx.Node]]] = {}
    uses: list[_state.BufferUse] = []
    reads: dict[tuple[int, str], tuple[nn.Module, Any]] = {}
    try:
        for mode in (True, False):
            apply_modes(model, table, mode)
            with reading_attributes(reads):
                captured, how, leaf_paths = _capture(
                    model,
                    named_inputs,
                    concrete_args,
                    leaf_modules,
                    point_modules,
                    recompute_paths,
                    snapshot.watch("torch.export"),
                    autocast,
                )
            mine = list(captured.added_attrs)
            if not mode:
                mine = share_constants(model, captured.graph, mine, added)
            added.extend(mine)
            snapshot.check_unchanged(
                how, ignore=[n for n in added if _CAPTURE_CONSTANT.fullmatch(n)]
            )
            graph = captured.graph
            try:
                if named_inputs is not None:
                    split_nodes = _export.locate(graph, points, targets, model)
                else:
                    leaves = [*leaf_paths, *recompute_paths]
                    split_nodes = _locate(model, graph, points, targets, leaves)
            except SplitPointError as exc:
                if mode:
                    raise
                raise SplitPointError(f"in eval mode (model.eval()): {exc}") from exc
            stage_of = _split.assign_stages(graph, split_nodes)
            _guards.label_guards(captured.guards, stage_of)
            _regions.place_regions(graph, stage_of, split_nodes, points)
            computed = (s for n, s in stage_of.items() if not _guards.is_guard(n))
            if mode and points and not any(s == count - 1 for s in computed):
                raise SplitPointError(
                    f"split point {points[-1]!r} is the last computation in forward: the stage "
                    f"after it would compute nothing. Drop {points[-1]!r} from split_points."
                )
            if mode and recompute_paths and named_inputs is not None:
                _export.check_recomputed_called(graph, recompute_paths)
            elif mode and recompute_paths:
                _check_recompute_called(model, graph, recompute_paths, leaf_paths)
            uses.append(
                _state.analyze(graph, stage_of, names, mode, count - 1, captured.buffer_writes)
            )
            modes[mode] = (graph, stage_of, split_nodes)
        model.train(training)
        buffer_plan = _state.plan_buffers(uses, points)
        for graph, stage_of, split_nodes in modes.values():
            _state.insert_buffer_values(graph, stage_of, split_nodes, buffer_plan, names, count - 1)
            graph.lint()
        train_graph, train_stages, _ = modes[True]
        eval_graph, eval_stages, _ = modes[False]
        cut = _split.split(
            model,
            train_graph,
            train_stages,
            count,
            eval_mode=(eval_graph, eval_stages),
            split_points=points,
            training=training,
        )
    finally:
        _tracer.remove_attrs(model, added)
    if recompute_paths:
        for stage in cut.stages:
            if named_inputs is None:
                _recompute.checkpoint_calls(stage, frozenset(recompute_paths))
            else:
                _export.checkpoint_regions(stage, recompute_paths)
    if autocast is not None:
        for stage in cut.stages:
            _export.autocast_stage(stage, _modal.stage_graphs(stage), autocast)
    _record_model_names(model, cut.stages)
    path_of = {id(m): name for name, m in model.named_modules()}
    stage_modes = tuple(
        {
            name: table[path_of[id(sub)]]
            for name, sub in stage.named_modules()
            if name and path_of.get(id(sub)) in table
        }
        for stage in cut.stages
    )
    liveness = compute_liveness(cut.input_names, cut.arg_names, cut.defined_by)
    buffers = tuple(
        BufferInfo(
            name=name,
            owner=owner,
            readers=buffer_plan.readers[name],
            persistent=names.persistent[name],
            value=cut.buffer_values.get(name),
        )
        for name, owner in sorted(buffer_plan.owner.items())
    )
    return PipelinePlan(
        stages=tuple(cut.stages),
        stage_names=tuple(f"submod_{k}" for k in range(count)),
        input_names=tuple(cut.input_names),
        stage_arg_names=tuple(tuple(a) for a in cut.arg_names),
        liveness=liveness,
        tie_groups=find_tie_groups(cut.stages),
        split_points=tuple(points),
        graph=cut.top,
        model=model,
        concrete_args=dict(concrete_args or {}),
        costs=costs,
        recomputed=tuple(recompute_paths),
        buffers=buffers,
        param_dtype=None if named_inputs is None else (capture_dtype or _param_dtype(model)),
        autocast=autocast,
        input_defaults=_input_defaults(model, cut.input_names),
        module_modes=table,
        stage_modes=stage_modes,
        _model_watch=ModelWatch(
            model, cut.stages, reads, recompute_paths if named_inputs is None else ()
        ),
    )


@dataclass(frozen=True)
class _Origin:
    """Where a boundary value comes from, as the stage graphs tell it ([Note: boundary
    values])."""

    kind: str
    module: str | None
    module_type: str | None = None
    #: The output paths when the graph says (a module called as one op), else None.
    output: tuple[str, ...] | None = None
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None


def _boundary_origins(plan: PipelinePlan) -> dict[str, _Origin]:
    """Every value some stage sends, by name ([Note: boundary values])."""
    produced: dict[str, Any] = {}
    producer: dict[str, int] = {}
    consumers: dict[str, list[fx.Node]] = {}
    for k, stage in enumerate(plan.stages):
        graph = stage.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        for name, node in zip(plan.stage_arg_names[k], placeholders, strict=False):
            consumers.setdefault(name, []).extend(u for u in node.users if u.op != "output")
            if k == 0:
                produced.setdefault(name, node)
        returned = graph.output_node().args[0]
        items = list(returned) if isinstance(returned, tuple) else None
        if items is None:
            produced[plan.stage_names[k]] = returned
            producer[plan.stage_names[k]] = k
        else:
            for i, item in enumerate(items):
                produced[f"{plan.stage_names[k]}.{i}"] = item
                producer[f"{plan.stage_names[k]}.{i}"] = k
        for node in graph.nodes:
            if node.op not in ("placeholder", "output"):
                for used in node.all_input_nodes:
                    consumers.setdefault(f"@{k}:{used.name}", []).append(node)
    buffers = {b.value: b.name for b in plan.buffers if b.value}
    out: dict[str, _Origin] = {}
    names = {n for k in range(plan.num_stages) for n in plan.sends(k)}
    for name in sorted(names):
        node = produced.get(name)
        shape, dtype = _meta_shape(node)
        if name in plan.input_names:
            out[name] = _Origin("input", None, shape=shape, dtype=dtype)
        elif name in buffers:
            out[name] = _Origin("buffer", buffers[name], shape=shape, dtype=dtype)
        elif isinstance(node, fx.Node):
            inside = consumers.get(f"@{producer.get(name)}:{node.name}", [])
            users = [*consumers.get(name, []), *inside]
            out[name] = _origin_of(node, users, shape, dtype)
        else:
            out[name] = _Origin("inside", "", "forward", shape=shape, dtype=dtype)
    return out


def _meta_shape(node: Any) -> tuple[tuple[int, ...] | None, torch.dtype | None]:
    """The shape and dtype the capture recorded for ``node`` (the export path records them)."""
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    if isinstance(value, torch.Tensor) and all(isinstance(d, int) for d in value.shape):
        return tuple(int(d) for d in value.shape), value.dtype
    return None, None


def _stack(node: fx.Node) -> list[tuple[str, str]]:
    """``(module path, class name)`` of the modules whose code computed ``node``, outermost
    first, the model itself left out."""
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for path, kind in stack.values():
        if path:
            name = kind if isinstance(kind, str) else getattr(kind, "__qualname__", str(kind))
            out.append((str(path), name.rsplit(".", 1)[-1]))
    return out


def _origin_of(
    node: fx.Node,
    users: Sequence[fx.Node],
    shape: tuple[int, ...] | None,
    dtype: torch.dtype | None,
) -> _Origin:
    """The outermost module whose code computed ``node`` and that some code outside it uses:
    ``node`` is (part of) its output; or, when every use is inside all of them, the innermost
    one, inside whose forward it stays."""
    path: list[str] = []
    called = node
    while called.op == "call_function" and called.target in (operator.getitem, getattr):
        key = called.args[1]
        path.insert(0, f".{key}" if called.target is getattr else f"[{key!r}]")
        if not isinstance(called.args[0], fx.Node):
            break
        called = called.args[0]
    if called.op == "call_module":  # a module called as one op: the graph says the path
        module = str(called.target)
        kind = next((t for p, t in _stack(called) if p == module), None)
        return _Origin("output", module, kind, ("".join(path),), shape, dtype)
    stack = _stack(node)
    used_in = [{p for p, _ in _stack(user)} for user in users]
    for module, kind in stack:
        if not used_in or any(module not in inside for inside in used_in):
            return _Origin("output", module, kind, None, shape, dtype)
    if stack:
        return _Origin("inside", stack[-1][0], stack[-1][1], None, shape, dtype)
    return _Origin("inside", "", "forward", None, shape, dtype)


def _record_model_names(model: nn.Module, stages: Sequence[fx.GraphModule]) -> None:
    """Set ``stage.meta[MODEL_NAMES]`` on every stage (see :data:`MODEL_NAMES`)."""
    names_of: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if isinstance(tensor, torch.Tensor):
            names_of.setdefault(id(tensor), []).append(name)
    for stage in stages:
        held = {**dict(stage.named_buffers(remove_duplicate=False))}
        held.update(stage.named_parameters(remove_duplicate=False))
        stage.meta[MODEL_NAMES] = {
            name: tuple(names_of[id(tensor)])
            for name, tensor in held.items()
            if len(names_of.get(id(tensor), ())) > 1
        }


#: Names the captures give the constants they set on the model (fx's tensor constants,
#: export's constants and subgraphs).
_CAPTURE_CONSTANT = re.compile(r"_tensor_constant\d+|_torchbind_obj\d+|_export_constant\d+")


def _capture(
    model: nn.Module,
    named_inputs: Mapping[str, Any] | None,
    concrete_args: Mapping[str, Any] | None,
    leaf_modules: Sequence[str | type[nn.Module]] | None,
    point_modules: Sequence[nn.Module],
    recompute_paths: Sequence[str],
    after_forward: Callable[..., None],
    autocast: torch.dtype | None = None,
) -> tuple[Captured, str, list[str]]:
    """One capture of the model in its current mode: the graph, the capture's name, and the
    leaf module paths. ``after_forward`` watches the export path's forward, which runs under
    ``torch.autocast(autocast)`` when given ([Note: stages under autocast] in ``_export``)."""
    hooked = _backward_hooked(model, named_inputs is not None)
    if named_inputs is not None:
        region: Any = contextlib.nullcontext()
        if autocast is not None:
            tensors = [v for v in named_inputs.values() if isinstance(v, torch.Tensor)]
            region = torch.autocast(tensors[0].device.type if tensors else "cpu", dtype=autocast)
        with region:
            captured = _export.capture(model, named_inputs, concrete_args or {}, after_forward)
        return captured, "torch.export", []
    leaf_ids, leaf_types, leaf_paths = resolve_leaves(model, leaf_modules or ())
    # A module with a backward hook is called as one op: its hooks run ([Note: hooks] in
    # ``_watch``).
    leaf_ids |= frozenset(id(m) for _, m in hooked)
    leaf_paths = [*leaf_paths, *(p for p, _ in hooked if p not in leaf_paths)]
    split_ids = frozenset(id(m) for m in point_modules)
    recompute_ids = frozenset(id(model.get_submodule(p)) for p in recompute_paths)
    captured = capture(
        model,
        leaf_ids=split_ids | leaf_ids | recompute_ids,
        leaf_types=leaf_types,
        concrete_args=concrete_args,
        split_ids=split_ids,
        checkpoint_ids=recompute_ids,
    )
    return captured, "torch.fx", leaf_paths


def _backward_hooked(model: nn.Module, exported: bool) -> list[tuple[str, nn.Module]]:
    """The modules with a backward (or backward pre-) hook, which a stage graph must call as
    one op for the hook to run ([Note: hooks] in ``_watch``).

    Raises:
        CaptureError: the root has one (no stage calls the root), or the capture is
            torch.export's, which inlines every module.
    """
    hooked = [
        (path, m) for path, m in model.named_modules() if m._backward_hooks or m._backward_pre_hooks
    ]
    if not hooked:
        return []
    paths = [p for p, _ in hooked]
    if "" in paths:
        raise CaptureError(
            f"the model's root ({type(model).__name__}) has a backward hook: no stage runs the "
            "root's call, so it would never run. Register it on the modules it is about, or "
            "on the loss"
        )
    if exported:
        raise CaptureError(
            f"modules {paths} have backward hooks (register_full_backward_hook): torch.export "
            "inlines every module, so they would never run. Partition without example_inputs: "
            "the torch.fx capture calls each such module as one op, hooks included"
        )
    return hooked


def _param_dtype(model: nn.Module) -> torch.dtype | None:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def _input_defaults(model: nn.Module, input_names: Sequence[str]) -> dict[str, Any]:
    """forward's default values of the plan's inputs that the stages can take instead of a
    value: Python numbers. The capture traced each input as a value; a ``None`` (or other
    object) default could not stand in for one (``concrete_args`` fixes such an input)."""
    parameters = inspect.signature(model.forward).parameters
    defaults: dict[str, Any] = {}
    for name in input_names:
        parameter = parameters.get(name)
        if parameter is not None and type(parameter.default) in (bool, int, float, complex):
            defaults[name] = parameter.default
    return defaults


def _engine_param_dtype(config: Mapping[str, Any]) -> torch.dtype | None:
    """The dtype a config makes the engine cast parameters to (None: it keeps theirs)."""
    for key, dtype in (
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("fp16", torch.float16),
    ):
        section = config.get(key)
        if isinstance(section, Mapping) and section.get("enabled", False):
            return dtype
    return None


def check_capture_dtype(plan: PipelinePlan, config: Mapping[str, Any]) -> None:
    """Refuse to train a plan captured by torch.export in another parameter dtype than the
    engine will give its parameters ([Note: export precision] in ``_export``).

    Raises:
        ConfigError: naming both dtypes and the ``partition(..., dtype=)`` that fits.
    """
    captured = plan.param_dtype
    if captured is None:
        return
    engine = _engine_param_dtype(config)
    if engine is None:
        engine = next(
            (p.dtype for s in plan.stages for p in s.parameters() if p.is_floating_point()),
            captured,
        )
    if engine == captured:
        return
    enabled = (
        "enables " + ("bf16" if engine == torch.bfloat16 else "fp16")
        if engine
        in (
            torch.bfloat16,
            torch.float16,
        )
        else "keeps the parameters' dtype"
    )
    raise ConfigError(
        f"the plan was captured by torch.export (example_inputs=) with {captured} parameters, "
        f"but the config {enabled}, so the engine trains {engine} parameters. torch.export "
        f"writes dtypes into the stage graphs (x.to(h.dtype) became a cast to {captured}), so "
        "the stages would fail or compute in the wrong precision. Partition for the engine's "
        f"precision: partition(model, ..., example_inputs=..., dtype={engine})"
    )


def _balanced(
    model: nn.Module,
    num_stages: int,
    balance: BalanceMethod,
    fixed: Sequence[str],
    micro_batches: int | None,
    inputs: Mapping[str, Any] | None,
    concrete_args: Mapping[str, Any] | None,
    leaf_modules: Sequence[str | type[nn.Module]],
    candidates: Sequence[str] | None,
    bandwidth: float | None,
) -> tuple[list[str], PlanCosts]:
    """Split points chosen by the cost model around ``fixed``, and the plan's predicted costs."""
    return balanced_split_points(
        model,
        num_stages,
        balance,
        example_inputs=inputs,
        split_points=fixed,
        candidates=candidates,
        micro_batches=micro_batches,
        concrete_args=concrete_args,
        leaf_modules=leaf_modules,
        bandwidth=bandwidth,
    )


def _resolve_recompute(model: nn.Module, recompute: Sequence[str] | str | None) -> list[str]:
    """The outermost modules the ``recompute`` patterns match, in ``named_modules`` order."""
    if recompute is None:
        return []
    patterns = [recompute] if isinstance(recompute, str) else list(recompute)
    names = [name for name, _ in model.named_modules() if name]
    matched: set[str] = set()
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            raise RecomputeError(
                f"recompute entry {pattern!r} is not a module path or glob pattern (a "
                "non-empty str)"
            )
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise RecomputeError(
                f"recompute pattern {pattern!r} matches no module of {type(model).__name__}"
                + close_matches(pattern, names)
            )
        matched.update(hits)
    outermost = [
        n
        for n in names
        if n in matched and not any(n.startswith(o + ".") for o in matched if o != n)
    ]
    return outermost


def _check_recompute_nesting(
    points: Sequence[str], targets: Sequence[str], recompute_paths: Sequence[str]
) -> None:
    for path, target in zip(points, targets, strict=True):
        for outer in recompute_paths:
            if target.startswith(outer + "."):
                raise RecomputeError(
                    f"split point {path!r} is inside recomputed module {outer!r}, which runs "
                    "(and is recomputed) as one call; recompute the modules inside it instead, "
                    "or choose a split point outside it"
                )


def _check_recompute_called(
    model: nn.Module, graph: fx.Graph, recompute_paths: Sequence[str], leaf_paths: Sequence[str]
) -> None:
    called = {str(n.target) for n in graph.nodes if n.op == "call_module"}
    for path in recompute_paths:
        if path not in called:
            raise RecomputeError(
                f"recomputed module {path!r}: "
                + _never_called(model, path, path, [], [], leaf_paths).replace(
                    f"split point {path!r} ", "it ", 1
                )
            )


def _normalise_split_points(split_points: Sequence[str]) -> list[str]:
    if isinstance(split_points, str):
        raise SplitPointError(
            f"split_points must be a list of module paths, got the string {split_points!r}; "
            f"write [{split_points!r}]"
        )
    points = list(split_points)
    for path in points:
        if not isinstance(path, str):
            raise SplitPointError(f"split point {path!r} is not a module path (a str)")
        if not path:
            raise SplitPointError(
                "split point '' is the whole model; name a submodule after which a stage ends"
            )
    seen: set[str] = set()
    for path in points:
        if path in seen:
            raise SplitPointError(f"split point {path!r} is listed more than once")
        seen.add(path)
    return points


def _resolve_split_point(model: nn.Module, path: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        pass
    names = [name for name, _ in model.named_modules() if name]
    try:
        model.get_parameter(path)
    except AttributeError:
        raise SplitPointError(
            f"split point {path!r} is not a module of {type(model).__name__}"
            + close_matches(path, names)
        ) from None
    raise SplitPointError(
        f"split point {path!r} is a parameter, not a module; name the module that uses it"
    )


def _locate(
    model: nn.Module,
    graph: fx.Graph,
    points: Sequence[str],
    targets: Sequence[str],
    leaf_paths: Sequence[str],
) -> list[fx.Node]:
    """Find each split point's single call node and check execution order."""
    calls: dict[str, list[fx.Node]] = {t: [] for t in targets}
    position: dict[fx.Node, int] = {}
    for i, node in enumerate(graph.nodes):
        position[node] = i
        if node.op == "call_module" and node.target in calls:
            calls[str(node.target)].append(node)
    found: list[fx.Node] = []
    for path, target in zip(points, targets, strict=True):
        nodes = calls[target]
        if not nodes:
            raise SplitPointError(_never_called(model, path, target, points, targets, leaf_paths))
        check_single_call(path, len(nodes))
        found.append(nodes[0])
    check_execution_order(points, [position[node] for node in found], "calls")
    return found


def _never_called(
    model: nn.Module,
    path: str,
    target: str,
    points: Sequence[str],
    targets: Sequence[str],
    leaf_paths: Sequence[str],
) -> str:
    for other_path, other in zip(points, targets, strict=True):
        if target.startswith(other + "."):
            return (
                f"split point {path!r} is inside split point {other_path!r}, which runs as one "
                "call; a split point cannot contain another"
            )
    for leaf in leaf_paths:
        if target.startswith(leaf + "."):
            return (
                f"split point {path!r} is inside leaf module {leaf!r}, which runs as one call; "
                f"remove {leaf!r} from leaf_modules or choose another split point"
            )
    atoms = target.split(".")
    default_leaf = fx.Tracer()
    for i in range(1, len(atoms)):
        prefix = ".".join(atoms[:i])
        if default_leaf.is_leaf_module(model.get_submodule(prefix), prefix):
            return (
                f"split point {path!r} is inside {prefix!r}, a torch.nn module that runs as one "
                "call; choose a split point outside it"
            )
    return (
        f"split point {path!r} is never called by forward (a module forward does not call, or "
        "calls through .forward(...) or a functional path, is not a call fx can see); choose a "
        "module forward calls as self.<name>(...)"
    )
