"""What every rank must agree on, checked before disagreement can hang or mistrain a run.

[Note: rank agreement]
Each rank partitions the model itself, so two ranks can build different pipelines: another
split point, another number of stages, another model size. Trained together they either hang
(one rank refuses its topology and leaves the others in ``new_group``) or train a model that is
none of theirs, without a word. :func:`check_plan_agreement` is therefore the first collective
a multi-process dialect's ``pipe_engine`` runs: every rank sends a small summary of what it
built (stage count, topology, split points, inputs, liveness, ties, each stage's parameter
names and shapes, a digest of each stage's code, the dialect and its options) with one
``all_gather_object`` on the default process group, and every rank raises the same
:class:`~pipedialect.PlanDisagreementError` naming the first thing that differs and the ranks
that differ, before any rank can reach a collective the others would miss.

A step has the same problem: a rank whose data iterator runs out, or whose loss is not finite,
must not leave its peers waiting in a send or a collective. :func:`agree_on_error` (one
``all_reduce`` of a flag; the errors themselves are gathered only when one is set) makes every
rank raise when any rank has an error. :func:`pull_micro_batches` reads a whole step's
micro-batches before anything is computed, so a step either runs complete or changes nothing;
:func:`first_nonfinite_loss` and :func:`first_nonfinite_grad` find what ``check_finite``
refuses.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .errors import (
    DataError,
    DataExhaustedError,
    NonFiniteError,
    PipeDialectError,
    PlanDisagreementError,
)

__all__ = [
    "agree_on_error",
    "check_inputs",
    "check_plan_agreement",
    "first_nonfinite_grad",
    "first_nonfinite_loss",
    "nonfinite_grad_error",
    "nonfinite_loss_error",
    "pull_micro_batches",
    "root_nonfinite",
]

#: Options that legitimately differ per rank (each rank has its own device).
_PER_RANK_OPTIONS = frozenset({"device"})
#: The config entries every rank must share (they fix how many micro-batches each step sends).
_CONFIG_KEYS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
)
#: How each summary field reads in a message.
_LABELS = {
    "dialect": "dialect",
    "num_stages": "number of stages",
    "topology": "topology",
    "split_points": "split after",
    "input_names": "model inputs",
    "stage_arg_names": "stage arguments",
    "liveness": "liveness (values each stage receives)",
    "tie_groups": "tied parameters",
    "parameters": "parameters (name, shape)",
    "code": "stage code digest",
    "options": "pipe_engine options",
}
#: Fields that hold one entry per stage: a difference is reported for the first stage.
_PER_STAGE = frozenset({"stage_arg_names", "liveness", "parameters", "code"})


def _topology_summary(topology: Any) -> Any:
    if topology is None:
        return None
    axes = getattr(topology, "get_axis_names", None)
    names = list(axes()) if callable(axes) else ["pipe", "data", "model"]
    try:
        return {str(axis): int(topology.get_dim(axis)) for axis in names}
    except Exception:  # not a topology: pipe_engine refuses it by name, on every rank alike
        return type(topology).__name__


def _options_summary(options: Mapping[str, Any]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for key in sorted(options):
        value = options[key]
        if key in _PER_RANK_OPTIONS:
            continue
        if value is None or isinstance(value, bool | int | float | str):
            summary[key] = value
        elif key == "config" and isinstance(value, Mapping):
            summary.update({f"config.{k}": value.get(k) for k in _CONFIG_KEYS if k in value})
    return summary


def _plan_summary(
    plan: Any, dialect: str, options: Mapping[str, Any], given: Sequence[nn.Module] | None
) -> dict[str, Any]:
    stages = list(getattr(plan, "stages", None) or given or ())
    ties = getattr(plan, "tie_groups", None)
    return {
        "dialect": dialect,
        "num_stages": len(stages),
        "topology": _topology_summary(options.get("topology")),
        "split_points": list(getattr(plan, "split_points", ())),
        "input_names": list(getattr(plan, "input_names", ())),
        "stage_arg_names": [list(a) for a in getattr(plan, "stage_arg_names", ())],
        "liveness": [list(v) for v in getattr(plan, "liveness", ())],
        "tie_groups": [] if ties is None else [(g.key, list(g.members)) for g in ties],
        "parameters": [
            # Every name, shared or not: a rank that materialised its stage (to_empty(), which
            # unties) must summarise it as one that did not.
            [(n, tuple(p.shape)) for n, p in stage.named_parameters(remove_duplicate=False)]
            for stage in stages
        ],
        "code": [
            hashlib.sha256(str(getattr(stage, "code", "")).encode()).hexdigest()[:16]
            for stage in stages
        ],
        "options": _options_summary(options),
    }


def _ranks_text(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _grouped(values: Sequence[Any]) -> list[tuple[list[int], Any]]:
    """The distinct values, each with the ranks that hold it, in order of first rank."""
    groups: dict[str, tuple[list[int], Any]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(repr(value), ([], value))[0].append(rank)
    return list(groups.values())


def _narrow(field: str, values: list[Any]) -> tuple[str, list[Any]]:
    """For a per-stage field, the first stage (and entry) whose values differ."""
    label = _LABELS[field]
    if field not in _PER_STAGE:
        return label, values
    count = max(len(v) for v in values)
    for stage in range(count):
        at = [v[stage] if stage < len(v) else None for v in values]
        if len({repr(a) for a in at}) == 1:
            continue
        if field != "parameters":
            return f"stage {stage} {label}", at
        entries = max(len(a or ()) for a in at)
        for i in range(entries):
            entry = [a[i] if a is not None and i < len(a) else "(none)" for a in at]
            if len({repr(e) for e in entry}) > 1:
                return f"stage {stage} parameter #{i} (name, shape)", entry
    return label, values


def check_plan_agreement(
    plan: Any,
    *,
    dialect: str,
    options: Mapping[str, Any] | None = None,
    stages: Sequence[nn.Module] | None = None,
) -> None:
    """Raise on every rank unless every rank built the same plan; see [Note: rank agreement].

    Call it on every rank, first thing in ``pipe_engine`` (it is a collective on the default
    process group; without one, or with one rank, it does nothing). ``options`` are the
    ``pipe_engine`` keyword arguments: ``topology`` is summarised by its axes, ``config`` by its
    batch-size entries, plain values as they are; other values and ``device`` are not compared.
    ``stages`` (the stage modules) stand in for a plan that has none (Slapo's metadata).

    Raises:
        PlanDisagreementError: the ranks differ; the message names the first field that
            differs, each rank's value, and the ranks that differ from rank 0.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = _plan_summary(plan, dialect, options or {}, stages)
    summaries: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(summaries, mine)
    for field in mine:
        values = [s[field] for s in summaries]
        if len({repr(v) for v in values}) == 1:
            continue
        label, shown = _narrow(field, values)
        groups = _grouped(shown)
        odd = tuple(r for r, v in enumerate(values) if repr(v) != repr(values[0]))
        detail = "; ".join(f"{_ranks_text(ranks)}: {value!r}" for ranks, value in groups)
        raise PlanDisagreementError(
            f"the ranks built different pipelines ({dialect} pipe_engine on rank "
            f"{dist.get_rank()}): {label} differs: {detail}. Every rank must partition the "
            "same model at the same split points and pass the same topology and options; "
            f"fix {_ranks_text(odd)} (nothing was built, so no rank is left waiting)",
            field=field,
            ranks=odd,
        )


def agree_on_error(
    error: PipeDialectError | None,
    *,
    device: torch.device,
    what: str,
    choose: Callable[[Sequence[PipeDialectError | None]], int] | None = None,
) -> None:
    """Raise on every rank if any rank has an ``error``; return on every rank otherwise.

    Every rank of the default process group calls it at the same point. Costs one
    ``all_reduce`` of one integer when nobody failed; when somebody did, the errors are gathered
    and a rank raises its own, or without one a copy of the first failing rank's, its message
    prefixed with that rank and ``what``. ``choose`` (given every rank's error, the rank whose
    error every rank raises) picks one error for all instead.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if int(flag.item()) == 0:
        return
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    if choose is not None:
        chosen = choose(errors)
    elif error is not None:
        raise error
    else:
        chosen = next(r for r, e in enumerate(errors) if e is not None)
    if chosen == dist.get_rank() and error is not None:
        raise error
    first = errors[chosen]
    first.args = (f"rank {chosen} failed {what}, so every rank stops: {first.args[0]}",)
    raise first


def root_nonfinite(errors: Sequence[PipeDialectError | None]) -> int:
    """The rank whose :class:`~pipedialect.NonFiniteError` came first: a loss, else the
    earliest stage (a ``choose`` for :func:`agree_on_error`)."""

    def order(rank: int) -> tuple[int, int, int]:
        error = errors[rank]
        if not isinstance(error, NonFiniteError):
            return (2, 0, rank)
        return (0 if error.micro_batch is not None else 1, error.stage, rank)

    return min((r for r, e in enumerate(errors) if e is not None), key=order)


def pull_micro_batches(
    data_iter: Iterator[Any], count: int, *, what: str = "train_batch", source: str | None = None
) -> list[Any]:
    """Read ``count`` items from ``data_iter`` before any of them is used.

    Raises:
        DataExhaustedError: the iterator ran out first; nothing was computed from what it gave.
    """
    source = source or "gradient_accumulation_steps"
    items: list[Any] = []
    for got in range(count):
        try:
            items.append(next(data_iter))
        except StopIteration:
            raise DataExhaustedError(
                f"{what} needs {count} micro-batches ({source}), the data iterator ran out "
                f"after {got}; nothing was computed and no gradient or parameter changed. Pass "
                f"an iterator with at least {count} more micro-batches (a repeating loader "
                "never runs out)",
                expected=count,
                got=got,
            ) from None
    return items


def check_inputs(inputs: Any, input_names: Sequence[str], index: int) -> None:
    """Refuse a tuple or list of more inputs than the model takes, explaining how it is read."""
    if isinstance(inputs, tuple | list) and len(inputs) > len(input_names):
        raise DataError(
            f"micro-batch {index}: its inputs are a {type(inputs).__name__} of {len(inputs)} "
            "values, and a tuple or list is passed as the model's positional inputs, one per "
            f"element (as DeepSpeed does), but the model takes {len(input_names)} "
            f"({list(input_names)}). Yield the input itself for a one-input model, or wrap a "
            "list-valued input in a 1-tuple: ((values,), labels)"
        )


def first_nonfinite_loss(losses: Sequence[torch.Tensor]) -> int | None:
    """The index of the first loss with a NaN or infinite element, or None (one sync)."""
    if not losses:
        return None
    flags = torch.stack([torch.isfinite(loss.detach()).all() for loss in losses])
    if bool(flags.all()):
        return None
    return int((~flags).nonzero()[0, 0])


def first_nonfinite_grad(
    named: Iterable[tuple[str, nn.Parameter]],
) -> tuple[str, torch.Tensor] | None:
    """The first ``(name, gradient)`` with a NaN or infinite element, or None (one sync)."""
    grads = [(name, p.grad) for name, p in named if p.grad is not None]
    if not grads:
        return None
    flags = torch.stack([torch.isfinite(g).all().to(grads[0][1].device) for _, g in grads])
    if bool(flags.all()):
        return None
    return grads[int((~flags).nonzero()[0, 0])]


def _kind(value: torch.Tensor) -> str:
    return "NaN" if bool(torch.isnan(value).any()) else "infinite"


def nonfinite_loss_error(
    loss: torch.Tensor, *, step: int, stage: int, micro_batch: int
) -> NonFiniteError:
    """The error ``check_finite`` raises for a non-finite loss."""
    return NonFiniteError(
        f"[Stage {stage}] step {step}, micro-batch {micro_batch}: the loss is {_kind(loss)}; the "
        "optimizer did not step and the step's gradients were dropped. Check that "
        "micro-batch's data, lower the learning rate, or pass check_finite=False to train on",
        step=step,
        stage=stage,
        micro_batch=micro_batch,
    )


def nonfinite_grad_error(name: str, grad: torch.Tensor, *, step: int, stage: int) -> NonFiniteError:
    """The error ``check_finite`` raises for a non-finite gradient."""
    return NonFiniteError(
        f"[Stage {stage}] step {step}: the gradient of parameter {name!r} is {_kind(grad)} "
        "(every micro-batch loss was finite); the optimizer did not step and the step's "
        "gradients were dropped. Lower the learning rate, enable gradient_clipping, or pass "
        "check_finite=False to train on",
        step=step,
        stage=stage,
        parameter=name,
    )
