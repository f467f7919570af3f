"""What each rank runs in the torch dialect's data-parallel tests (importable by spawned ranks).

Four ranks, one gloo process group: every configuration is a pipeline of two ranks replicated
twice (``dialect.make_topology(stages, 2)``). Replica ``d`` reads the stream seeded
``DATA_SEED + d``; each rank returns its losses and the parameters of the stages it trained,
by their original names, for the test process to compare with the unsplit model trained on
both replicas' micro-batches.
"""

from __future__ import annotations

from typing import Any

import _model_registry
import torch
import torch.distributed as dist

import pipedialect
from pipedialect.plan.partition import partition

DP = 2


def _engine(case: dict[str, Any], seed: int = 0) -> tuple[Any, Any, int, dict[str, Any], Any]:
    """Build ``case``'s engine; return the plan, the engine, this rank's replica, the config
    and the model spec."""
    spec = _model_registry.spec_for(case["model"])
    config = _model_registry.ds_config(
        "adam", gas=case["gas"], micro=case["micro"], dp=DP, clip=case.get("clip", 0.0)
    )
    dialect = type(pipedialect.get_dialect("torch"))(
        schedule=case["schedule"], stages_per_rank=case.get("stages_per_rank")
    )
    topology = dialect.make_topology(case["stages"], DP)
    replica = int(topology.get_coord(dist.get_rank()).data)
    if case.get("seed_per_replica"):  # replica 1 builds other weights: replica 0's must win
        seed += replica
    plan = partition(spec.build(seed), spec.split_points_for(case["stages"]))
    module = dialect.pipe_engine(plan, config=config, loss_fn=spec.loss_fn, topology=topology)
    engine = dialect.runtime_engine(module, config=config)
    return plan, engine, replica, config, spec


def _params(plan: Any, stages: list[int]) -> dict[str, torch.Tensor]:
    return {
        n: p.detach().cpu().clone()
        for k in stages
        for n, p in plan.stages[k].named_parameters(remove_duplicate=False)
    }


def _one(case: dict[str, Any]) -> dict[str, Any]:
    plan, engine, replica, _, spec = _engine(case)
    gas, micro, steps = case["gas"], case["micro"], case["steps"]
    data = _model_registry.data_stream(spec, steps * gas, micro, replica)
    losses = [float(engine.train_batch(data_iter=data)) for _ in range(steps)]
    eval_data = _model_registry.data_stream(spec, gas, micro, DP + replica)
    eval_loss = float(engine.eval_batch(eval_data))
    return {
        "case": case,
        "rank": dist.get_rank(),
        "replica": replica,
        "stages": list(engine.stage_ids),
        "losses": losses,
        "eval_loss": eval_loss,
        "params": _params(plan, list(engine.stage_ids)),
    }


def _checkpoint_run(case: dict[str, Any], ckpt_dir: str, save_at: int) -> dict[str, Any]:
    """Train ``case`` saving after ``save_at`` steps; resume a fresh engine (other initial
    weights) from the checkpoint and train the remaining steps on the same data."""
    plan, engine, replica, _, spec = _engine(case)
    gas, micro, steps = case["gas"], case["micro"], case["steps"]
    data = _model_registry.data_stream(spec, steps * gas, micro, replica)
    losses = []
    for step in range(steps):
        losses.append(float(engine.train_batch(data_iter=data)))
        if step + 1 == save_at:
            engine.save_checkpoint(ckpt_dir, tag="mid")
    plan2, engine2, _, _, _ = _engine(case, seed=7)
    engine2.load_checkpoint(ckpt_dir)
    data = _model_registry.data_stream(spec, steps * gas, micro, replica)
    for _ in range(save_at * gas):
        next(data)
    resumed = [float(engine2.train_batch(data_iter=data)) for _ in range(steps - save_at)]
    stages = list(engine.stage_ids)
    first, second = _params(plan, stages), _params(plan2, stages)
    return {
        "losses": losses,
        "resumed": resumed,
        "params_equal": all(torch.equal(first[n], second[n]) for n in first),
        "global_steps": engine2.global_steps,
    }


def run_cases(
    cases: list[dict[str, Any]], checkpoint: dict[str, Any] | None = None, ckpt_dir: str = ""
) -> dict[str, Any]:
    """Train every case in turn (one process group), then the checkpoint round trip."""
    pipedialect.get_dialect("torch").init_distributed()
    results = []
    for case in cases:
        results.append(_one(case))
        dist.barrier()
    resumed = None if checkpoint is None else _checkpoint_run(checkpoint, ckpt_dir, save_at=2)
    return {"rank": dist.get_rank(), "results": results, "resumed": resumed}
