"""What each rank runs in the client optimizer tests (module-level, for spawned ranks).

A rank partitions the tied ``gpt`` test model into two stages and trains it on one dialect with
``runtime_engine(optimizer=<factory>, lr_scheduler=<factory>)`` and a config without an
``optimizer`` section: torch's AdamW over the engine's parameter groups (``no_weight_decay``)
and transformers' cosine schedule with warm-up. It returns, per step, the loss, the learning
rate before the step and the engine's global gradient norm, and its stages' parameters by their
original names, for the test process to compare with the unsplit model trained by hand with
the same optimizer and schedule.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from typing import Any

import torch

import pipedialect
from pipedialect.engine.param_groups import no_weight_decay
from pipedialect.plan.partition import partition

MODEL = "gpt"
GAS, MICRO, STEPS, WARMUP = 2, 2, 5, 2
LR, WEIGHT_DECAY = 1e-2, 0.1


def config(clip: float) -> dict[str, Any]:
    """Batch sizes and clipping only: the optimizer comes from ``runtime_engine``."""
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": clip,
        "steps_per_print": 10**9,
    }


def make_optimizer(groups: Any) -> torch.optim.Optimizer:
    """The client optimizer: torch's AdamW over whatever groups it is given."""
    return torch.optim.AdamW(groups, lr=LR, weight_decay=WEIGHT_DECAY)


def make_schedule(optimizer: torch.optim.Optimizer) -> Any:
    """The client schedule: transformers' cosine decay after a linear warm-up."""
    import transformers

    return transformers.get_cosine_schedule_with_warmup(optimizer, WARMUP, STEPS)


def engine_for(dialect_name: str, clip: float) -> tuple[Any, Any, Any]:
    """``(plan, engine, dialect)`` of the two-stage ``gpt`` with the client factories."""
    import _model_registry

    spec = _model_registry.spec_for(MODEL)
    plan = partition(spec.build(0), spec.split_points_for(2))
    dialect = pipedialect.get_dialect(dialect_name)
    extra: dict[str, Any] = {}
    if dialect_name == "deepspeed":
        extra["topology"] = dialect.make_topology(2, 1)
    module = dialect.pipe_engine(plan, config=config(clip), loss_fn=spec.loss_fn, **extra)
    engine = dialect.runtime_engine(
        module,
        config=config(clip),
        param_groups=no_weight_decay(),
        optimizer=make_optimizer,
        lr_scheduler=make_schedule,
    )
    return plan, engine, dialect


def train(dialect_name: str, clip: float) -> dict[str, Any]:
    """Train ``STEPS`` batches; return the per-step records and this rank's parameters."""
    import _model_registry

    dialect = pipedialect.get_dialect(dialect_name)
    dialect.init_distributed()
    plan, engine, dialect = engine_for(dialect_name, clip)
    spec = _model_registry.spec_for(MODEL)
    data = _model_registry.data_stream(spec, STEPS * GAS, MICRO, 0)
    losses, lrs, norms = [], [], []
    for _ in range(STEPS):
        lrs.append([float(lr) for lr in engine.get_lr()])
        losses.append(float(engine.train_batch(data_iter=data)))
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
    params: dict[str, torch.Tensor] = {}
    for stage in dialect.local_stages(engine):
        params.update(_model_registry.local_params(plan, stage))
    return {
        "losses": losses,
        "lrs": lrs,
        "norms": norms,
        "params": params,
        "optimizer": type(engine.optimizer).__name__,
        "optimizer_state_steps": sorted(
            {int(state["step"]) for state in engine.optimizer.state.values()}
        ),
    }


def _example() -> Any:
    """examples/hf_trainer.py as a module (its folder on ``sys.path`` once)."""
    import importlib
    import sys
    from pathlib import Path

    folder = str(Path(__file__).resolve().parents[1] / "examples")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module("hf_trainer")


def run_example(*argv: str) -> dict[str, Any] | None:
    """examples/hf_trainer.py's ``main()`` in this process with ``argv``: the result line it
    prints (on the process of world rank 0), None where it prints none (the other ranks).

    The test process runs it for plain Trainer's reference; launched ranks run it as torchrun's
    ranks run the script (the launcher sets the same environment), forked from a process that
    imported torch once instead of importing it afresh on every rank."""
    import contextlib
    import io
    import json
    import sys

    example = _example()
    out = io.StringIO()
    old = sys.argv
    try:
        sys.argv = [example.__file__, *argv]
        with contextlib.redirect_stdout(out):
            example.main()
    finally:
        sys.argv = old
    # Engines log to standard output too (DeepSpeed's topology lines on every rank).
    lines = [ln for ln in out.getvalue().splitlines() if ln.startswith('{"losses": [')]
    if not lines:
        return None
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def pipeline_trainer_refusals(out: str) -> list[tuple[str, str]]:
    """Build a PipelineTrainer on the torch dialect twice, each time with a setting that can
    only fail: Trainer's default gradient_accumulation_steps=1 under 1F1B over two stages, and
    split points making three stages on two processes. Returns each error's class and message
    on this rank (every rank must raise the same one, when the trainer is built)."""
    import transformers

    from pipedialect.integrations.transformers import PipelineTrainer, PipelineTrainingArguments

    example = _example()

    transformers.logging.set_verbosity_error()
    found = []
    for case in (
        {"gradient_accumulation_steps": 1},
        {"split_points": ["model.layers.0", "model.layers.2"]},
    ):
        base = example.training_arguments(out, cls=PipelineTrainingArguments, dialect="torch")
        fields = {k: v for k, v in base.to_dict().items() if k in ("output_dir", "use_cpu")}
        args = PipelineTrainingArguments(
            **fields,
            per_device_train_batch_size=2,
            per_device_eval_batch_size=2,
            gradient_accumulation_steps=case.get("gradient_accumulation_steps", 2),
            split_points=case.get("split_points"),
            report_to=[],
            dialect="torch",
        )
        try:
            PipelineTrainer(
                model=example.build_model("llama"),
                args=args,
                train_dataset=example.TokenData(8, seed=1),
            )
            found.append(("built", ""))
        except pipedialect.PipeDialectError as exc:
            found.append((type(exc).__name__, str(exc)))
    return found
