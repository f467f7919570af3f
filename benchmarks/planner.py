"""The planner's predictions against measured runs: step time, micro-batches in flight, choice.

A model of 8 blocks of unequal cost whose compute is emulated: each block holds its rank for
``cost x samples`` milliseconds in its forward, in its input-gradient backward and in its
weight-gradient backward (the weight pass sits on the parameter's path, so a split backward
runs it separately), by sleeping, so the measurement does not depend on how many cores the
ranks share. The planner measures the model once (``plan_layout(..., measure_time=True)``),
with the link latency measured by a ping-pong between two ranks and each runtime's own cost
per computation and per step fitted to runs of the same model at no cost, and predicts every
layout of the search space; then each layout in ``LAYOUTS`` (degrees, schedules, micro-batch
counts, recomputation; torch and DeepSpeed dialects) trains for real over gloo on this
machine, one warm-up step and ``--steps`` timed steps, with the planner's split points.
Printed: predicted against measured step time per layout (targets: median relative error <=
10%, Spearman rank correlation >= 0.9), the predicted peak of micro-batches in flight per stage
against the one counted in the run (target: equal), and the measured step of the planner's
choice against the fastest measured layout of its dialect and world size (target: within 5%).

    python benchmarks/planner.py [--steps 3] [--only torch|deepspeed] [--out DIR]

``--out`` keeps the predicted and measured Chrome traces of every layout. Run it when the
machine is quiet: the table starts with ``uptime``'s load average.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _smoke
import torch
import torch.nn.functional as F
from torch import nn

import pipedialect
from pipedialect.planner import Layout, LayoutPlan, plan_layout, write_chrome_trace
from pipedialect.runtime.launch import launch

#: Emulated milliseconds per sample of each block's forward (its input and weight gradients
#: cost the same again each: a backward twice the forward, half of it in the weight pass).
BLOCK_MS = (3.0, 6.0, 5.0, 4.0, 4.0, 5.0, 6.0, 9.0)
DIM = 32
GLOBAL_BATCH = 32
#: Frozen bytes per block, and the bytes per rank the planner is told: the 8 blocks' 32 MiB do
#: not fit one rank, so every layout pipelines.
BALLAST = 4 << 20
MEMORY = 24 << 20
#: Samples of the micro-batch the planner measures (larger: the timer's own cost matters less).
EXAMPLE_BATCH = 8

#: (dialect, world size, schedule, pipeline ranks, stages per rank, data replicas, micro-batches,
#: recomputation pattern or None).
LAYOUTS: tuple[tuple[str, int, str, int, int, int, int, str | None], ...] = (
    ("torch", 4, "1f1b", 4, 1, 1, 4, None),
    ("torch", 4, "1f1b", 4, 1, 1, 8, None),
    ("torch", 4, "1f1b", 4, 1, 1, 16, None),
    ("torch", 4, "gpipe", 4, 1, 1, 8, None),
    ("torch", 4, "1f1b", 2, 1, 2, 8, None),
    ("torch", 4, "interleaved_1f1b", 4, 2, 1, 8, None),
    ("torch", 4, "interleaved_1f1b", 2, 2, 2, 8, None),
    ("torch", 4, "looped_bfs", 4, 2, 1, 8, None),
    ("torch", 4, "interleaved_zero_bubble", 4, 1, 1, 8, None),
    ("torch", 4, "interleaved_zero_bubble", 4, 2, 1, 8, None),
    ("torch", 4, "zbv_zero_bubble", 4, 2, 1, 8, None),
    ("torch", 4, "dualpipev", 4, 2, 1, 8, None),
    ("torch", 4, "1f1b", 4, 1, 1, 8, "blocks.*"),
    ("torch", 4, "zbv_zero_bubble", 4, 2, 1, 8, "blocks.*"),
    ("deepspeed", 4, "deepspeed_1f1b", 4, 1, 1, 4, None),
    ("deepspeed", 4, "deepspeed_1f1b", 4, 1, 1, 8, None),
    ("deepspeed", 4, "deepspeed_1f1b", 2, 1, 2, 8, None),
    ("deepspeed", 4, "deepspeed_1f1b", 4, 1, 1, 8, "blocks.*"),
    ("torch", 2, "1f1b", 2, 1, 1, 8, None),
    ("torch", 2, "gpipe", 2, 1, 1, 4, None),
    ("torch", 2, "interleaved_1f1b", 2, 2, 1, 8, None),
    ("torch", 2, "zbv_zero_bubble", 2, 2, 1, 8, None),
    ("torch", 2, "dualpipev", 2, 2, 1, 8, None),
    ("deepspeed", 2, "deepspeed_1f1b", 2, 1, 1, 8, None),
)

# -- the emulated model -------------------------------------------------------------------------

#: What this process's blocks did, for the in-flight counts: (time, block, "F" | "I" | "W").
EVENTS: list[tuple[float, int, str]] = []


def _in_backward() -> bool:
    return bool(torch._C._current_graph_task_id() != -1)


class _Hold(torch.autograd.Function):
    """Identity on the activation: holds the thread in forward and in the input gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, block: int, seconds: float) -> torch.Tensor:
        if not _in_backward():
            EVENTS.append((time.perf_counter(), block, "F"))
        time.sleep(seconds)
        ctx.block, ctx.seconds = block, seconds
        # What a real layer keeps for its backward (and what makes a checkpoint recompute).
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (_,) = ctx.saved_tensors
        time.sleep(ctx.seconds)
        EVENTS.append((time.perf_counter(), ctx.block, "I"))
        return grad, None, None


