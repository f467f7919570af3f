"""Which training rule a dialect broke, when its numbers differ from the unsplit model's.

"Parameter x differs after step 1" says that something is wrong, not what. So when a training
case fails, the unsplit model is trained again with one rule of the config's semantics broken
at a time (no clipping, clipping by each stage's own norm, ...): when every rank's losses and
parameters equal one such variant's, and that variant differs from the reference, the failure
names the rule and says what it requires. Variants are only trained for a failing case.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._cases import Case, get_case
from ._compare import relative_error
from ._data import LR, train_stream
from ._models import suite_model
from ._reference import plan_for, reference
from ._runner import one_thread

__all__ = ["broken_rule"]

#: Relative tolerance for "equals the variant" (the suite's own).
RTOL = 1e-6


@dataclass(frozen=True)
class _Variant:
    """The unsplit model's training with one rule changed; see :data:`_VARIANTS`."""

    #: ``"global"`` (the rule), ``"none"``, ``"per-stage"``, ``"first-stage"`` or
    #: ``"tied-per-stage"`` (a tied weight counted once per stage that holds it).
    clip: str = "global"
    #: Divide each micro-batch loss by ``gas * replicas`` before its backward.
    divide: bool = True
    #: ``torch.optim.AdamW`` (weight decay 0.01) instead of ``torch.optim.Adam``.
    adamw: bool = False
    #: Step the optimizer after every micro-batch instead of once per batch.
    step_each_micro_batch: bool = False


#: (variant, the rule's name, what the dialect did and what the rule requires).
_VARIANTS: tuple[tuple[_Variant, str, str], ...] = (
    (
        _Variant(clip="none"),
        "gradient clipping",
        "they are those of the unsplit model trained without clipping: gradient_clipping={clip} "
        "must scale the gradients by min(1, {clip} / (norm + 1e-6)), norm being their 2-norm "
        "over all stages, a tied weight counted once",
    ),
    (
        _Variant(clip="per-stage"),
        "gradient clipping",
        "they are those of the unsplit model with each stage clipped by its own gradient norm: "
        "the norm must be the global one, over all stages (sum the squared norms of every "
        "rank's stages, a tied weight counted once), and every stage scaled by the same "
        "coefficient",
    ),
    (
        _Variant(clip="first-stage"),
        "gradient clipping",
        "they are those of the unsplit model clipped by the norm of the first stage's gradients "
        "alone (upstream DeepSpeed's pipeline clipping): the norm must be the global one, over "
        "all stages, a tied weight counted once",
    ),
    (
        _Variant(clip="tied-per-stage"),
        "gradient clipping",
        "they are those of the unsplit model clipped with a tied weight counted once per stage "
        "that holds it: count each tied weight once in the global norm",
    ),
    (
        _Variant(divide=False),
        "loss scaling",
        "they are those of the unsplit model trained on the sum of the micro-batch losses: "
        "divide each micro-batch loss by gradient_accumulation_steps x replicas ({scale}) "
        "before its backward",
    ),
    (
        _Variant(adamw=True),
        "the optimizer",
        "they are those of the unsplit model trained with AdamW (decoupled weight decay 0.01): "
        '"type": "Adam" with "adam_w_mode": false and "torch_adam": true is torch.optim.Adam '
        "(pipedialect.engine.config.build_optimizer builds what DeepSpeed builds)",
    ),
    (
        _Variant(step_each_micro_batch=True),
        "one optimizer step per batch",
        "they are those of the unsplit model with an optimizer step after every micro-batch: "
        "train_batch() accumulates gradient_accumulation_steps micro-batches, then steps once",
    ),
)


@dataclass(frozen=True)
class _Trained:
    losses: tuple[float, ...]
    params: tuple[dict[str, torch.Tensor], ...]


def _call(model: Any, inputs: Any) -> Any:
    return model(*inputs) if isinstance(inputs, tuple | list) else model(inputs)


def _stage_params(case: Case, model: torch.nn.Module) -> list[list[torch.nn.Parameter]]:
    """``model``'s parameters, grouped by the stage of the case's plan that holds them."""
    stages = plan_for(case.id).stages
    return [
        [model.get_parameter(name) for name, _ in stage.named_parameters(remove_duplicate=False)]
        for stage in stages
    ]


