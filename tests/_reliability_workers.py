"""What each rank runs in the reliability tests (module-level, so spawned ranks can import it).

One launch per dialect runs every case in turn in one process group: ranks that disagree on the
plan, an iterator that runs out mid-step (then a retry), steps without data or with data
DeepSpeed cannot load, a non-finite loss (then a retry) and gradient, and checkpoints that do not
fit. A case that must fail returns the error's type, attributes, message and how long the rank
took to raise it; a case that trains returns its losses and this rank's parameters, for the test
process to compare with the unsplit model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _error_records import timed_attempt
from _reference import train_unsplit

import pipedialect
from pipedialect.models import get_model
from pipedialect.plan.partition import partition

GAS, MICRO, DATA_SEED = 4, 2, 300
_ATTRS = ("field", "ranks", "expected", "got", "step", "stage", "micro_batch", "parameter")


def config() -> dict[str, Any]:
    """Plain Adam (torch's), no clipping: the test's reference is a plain PyTorch loop."""
    return {
        "train_batch_size": GAS * MICRO,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": 1e-2, "torch_adam": True, "adam_w_mode": False},
        },
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }


def step_batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``GAS`` micro-batches of training step ``step`` (0-based), the same everywhere."""
    spec = get_model("skip")
    return list(spec.micro_batches(GAS, batch_size=MICRO, seed=DATA_SEED + step))


def with_nan(batches: list[Any], index: int) -> list[Any]:
    """``batches`` with a NaN in micro-batch ``index``'s inputs."""
    out = list(batches)
    x, y = out[index]
    x = x.clone()
    x[0, 0] = float("nan")
    out[index] = (x, y)
    return out


def _attempt(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn`` on every rank at once; return the error it raised (type, bases, attributes,
    message, seconds)."""
    dist.barrier()
    record = timed_attempt(fn, _ATTRS)
    dist.barrier()
    return record


class _Run:
    def __init__(self, dialect_name: str) -> None:
        self.dialect = pipedialect.get_dialect(dialect_name)
        self.dialect.init_distributed()
        self.rank = dist.get_rank()
        self.spec = get_model("skip")

    def build(
        self, split_points: list[str], *, dim: int = 16, check_finite: bool = False
    ) -> tuple[Any, Any]:
        plan = partition(self.spec.factory(seed=0, dim=dim), split_points)
        module = self.dialect.pipe_engine(
            plan,
            config=config(),
            loss_fn=self.spec.loss_fn,
            topology=self.dialect.make_topology(plan.num_stages),
        )
        return plan, self.dialect.runtime_engine(module, config=config(), check_finite=check_finite)

    def params(self, plan: Any, engine: Any) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for k in self.dialect.local_stages(engine):
            for n, p in plan.stages[k].named_parameters():
                out[n] = p.detach().cpu().clone()
        return out


def run(dialect_name: str, ckpt_dir: str) -> dict[str, Any]:
    """Every case on this rank; see the module docstring."""
    run = _Run(dialect_name)
    rank = run.rank
    out: dict[str, Any] = {"rank": rank}

    # Item 1: the same stage count, other split points (blocks.2 would never run on rank 0).
    out["split_points"] = _attempt(lambda: run.build(["blocks.1"] if rank == 0 else ["blocks.2"]))
    # Item 1: the same split points, a wider model on rank 1.
    out["model_size"] = _attempt(lambda: run.build(["blocks.1"], dim=16 if rank == 0 else 24))
    # Item 2: another stage count (rank 1 alone would refuse its topology).
    out["stage_count"] = _attempt(
        lambda: run.build(["blocks.1"] if rank == 0 else ["blocks.0", "blocks.2"])
    )

    # Item 6: a fresh engine's train_batch() without any data iterator.
    plan, engine = run.build(["blocks.1"])
    out["no_iterator"] = _attempt(lambda: engine.train_batch())
    # Item 3: rank 1's iterator runs out after 2 of 4 micro-batches; then a retry.
    first = step_batches(0)
    short: Iterator[Any] = iter(first if rank == 0 else first[:2])
    out["exhausted"] = _attempt(lambda: engine.train_batch(short))
    losses = [float(engine.train_batch(iter(step_batches(s)))) for s in range(2)]
    out["retry"] = {"losses": losses, "params": run.params(plan, engine)}

    # Item 6: inputs the engine would misread, or DeepSpeed's loader only assert on.
    listed = [([x, x], y) for x, y in step_batches(2)]
    out["list_input"] = _attempt(lambda: engine.train_batch(iter(listed)))
    if dialect_name == "deepspeed":  # elsewhere a dict is the model's one input
        dicts = [({"x": x}, y) for x, y in step_batches(2)]
        out["dict_input"] = _attempt(lambda: engine.train_batch(iter(dicts)))

    if dialect_name == "deepspeed":  # batch sizes DeepSpeed would only assert on
        bad = {**config(), "train_batch_size": 10}
        out["batch_sizes"] = _attempt(lambda: run.dialect.runtime_engine(engine.module, config=bad))

    # Item 8: a NaN loss at step 2, micro-batch 1 (every rank stops), then the clean step 2.
    plan, engine = run.build(["blocks.1"], check_finite=True)
    engine.train_batch(iter(step_batches(0)))
    out["nan_loss"] = _attempt(lambda: engine.train_batch(iter(with_nan(step_batches(1), 1))))
    losses = [float(engine.train_batch(iter(step_batches(1))))]
    out["nan_retry"] = {"losses": losses, "params": run.params(plan, engine)}
    # What the step kept of its losses, for the finiteness check: bytes of storage per loss
    # (mse_loss's scalar shares a buffer of its input's size on CPUs).
    if dialect_name == "deepspeed":
        kept = engine.__dict__.get("_pipedialect_losses", [])
    else:
        kept = list(engine.module.context.losses.values())
    out["kept_loss_bytes"] = [t.untyped_storage().nbytes() for t in kept]

    # Item 8: an infinite gradient of stage 0's stem.weight with every loss finite.
    plan, engine = run.build(["blocks.1"], check_finite=True)
    if 0 in run.dialect.local_stages(engine):
        weight = plan.stages[0].get_parameter("stem.weight")
        weight.register_hook(lambda g: g + float("inf"))
    out["inf_grad"] = _attempt(lambda: engine.train_batch(iter(step_batches(0))))

    # Item 6: checkpoints that do not fit.
    plan, engine = run.build(["blocks.1"])
    engine.train_batch(iter(step_batches(0)))
    engine.save_checkpoint(ckpt_dir, tag="small")
    dist.barrier()
    if rank == 0:
        (Path(ckpt_dir) / "latest").write_text("gone")
    dist.barrier()
    out["latest_missing"] = _attempt(lambda: engine.load_checkpoint(ckpt_dir))
    plan, engine = run.build(["blocks.1"], dim=24)
    out["resized"] = _attempt(lambda: engine.load_checkpoint(ckpt_dir, tag="small"))
    return out


def reference(steps: list[list[Any]]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The unsplit model trained on ``steps`` (lists of micro-batches): losses and parameters."""
    model = get_model("skip").factory(seed=0, dim=16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = train_unsplit(model, opt, steps, torch.nn.functional.mse_loss).losses
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