class _HoldWeight(torch.autograd.Function):
    """Identity on a parameter: holds the thread in its gradient (the weight pass)."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, block: int, seconds: float) -> torch.Tensor:
        ctx.block, ctx.seconds = block, seconds
        return w.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.seconds)
        EVENTS.append((time.perf_counter(), ctx.block, "W"))
        return grad, None, None


class Hold(nn.Module):
    """``cost x samples`` ms in forward and in the input gradient; fx calls it as a leaf."""

    def __init__(self, block: int, ms: float) -> None:
        super().__init__()
        self.block, self.ms = block, ms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _Hold.apply(x, self.block, self.ms * x.shape[0] / 1e3)
        return out


class HoldWeight(nn.Module):
    """A parameter whose gradient costs ``cost x samples`` ms (the weight pass)."""

    def __init__(self, block: int, ms: float) -> None:
        super().__init__()
        self.block, self.ms = block, ms
        self.weight = nn.Parameter(torch.zeros(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w: torch.Tensor = _HoldWeight.apply(self.weight, self.block, self.ms * x.shape[0] / 1e3)
        return x + w


class Block(nn.Module):
    """One emulated block: forward, input gradient and weight gradient each ``ms x samples``,
    and :data:`BALLAST` bytes of frozen state (so that the whole model does not fit one rank)."""

    def __init__(self, block: int, ms: float) -> None:
        super().__init__()
        self.weight = HoldWeight(block, ms)
        self.hold = Hold(block, ms)
        self.register_buffer("ballast", torch.zeros(BALLAST // 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.hold(self.weight(x) + self.ballast[:DIM] * 0)
        return out


class Emulated(nn.Module):
    """Blocks of :data:`BLOCK_MS` (or of no cost at all, for the calibration), in sequence."""

    def __init__(self, block_ms: Sequence[float] = BLOCK_MS, free: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(k, 0.0 if free else ms) for k, ms in enumerate(block_ms))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


LEAVES = [Hold, HoldWeight]


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def _config(layout: dict[str, Any]) -> dict[str, Any]:
    return {
        **layout["config"],
        "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }


# -- measuring ----------------------------------------------------------------------------------


def _ping_pong(rounds: int, samples: int) -> float:
    """Seconds of one boundary message between two ranks (half a round trip, the median)."""
    import torch.distributed as dist

    pipedialect.get_dialect("torch").init_distributed()
    rank = dist.get_rank()
    buf = torch.zeros(samples, DIM)
    times = []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        times.append((time.perf_counter() - start) / 2)
    return statistics.median(times)


def _in_flight(
    events: Sequence[tuple[float, int, str]], stages: dict[int, list[int]]
) -> dict[int, int]:
    """Peak micro-batches in flight per stage from the blocks' events: a micro-batch enters
    with its first block's forward and leaves once every block's input and weight gradients
    are done."""
    peaks = {}
    for stage, blocks in stages.items():
        counts = {b: {"F": 0, "I": 0, "W": 0} for b in blocks}
        peak = 0
        for _, block, kind in sorted(e for e in events if e[1] in counts):
            counts[block][kind] += 1
            entered = counts[blocks[0]]["F"]
            left = min(min(c["I"], c["W"]) for c in counts.values())
            peak = max(peak, entered - left)
        peaks[stage] = peak
    return peaks


def _run_layouts(
    layouts: list[dict[str, Any]], steps: int, out_dir: str | None
) -> list[dict[str, Any]]:
    """On every rank: each layout, one warm-up step, then ``steps`` timed steps."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dialect = pipedialect.get_dialect(layouts[0]["dialect"])
    dialect.init_distributed()
    rank = dist.get_rank()
    results = []
    for layout in layouts:
        torch.manual_seed(0)
        model = Emulated(layout["block_ms"], free=layout["free"])
        plan = pipedialect.partition(model, **layout["partition"], leaf_modules=LEAVES)
        config = _config(layout)
        topology = layout["topology"](dialect)
        module = dialect.pipe_engine(
            plan, config=config, loss_fn=_loss, topology=topology, **layout["engine"]
        )
        engine = dialect.runtime_engine(module, config=config)
        mbs, m = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
        gen = torch.Generator().manual_seed(1 + rank)
        batches = [
            (torch.randn(mbs, DIM, generator=gen), torch.randn(mbs, DIM, generator=gen))
            for _ in range(m * (steps + 2))
        ]
        data = iter(batches)
        engine.train_batch(data)
        dist.barrier()
        durations = []
        for _ in range(steps):
            EVENTS.clear()
            start = time.perf_counter()
            engine.train_batch(data)
            durations.append(time.perf_counter() - start)
        local = [
            k for k, r in enumerate(layout["placement"]) if r == rank // layout["replica_size"]
        ]
        if rank % layout["replica_size"] == 0:
            stages = {k: layout["blocks_of"][k] for k in local}
            in_flight = _in_flight(EVENTS, stages)
        else:
            in_flight = {}
        results.append({"steps": durations, "in_flight": in_flight})
        del engine, module
        dist.barrier()
    return results


