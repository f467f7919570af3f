"""What each rank runs in the DeepSpeed tests (module-level, so spawned ranks can import it).

Every worker builds the whole model (identical weights on every rank: per-module seeded init),
partitions it, and trains it with the real DeepSpeed PipelineEngine over gloo. It returns the
losses and the parameters of the stage it trained, by their original names, for the test process
to compare with the unsplit model. The models, data streams and configs are the suite's shared
ones (``_model_registry``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint
from _model_registry import (
    DROPNET,
    DROPOUT_SEED,
    MODULE_RECOMPUTE,
    NoGradFloatFirst,
    count_module_calls,
    data_stream,
    ds_config,
    float_batches,
    gpt16,
    local_params,
    reference_optimizer,
    spec_for,
    token_batches,
)
from _reference import call_model, steps_from, train_unsplit
from torch import nn

import pipedialect
from pipedialect.models import ModelSpec, cross_entropy_loss, get_model, mse_loss
from pipedialect.plan.partition import partition


def build(
    name: str,
    num_stages: int,
    dp: int,
    config: dict[str, Any],
    seed: int = 0,
    perturb_ties: bool = False,
) -> tuple[Any, Any, Any, ModelSpec]:
    """Partition the model and build the DeepSpeed engine on this rank.

    ``perturb_ties`` shifts every tied weight on every rank but rank 0 before the engine is
    built: the engine must make them equal again (broadcast from the first owner).
    """
    spec = spec_for(name)
    split_points = spec.split_points_for(num_stages) if num_stages > 1 else ()
    plan = partition(spec.build(seed), split_points)
    dialect = pipedialect.get_dialect("deepspeed")
    dialect.init_distributed()
    if perturb_ties and torch.distributed.get_rank() != 0:
        with torch.no_grad():
            for group in plan.tie_groups:
                name0, stage0 = next(iter(group))
                plan.stages[stage0].get_parameter(name0).add_(1.0)
    topology = dialect.make_topology(num_stages, dp)
    module = dialect.pipe_engine(
        plan,
        config=config,
        loss_fn=spec.loss_fn,
        topology=topology,
        dynamic_shapes=name == "gptvarlen",
    )
    engine = dialect.runtime_engine(module, config=config)
    return plan, engine, dialect, spec


def train(
    name: str,
    num_stages: int,
    dp: int,
    optimizer: str,
    steps: int,
    gas: int = 4,
    micro: int = 2,
    clip: float = 0.0,
    perturb_ties: bool = False,
) -> dict[str, Any]:
    """Train ``steps`` batches; return losses, this rank's stage and its parameters."""
    torch.backends.cuda.matmul.allow_tf32 = False  # exact fp32 on GPUs too
    torch.backends.cudnn.allow_tf32 = False
    config = ds_config(optimizer, gas=gas, micro=micro, dp=dp, clip=clip)
    plan, engine, dialect, spec = build(name, num_stages, dp, config, perturb_ties=perturb_ties)
    dp_rank = engine.grid.get_data_parallel_rank()
    data = data_stream(spec, steps * gas, micro, dp_rank)
    losses = [float(engine.train_batch(data_iter=data)) for _ in range(steps)]
    (stage,) = dialect.local_stages(engine)
    eval_loss = float(engine.eval_batch(data_stream(spec, gas, micro, dp_rank)))
    return {
        "losses": losses,
        "eval_loss": eval_loss,
        "device": str(next(plan.stages[stage].parameters()).device),
        # Only the local stage's parameters are in the engine (and on its device).
        "engine_holds_only_local_stage": {id(p) for p in engine.module.parameters()}
        == {id(p) for p in plan.stages[stage].parameters()},
        "stage": stage,
        "dp_rank": dp_rank,
        "params": local_params(plan, stage),
        "replicated": sorted(
            n
            for n, p in plan.stages[stage].named_parameters(remove_duplicate=False)
            if getattr(p, "ds_pipe_replicated", False)
        ),
    }


