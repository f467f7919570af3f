"""What each rank runs in ``test_deepspeed_recipe`` (module-level, so spawned ranks import it).

Each worker builds the whole model (the same weights on every rank), partitions it and trains
its stage with the real DeepSpeed ``PipelineEngine`` over gloo, then returns the losses and its
stage's parameters under the model's names, for the test process to compare with the unsplit
model trained by plain PyTorch.
"""

from __future__ import annotations

from typing import Any

import _model_registry
import torch
from torch import nn

import pipedialect
from pipedialect.engine.param_groups import no_weight_decay
from pipedialect.models import get_model
from pipedialect.plan.partition import partition


def recipe_config(
    optimizer: str, *, gas: int, micro: int, dp: int, zero_stage: int = 0, clip: float = 0.0
) -> dict[str, Any]:
    """``_model_registry.ds_config``, with a ``zero_optimization`` section if ``zero_stage > 0``."""
    config = _model_registry.ds_config(optimizer, gas=gas, micro=micro, dp=dp, clip=clip)
    if zero_stage:
        config["zero_optimization"] = {"stage": zero_stage}
    return config


def _build(
    num_stages: int, dp: int, config: dict[str, Any], **engine_kwargs: Any
) -> tuple[Any, Any, Any]:
    spec = get_model("gpt")
    plan = partition(spec.build(0), spec.split_points_for(num_stages))
    dialect = pipedialect.get_dialect("deepspeed")
    dialect.init_distributed()
    module = dialect.pipe_engine(
        plan, config=config, loss_fn=spec.loss_fn, topology=dialect.make_topology(num_stages, dp)
    )
    engine = dialect.runtime_engine(module, config=config, **engine_kwargs)
    return plan, engine, dialect


def _groups_of(engine: Any, plan: Any, stage: int) -> dict[str, float | None]:
    """Each local parameter's weight decay in the engine's optimizer, by the model's names.

    ZeRO wraps the torch optimizer; its ``param_groups`` are the torch optimizer's, one per
    group given to DeepSpeed, in order, so the groups of the basic optimizer are read with the
    parameters DeepSpeed was given (``engine.basic_optimizer`` holds them before flattening).
    """
    basic = engine.basic_optimizer
    out: dict[str, float | None] = {}
    for name, param in plan.stages[stage].named_parameters(remove_duplicate=False):
        found = [
            g.get("weight_decay")
            for g in basic.param_groups
            if any(p is param for p in g["params"])
        ]
        out[name] = found[0] if len(found) == 1 else None
    return out


def zero_run(
    num_stages: int,
    dp: int,
    optimizer: str,
    steps: int,
    *,
    zero_stage: int = 0,
    groups: bool = False,
    gas: int = 2,
    micro: int = 2,
    clip: float = 0.0,
) -> dict[str, Any]:
    """Train the tied gpt model; return losses, parameters and what the optimizer was."""
    config = recipe_config(optimizer, gas=gas, micro=micro, dp=dp, zero_stage=zero_stage, clip=clip)
    extra: dict[str, Any] = {"param_groups": no_weight_decay()} if groups else {}
    plan, engine, dialect = _build(num_stages, dp, config, **extra)
    (stage,) = dialect.local_stages(engine)
    dp_rank = engine.grid.get_data_parallel_rank()
    spec = get_model("gpt")
    data = _model_registry.data_stream(spec, steps * gas, micro, dp_rank)
    losses = [float(engine.train_batch(data_iter=data)) for _ in range(steps)]
    local = sum(p.numel() for p in plan.stages[stage].parameters())
    # The Adam state this rank holds: with ZeRO-1 only its partition of the flat fp32 copy.
    state = (
        sum(
            v.numel()
            for s in engine.optimizer.state_dict()
            .get("base_optimizer_state", {})
            .get("state", {})
            .values()
            for k, v in s.items()
            if k == "exp_avg"
        )
        if zero_stage
        else None
    )
    return {
        "losses": losses,
        "stage": stage,
        "dp_rank": dp_rank,
        "params": _model_registry.local_params(plan, stage),
        "optimizer": type(engine.optimizer).__name__,
        "zero_stage": int(engine.zero_optimization_stage()),
        "local_numel": local,
        "exp_avg_numel": state,
        "groups": _groups_of(engine, plan, stage) if groups else None,
    }


