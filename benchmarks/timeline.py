"""The measured pipeline bubble against ``(p - 1) / (m + p - 1)``, from real traced runs.

p ranks over gloo on 127.0.0.1 (``--ranks``, default 4), one equal stage each, m micro-batches
(``--micro-batches``, default 8): the torch dialect with GPipe and with 1F1B, and DeepSpeed's
``PipelineEngine`` (1F1B). Each configuration trains one untraced warm-up step, then
``--steps`` steps inside :func:`pipedialect.trace`; the bubble of each rank is
``1 - busy / window`` (forward and backward time over the span from the step's first forward to
its last backward on any rank), printed beside the theoretical one, with the difference in
percentage points (the target: within 5).

What a stage computes (``--work``):

- ``matmul``: two 1024-wide linear layers per stage, computed on the CPU (one thread per rank).
  This measures the schedule only when every rank has a core of its own: with fewer cores
  than ranks, ranks that compute at once share cores, so stage times vary with who else is
  computing and messages wait for a core, and the timeline shows the machine, not the schedule.
- ``wait``: each stage holds its rank for a fixed time (``--forward-ms``, default 100; backward
  twice that) in its forward and its backward, without using a core, as a host waits on an
  accelerator kernel; the stage still computes a small linear layer. The timeline is then set
  by the schedule and the communication, whatever the number of cores. The theoretical bubble
  takes communication as free, so the stage time must be large against a message's latency
  (milliseconds on busy shared cores).
- ``both`` (the default) runs both.

    python benchmarks/timeline.py [--ranks 4] [--micro-batches 8] [--work both] [--out DIR]

``--out`` keeps every configuration's Chrome trace (``chrome://tracing``, ui.perfetto.dev) and
picture of the last traced step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _smoke
import torch
import torch.nn.functional as F
from torch import nn

import pipedialect
from pipedialect.runtime.launch import launch

TARGET_POINTS = 5.0


class _Held(torch.autograd.Function):
    """Identity that holds the thread ``forward_s`` in forward and ``backward_s`` in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad, None, None


class Hold(nn.Module):
    """A fixed wait in forward and backward (``--work wait``); fx calls it as a leaf."""

    def __init__(self, forward_s: float) -> None:
        super().__init__()
        self.forward_s = forward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _Held.apply(x, self.forward_s, 2 * self.forward_s)
        return out


class Stage(nn.Module):
    """One pipeline stage's worth of work."""

    def __init__(self, work: str, dim: int, forward_s: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, dim)
        self.fc2 = nn.Linear(dim, dim) if work == "matmul" else nn.Identity()
        self.hold = Hold(forward_s) if work == "wait" else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.hold(self.fc2(torch.tanh(self.fc1(x))))
        return out


class EqualStages(nn.Module):
    """``num_stages`` identical stages: every stage of the pipeline costs the same."""

    def __init__(self, num_stages: int, work: str, dim: int, forward_s: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Stage(work, dim, forward_s) for _ in range(num_stages))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def _config(micro_batches: int, micro: int) -> dict[str, Any]:
    return {
        "train_batch_size": micro * micro_batches,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": micro_batches,
        "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
        "steps_per_print": 10**9,
    }