# -- the table ----------------------------------------------------------------------------------


def _spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    def ranks(v: Sequence[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else 1.0


def _find(plan: LayoutPlan, spec: tuple[Any, ...]) -> Layout:
    _, _, schedule, p, v, d, m, ckpt = spec
    for row in plan.rows:
        lay = row.layout
        if (
            row.prediction is not None
            and (lay.schedule, lay.pipeline, lay.stages_per_rank, lay.data_parallel)
            == (schedule, p, v, d)
            and lay.micro_batches == m
            and lay.recompute == ckpt
        ):
            return lay
    raise SystemExit(f"the planner did not predict {spec}")


def _blocks_of(layout: Layout) -> dict[int, list[int]]:
    names = [f"blocks.{k}" for k in range(len(BLOCK_MS))]
    ends = [names.index(p) for p in layout.split_points]
    bounds = [-1, *ends, len(names) - 1]
    return {s: list(range(bounds[s] + 1, bounds[s + 1] + 1)) for s in range(len(bounds) - 1)}


def _payload(plan: LayoutPlan, lay: Layout, dialect: str, free: bool = False) -> dict[str, Any]:
    program = plan.programs[(lay.schedule, lay.pipeline, lay.micro_batches, lay.stages_per_rank)]
    return {
        "dialect": dialect,
        "free": free,
        "block_ms": BLOCK_MS,
        "partition": lay.partition_kwargs(),
        "engine": lay.pipe_engine_kwargs(),
        "config": lay.config(),
        "topology": lay.topology,
        "placement": program.placement,
        "replica_size": lay.data_parallel,
        "blocks_of": _blocks_of(lay),
        "name": re.sub(r"[^A-Za-z0-9=._-]+", "_", f"{dialect}-{lay.world_size}-{lay.describe()}"),
    }


def _plan(
    model: nn.Module,
    dialect: str,
    world: int,
    latency: float,
    memory: float = MEMORY,
    **kwargs: Any,
) -> LayoutPlan:
    return plan_layout(
        model,
        {"x": torch.randn(EXAMPLE_BATCH, DIM)},
        world_size=world,
        memory_per_rank=memory,
        global_batch=GLOBAL_BATCH,
        bandwidth="1GB/s",
        latency=latency,
        dialect=dialect,
        measure_time=True,
        repeats=5,
        leaf_modules=LEAVES,
        candidates=[f"blocks.{k}" for k in range(len(BLOCK_MS) - 1)],
        exhaustive=True,
        **kwargs,
    )


CALIBRATION_COUNTS = (4, 8, 16, 32)


def _calibrate(dialect: str, latency: float, steps: int) -> tuple[float, float]:
    """Seconds the runtime adds per computation and per step, from runs of the model at no
    cost (2 ranks, 1F1B, :data:`CALIBRATION_COUNTS` micro-batches, the median of ``steps + 2``
    steps each): the least-squares fit ``step = a * computations on the critical path + c``,
    the count taken from the simulator."""
    from pipedialect.planner import StageTimes, build_program, simulate

    schedule = "deepspeed_1f1b" if dialect == "deepspeed" else "1f1b"
    plan = _plan(
        Emulated(BLOCK_MS, free=True),
        dialect,
        2,
        latency,
        memory=1 << 40,
        schedules=[schedule],
        micro_batches=list(CALIBRATION_COUNTS),
    )
    runs = [_find(plan, (dialect, 2, schedule, 2, 1, 1, m, None)) for m in CALIBRATION_COUNTS]
    per_rank = launch(
        _run_layouts,
        2,
        [_payload(plan, lay, dialect, free=True) for lay in runs],
        steps + 2,
        None,
        timeout=1800,
    )
    measured = [statistics.median(per_rank[0][i]["steps"]) for i in range(len(runs))]
    free = [StageTimes(0.0, 0.0, 0.0, action_overhead=1.0)] * 2
    counts = [
        simulate(build_program(schedule, 2, m, 1), free).step_time for m in CALIBRATION_COUNTS
    ]
    slope, intercept = statistics.linear_regression(counts, measured)
    return max(0.0, slope), max(0.0, intercept)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", choices=("torch", "deepspeed"), default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--select", default=None, help="comma-separated indices into LAYOUTS")
    parser.add_argument("--rounds", type=int, default=50, help="ping-pong rounds")
    parser.add_argument("--scale", type=float, default=1.0, help="times every block's cost")
    opts = _smoke.parse_args(
        parser,
        # Two layouts of torch on 2 ranks and one of DeepSpeed, blocks at a 20th of their cost.
        {"steps": 1, "rounds": 3, "scale": 0.05, "select": "18,19,23"},
    )
    global BLOCK_MS, CALIBRATION_COUNTS
    BLOCK_MS = tuple(ms * opts.scale for ms in BLOCK_MS)
    if opts.smoke:
        CALIBRATION_COUNTS = (2, 4)
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"uptime: {load}")
    print(f"{os.cpu_count()} cores, torch {torch.__version__}")
    latency = launch(_ping_pong, 2, opts.rounds, GLOBAL_BATCH // 8, timeout=300)[0]
    print(f"measured message time (ping-pong, half a round trip): {latency * 1e3:.2f} ms")
    model = Emulated(BLOCK_MS)
    plans: dict[tuple[str, int], LayoutPlan] = {}
    specs = [s for s in LAYOUTS if opts.only in (None, s[0])]
    if opts.select:
        specs = [LAYOUTS[int(i)] for i in opts.select.split(",")]
    overheads = {}
    for dialect in sorted({s[0] for s in specs}):
        overheads[dialect] = _calibrate(dialect, latency, opts.steps)
        per_action, per_step = overheads[dialect]
        print(
            f"calibration ({dialect}, a model of no cost, {len(CALIBRATION_COUNTS)} micro-batch "
            f"counts): {per_action * 1e3:.2f} ms per computation, {per_step * 1e3:.1f} ms per "
            "step"
        )
    for dialect, world in sorted({(s[0], s[1]) for s in specs}):
        per_action, per_step = overheads[dialect]
        plans[(dialect, world)] = _plan(
            model,
            dialect,
            world,
            latency,
            recompute="blocks.*",
            action_overhead=per_action,
            step_overhead=per_step,
        )
    rows = []
    for (dialect, world), plan in plans.items():
        group = [s for s in specs if (s[0], s[1]) == (dialect, world)]
        chosen = plan.layout
        runs = [_find(plan, s) for s in group]
        if chosen not in runs:
            runs.append(chosen)
        payload = [_payload(plan, lay, dialect) for lay in runs]
        out = None if opts.out is None else str(opts.out)
        if opts.out is not None:
            opts.out.mkdir(parents=True, exist_ok=True)
        per_rank = launch(_run_layouts, world, payload, opts.steps, out, timeout=3600)
        for i, lay in enumerate(runs):
            pred = plan.prediction(lay)
            measured = statistics.median(per_rank[0][i]["steps"])
            counted: dict[int, int] = {}
            for r in per_rank:
                counted.update(r[i]["in_flight"])
            rows.append(
                {
                    "dialect": dialect,
                    "world": world,
                    "layout": lay,
                    "predicted": pred.step_time,
                    "measured": measured,
                    "in_flight": pred.simulation.in_flight,
                    "counted": tuple(counted[k] for k in sorted(counted)),
                    "chosen": lay == chosen,
                }
            )
            if opts.out is not None:
                write_chrome_trace(pred, opts.out / f"{payload[i]['name']}-predicted.json")
    _report(rows)


def _report(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'dialect':<9} {'W':>1}  {'layout':<52} {'predicted':>9} {'measured':>9} {'error':>7}"
        f"  {'in flight (predicted / counted)':<34}"
    )
    print(header)
    print("-" * len(header))
    errors = []
    equal = 0
    for r in rows:
        err = r["predicted"] / r["measured"] - 1
        errors.append(abs(err))
        same = r["in_flight"] == r["counted"]
        equal += same
        mark = " <- planner's choice" if r["chosen"] else ""
        flights = f"{list(r['in_flight'])} {'=' if same else '!='} {list(r['counted'])}"
        print(
            f"{r['dialect']:<9} {r['world']:>1}  {r['layout'].describe():<52} "
            f"{r['predicted'] * 1e3:>7.0f}ms {r['measured'] * 1e3:>7.0f}ms {err:>+7.1%}  "
            f"{flights:<34}{mark}"
        )
    rho = _spearman([r["predicted"] for r in rows], [r["measured"] for r in rows])
    median = statistics.median(errors)
    print()
    print(f"layouts: {len(rows)}")
    print(
        f"median relative error of the step time: {median:.1%} (target <= 10%: "
        f"{'met' if median <= 0.10 else 'not met'})"
    )
    verdict = "met" if rho >= 0.9 else "not met"
    print(f"Spearman rank correlation: {rho:.3f} (target >= 0.9: {verdict})")
    print(f"peak in flight per stage equal to the counted one: {equal} of {len(rows)} layouts")
    for dialect, world in sorted({(r["dialect"], r["world"]) for r in rows}):
        group = [r for r in rows if (r["dialect"], r["world"]) == (dialect, world)]
        chosen = next(r for r in group if r["chosen"])
        fastest = min(group, key=lambda r: r["measured"])
        ratio = chosen["measured"] / fastest["measured"]
        print(
            f"{dialect} on {world} ranks: the planner chose {chosen['layout'].describe()}, "
            f"measured {chosen['measured'] * 1e3:.0f} ms; fastest measured "
            f"{fastest['layout'].describe()} {fastest['measured'] * 1e3:.0f} ms: ratio "
            f"{ratio:.3f} (target <= 1.05: {'met' if ratio <= 1.05 else 'not met'})"
        )
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"uptime at the end: {load}")


if __name__ == "__main__":
    main()
