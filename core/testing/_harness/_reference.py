"""The independent reference: the unsplit model trained by a plain PyTorch loop.

Nothing here touches a dialect, a stage wrapper or a codec. The loop applies the config's
semantics as DeepSpeed 0.19 does: each micro-batch loss is divided by ``gas * replicas`` before
its backward, the gradient norm is clipped over all parameters (a tied one once), Adam steps
once per batch, and the reported loss is the mean micro-batch loss over all replicas.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from ...plan.partition import PipelinePlan, partition
from ._cases import Case, get_case
from ._data import LR, eval_stream, train_stream
from ._models import suite_model
from ._runner import one_thread

__all__ = ["Reference", "expected_receives", "plan_for", "reference", "tied_names"]


@dataclass(frozen=True)
class Reference:
    """What the unsplit model gives on a case's data."""

    #: The mean micro-batch loss of each step.
    losses: tuple[float, ...]
    #: Every parameter by every name it has, after each step.
    params: tuple[dict[str, torch.Tensor], ...]
    #: The parameters before training.
    initial: dict[str, torch.Tensor]
    #: The mean evaluation loss after training.
    eval_loss: float


def _call(model: Any, inputs: Any) -> Any:
    return model(*inputs) if isinstance(inputs, tuple | list) else model(inputs)


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}


@functools.cache
def reference(case_id: str) -> Reference:
    """Train the unsplit model of ``case_id`` in this process (cached per process)."""
    with one_thread():
        return _train_unsplit(get_case(case_id))


def _train_unsplit(case: Case) -> Reference:
    spec = suite_model(case.model)
    model = spec.build(0)
    params = list(model.parameters())
    optimizer = torch.optim.Adam(params, lr=LR)
    streams = [iter(train_stream(case, d)) for d in range(case.data_parallel)]
    scale = case.gas * case.data_parallel
    initial = _snapshot(model)
    losses: list[float] = []
    snapshots: list[dict[str, torch.Tensor]] = []
    for _ in range(case.steps):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for stream in streams:
            for _ in range(case.gas):
                inputs, labels = next(stream)
                loss = spec.loss_fn(_call(model, inputs), labels)
                torch.autograd.backward(loss / scale)
                total += float(loss.item())
        if case.clip > 0:
            torch.nn.utils.clip_grad_norm_(params, case.clip)
        optimizer.step()
        losses.append(total / scale)
        snapshots.append(_snapshot(model))
    with torch.no_grad():
        evals = [
            float(spec.loss_fn(_call(model, inputs), labels).item())
            for d in range(case.data_parallel)
            for inputs, labels in eval_stream(case, d)
        ]
    return Reference(tuple(losses), tuple(snapshots), initial, sum(evals) / len(evals))


@functools.cache
def expected_receives(case_id: str) -> dict[int, tuple[tuple[str, ...], list[Any]]]:
    """What each stage ``k > 0`` receives in the first training micro-batch of replica 0.

    Computed by calling the plan's stage modules directly, in order (no wrapper, no codec):
    ``{k: (value names, values)}``.
    """
    case = get_case(case_id)
    plan = plan_for(case_id)
    inputs, _ = train_stream(case, 0, count=1)[0]
    inputs = tuple(inputs) if isinstance(inputs, tuple | list) else (inputs,)
    env: dict[str, Any] = dict(zip(plan.input_names, inputs, strict=True))
    out: dict[int, tuple[tuple[str, ...], list[Any]]] = {}
    with torch.no_grad(), one_thread():
        for k, stage in enumerate(plan.stages):
            if k > 0:
                out[k] = (plan.liveness[k], [env[name] for name in plan.liveness[k]])
            result = stage(*(env[name] for name in plan.stage_arg_names[k]))
            env[plan.stage_names[k]] = result
            if isinstance(result, tuple):
                for i, item in enumerate(result):
                    env[f"{plan.stage_names[k]}.{i}"] = item
    return out


@functools.cache
def plan_for(case_id: str) -> PipelinePlan:
    """The plan of ``case_id``'s model, partitioned in this process."""
    case = get_case(case_id)
    spec = suite_model(case.model)
    return partition(spec.build(0), spec.split_points_for(case.stages))


def tied_names(case_id: str) -> dict[str, tuple[str, list[tuple[str, int]]]]:
    """For each tied parameter name of the case's plan: its group key and the other members."""
    out: dict[str, tuple[str, list[tuple[str, int]]]] = {}
    for group in plan_for(case_id).tie_groups:
        for name, stage in group.members:
            others = [(n, s) for n, s in group.members if (n, s) != (name, stage)]
            out[name] = (group.key, others)
    return out
