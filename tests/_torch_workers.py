"""What each rank runs in the torch dialect tests (module-level, so spawned ranks can import it).

Every worker joins one gloo process group and then trains several configurations one after the
other (each launch costs seconds on two shared cores; a configuration costs a fraction of one).
For each it builds the whole model (identical weights on every rank: per-module seeded init),
partitions it, trains it with ``torch.distributed.pipelining`` through the torch dialect, and
returns the losses and the parameters of the stages it trained, by their original names, for
the test process to compare with the unsplit model.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

import pipedialect
from pipedialect.models import ModelSpec, get_model
from pipedialect.plan.partition import partition

DATA_SEED = 100


def spec_for(name: str) -> ModelSpec:
    """The shared test models, plus the extra ones of the DeepSpeed tests."""
    import _model_registry

    return _model_registry.spec_for(name)


def ds_config(optimizer: str, *, gas: int, micro: int, clip: float = 0.0) -> dict[str, Any]:
    """A DeepSpeed config; ``optimizer`` is sgd, adam (plain Adam) or adamw (DeepSpeed's Adam)."""
    import _model_registry

    return _model_registry.ds_config(optimizer, gas=gas, micro=micro, dp=1, clip=clip)


def data_stream(spec: ModelSpec, count: int, micro: int) -> Iterator[Any]:
    return iter(list(spec.micro_batches(count, batch_size=micro, seed=DATA_SEED)))


def _one(case: dict[str, Any]) -> dict[str, Any]:
    """Train one configuration on this rank; return what the test compares."""
    name = case["model"]
    spec = spec_for(name)
    gas, micro, steps = case.get("gas", 4), case.get("micro", 2), case.get("steps", 3)
    config = ds_config(
        case.get("optimizer", "adam"), gas=gas, micro=micro, clip=case.get("clip", 0.0)
    )
    dialect = pipedialect.get_dialect("torch")
    if case.get("meta"):
        plan, stage_modules = _meta_plan(spec, case, dialect)
    else:
        plan, stage_modules = partition(spec.build(0), spec.split_points_for(case["stages"])), None
    module = dialect.pipe_engine(
        plan, stage_modules, config=config, loss_fn=spec.loss_fn, schedule=case["schedule"]
    )
    engine = dialect.runtime_engine(module, config=config)
    stages = list(dialect.local_stages(engine))
    reads = engine.is_first_stage() or engine.is_last_stage()
    data = (
        data_stream(spec, steps * gas, micro) if reads or not case.get("none_in_middle") else None
    )
    losses = [float(engine.train_batch(data_iter=data)) for _ in range(steps)]
    eval_data = data_stream(spec, gas, micro) if reads or not case.get("none_in_middle") else None
    eval_loss = float(engine.eval_batch(eval_data))
    short_eval = None
    if case.get("eval_micro"):
        count = case["eval_micro"]
        short = data_stream(spec, count, micro) if reads else None
        mean, logits = engine.eval_batch(short, return_logits=True, num_micro_batches=count)
        short_eval = (float(mean), None if logits is None else logits.detach().cpu())
    params: dict[str, torch.Tensor] = {}
    for k in stages:
        for n, p in plan.stages[k].named_parameters(remove_duplicate=False):
            params[n] = p.detach().cpu().clone()
    return {
        "case": case,
        "rank": dist.get_rank(),
        "stages": stages,
        "losses": losses,
        "eval_loss": eval_loss,
        "short_eval": short_eval,
        "params": params,
    }


def _meta_plan(spec: ModelSpec, case: dict[str, Any], dialect: Any) -> tuple[Any, list[Any]]:
    """The plan of the model built on the meta device, with only this rank's stages
    materialised, one by one (``to_empty()`` and the real model's values), as at scale."""
    import _tie_workers

    from pipedialect.dialects.torch._schedules import resolve_schedule, stage_to_rank

    with torch.device("meta"):
        plan = partition(spec.build(0), spec.split_points_for(case["stages"]))
    state = spec.build(0).state_dict()
    placement = stage_to_rank(
        resolve_schedule(case["schedule"]), case["stages"], dist.get_world_size()
    )
    stages = list(dialect.wrap_stages(plan))
    for k, stage in enumerate(stages):
        if placement[k] == dist.get_rank():
            _tie_workers.materialise(stage, state)
    return plan, stages


def run_cases(
    cases: list[dict[str, Any]],
    tie_sync: bool = True,
    error_cases: tuple[dict[str, Any], ...] = (),
    checkpoint_dir: str | None = None,
) -> dict[str, Any]:
    """Train every case in turn on this rank (one process group for all), then try to build an
    engine for every error case, then (with ``checkpoint_dir``) save and resume; return the
    results, the error messages and the checkpoint run."""
    if not tie_sync:
        from pipedialect.dialects.torch import _ties

        _ties.TieSync.all_reduce_grads = lambda self: None  # type: ignore[method-assign]
    dialect = pipedialect.get_dialect("torch")
    dialect.init_distributed()
    results = []
    for case in cases:
        results.append(_one(case))
        dist.barrier()
    errors = [_build_error(case) for case in error_cases]
    resumed = None if checkpoint_dir is None else _checkpoint_run(checkpoint_dir)
    return {"rank": dist.get_rank(), "results": results, "errors": errors, "resumed": resumed}


def _engine(name: str, stages: int, schedule: str, config: dict[str, Any], seed: int) -> Any:
    spec = spec_for(name)
    plan = partition(spec.build(seed), spec.split_points_for(stages))
    dialect = pipedialect.get_dialect("torch")
    module = dialect.pipe_engine(plan, config=config, loss_fn=spec.loss_fn, schedule=schedule)
    return plan, dialect.runtime_engine(module, config=config)


def _checkpoint_run(ckpt_dir: str, save_at: int = 2, steps: int = 4) -> dict[str, Any]:
    """Train ``steps`` steps saving after ``save_at``; resume a fresh engine (other initial
    weights) from the checkpoint and train the same remaining steps; then try to load the
    checkpoint into an engine of another plan."""
    gas, micro = 2, 2
    config = ds_config("adam", gas=gas, micro=micro)
    spec = spec_for("gpt")
    plan, engine = _engine("gpt", 4, "interleaved_1f1b", config, seed=0)
    data = data_stream(spec, steps * gas, micro)
    losses = []
    for step in range(steps):
        losses.append(float(engine.train_batch(data_iter=data)))
        if step + 1 == save_at:
            engine.save_checkpoint(ckpt_dir, tag="mid", client_state={"step": save_at})
    plan2, engine2 = _engine("gpt", 4, "interleaved_1f1b", config, seed=7)
    path, client = engine2.load_checkpoint(ckpt_dir)  # the tag from "latest"
    data = data_stream(spec, steps * gas, micro)
    for _ in range(save_at * gas):
        next(data)
    resumed = [float(engine2.train_batch(data_iter=data)) for _ in range(steps - save_at)]
    same = all(
        torch.equal(p, q)
        for k in engine.stage_ids
        for p, q in zip(plan.stages[k].parameters(), plan2.stages[k].parameters(), strict=True)
    )
    _, other = _engine("gpt", 2, "1f1b", config, seed=0)
    try:
        other.load_checkpoint(ckpt_dir, tag="mid")
        refused = "no error"
    except pipedialect.PipeDialectError as exc:
        refused = f"{type(exc).__name__}: {exc}"
    return {
        "losses": losses,
        "resumed": resumed,
        "client": client,
        "path": path,
        "params_equal": same,
        "refused": refused,
        "global_steps": engine2.global_steps,
    }


def _build_error(case: dict[str, Any]) -> str:
    """Build an engine with one mistake; return the error's type and message."""
    spec = get_model("gpt")
    plan = partition(spec.build(0), spec.split_points_for(case.get("stages", 2)))
    dialect = pipedialect.get_dialect("torch")
    config = ds_config("sgd", gas=4, micro=2)
    kwargs = {"config": config, "loss_fn": spec.loss_fn, **case.get("kwargs", {})}
    try:
        dialect.pipe_engine(plan, **kwargs)
    except pipedialect.PipeDialectError as exc:
        dist.barrier()  # every rank got here: nothing hung half-way through a collective
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def new_shape_mid_run() -> None:
    """The third micro-batch has a longer sequence than the first two: the sender must refuse."""
    spec = get_model("gpt")
    plan = partition(spec.build(0), spec.split_points_for(2))
    dialect = pipedialect.get_dialect("torch")
    dialect.init_distributed()
    config = ds_config("sgd", gas=4, micro=2)
    module = dialect.pipe_engine(plan, config=config, loss_fn=spec.loss_fn)
    engine = dialect.runtime_engine(module, config=config)
    batches = list(spec.micro_batches(4, batch_size=2, seed=DATA_SEED))
    ids, labels = batches[2]
    batches[2] = (ids[:, :6].contiguous(), labels[:, :6].contiguous())
    engine.train_batch(iter(batches))


class ScheduleVariants:
    """A plugin registering the torch dialect once per schedule, as ``torch-<schedule>``.

    For running the conformance suite on each schedule in one ``pipedialect check`` process
    (registered in-process: the suite's ranks receive the dialect object itself). The looped
    variants run one stage per rank, the V-shaped ones their two stages per rank.
    """

    def __init__(self, schedules: list[str]) -> None:
        self.schedules = schedules

    @pipedialect.hookimpl
    def register_dialects(self, register: Any) -> None:
        from pipedialect.dialects.torch import TorchDialect

        for schedule in self.schedules:
            v_shaped = schedule in ("zbv_zero_bubble", "dualpipev")  # two stages per rank
            dialect = TorchDialect(schedule=schedule, stages_per_rank=None if v_shaped else 1)
            dialect.name = f"torch-{schedule}"  # type: ignore[misc]
            register(dialect)


def check_schedules(schedules: list[str], select: str) -> int:
    """``pipedialect check torch-<schedule>...`` for ``schedules``, in this process."""
    from pipedialect.cli import main
    from pipedialect.plugins import register_plugin

    register_plugin(ScheduleVariants(schedules), name="torch-schedule-variants")
    return main(["check", *(f"torch-{s}" for s in schedules), "-k", select])


def module_checkpoint_run(steps: int = 3, gas: int = 2) -> dict[str, Any]:
    """DropNet partitioned with ``recompute=`` on 2 torch-dialect stages (1F1B); losses,
    parameters and how often the recomputed module of this rank's stage ran."""
    import _model_registry

    spec = _model_registry.DROPNET
    dialect = pipedialect.get_dialect("torch")
    dialect.init_distributed()
    plan = partition(
        spec.build(0), spec.split_points_for(2), recompute=_model_registry.MODULE_RECOMPUTE
    )
    config = ds_config("sgd", gas=gas, micro=2)
    module = dialect.pipe_engine(plan, config=config, loss_fn=spec.loss_fn, schedule="1F1B")
    engine = dialect.runtime_engine(module, config=config)
    (stage,) = dialect.local_stages(engine)
    calls = _model_registry.count_module_calls(
        plan.stages[stage], "block0" if stage == 0 else "head"
    )
    torch.manual_seed(_model_registry.DROPOUT_SEED + stage)
    data = _model_registry.data_stream(spec, steps * gas, 2, 0)
    losses, calls_after = [], []
    for _ in range(steps):
        losses.append(float(engine.train_batch(data_iter=data)))
        calls_after.append(calls[0])
    params = {
        n: p.detach().cpu().clone()
        for n, p in plan.stages[stage].named_parameters(remove_duplicate=False)
    }
    return {"stage": stage, "losses": losses, "params": params, "calls": calls_after}