def checkpoint_run(
    name: str, num_stages: int, optimizer: str, ckpt_dir: str, save_at: int, steps: int
) -> dict[str, Any]:
    """Train, saving a checkpoint after ``save_at`` steps, or resume from it if it exists."""
    gas, micro = 2, 2
    config = ds_config(optimizer, gas=gas, micro=micro, dp=1)
    resume = (Path(ckpt_dir) / f"step{save_at}").is_dir()
    plan, engine, dialect, spec = build(name, num_stages, 1, config, seed=0 if not resume else 7)
    data = data_stream(spec, steps * gas, micro, 0)
    losses: list[float] = []
    start = 0
    if resume:
        # Different initial weights (seed 7): everything must come from the checkpoint.
        engine.load_checkpoint(ckpt_dir, tag=f"step{save_at}")
        for _ in range(save_at * gas):  # the data the first run already consumed
            next(data)
        start = save_at
    for step in range(start, steps):
        losses.append(float(engine.train_batch(data_iter=data)))
        if not resume and step + 1 == save_at:
            engine.save_checkpoint(ckpt_dir, tag=f"step{save_at}")
    (stage,) = dialect.local_stages(engine)
    return {"losses": losses, "stage": stage, "params": local_params(plan, stage)}


def fail_mid_step(name: str) -> None:
    """Rank 1's stage raises during its second training step."""
    config = ds_config("sgd", gas=2, micro=2, dp=1)
    plan, engine, dialect, spec = build(name, 2, 1, config)
    (stage,) = dialect.local_stages(engine)
    calls = {"n": 0}

    def explode(module: nn.Module, args: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure in stage 1")

    if stage == 1:
        plan.stages[1].register_forward_pre_hook(explode)
    data = data_stream(spec, 8, 2, 0)
    for _ in range(4):
        engine.train_batch(data_iter=data)


def build_errors(case: str) -> str:
    """Build an engine with one mistake; return the error's type and message."""
    spec = get_model("gpt")
    plan = partition(spec.build(0), spec.split_points_for(2))
    dialect = pipedialect.get_dialect("deepspeed")
    dialect.init_distributed()
    config = ds_config("sgd", gas=2, micro=2, dp=1)
    kwargs: dict[str, Any] = {
        "config": config,
        "loss_fn": spec.loss_fn,
        "topology": dialect.make_topology(2, 1),
    }
    if case == "stages":
        kwargs["topology"] = dialect.make_topology(1, 2)
    elif case == "missing":
        del kwargs["loss_fn"], kwargs["config"]
    try:
        dialect.pipe_engine(plan, **kwargs)
    except pipedialect.PipeDialectError as exc:
        import torch.distributed as dist

        dist.barrier()  # every rank got here: nothing hung half-way through a collective
        return f"{type(exc).__name__}: {exc}"
    return "no error"


# -- wire state: evaluation and training in any order, reset_activation_shape ----------------


#: What :func:`wire_state_run` runs: (name, model, split, dynamic, phases); a phase is
#: (steps, batches seed, sequence length or None, reset first). "t" trains, "e" evaluates.
WIRE_STATE_CASES: list[tuple[str, str, str, bool, list[tuple[str, int, int | None, bool]]]] = [
    ("dynamic", "nograd", "emit", True, [("etet", 1, None, False)]),
    ("static", "nograd", "emit", False, [("tete", 2, None, False)]),
    ("reset", "gpt16", "blocks.1", False, [("tte", 3, 16, False), ("ette", 4, 8, True)]),
]


def wire_state_model(name: str) -> tuple[nn.Module, Any]:
    if name == "nograd":
        return NoGradFloatFirst(), mse_loss
    return gpt16(), cross_entropy_loss


def wire_state_batches(seed: int, length: int | None, count: int) -> list[Any]:
    if length is None:
        return float_batches(count, seed)
    return token_batches(count, length, seed)


def wire_state_reference(model_name: str, phases: list[Any], gas: int = 2) -> tuple[Any, Any]:
    """Run the phases of a case on the unsplit model in this process (the reference)."""
    model, loss_fn = wire_state_model(model_name)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for steps, seed, length, _reset in phases:
        batches = wire_state_batches(seed, length, gas * len(steps))
        for i, step in enumerate(steps):
            chunk = batches[i * gas : (i + 1) * gas]
            model.train(step == "t")
            with torch.set_grad_enabled(step == "t"):
                total = 0.0
                for x, y in chunk:
                    loss = loss_fn(model(x), y)
                    if step == "t":
                        (loss / gas).backward()
                    total += loss.item() / gas
            if step == "t":
                opt.step()
                opt.zero_grad()
            losses.append(total)
    return losses, dict(model.named_parameters(remove_duplicate=False))


def assert_wire_state_matches(results: list[Any], cases: tuple[str, ...]) -> None:
    """Every rank of a :func:`wire_state_run` launch ran each of ``cases`` and ended where the
    unsplit model does: the same losses, step by step, and the same parameters."""
    import pytest
    from _compare import ATOL, RTOL, assert_tensor_close

    ran = {r["case"] for rank_results in results for r in rank_results}
    # Each case's unsplit run, once for all ranks.
    references = {c[0]: wire_state_reference(c[1], c[4]) for c in WIRE_STATE_CASES if c[0] in ran}
    seen = set()
    for rank_results in results:
        for r in rank_results:
            ref_losses, ref_params = references[r["case"]]
            assert r["losses"] == pytest.approx(ref_losses, rel=RTOL, abs=ATOL), r["case"]
            for name, value in r["params"].items():
                assert_tensor_close(value, ref_params[name].detach(), f"{r['case']} {name}")
            seen.add((r["case"], r["stage"]))
    assert seen == {(c, s) for c in cases for s in (0, 1)}


class SendCounter:
    """Counts the tensors DeepSpeed's point-to-point layer sends while active (the DeepSpeed
    dialect's engine sends a boundary's metadata tensor once: [Note: metadata sent once])."""

    def __init__(self) -> None:
        import deepspeed.runtime.pipe.p2p as p2p

        self.p2p = p2p
        self.original = p2p.send
        self.count = 0

    def __enter__(self) -> SendCounter:
        def counting_send(tensor: torch.Tensor, dest_stage: int, async_op: bool = False) -> Any:
            self.count += 1
            return self.original(tensor, dest_stage, async_op)

        self.p2p.send = counting_send
        return self

    def __exit__(self, *exc: object) -> None:
        self.p2p.send = self.original


def wire_state_run(
    dialect_name: str, only: tuple[str, ...] | None = None, gas: int = 2
) -> list[dict[str, Any]]:
    """The cases of :data:`WIRE_STATE_CASES` (or those named in ``only``) on a real engine,
    one after the other; on DeepSpeed, with the tensors each step sent."""
    dialect = pipedialect.get_dialect(dialect_name)
    dialect.init_distributed()
    results = []
    for name, model_name, split, dynamic, phases in WIRE_STATE_CASES:
        if only is not None and name not in only:
            continue
        model, loss_fn = wire_state_model(model_name)
        plan = partition(model, [split])
        config = ds_config("sgd", gas=gas, micro=2, dp=1)
        extra: dict[str, Any] = {"dynamic_shapes": True} if dynamic else {}
        if dialect_name == "deepspeed":
            extra["topology"] = dialect.make_topology(2, 1)
        module = dialect.pipe_engine(plan, config=config, loss_fn=loss_fn, **extra)
        engine = dialect.runtime_engine(module, config=config)
        losses: list[float] = []
        sends: list[int] = []
        for steps, seed, length, reset in phases:
            if reset:
                engine.reset_activation_shape()
            batches = wire_state_batches(seed, length, gas * len(steps))
            for i, step in enumerate(steps):
                chunk = iter(batches[i * gas : (i + 1) * gas])
                run = engine.train_batch if step == "t" else engine.eval_batch
                if dialect_name != "deepspeed":
                    losses.append(float(run(chunk)))
                    continue
                with SendCounter() as counter:
                    losses.append(float(run(chunk)))
                sends.append(counter.count)
        (stage,) = dialect.local_stages(engine)
        results.append(
            {
                "case": name,
                "stage": stage,
                "losses": losses,
                "params": local_params(plan, stage),
                "sends": sends,
            }
        )
    return results


def shape_change_without_reset() -> None:
    """Train at sequence length 16, then at 8 without ``reset_activation_shape``."""
    dialect = pipedialect.get_dialect("deepspeed")
    dialect.init_distributed()
    plan = partition(gpt16(), ["blocks.1"])
    config = ds_config("sgd", gas=2, micro=2, dp=1)
    module = dialect.pipe_engine(
        plan, config=config, loss_fn=cross_entropy_loss, topology=dialect.make_topology(2, 1)
    )
    engine = dialect.runtime_engine(module, config=config)
    engine.train_batch(iter(token_batches(2, 16, 3)))
    engine.train_batch(iter(token_batches(2, 8, 4)))


# -- activation recomputation ------------------------------------------------------------------


#: (name, model, config "pipeline" section or None, pipe_engine activation_checkpoint_interval
#: or None); every case trains 3 SGD steps of 2 micro-batches on 2 stages.
CHECKPOINT_CASES: list[tuple[str, str, dict[str, Any] | None, int | None]] = [
    ("token ids, reentrant default", "gpt", {"activation_checkpoint_interval": 1}, None),
    (
        "bool, int, no-grad float boundary, use_reentrant false",
        "mixed",
        {"activation_checkpoint_interval": 3, "use_reentrant": False},
        None,
    ),
    ("dropout, argument", "dropnet", None, 2),
    ("dropout, no checkpointing", "dropnet", None, 0),
]


def _record_grads_before_each_step(engine: Any, stage: nn.Module) -> list[dict[str, Any]]:
    """The gradients the optimizer steps with (tied ones already all-reduced), per step."""
    params = dict(stage.named_parameters(remove_duplicate=False))
    grads: list[dict[str, Any]] = []

    def snapshot(*_: Any) -> None:
        grads.append({n: p.grad.detach().clone() for n, p in params.items()})

    engine.optimizer.register_step_pre_hook(snapshot)
    return grads


def _count_calls(stage: nn.Module) -> list[int]:
    calls = [0]

    def count(*_: Any) -> None:
        calls[0] += 1

    stage.register_forward_pre_hook(count)
    return calls


def checkpointing_run(steps: int = 3, gas: int = 2) -> list[dict[str, Any]]:
    """Train every case of :data:`CHECKPOINT_CASES`; record losses, gradients, forward calls."""
    dialect = pipedialect.get_dialect("deepspeed")
    dialect.init_distributed()
    results = []
    for name, model_name, pipeline, interval in CHECKPOINT_CASES:
        spec = spec_for(model_name) if model_name != "dropnet" else DROPNET
        plan = partition(spec.build(0), spec.split_points_for(2))
        config = ds_config("sgd", gas=gas, micro=2, dp=1)
        if pipeline is not None:
            config["pipeline"] = pipeline
        kwargs = {} if interval is None else {"activation_checkpoint_interval": interval}
        module = dialect.pipe_engine(
            plan,
            config=config,
            loss_fn=spec.loss_fn,
            topology=dialect.make_topology(2, 1),
            **kwargs,
        )
        engine = dialect.runtime_engine(module, config=config)
        (stage,) = dialect.local_stages(engine)
        grads = _record_grads_before_each_step(engine, plan.stages[stage])
        calls = _count_calls(plan.stages[stage])
        torch.manual_seed(DROPOUT_SEED + stage)
        data = data_stream(spec, steps * gas, 2, 0)
        losses = [float(engine.train_batch(data_iter=data)) for _ in range(steps)]
        results.append(
            {
                "case": name,
                "stage": stage,
                "interval": engine.module.activation_checkpoint_interval,
                "losses": losses,
                "grads": grads,
                "forward_calls": calls[0],
                "params": local_params(plan, stage),
            }
        )
    from pipedialect.dialects.deepspeed._module import recompute_stage

    refused = "no error"
    try:
        engine.module.activation_checkpoint_func = torch.utils.checkpoint.checkpoint
    except pipedialect.ConfigError as exc:
        refused = str(exc)
    still = engine.module.activation_checkpoint_func is recompute_stage
    # A plain PipelineModule of stage wrappers would use DeepSpeed's checkpoint: refused.
    from deepspeed.pipe import PipelineModule

    spec = spec_for("gpt")
    plan = partition(spec.build(0), spec.split_points_for(2))
    plain = PipelineModule(
        layers=dialect.wrap_stages(plan),
        topology=dialect.make_topology(2, 1),
        loss_fn=spec.loss_fn,
        partition_method="uniform",
        activation_checkpoint_interval=1,
    )
    plain_refused = "no error"
    try:
        dialect.runtime_engine(plain, config=ds_config("sgd", gas=gas, micro=2, dp=1))
    except pipedialect.ConfigError as exc:
        plain_refused = str(exc)
    results.append(
        {
            "case": "refusals",
            "refused": refused,
            "still": still,
            "plain_refused": plain_refused,
        }
    )
    return results


def module_checkpoint_run(steps: int = 3, gas: int = 2) -> dict[str, Any]:
    """Train DropNet partitioned with ``recompute=MODULE_RECOMPUTE`` on 2 DeepSpeed stages;
    record losses, gradients, parameters and how often the recomputed modules ran."""
    dialect = pipedialect.get_dialect("deepspeed")
    dialect.init_distributed()
    plan = partition(DROPNET.build(0), DROPNET.split_points_for(2), recompute=MODULE_RECOMPUTE)
    config = ds_config("sgd", gas=gas, micro=2, dp=1)
    module = dialect.pipe_engine(
        plan, config=config, loss_fn=DROPNET.loss_fn, topology=dialect.make_topology(2, 1)
    )
    engine = dialect.runtime_engine(module, config=config)
    (stage,) = dialect.local_stages(engine)
    grads = _record_grads_before_each_step(engine, plan.stages[stage])
    path = "block0" if stage == 0 else "head"
    calls = count_module_calls(plan.stages[stage], path)
    torch.manual_seed(DROPOUT_SEED + stage)
    data = data_stream(DROPNET, steps * gas, 2, 0)
    losses, calls_after = [], []
    for _ in range(steps):
        losses.append(float(engine.train_batch(data_iter=data)))
        calls_after.append(calls[0])
    return {
        "stage": stage,
        "losses": losses,
        "grads": grads,
        "params": local_params(plan, stage),
        "calls": calls_after,
        "code": plan.stages[stage].code,
    }


def fp16_train(name: str, num_stages: int, steps: int) -> dict[str, Any]:
    """Train ``steps`` batches with fp16 and DeepSpeed's dynamic loss scaling (GPU tier)."""
    config = ds_config("adam", gas=4, micro=2, dp=1)
    config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8}
    plan, engine, dialect, spec = build(name, num_stages, 1, config)
    data = data_stream(spec, steps * 4, 2, 0)
    losses = [float(engine.train_batch(data_iter=data)) for _ in range(steps)]
    (stage,) = dialect.local_stages(engine)
    return {
        "losses": losses,
        "stage": stage,
        "dtype": str(next(plan.stages[stage].parameters()).dtype),
        "skipped": int(getattr(engine, "skipped_steps", 0)),
    }


# -- the unsplit references of the DeepSpeed tests (run in the test process) -------------------


def unsplit_reference(
    name: str, dp: int, optimizer: str, steps: int, gas: int = 4, micro: int = 2, clip: float = 0.0
) -> tuple[list[float], dict[str, torch.Tensor], float]:
    """Train the unsplit model ``name`` on ``dp`` replicas' streams (tests/_reference.py) in
    this process; return losses, parameters and an eval loss."""
    spec = spec_for(name)
    model = spec.build(0)
    opt = reference_optimizer(optimizer, list(model.parameters()))
    streams = [data_stream(spec, steps * gas, micro, r) for r in range(dp)]
    losses = train_unsplit(model, opt, steps_from(streams, steps, gas), spec.loss_fn, clip=clip)[0]
    with torch.no_grad():
        evals = []
        for r in range(dp):
            for inputs, labels in data_stream(spec, gas, micro, r):
                evals.append(spec.loss_fn(call_model(model, inputs), labels).item())
    named = dict(model.named_parameters(remove_duplicate=False))
    return losses, named, sum(evals) / len(evals)
