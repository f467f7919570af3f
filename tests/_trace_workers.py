"""What each rank runs in the timeline tests (module-level, so spawned ranks can import it).

Each worker trains the same model twice in one process group, from the same weights on the same
micro-batches: once untraced, once inside :func:`pipedialect.trace`. It returns both runs' losses
and parameters (tracing must not change them), and the traced run's spans and bubble.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import pipedialect
from pipedialect.plan.partition import partition

GAS, MICRO, STEPS = 4, 2, 2


def _run(dialect_name: str, traced: bool, path: Path | None, **pipe_kwargs: Any) -> dict[str, Any]:
    import _model_registry

    spec = _model_registry.spec_for("gpt")
    plan = partition(spec.build(0), spec.split_points_for(2))
    config = _model_registry.ds_config("sgd", gas=GAS, micro=MICRO, dp=1)
    dialect = pipedialect.get_dialect(dialect_name)
    if dialect_name == "deepspeed":
        pipe_kwargs["topology"] = dialect.make_topology(2, 1)
    module = dialect.pipe_engine(plan, config=config, loss_fn=spec.loss_fn, **pipe_kwargs)
    engine = dialect.runtime_engine(module, config=config)
    data = iter(list(spec.micro_batches(GAS * STEPS, batch_size=MICRO, seed=7)))
    result: dict[str, Any] = {}
    if traced:
        with pipedialect.trace(engine, path) as recorded:
            losses = [float(engine.train_batch(data)) for _ in range(STEPS)]
        timeline = recorded.timeline
        assert timeline is not None
        result["spans"] = timeline.spans
        result["bubble"] = timeline.bubble()
        result["theoretical"] = timeline.theoretical_bubble()
        from torch.distributed.pipelining import schedules

        result["restored"] = (
            not {"train_batch", "eval_batch", "_INSTRUCTION_MAP"} & set(vars(engine))
            and "step" not in vars(engine.optimizer)
            and schedules._batch_p2p.__module__ == schedules.__name__
            and schedules._wait_batch_p2p.__module__ == schedules.__name__
            and not any(
                isinstance(m, pipedialect.StageWrapper)
                and (m._forward_hooks or m._forward_pre_hooks)
                for m in engine.module.modules()
            )
        )
    else:
        losses = [float(engine.train_batch(data)) for _ in range(STEPS)]
    stages = sorted(
        {m.stage_id for m in engine.module.modules() if isinstance(m, pipedialect.StageWrapper)}
    )
    result["losses"] = losses
    result["params"] = {
        f"{k}.{n}": p.detach().clone()
        for k in stages
        for n, p in plan.stages[k].named_parameters(remove_duplicate=False)
    }
    return result


def traced_and_untraced(dialect_name: str, out_dir: str) -> dict[str, Any]:
    """Untraced, then traced (and, on DeepSpeed, traced with activation recomputation)."""
    dialect = pipedialect.get_dialect(dialect_name)
    dialect.init_distributed()
    torch.set_num_threads(1)
    extra: dict[str, Any] = {"schedule": "1f1b"} if dialect_name == "torch" else {}
    runs = {
        "untraced": _run(dialect_name, False, None, **extra),
        "traced": _run(dialect_name, True, Path(out_dir) / "timeline.json", **extra),
    }
    if dialect_name == "deepspeed":
        runs["recomputed"] = _run(
            dialect_name,
            True,
            Path(out_dir) / "recomputed.json",
            activation_checkpoint_interval=1,
        )
    else:
        runs["gpipe"] = _run(dialect_name, True, Path(out_dir) / "gpipe.json", schedule="gpipe")
    runs["rank"] = torch.distributed.get_rank()
    return runs
