"""What each rank runs in the portable checkpoint tests (importable by spawned ranks).

One model, ``skiptied`` (an embedding tied to the output projection, a tie between the first and
the last of four stages), trained with plain Adam, gradient clipping that clips every step, and
8 samples per step: the micro-batches of step ``s`` are ``stream()[4 s : 4 s + 4]``, split over
the data-parallel replicas in order (replica ``d`` of ``D`` takes its ``4 / D`` in a row), so
every layout trains on the same samples per step. A :class:`Position` is the data loader whose
position the checkpoints carry.

- :func:`save_on_deepspeed_pp4`: DeepSpeed, PP=4, 3 steps, then ``pipedialect.checkpoint.save``.
- :func:`resume_on_four_ranks`: in one process group of 4, DeepSpeed PP=2 x DP=2, torch
  PP=2 x DP=2 and torch PP=2 x FSDP=2 each load that checkpoint and train 3 more steps; the
  FSDP run saves again after its first step, and DeepSpeed PP=2 x DP=2 and torch PP=4 resume
  that one.
- :func:`killed_in_save`: a local save SIGKILLed midway (the crash-test hook).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import _model_registry
import torch
import torch.distributed as dist

import pipedialect
import pipedialect.checkpoint as ckpt
from pipedialect.plan.partition import partition
from pipedialect.runtime.sharded import is_sharded

MODEL = "skiptied"
MICRO, SAMPLES_PER_STEP, CLIP, LR = 2, 8, 0.05, 1e-2
SAVED_AT, STEPS = 3, 6
MICRO_PER_STEP = SAMPLES_PER_STEP // MICRO
#: The save-kill test hook of pipedialect.engine.checkpoint_files.
KILL_ENV = "PIPEDIALECT_TEST_KILL_IN_SAVE"


def stream() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every micro-batch of the whole run, in order."""
    spec = _model_registry.spec_for(MODEL)
    return list(spec.micro_batches(STEPS * MICRO_PER_STEP, batch_size=MICRO, seed=500))