def _lm_items(count: int, seed: int) -> list[torch.Tensor]:
    """``count`` token sequences of 9 tokens: dataset items a collate function splits."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 32, (9,), generator=gen) for _ in range(count)]


def shift_collate(items: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch of next-token pairs from a list of sequences: (ids[:-1], ids[1:])."""
    ids = torch.stack(items)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def lm_batches(count: int, micro: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The micro-batches DeepSpeed's loader should make of ``_lm_items`` (in order)."""
    items = _lm_items(count * micro, seed)
    return [shift_collate(items[i * micro : (i + 1) * micro]) for i in range(count)]


def training_data_run(steps: int, *, gas: int = 2, micro: int = 2) -> dict[str, Any]:
    """Train from ``training_data`` through ``collate_fn`` (no iterator given to train_batch)."""
    config = recipe_config("adam", gas=gas, micro=micro, dp=1)
    dataset = _lm_items(steps * gas * micro, seed=5)
    plan, engine, dialect = _build(2, 1, config, training_data=dataset, collate_fn=shift_collate)
    (stage,) = dialect.local_stages(engine)
    losses = [float(engine.train_batch()) for _ in range(steps)]
    return {"losses": losses, "stage": stage, "params": _model_registry.local_params(plan, stage)}


def _error_of(build: Any) -> str:
    try:
        build()
    except pipedialect.ConfigError as exc:
        return f"ConfigError: {exc}"
    return "no error"


def grouping_errors() -> dict[str, str]:
    """Three grouping mistakes on a pp=2 gpt, each built and refused in turn, then a good build
    that trains one step: the errors of each case, and ``"trained"``."""
    config = recipe_config("adamw", gas=2, micro=2, dp=1)
    spec = get_model("gpt")
    dialect = pipedialect.get_dialect("deepspeed")
    dialect.init_distributed()
    stage = torch.distributed.get_rank()  # pipe=2, data=1: the rank is the stage

    def head_exempt(named: list[tuple[str, nn.Parameter]]) -> list[dict[str, Any]]:
        # Stage 1 exempts the tied weight (as lm_head.weight) from weight decay; stage 0 not.
        head = [p for n, p in named if n == "lm_head.weight"]
        rest = [p for n, p in named if n != "lm_head.weight"]
        return [{"params": rest}, *([{"params": head, "weight_decay": 0.0}] if head else [])]

    def build(**kwargs: Any) -> tuple[Any, Any]:
        plan = partition(spec.build(0), spec.split_points_for(2))
        topology = dialect.make_topology(2, 1)
        module = dialect.pipe_engine(plan, config=config, loss_fn=spec.loss_fn, topology=topology)
        for key in ("model_parameters", "optimizer"):
            if callable(kwargs.get(key)):  # made from this rank's plan and module
                kwargs[key] = kwargs[key](plan, module)
        # A client optimizer replaces the config's optimizer section, which must then be absent.
        used = {k: v for k, v in config.items() if k != "optimizer" or "optimizer" not in kwargs}
        return plan, dialect.runtime_engine(module, config=used, **kwargs)

    def all_but_first(plan: Any, module: nn.Module) -> list[nn.Parameter]:
        return list(module.parameters())[1:]

    def with_foreign(plan: Any, module: nn.Module) -> list[nn.Parameter]:
        other = next(plan.stages[1 - stage].parameters())
        return [*module.parameters(), other]

    def short_optimizer(plan: Any, module: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(list(module.parameters())[1:], lr=0.1)

    out = {
        "tie": _error_of(lambda: build(param_groups=head_exempt)),
        "missing": _error_of(lambda: build(model_parameters=all_but_first)),
        "foreign": _error_of(lambda: build(model_parameters=with_foreign)),
        "optimizer": _error_of(lambda: build(optimizer=short_optimizer)),
    }
    # runtime_engine without config= trains with the config pipe_engine was given
    plan = partition(spec.build(0), spec.split_points_for(2))
    module = dialect.pipe_engine(
        plan, config=config, loss_fn=spec.loss_fn, topology=dialect.make_topology(2, 1)
    )
    engine = dialect.runtime_engine(module)
    assert engine.gradient_accumulation_steps() == config["gradient_accumulation_steps"]
    engine.train_batch(data_iter=_model_registry.data_stream(spec, 2, 2, 0))
    assert stage == dialect.local_stages(engine)[0]
    out["after"] = "trained"
    return out
