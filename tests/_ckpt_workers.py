"""What each rank runs in the crash-safe checkpoint and soak tests (importable by spawned ranks).

:func:`crash_phase` is one launch of a three-launch chain: the first saves tag ``a`` after one
step and is SIGKILLed while saving tag ``b``; the second loads ``latest`` and is SIGKILLed while
publishing tag ``a`` again (the old ``a`` renamed aside, the new one not yet in place); the
third loads ``latest`` again, then flips 64 bytes of a file and tries once more. A killed launch
returns nothing, so what a phase loaded is written to ``ckpt_dir`` first. :func:`soak` trains
PP=2 x DP=2 with a checkpoint every 10 steps, optionally killing one rank at one step, and
resumes from ``latest`` when there is one.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _reliability_workers import _attempt, config, step_batches

import pipedialect
from pipedialect.models import get_model
from pipedialect.plan.partition import partition

KILL_ENV = "PIPEDIALECT_TEST_KILL_IN_SAVE"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _build(dialect: Any, cfg: dict[str, Any], data_parallel: int = 1) -> tuple[Any, Any]:
    spec = get_model("skip")
    plan = partition(spec.factory(seed=0, dim=16), ["blocks.1"])
    kwargs: dict[str, Any] = {"config": cfg, "loss_fn": spec.loss_fn}
    if dialect.name != "local":
        kwargs["topology"] = dialect.make_topology(plan.num_stages, data_parallel)
    module = dialect.pipe_engine(plan, **kwargs)
    return plan, dialect.runtime_engine(module, config=cfg)


def _params(dialect: Any, plan: Any, engine: Any) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k in dialect.local_stages(engine):
        for n, p in plan.stages[k].named_parameters():
            out[n] = p.detach().cpu().clone()
    return out


def _loaded(dialect: Any, plan: Any, engine: Any, ckpt_dir: str) -> dict[str, Any]:
    path, _ = engine.load_checkpoint(ckpt_dir)
    return {
        "path": str(path),
        "global_steps": int(engine.global_steps),
        "latest": (Path(ckpt_dir) / "latest").read_text(),
        "params": _params(dialect, plan, engine),
    }


def crash_phase(dialect_name: str, ckpt_dir: str, phase: int) -> dict[str, Any]:
    """Phase 1, 2 or 3 of the chain in the module docstring."""
    dialect = pipedialect.get_dialect(dialect_name)
    dialect.init_distributed()
    rank, last = _rank(), _world() - 1
    plan, engine = _build(dialect, config())
    if phase == 1:
        engine.train_batch(iter(step_batches(0)))
        engine.save_checkpoint(ckpt_dir, tag="a")
        engine.train_batch(iter(step_batches(1)))
        os.environ[KILL_ENV] = f"{last}:written"  # the last rank dies with its files written
        engine.save_checkpoint(ckpt_dir, tag="b")
        return {"survived": True}
    loaded = _loaded(dialect, plan, engine, ckpt_dir)
    torch.save(loaded, Path(ckpt_dir) / f"phase{phase}-rank{rank}.result")
    if phase == 2:
        _barrier()
        engine.train_batch(iter(step_batches(1)))
        os.environ[KILL_ENV] = "0:aside"  # rank 0 dies with the old "a" renamed aside
        engine.save_checkpoint(ckpt_dir, tag="a")
        return {"survived": True}
    _barrier()
    victim = ""
    if rank == 0:
        directory = Path(ckpt_dir) / "a.old"
        victim_path = max(directory.glob("*.pt"), key=lambda f: f.stat().st_size)
        data = bytearray(victim_path.read_bytes())
        middle = len(data) // 2
        data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
        victim_path.write_bytes(bytes(data))
        victim = str(victim_path)
    _barrier()
    flipped = _attempt(lambda: engine.load_checkpoint(ckpt_dir)) if _world() > 1 else None
    if flipped is None:
        try:
            engine.load_checkpoint(ckpt_dir)
            flipped = {"error": None}
        except pipedialect.CheckpointError as exc:
            flipped = {"error": type(exc).__name__, "message": str(exc)}
    return {"rank": rank, "loaded": loaded, "flipped": flipped, "victim": victim}


SOAK_STEPS, SOAK_EVERY, SOAK_GAS, SOAK_MICRO, SOAK_DP = 50, 10, 2, 2, 2


def soak_batches(step: int, dp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The micro-batches of data-parallel replica ``dp_rank`` at step ``step``."""
    spec = get_model("skip")
    seed = 1000 + step * SOAK_DP + dp_rank
    return list(spec.micro_batches(SOAK_GAS, batch_size=SOAK_MICRO, seed=seed))


def soak(ckpt_dir: str, kill_rank: int, kill_step: int) -> dict[str, Any]:
    """Train to step 50 (resuming from ``latest`` if any), checkpointing every 10 steps; rank
    ``kill_rank`` SIGKILLs itself before step ``kill_step`` of a fresh (not resumed) run."""
    dialect = pipedialect.get_dialect("deepspeed")
    dialect.init_distributed()
    cfg = {
        **config(),
        "train_batch_size": SOAK_GAS * SOAK_MICRO * SOAK_DP,
        "train_micro_batch_size_per_gpu": SOAK_MICRO,
        "gradient_accumulation_steps": SOAK_GAS,
    }
    plan, engine = _build(dialect, cfg, data_parallel=SOAK_DP)
    resumed = (Path(ckpt_dir) / "latest").is_file()
    if resumed:
        engine.load_checkpoint(ckpt_dir)
    dp_rank = int(engine.grid.data_parallel_id)
    for step in range(int(engine.global_steps), SOAK_STEPS):
        if not resumed and step == kill_step and dist.get_rank() == kill_rank:
            (Path(ckpt_dir) / f"killed-rank{kill_rank}-step{step}").touch()
            os.kill(os.getpid(), signal.SIGKILL)
        engine.train_batch(iter(soak_batches(step, dp_rank)))
        if (step + 1) % SOAK_EVERY == 0:
            engine.save_checkpoint(ckpt_dir, tag=f"step{step + 1}")
    return {
        "rank": dist.get_rank(),
        "resumed": resumed,
        "global_steps": int(engine.global_steps),
        "params": _params(dialect, plan, engine),
    }