def _unique(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    return list({id(p): p for p in params}.values())


def _clip(
    variant: _Variant, max_norm: float, model: torch.nn.Module, by_stage: Sequence[Sequence[Any]]
) -> None:
    def norm(params: Iterable[torch.nn.Parameter]) -> torch.Tensor:
        grads = [p.grad.detach().float() for p in params if p.grad is not None]
        if not grads:
            return torch.zeros(())
        return torch.stack([g.norm(2) for g in grads]).pow(2).sum().sqrt()

    def scale(params: Iterable[torch.nn.Parameter], total: torch.Tensor) -> None:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)

    everything = _unique(model.parameters())
    if variant.clip == "global":
        scale(everything, norm(everything))
    elif variant.clip == "per-stage":
        norms = [norm(_unique(stage)) for stage in by_stage]
        for stage, total in zip(by_stage, norms, strict=True):
            scale(_unique(stage), total)
    elif variant.clip == "first-stage":
        scale(everything, norm(_unique(by_stage[0])))
    elif variant.clip == "tied-per-stage":
        per_stage = [norm(_unique(stage)).pow(2) for stage in by_stage]
        scale(everything, torch.stack(per_stage).sum().sqrt())


@functools.cache
def _train(case_id: str, variant: _Variant) -> _Trained:
    case = get_case(case_id)
    spec = suite_model(case.model)
    model = spec.build(0)
    by_stage = _stage_params(case, model)
    params = list(model.parameters())
    cls = torch.optim.AdamW if variant.adamw else torch.optim.Adam
    optimizer = cls(params, lr=LR)
    streams = [iter(train_stream(case, d)) for d in range(case.data_parallel)]
    scale = case.gas * case.data_parallel
    losses: list[float] = []
    snapshots: list[dict[str, torch.Tensor]] = []
    for _ in range(case.steps):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for stream in streams:
            for _ in range(case.gas):
                inputs, labels = next(stream)
                loss = spec.loss_fn(_call(model, inputs), labels)
                torch.autograd.backward(loss / scale if variant.divide else loss)
                total += float(loss.item())
                if variant.step_each_micro_batch:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
        if not variant.step_each_micro_batch:
            if case.clip > 0 and variant.clip != "none":
                _clip(variant, case.clip, model, by_stage)
            optimizer.step()
        losses.append(total / scale)
        snapshots.append(
            {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
        )
    return _Trained(tuple(losses), tuple(snapshots))


def _applies(variant: _Variant, case: Case) -> bool:
    """Whether ``variant`` can differ from the rule on ``case``: clipping variants need clipping."""
    if variant.clip != "global" and case.clip <= 0:
        return False
    if variant.clip in ("per-stage", "first-stage") and case.stages < 2:
        return False
    return variant.clip != "tied-per-stage" or bool(plan_for(case.id).tie_groups)


def _close(
    losses: Sequence[float], params: Sequence[Mapping[str, torch.Tensor]], want: _Trained
) -> bool:
    """Whether ``losses`` and ``params`` (by name, per step) equal ``want``'s."""
    if len(losses) != len(want.losses) or len(params) != len(want.params):
        return False
    for a, e in zip(losses, want.losses, strict=True):
        if abs(a - e) > RTOL * max(abs(e), 1e-7):
            return False
    for got, expected in zip(params, want.params, strict=True):
        for name, value in got.items():
            if name not in expected or relative_error(value, expected[name]) > RTOL:
                return False
    return True


def _flat(snapshot: Mapping[int, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One step's ``{stage: {name: value}}`` as ``{name: value}``."""
    return {name: value for named in snapshot.values() for name, value in named.items()}


def broken_rule(case: Case, records: Mapping[int, Mapping[str, Any]]) -> str | None:
    """The rule whose breaking explains every rank's numbers, as a sentence; None if none does."""
    ranks = [rec for rec in records.values() if rec.get("losses") and rec.get("params")]
    if not ranks:
        return None
    ref = reference(case.id)
    baseline = _Trained(ref.losses, ref.params)
    with one_thread():
        for variant, rule, text in _VARIANTS:
            if not _applies(variant, case):
                continue
            trained = _train(case.id, variant)
            if _close(trained.losses, trained.params, baseline):
                continue  # on this case the variant trains as the rule does: it explains nothing
            if all(
                _close(rec["losses"], [_flat(s) for s in rec["params"]], trained) for rec in ranks
            ):
                detail = text.format(clip=case.clip, scale=case.gas * case.data_parallel)
                return (
                    f"rule broken: {rule}. Every rank's losses and parameters differ from the "
                    f"unsplit model's, but {detail}"
                )
    return None
