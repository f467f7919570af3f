"""From an ``nn.Module`` and one micro-batch to the planner's chains.

[Note: measuring a model for the planner]
One measurement of the model (:func:`pipedialect.cost.balance.profile_model`: a forward and backward
on fake tensors of the example inputs, and with ``measure_time`` a timed run on the real ones;
[Note: balance trace]) gives, per gap between module events, the forward and backward seconds
(or FLOPs, turned into seconds at ``flops_per_second``), the parameters read, the tensors saved
for the backward and the bytes a cut would carry. Folding the gaps onto the candidate split
points gives the chain's atoms ([Note: the chain]).

Recomputation (``recompute=``, resolved as :func:`pipedialect.partition` resolves it: glob
patterns over module paths, the outermost match counting) changes the atoms of a recomputed
module: what its forward saved is dropped and the tensors live at its entry are kept instead
(what the checkpoint keeps, counted generously), and its forward seconds are run again in the
backward. While its backward runs, the recomputation holds again what its forward saved (one
recomputed module at a time: each is re-materialised when its own backward starts and freed
when it ends), so a stage's backward briefly holds the largest of them on top of its
micro-batches in flight (``Atom.rematerialized``). No split point may fall inside a recomputed
module, so candidates inside are left out.

Tensor parallelism (``tensor_parallel={"glob": "colwise" | "rowwise"}``, the torch dialect's
option): the matched modules' seconds, parameters and saved tensors are marked as sharded; a
row-wise module's output is all-reduced in the forward and a column-wise module's input
gradient in the backward (Megatron's pairing), their sizes taken from one more forward on fake
tensors.
"""

from __future__ import annotations

import bisect
import fnmatch
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from ..errors import ConfigError, RecomputeError, SplitPointError
from . import _profile
from ._chain import Atom, Chain
from .balance import ModelProfile, profile_model

__all__ = ["checkpoint_label", "model_chains"]

_STYLES = ("colwise", "rowwise")


def checkpoint_label(patterns: Sequence[str] | None) -> str:
    """The label of a recomputation option in tables (``""`` for none)."""
    return ",".join(patterns) if patterns else ""


def _resolve(model: nn.Module, patterns: Sequence[str], what: str) -> list[str]:
    """The outermost modules the glob ``patterns`` match, in ``named_modules`` order (as
    ``partition(..., recompute=)`` resolves them)."""
    names = [n for n, _ in model.named_modules() if n]
    matched: list[str] = []
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise ConfigError(f"{what} entry {pattern!r} is not a module path or glob (a str)")
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            error = RecomputeError if what == "recompute" else ConfigError
            raise error(f"{what} pattern {pattern!r} matches no module of {type(model).__name__}")
        matched += [h for h in hits if h not in matched]
    return [n for n in names if n in matched and not any(n.startswith(o + ".") for o in matched)]


def _batch_of(example_inputs: Mapping[str, Any]) -> int:
    for t in pytree.tree_leaves(dict(example_inputs)):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    raise ConfigError(
        "cannot tell the micro-batch size from example_inputs (no tensor with a batch "
        "dimension); pass batch_size="
    )


