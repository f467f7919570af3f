"""What each rank runs in the learning-rate schedule tests (module-level, for spawned ranks).

One launch trains every schedule case in turn on one dialect and returns, per case, the
learning rates of each step (``engine.get_lr()`` before the step) and the losses.
"""

from __future__ import annotations

from typing import Any

import _model_registry
import torch.distributed as dist

import pipedialect
from pipedialect.plan.partition import partition

MODEL = "gpt"
GAS = 2
MICRO = 2


def config_for(section: dict[str, Any]) -> dict[str, Any]:
    """A DeepSpeed config: plain Adam (lr 1e-2, betas for OneCycle to cycle), ``section``."""
    config = _model_registry.ds_config("adam", gas=GAS, micro=MICRO, dp=1)
    config["scheduler"] = section
    return config


def _engine(dialect_name: str, config: dict[str, Any]) -> Any:
    import _ds_workers

    if dialect_name == "deepspeed":
        return _ds_workers.build(MODEL, 2, 1, config)[1]
    spec = _model_registry.spec_for(MODEL)
    plan = partition(spec.build(0), spec.split_points_for(2))
    dialect = pipedialect.get_dialect(dialect_name)
    module = dialect.pipe_engine(plan, config=config, loss_fn=spec.loss_fn, schedule="1f1b")
    return dialect.runtime_engine(module, config=config)


def lr_run(dialect_name: str, sections: list[dict[str, Any]], steps: int) -> list[dict[str, Any]]:
    """Train ``steps`` batches per scheduler section; return the per-step rates and losses."""
    pipedialect.get_dialect(dialect_name).init_distributed()
    spec = _model_registry.spec_for(MODEL)
    results = []
    for section in sections:
        engine = _engine(dialect_name, config_for(section))
        data = _model_registry.data_stream(spec, steps * GAS, MICRO, 0)
        lrs, losses = [], []
        for _ in range(steps):
            lrs.append([float(lr) for lr in engine.get_lr()])
            losses.append(float(engine.train_batch(data_iter=data)))
        lrs.append([float(lr) for lr in engine.get_lr()])
        results.append({"rank": dist.get_rank(), "lrs": lrs, "losses": losses})
        dist.barrier()
    return results