def _run(
    dialect_name: str, schedules: Sequence[str], args: dict[str, Any], out_dir: str
) -> list[dict[str, Any]]:
    """On every rank: each schedule, one warm-up step, then ``steps`` traced steps."""
    torch.set_num_threads(1)
    p, m, work = args["ranks"], args["micro_batches"], args["work"]
    dim = 1024 if work == "matmul" else 64
    micro = 128 if work == "matmul" else 8
    dialect = pipedialect.get_dialect(dialect_name)
    dialect.init_distributed()
    results = []
    for schedule in schedules:
        model = EqualStages(p, work, dim, args["forward_ms"] / 1000.0)
        plan = pipedialect.partition(
            model, [f"blocks.{k}" for k in range(p - 1)], leaf_modules=[Hold]
        )
        config = _config(m, micro)
        extra: dict[str, Any] = {}
        if dialect_name == "deepspeed":
            extra["topology"] = dialect.make_topology(p, 1)
        else:
            extra["schedule"] = schedule
        module = dialect.pipe_engine(plan, config=config, loss_fn=_loss, **extra)
        engine = dialect.runtime_engine(module, config=config)
        gen = torch.Generator().manual_seed(1)
        batches = [
            (torch.randn(micro, dim, generator=gen), torch.randn(micro, dim, generator=gen))
            for _ in range(m * (args["steps"] + 1))
        ]
        data = iter(batches)
        engine.train_batch(data)  # warm-up: first-step set-up is not the schedule
        name = f"{dialect_name}-{schedule}-{work}"
        with pipedialect.trace(engine, Path(out_dir) / f"{name}.json") as recorded:
            for _ in range(args["steps"]):
                engine.train_batch(data)
        timeline = recorded.timeline
        assert timeline is not None
        results.append(
            {
                "dialect": dialect_name,
                "schedule": schedule,
                "work": work,
                "p": timeline.pipeline_depth(),
                "m": timeline.micro_batches(),
                "theory": timeline.theoretical_bubble(),
                "bubble": timeline.bubble(),
                "step_ms": statistics.median(s.window_ns for s in timeline.steps()) / 1e6,
            }
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--work", choices=("matmul", "wait", "both"), default="both")
    parser.add_argument("--forward-ms", type=float, default=100.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--dialects", default="torch,deepspeed")
    opts = _smoke.parse_args(
        parser, {"ranks": 2, "micro_batches": 2, "steps": 1, "work": "wait", "forward_ms": 2.0}
    )
    out = opts.out or Path(tempfile.mkdtemp(prefix="pipedialect-timeline-"))
    out.mkdir(parents=True, exist_ok=True)
    works = ("matmul", "wait") if opts.work == "both" else (opts.work,)
    plan = {"torch": ("gpipe", "1f1b"), "deepspeed": ("1f1b",)}
    cores = os.cpu_count() or 1
    print(
        f"p={opts.ranks} ranks, m={opts.micro_batches} micro-batches, {opts.steps} traced steps, "
        f"{cores} cores"
    )
    rows = []
    for work in works:
        args = {
            "ranks": opts.ranks,
            "micro_batches": opts.micro_batches,
            "steps": opts.steps,
            "work": work,
            "forward_ms": opts.forward_ms,
        }
        for dialect_name in opts.dialects.split(","):
            per_rank = launch(
                _run, opts.ranks, dialect_name, plan[dialect_name], args, str(out), timeout=900
            )
            rows.extend(per_rank[0])
    header = (
        f"{'dialect':<10} {'schedule':<8} {'work':<7} {'p':>2} {'m':>3} {'theory':>7} "
        f"{'measured (mean, per rank)':<36} {'diff':>6} {'step ms':>8}  within {TARGET_POINTS:g}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        bubbles = list(row["bubble"].values())
        mean = statistics.fmean(bubbles)
        diff = 100.0 * (mean - row["theory"])
        ranks = " ".join(f"{b:.1%}" for b in bubbles)
        print(
            f"{row['dialect']:<10} {row['schedule']:<8} {row['work']:<7} {row['p']:>2} "
            f"{row['m']:>3} {row['theory']:>7.1%} {mean:>6.1%} ({ranks}){'':<4} "
            f"{diff:>+6.1f} {row['step_ms']:>8.1f}  {'yes' if abs(diff) <= TARGET_POINTS else 'no'}"
        )
    if cores < opts.ranks and "matmul" in works:
        print(
            f"note: {cores} cores for {opts.ranks} ranks: the matmul rows share cores, so their "
            "stages stretch when ranks compute at once (see the docstring)"
        )
    print(f"traces and pictures: {out}")


if __name__ == "__main__":
    main()