def _io_bytes(
    model: nn.Module,
    example_inputs: Mapping[str, Any],
    fixed: Mapping[str, Any],
    paths: Sequence[str],
) -> dict[str, tuple[int, int]]:
    """Input and output bytes of the first call of each module in ``paths``, on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    swapped, _ = _profile._fake_state(model, mode, _profile._device_of(example_inputs))
    found: dict[str, tuple[int, int]] = {}
    modules = dict(model.named_modules())

    def nbytes(value: Any) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in pytree.tree_leaves(value)
            if isinstance(t, torch.Tensor)
        )

    def hook(path: str) -> Any:
        def record(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            found.setdefault(path, (nbytes((args, kwargs)), nbytes(output)))

        return record

    handles = [modules[p].register_forward_hook(hook(p), with_kwargs=True) for p in paths]
    try:
        with mode:
            kwargs = pytree.tree_map(
                lambda v: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v,
                {**dict(example_inputs), **dict(fixed)},
            )
            with torch.no_grad():
                torch.func.functional_call(
                    model, swapped, (), kwargs, tie_weights=False, strict=False
                )
    finally:
        for h in handles:
            h.remove()
    return found


def model_chains(
    model: nn.Module,
    example_inputs: Mapping[str, Any],
    *,
    recompute_options: Sequence[Sequence[str] | None] = (None,),
    tensor_parallel: Mapping[str, str] | None = None,
    measure_time: bool = False,
    repeats: int = 3,
    flops_per_second: float | None = None,
    batch_size: int | None = None,
    candidates: Sequence[str] | None = None,
    concrete_args: Mapping[str, Any] | None = None,
    leaf_modules: Sequence[str | type[nn.Module]] | None = None,
    weight_fraction: float = 0.5,
    profile: ModelProfile | None = None,
    every_rank: bool = True,
) -> dict[str, Chain]:
    """The chain of ``model`` for each recomputation option, by label
    ([Note: measuring a model for the planner]).

    Args:
        model: the model (on the meta device, unless ``measure_time``).
        example_inputs: ``{parameter name: tensor}``, one micro-batch.
        recompute_options: recomputation options: None (no recomputation) or a list of module paths
            or glob patterns, as ``partition(..., recompute=)`` takes them.
        tensor_parallel: ``{module glob: "colwise" | "rowwise"}``, the modules tensor
            parallelism would shard.
        measure_time: time forward and backward on this machine (real tensors).
        repeats: timed runs with ``measure_time``.
        flops_per_second: without ``measure_time``, the sustained FLOP/s that turns counted
            FLOPs into seconds.
        batch_size: samples in ``example_inputs`` (default: their first dimension).
        candidates: the modules that may end a stage (default: the model's blocks, [Note:
            blocks] in :mod:`pipedialect.cost.balance`, or every candidate when it has none;
            ``profile_model(...).candidates`` lists every module that can).
        concrete_args, leaf_modules: as for :func:`pipedialect.partition`.
        weight_fraction: the share of each backward in its weight pass.
        profile: a measurement already taken (:func:`pipedialect.cost.balance.profile_model` with
            these inputs).
        every_rank: with ``measure_time`` under ``torch.distributed``: every rank calls this
            and takes rank 0's times (see :func:`pipedialect.cost.balance.profile_model`).

    Raises:
        ConfigError: no way to turn work into seconds, or a bad ``tensor_parallel`` plan.
        RecomputeError: a ``recompute`` pattern matches no module.
    """
    if (
        not measure_time
        and flops_per_second is None
        and (profile is None or profile._trace.forward_time is None)
    ):
        raise ConfigError(
            "the planner needs seconds: pass measure_time=True (time the model on this "
            "machine) or flops_per_second=<the target's sustained FLOP/s>"
        )
    if flops_per_second is not None and flops_per_second <= 0:
        raise ConfigError(f"flops_per_second must be positive, got {flops_per_second}")
    if profile is None:
        profile = profile_model(
            model,
            example_inputs=example_inputs,
            concrete_args=concrete_args,
            leaf_modules=leaf_modules,
            measure_time=measure_time,
            repeats=repeats,
            every_rank=every_rank,
        )
    trace = profile._trace
    if flops_per_second is not None and not measure_time:
        if trace.forward_flops is None or trace.backward_flops is None:
            raise ConfigError("flops_per_second needs a measurement taken with example_inputs")
        forward = [f / flops_per_second for f in trace.forward_flops]
        backward = [f / flops_per_second for f in trace.backward_flops]
        timing = None
        fixed: tuple[list[float], list[float]] | None = None
    else:
        if trace.forward_time is None or trace.backward_time is None:
            raise ConfigError("the measurement has no times; pass measure_time=True")
        forward, backward = list(trace.forward_time), list(trace.backward_time)
        timing = trace.timing
        fixed = None
        if trace.forward_fixed is not None and trace.backward_fixed is not None:
            fixed = (list(trace.forward_fixed), list(trace.backward_fixed))
    batch = batch_size if batch_size is not None else _batch_of(example_inputs)
    # The model's blocks by default ([Note: blocks] in cost.balance): a cut a person would make,
    # never one inside attention between two projections.
    pool = list(profile.blocks) if len(profile.blocks) > 1 else list(profile.candidates)
    if candidates is not None:
        resolved = []
        for path in candidates:
            why = profile.why_not(path)
            if why is not None:
                raise SplitPointError(f"candidate {path!r} cannot end a pipeline stage: {why}")
            resolved.append(profile._aliases[path])
        pool = [p for p in profile.candidates if p in set(resolved)]
    tensor = _tensor_modules(model, tensor_parallel, trace, example_inputs, concrete_args or {})
    chains: dict[str, Chain] = {}
    for option in recompute_options:
        patterns = list(option) if option else []
        if isinstance(option, str):
            patterns = [option]
        ckpt = _resolve(model, patterns, "recompute") if patterns else []
        for path in ckpt:
            if path not in trace.modules:
                raise RecomputeError(
                    f"recomputed module {path!r} is never called by forward in the measured run"
                )
        label = checkpoint_label(patterns)
        chains[label] = _chain(
            trace,
            pool,
            ckpt,
            tensor,
            forward,
            backward,
            batch,
            weight_fraction,
            label,
            [b for b in profile.blocks if b in trace.modules],
            timing,
            fixed,
        )
    return chains


def _tensor_modules(
    model: nn.Module,
    plan: Mapping[str, str] | None,
    trace: _profile.Trace,
    example_inputs: Mapping[str, Any],
    fixed: Mapping[str, Any],
) -> dict[str, tuple[str, int, int]]:
    """``{module path: (style, input bytes, output bytes)}`` of the modules ``plan`` shards."""
    if not plan:
        return {}
    styles: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in _STYLES:
            raise ConfigError(
                f"tensor_parallel style {style!r} for {pattern!r} is not one of {_STYLES}"
            )
        for path in _resolve(model, [pattern], "tensor_parallel"):
            styles[path] = style
    for path in styles:
        rec = trace.modules.get(path)
        if rec is None or rec.calls != 1:
            raise ConfigError(
                f"tensor_parallel module {path!r} must be called exactly once by forward "
                f"(it is called {0 if rec is None else rec.calls} times)"
            )
    io = _io_bytes(model, example_inputs, fixed, list(styles))
    return {path: (style, *io.get(path, (0, 0))) for path, style in styles.items()}


def _chain(
    trace: _profile.Trace,
    pool: Sequence[str],
    recomputed: Sequence[str],
    tensor: Mapping[str, tuple[str, int, int]],
    forward: Sequence[float],
    backward: Sequence[float],
    batch: int,
    weight_fraction: float,
    label: str,
    blocks: Sequence[str] = (),
    timing: _profile.Timing | None = None,
    fixed: tuple[Sequence[float], Sequence[float]] | None = None,
) -> Chain:
    modules = trace.modules
    forward_fixed, backward_fixed = fixed or ([0.0] * len(forward), [0.0] * len(backward))
    ordered = sorted(
        (p for p in pool if not any(p.startswith(c + ".") for c in recomputed)),
        key=lambda p: modules[p].exit,
    )
    xs = [modules[p].exit for p in ordered]
    enters = [modules[p].enter for p in ordered]
    nested_from = tuple(bisect.bisect_right(xs, enters[j]) for j in range(len(ordered)))
    last_op = max((g for g, n in enumerate(trace.ops) if n), default=0)
    atoms_of = _profile.fold(trace, xs)
    ckpt_gaps: dict[int, str] = {}
    for path in recomputed:
        rec = modules[path]
        for g in range(rec.enter + 1, rec.exit + 1):
            ckpt_gaps[g] = path
    tp_gaps: dict[int, str] = {}
    for path in tensor:
        rec = modules[path]
        for g in range(rec.enter + 1, rec.exit + 1):
            tp_gaps[g] = path
    saved_per_gap = trace.saved or [{} for _ in range(len(forward))]
    crossing = trace.crossing or [0] * len(forward)
    atoms = []
    for a, gaps in enumerate(atoms_of.gaps):
        saved: dict[Hashable, int] = {}
        tp_saved: set[Hashable] = set()
        for g in gaps:
            if g in ckpt_gaps:
                continue
            for key, nbytes in saved_per_gap[g].items():
                saved[key] = nbytes
                if g in tp_gaps:
                    tp_saved.add(key)
        rematerialized = 0
        for path in recomputed:
            if modules[path].enter + 1 in gaps:
                saved[("recompute", path)] = crossing[modules[path].enter]
                rec = modules[path]
                again: dict[int, int] = {}
                for g in range(rec.enter + 1, rec.exit + 1):
                    again.update(saved_per_gap[g])
                rematerialized = max(rematerialized, sum(again.values()))
        names = atoms_of.state[a]
        params = {
            n: trace.state[n].nbytes
            for n in sorted(names)
            if trace.state[n].is_parameter and trace.state[n].trainable
        }
        state = {
            n: trace.state[n].nbytes
            for n in sorted(names)
            if not (trace.state[n].is_parameter and trace.state[n].trainable)
        }
        tp_params = frozenset(n for n in params if any(n.startswith(t + ".") for t in tensor))
        fwd_bytes = sum(
            out
            for p, (style, _, out) in tensor.items()
            if style == "rowwise" and modules[p].enter + 1 in gaps
        )
        bwd_bytes = sum(
            inp
            for p, (style, inp, _) in tensor.items()
            if style == "colwise" and modules[p].enter + 1 in gaps
        )
        tensor_count = sum(1 for p in tensor if modules[p].enter + 1 in gaps)
        block_count = sum(1 for b in blocks if modules[b].exit in gaps)
        atoms.append(
            Atom(
                forward=sum(forward[g] for g in gaps),
                backward=sum(backward[g] for g in gaps),
                parameters=params,
                state=state,
                saved=saved,
                recompute=sum(forward[g] for g in gaps if g in ckpt_gaps),
                tensor_forward=sum(forward[g] for g in gaps if g in tp_gaps),
                tensor_backward=sum(backward[g] for g in gaps if g in tp_gaps),
                tensor_parameters=tp_params,
                tensor_saved=frozenset(tp_saved),
                tensor_forward_bytes=fwd_bytes,
                tensor_backward_bytes=bwd_bytes,
                rematerialized=rematerialized,
                blocks=block_count,
                tensor_modules=tensor_count,
                forward_fixed=sum(forward_fixed[g] for g in gaps),
                backward_fixed=sum(backward_fixed[g] for g in gaps),
            )
        )
    return Chain(
        atoms=tuple(atoms),
        cuts=tuple(ordered),
        boundary=tuple(crossing[x] for x in xs),
        batch=batch,
        nested_from=nested_from,
        last_cut_below=bisect.bisect_left(xs, last_op),
        weight_fraction=weight_fraction,
        label=label,
        cpu_share=timing.cpu_share if timing is not None else None,
        threads=timing.threads if timing is not None else 1,
        input_bytes=trace.input_bytes,
        output_bytes=trace.output_bytes,
    )