def config(dp: int) -> dict[str, Any]:
    """Plain Adam, clipping at the global norm, 8 samples per step over ``dp`` replicas."""
    cfg = _model_registry.ds_config("adam", gas=MICRO_PER_STEP // dp, micro=MICRO, dp=dp, clip=CLIP)
    cfg["optimizer"]["params"]["lr"] = LR
    return cfg


class Position:
    """A data loader over :func:`stream` for one replica: its state is the next step."""

    def __init__(self, replica: int, replicas: int) -> None:
        self.replica, self.replicas = replica, replicas
        self.step = 0
        self.data = stream()

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This replica's micro-batches of the next step."""
        per = MICRO_PER_STEP // self.replicas
        start = self.step * MICRO_PER_STEP + self.replica * per
        self.step += 1
        return self.data[start : start + per]

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


def build(
    dialect_name: str, stages: int, dp: int, seed: int = 0, **options: Any
) -> tuple[Any, Any, int]:
    """The plan, the engine and this rank's replica (``seed``: the initial weights;
    ``options``: the dialect's own ``pipe_engine`` options)."""
    spec = _model_registry.spec_for(MODEL)
    dialect = pipedialect.get_dialect(dialect_name)
    dialect.init_distributed()
    split = spec.split_points_for(stages) if stages > 1 else ()
    plan = partition(spec.build(seed), split)
    cfg = config(dp)
    kwargs: dict[str, Any] = {"config": cfg, "loss_fn": spec.loss_fn}
    replica = 0
    if dialect_name != "local":
        topology = dialect.make_topology(stages, dp)
        kwargs["topology"] = topology
        replica = int(topology.get_coord(dist.get_rank()).data)
    engine = dialect.runtime_engine(dialect.pipe_engine(plan, **kwargs, **options), config=cfg)
    return plan, engine, replica


def params(plan: Any, engine: Any, dialect_name: str) -> dict[str, torch.Tensor]:
    """This rank's parameters by every name they have (a sharded one whole: a collective)."""
    dialect = pipedialect.get_dialect(dialect_name)
    return {
        n: (p.full_tensor() if is_sharded(p) else p).detach().cpu().clone()
        for k in dialect.local_stages(engine)
        for n, p in plan.stages[k].named_parameters(remove_duplicate=False)
    }


def train(engine: Any, loader: Position, steps: int) -> list[float]:
    return [float(engine.train_batch(iter(loader.next_step()))) for _ in range(steps)]


def save_on_deepspeed_pp4(ckpt_dir: str) -> dict[str, Any]:
    """Train 3 steps on DeepSpeed PP=4 and save a portable checkpoint (with the loader)."""
    plan, engine, replica = build("deepspeed", 4, 1)
    loader = Position(replica, 1)
    losses = train(engine, loader, SAVED_AT)
    path = ckpt.save(engine, ckpt_dir, dataloader=loader)
    return {
        "rank": dist.get_rank(),
        "losses": losses,
        "path": str(path),
        "lr": engine.get_lr(),
        "params": params(plan, engine, "deepspeed"),
    }


def _resume(
    dialect_name: str,
    ckpt_dir: str,
    *,
    stages: int = 2,
    dp: int = 2,
    save_to: str | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Resume ``ckpt_dir`` and train to the end (saving into ``save_to`` after one step)."""
    # Other initial weights (seed 9): everything must come from the checkpoint.
    plan, engine, replica = build(dialect_name, stages, dp, seed=9, **options)
    loader = Position(replica, dp)
    ckpt.load(engine, ckpt_dir, dataloader=loader)
    loaded = {
        "global_steps": int(engine.global_steps),
        "micro_steps": int(getattr(engine, "micro_steps", -1)),
        "global_samples": int(getattr(engine, "global_samples", -1)),
        "loader_step": loader.step,
        "lr": engine.get_lr(),
        "params": params(plan, engine, dialect_name),
    }
    losses = train(engine, loader, 1)
    if save_to is not None:
        ckpt.save(engine, save_to, dataloader=loader)
    losses += train(engine, loader, STEPS - int(loaded["global_steps"]) - 1)
    return {
        "loaded": loaded,
        "losses": losses,
        "global_steps": int(engine.global_steps),
        "replica": replica,
        "stages": list(pipedialect.get_dialect(dialect_name).local_stages(engine)),
        "params": params(plan, engine, dialect_name),
    }


def resume_on_four_ranks(ckpt_dir: str, fsdp_dir: str) -> dict[str, Any]:
    """DeepSpeed PP=2 x DP=2, torch PP=2 x DP=2 and torch PP=2 x FSDP=2, each resumed from
    ``ckpt_dir``; the FSDP run saves into ``fsdp_dir`` after one step, and DeepSpeed
    PP=2 x DP=2 and torch PP=4 resume that checkpoint."""
    out: dict[str, Any] = {"rank": 0}
    out["deepspeed"] = _resume("deepspeed", ckpt_dir)
    out["rank"] = dist.get_rank()
    dist.barrier()
    out["torch"] = _resume("torch", ckpt_dir)
    dist.barrier()
    out["fsdp"] = _resume("torch", ckpt_dir, save_to=fsdp_dir, data_parallel_mode="fsdp")
    dist.barrier()
    out["deepspeed from fsdp"] = _resume("deepspeed", fsdp_dir)
    dist.barrier()
    out["torch pp4 from fsdp"] = _resume("torch", fsdp_dir, stages=4, dp=1)
    return out


def killed_in_save(ckpt_dir: str, tag: str, kill_at: str) -> None:
    """On local: save ``a`` after one step if there is no checkpoint yet; then train a step
    and save ``tag`` with the save-kill test hook set to ``kill_at`` (this process dies)."""
    _, engine, _ = build("local", 2, 1)
    loader = Position(0, 1)
    train(engine, loader, 1)
    if not (Path(ckpt_dir) / "latest").is_file():
        ckpt.save(engine, ckpt_dir, tag="a")
    train(engine, loader, 1)
    os.environ[KILL_ENV] = kill_at
    ckpt.save(engine, ckpt_dir, tag=tag)
