"""The planner's predictions against measured runs, over four workloads: step time, memory,
micro-batches in flight, choice.

Workloads (``WORKLOADS``), each a model of 8 blocks:

- ``compute``: blocks of unequal cost whose compute is emulated: each block holds its rank for
  ``cost x samples`` milliseconds in its forward, in its input-gradient backward and in its
  weight-gradient backward (the weight pass sits on the parameter's path, so a split backward
  runs it separately), by sleeping, so the measurement does not depend on how many cores the
  ranks share;
- ``comm``: the same blocks at about a millisecond of compute per micro-batch with 1 MiB per
  sample crossing every boundary (8-32 MiB per micro-batch): communication-heavy;
- ``dp``: 16 MiB of trainable parameters per block: data parallelism's gradient all-reduce
  dominates;
- ``gpt``: a small TinyGPT (``pipedialect.models``) computing for real;
- ``mhgpt``: a small MultiHeadGPT computing for real, with its tensor plan
  (``MHGPT_TENSOR_PLAN``): the tensor-parallel layouts (PP x TP, and PP x FSDP x TP on 8 ranks).

Sharded data parallelism (``data_parallel_mode="fsdp"``, the torch dialect) runs on the ``dp``,
``compute`` and ``gpt`` workloads beside their DDP layouts; after the per-workload lines the
table sums up the FSDP layouts and the tensor-parallel ones across workloads.

For each dialect (torch, deepspeed) and world size (2, 4) the runtime is first calibrated with
``pipedialect.planner.calibrate`` (what ``pipedialect plan --calibrate`` stores; here into a
temporary file), then the planner measures the model (``measure_time=True``) and predicts every
layout with nothing else given (no bandwidth, latency or overheads: the calibration's), and each
layout in ``LAYOUTS`` trains for real over gloo on this machine, one warm-up step and
``--steps`` timed steps, with the planner's split points.
Printed per workload: predicted against measured step time (targets: median relative error <=
10%, Spearman >= 0.8), the planner's choice against the fastest measured layout of its dialect
and world size (target: within 5%), the predicted peak memory per rank against the measured
growth of the resident set while it trains (benchmarks/memory.py's method: peak RSS above the
RSS before the model is built; the data set and the model's weights are made before that
baseline, and each rank builds the model on the meta device and fills only its own stages from
those weights (``pipedialect.plan.weights.from_state_dict``): a model built for real stays
whole in every rank as long as its engine, which is not what the planner predicts; target:
within 15%), the predicted
micro-batches in flight per stage against the counted ones (emulated workloads), and rank 0's
minor page faults per timed step (``faults``: memory the step wrote to for the first time,
which on this machine kind costs more than the copies themselves). The timed launches run on
glibc's own malloc thresholds, as a job does; the memory column comes from launches of its own,
one warm-up step and one sampled step each, whose ranks set glibc's mmap threshold to
``--mmap-threshold`` (65536 by default, what ``MALLOC_MMAP_THRESHOLD_=65536`` sets at a
process's start: freed tensors leave the resident set at once and every large tensor is fresh
memory, how benchmarks/memory.py measures) and give back what glibc kept before their baseline.
On glibc's own thresholds the resident set also holds memory freed but kept, which depends on
the order of frees and is not what the planner predicts. ``--heap`` prints, per rank of the
memory launches, what the resident set's growth is made of: glibc's bytes in use at their peak
(``mallinfo2``), the bytes it freed but kept, and the mapped files (the libraries' code a
rank's first steps page in).

    python benchmarks/planner.py [--steps 3] [--only torch|deepspeed] [--workloads compute,gpt]
    python benchmarks/planner.py --smoke        # a few layouts, seconds of compute: it runs
    python benchmarks/planner.py --sharded --isolate   # the FSDP, TP and 3D layouts only

``--isolate`` launches every layout in fresh ranks, twice (timed, then measured for memory;
slower): without it one launch times a workload's layouts and one more measures their memory,
where only the first layout pays the runtime's one-time memory, so the memory comparison holds
for ``--isolate`` runs. ``--smoke`` measures the memory of its first workload only.

``--out`` keeps the predicted Chrome traces of every layout. Run it when the machine is quiet
(the table starts with ``uptime``'s load average): the full run with ``--isolate`` took 9
minutes on 2 idle cores.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import resource
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _smoke
import torch
import torch.nn.functional as F
from torch import nn

import pipedialect
from pipedialect.cost import Layout, predict
from pipedialect.models import MHGPT_TENSOR_PLAN, MultiHeadGPT, TinyGPT, cross_entropy_loss
from pipedialect.plan import from_state_dict
from pipedialect.planner import LayoutPlan, calibrate, plan_layout, write_chrome_trace
from pipedialect.runtime.launch import launch

#: Emulated milliseconds per sample of each block's forward (its input and weight gradients
#: cost the same again each: a backward twice the forward, half of it in the weight pass).
BLOCK_MS = (3.0, 6.0, 5.0, 4.0, 4.0, 5.0, 6.0, 9.0)
GLOBAL_BATCH = 32
#: Frozen bytes per block of the compute workload, and the bytes per rank the planner is told:
#: the 8 blocks' 32 MiB do not fit one rank, so every layout pipelines.
BALLAST = 4 << 20
#: Samples of the micro-batch the planner measures (larger: the timer's own cost matters less).
EXAMPLE_BATCH = 8
GPT = {"vocab": 512, "dim": 64, "max_len": 32, "num_blocks": 8}
MHGPT = {"vocab": 512, "dim": 64, "heads": 4, "max_len": 32, "num_blocks": 8}
#: The workloads that compute for real (no emulated blocks, no in-flight counts).
REAL = {"gpt": GPT, "mhgpt": MHGPT}

#: name: (milliseconds per sample per block, features per sample across a boundary, trainable
#: elements per block, frozen bytes per block, bytes per rank the planner is told).
WORKLOADS: dict[str, tuple[tuple[float, ...], int, int, int, int]] = {
    "compute": (BLOCK_MS, 32, 32, BALLAST, 24 << 20),
    "comm": ((0.03,) * 8, 1 << 18, 32, 0, 2 << 30),
    "dp": ((0.5,) * 8, 32, 4 << 20, 0, 2 << 30),
    "gpt": ((), 0, 0, 0, 2 << 30),
    "mhgpt": ((), 0, 0, 0, 2 << 30),
}

#: (workload, dialect, world size, schedule, pipeline ranks, stages per rank, data replicas,
#: micro-batches, recomputation pattern or None, data-parallel mode "ddp" | "fsdp", tensor degree).
Spec = tuple[str, str, int, str, int, int, int, int, str | None, str, int]
LAYOUTS: tuple[Spec, ...] = (
    ("compute", "torch", 4, "1f1b", 4, 1, 1, 4, None, "ddp", 1),
    ("compute", "torch", 4, "1f1b", 4, 1, 1, 8, None, "ddp", 1),
    ("compute", "torch", 4, "1f1b", 4, 1, 1, 16, None, "ddp", 1),
    ("compute", "torch", 4, "gpipe", 4, 1, 1, 8, None, "ddp", 1),
    ("compute", "torch", 4, "1f1b", 2, 1, 2, 8, None, "ddp", 1),
    ("compute", "torch", 4, "interleaved_1f1b", 4, 2, 1, 8, None, "ddp", 1),
    ("compute", "torch", 4, "interleaved_1f1b", 2, 2, 2, 8, None, "ddp", 1),
    ("compute", "torch", 4, "looped_bfs", 4, 2, 1, 8, None, "ddp", 1),
    ("compute", "torch", 4, "interleaved_zero_bubble", 4, 1, 1, 8, None, "ddp", 1),
    ("compute", "torch", 4, "interleaved_zero_bubble", 4, 2, 1, 8, None, "ddp", 1),
    ("compute", "torch", 4, "zbv_zero_bubble", 4, 2, 1, 8, None, "ddp", 1),
    ("compute", "torch", 4, "dualpipev", 4, 2, 1, 8, None, "ddp", 1),
    ("compute", "torch", 4, "1f1b", 4, 1, 1, 8, "blocks.*", "ddp", 1),
    ("compute", "torch", 4, "zbv_zero_bubble", 4, 2, 1, 8, "blocks.*", "ddp", 1),
    ("compute", "deepspeed", 4, "deepspeed_1f1b", 4, 1, 1, 4, None, "ddp", 1),
    ("compute", "deepspeed", 4, "deepspeed_1f1b", 4, 1, 1, 8, None, "ddp", 1),
    ("compute", "deepspeed", 4, "deepspeed_1f1b", 2, 1, 2, 8, None, "ddp", 1),
    ("compute", "deepspeed", 4, "deepspeed_1f1b", 4, 1, 1, 8, "blocks.*", "ddp", 1),
    ("compute", "torch", 2, "1f1b", 2, 1, 1, 8, None, "ddp", 1),
    ("compute", "torch", 2, "gpipe", 2, 1, 1, 4, None, "ddp", 1),
    ("compute", "torch", 2, "interleaved_1f1b", 2, 2, 1, 8, None, "ddp", 1),
    ("compute", "torch", 2, "zbv_zero_bubble", 2, 2, 1, 8, None, "ddp", 1),
    ("compute", "torch", 2, "dualpipev", 2, 2, 1, 8, None, "ddp", 1),
    ("compute", "deepspeed", 2, "deepspeed_1f1b", 2, 1, 1, 8, None, "ddp", 1),
    ("comm", "torch", 2, "1f1b", 2, 1, 1, 4, None, "ddp", 1),
    ("comm", "torch", 2, "1f1b", 2, 1, 1, 8, None, "ddp", 1),
    ("comm", "torch", 2, "gpipe", 2, 1, 1, 4, None, "ddp", 1),
    ("comm", "torch", 4, "1f1b", 4, 1, 1, 8, None, "ddp", 1),
    ("comm", "torch", 4, "1f1b", 2, 1, 2, 8, None, "ddp", 1),
    ("comm", "torch", 4, "interleaved_1f1b", 4, 2, 1, 8, None, "ddp", 1),
    ("comm", "deepspeed", 2, "deepspeed_1f1b", 2, 1, 1, 4, None, "ddp", 1),
    ("comm", "deepspeed", 2, "deepspeed_1f1b", 2, 1, 1, 8, None, "ddp", 1),
    ("comm", "deepspeed", 4, "deepspeed_1f1b", 4, 1, 1, 8, None, "ddp", 1),
    ("comm", "deepspeed", 4, "deepspeed_1f1b", 2, 1, 2, 8, None, "ddp", 1),
    ("dp", "torch", 2, "1f1b", 2, 1, 1, 8, None, "ddp", 1),
    ("dp", "torch", 4, "1f1b", 4, 1, 1, 8, None, "ddp", 1),
    ("dp", "torch", 4, "1f1b", 2, 1, 2, 4, None, "ddp", 1),
    ("dp", "torch", 4, "1f1b", 2, 1, 2, 8, None, "ddp", 1),
    ("dp", "deepspeed", 2, "deepspeed_1f1b", 2, 1, 1, 4, None, "ddp", 1),
    ("dp", "deepspeed", 4, "deepspeed_1f1b", 4, 1, 1, 8, None, "ddp", 1),
    ("dp", "deepspeed", 4, "deepspeed_1f1b", 2, 1, 2, 8, None, "ddp", 1),
    ("gpt", "torch", 2, "1f1b", 2, 1, 1, 4, None, "ddp", 1),
    ("gpt", "torch", 2, "1f1b", 2, 1, 1, 8, None, "ddp", 1),
    ("gpt", "torch", 2, "gpipe", 2, 1, 1, 4, None, "ddp", 1),
    ("gpt", "torch", 2, "1f1b", 2, 1, 1, 8, "blocks.*", "ddp", 1),
    ("gpt", "deepspeed", 2, "deepspeed_1f1b", 2, 1, 1, 4, None, "ddp", 1),
    ("gpt", "deepspeed", 2, "deepspeed_1f1b", 2, 1, 1, 8, None, "ddp", 1),
    ("dp", "torch", 4, "1f1b", 2, 1, 2, 4, None, "fsdp", 1),
    ("dp", "torch", 4, "1f1b", 2, 1, 2, 8, None, "fsdp", 1),
    ("dp", "torch", 4, "gpipe", 2, 1, 2, 8, None, "fsdp", 1),
    ("dp", "torch", 4, "1f1b", 1, 1, 4, 4, None, "fsdp", 1),
    ("dp", "torch", 2, "1f1b", 1, 1, 2, 4, None, "fsdp", 1),
    ("compute", "torch", 4, "1f1b", 2, 1, 2, 8, None, "fsdp", 1),
    ("gpt", "torch", 4, "1f1b", 2, 1, 2, 4, None, "fsdp", 1),
    ("gpt", "torch", 4, "1f1b", 2, 1, 2, 8, None, "fsdp", 1),
    ("gpt", "torch", 4, "1f1b", 2, 1, 2, 4, None, "ddp", 1),
    ("mhgpt", "torch", 4, "1f1b", 2, 1, 1, 4, None, "ddp", 2),
    ("mhgpt", "torch", 4, "1f1b", 2, 1, 1, 8, None, "ddp", 2),
    ("mhgpt", "torch", 4, "gpipe", 2, 1, 1, 4, None, "ddp", 2),
    ("mhgpt", "torch", 4, "1f1b", 4, 1, 1, 8, None, "ddp", 1),
    ("mhgpt", "torch", 4, "1f1b", 2, 1, 2, 4, None, "fsdp", 1),
    ("mhgpt", "torch", 8, "1f1b", 2, 1, 2, 4, None, "fsdp", 2),
    ("mhgpt", "torch", 8, "1f1b", 2, 1, 2, 8, None, "fsdp", 2),
    ("gpt", "torch", 2, "1f1b", 1, 1, 2, 4, None, "fsdp", 1),
)
#: What --smoke runs: one layout of each workload's torch and DeepSpeed runs on 2 ranks, at a
#: twentieth of the emulated costs, and one FSDP layout (in the gpt launch: no launch more).
SMOKE = "18,23,24,41,45,63"

# -- the models ---------------------------------------------------------------------------------

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
    """``size`` trainable elements whose gradient costs ``cost x samples`` ms (the weight
    pass); the first ``width`` of them are added to the activation."""

    def __init__(self, block: int, ms: float, size: int, width: int) -> None:
        super().__init__()
        self.block, self.ms, self.width = block, ms, width
        self.weight = nn.Parameter(torch.zeros(max(size, width)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w: torch.Tensor = _HoldWeight.apply(self.weight, self.block, self.ms * x.shape[0] / 1e3)
        return x + w[: self.width]


class Block(nn.Module):
    """One emulated block: forward, input gradient and weight gradient each ``ms x samples``,
    ``grad`` trainable elements and ``ballast`` bytes of frozen state."""

    def __init__(self, block: int, ms: float, width: int, grad: int, ballast: int) -> None:
        super().__init__()
        self.weight = HoldWeight(block, ms, grad, width)
        self.hold = Hold(block, ms)
        self.register_buffer("ballast", torch.zeros(max(ballast // 4, width)))
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.hold(self.weight(x) + self.ballast[: self.width] * 0)
        return out


class Emulated(nn.Module):
    """A workload's blocks, in sequence."""

    def __init__(self, workload: str, scale: float = 1.0) -> None:
        super().__init__()
        block_ms, width, grad, ballast, _ = WORKLOADS[workload]
        self.blocks = nn.ModuleList(
            Block(k, ms * scale, width, grad, ballast) for k, ms in enumerate(block_ms)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


LEAVES = [Hold, HoldWeight]


def _model(workload: str, scale: float) -> nn.Module:
    torch.manual_seed(0)
    if workload == "gpt":
        return TinyGPT(**GPT, seed=0)
    if workload == "mhgpt":
        return MultiHeadGPT(**MHGPT, seed=0)
    return Emulated(workload, scale)


def _batch(workload: str, samples: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """One micro-batch: (input, target)."""
    if workload in REAL:
        sizes = REAL[workload]
        shape = (samples, sizes["max_len"])
        return (
            torch.randint(0, sizes["vocab"], shape, generator=gen),
            torch.randint(0, sizes["vocab"], shape, generator=gen),
        )
    width = WORKLOADS[workload][1]
    return torch.randn(samples, width, generator=gen), torch.randn(samples, width, generator=gen)


def _loss(workload: str) -> Any:
    return cross_entropy_loss if workload in REAL else _mse


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def _config(layout: dict[str, Any]) -> dict[str, Any]:
    return {
        **layout["config"],
        "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }


# -- measuring ----------------------------------------------------------------------------------


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _file_backed() -> int:
    """The resident pages that map files (the libraries' code and data) and shared memory."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[2]) * resource.getpagesize()


class _Mallinfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (every arena summed)."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _heap() -> tuple[int, int]:
    """glibc's bytes in use (heap chunks and mmapped ones) and bytes freed but kept in its
    arenas; (0, 0) where the C library has no ``mallinfo2``."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallinfo2"):
        return 0, 0
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd, info.fordblks


class _PeakRSS:
    """Samples the resident set every millisecond while running (the peak above a baseline);
    with ``heap``, glibc's bytes in use too (their peak, and the bytes freed but kept at the
    resident set's peak)."""

    def __init__(self, heap: bool = False) -> None:
        self.peak = 0
        self.heap = heap
        self.peak_used = 0
        self.kept_at_peak = 0
        self.file_at_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = _rss()
            used, kept = _heap() if self.heap else (0, 0)
            self.peak_used = max(self.peak_used, used)
            if rss > self.peak:
                self.peak, self.kept_at_peak = rss, kept
                if self.heap:
                    self.file_at_peak = _file_backed()
            time.sleep(0.001)

    def __enter__(self) -> _PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _set_mmap_threshold(threshold: int) -> None:
    """In this process, glibc's ``M_MMAP_THRESHOLD`` (what ``MALLOC_MMAP_THRESHOLD_`` sets when a
    process starts; it also turns off glibc's dynamic threshold), and the freed memory glibc kept
    so far given back: from here on a freed large tensor leaves the resident set at once and
    every large tensor is fresh memory, as benchmarks/memory.py measures. A rank forked from the
    launcher's fork server cannot take the variable from its environment (glibc read it when the
    server started), hence ``mallopt``."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallopt") or libc.mallopt(-3, threshold) != 1:
        raise SystemExit(f"cannot set glibc's mmap threshold to {threshold} (not glibc?)")
    libc.malloc_trim(0)


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


def _run_layouts(layouts: list[dict[str, Any]], steps: int) -> list[dict[str, Any]]:
    """On every rank: each layout, one warm-up step, then ``steps`` timed steps."""
    import gc

    import torch.distributed as dist

    torch.set_num_threads(1)
    threshold = layouts[0]["mmap_threshold"]
    if threshold is not None:
        _set_mmap_threshold(threshold)
    dialect = pipedialect.get_dialect(layouts[0]["dialect"])
    dialect.init_distributed()
    rank = dist.get_rank()
    results = []
    for layout in layouts:
        workload = layout["workload"]
        config = _config(layout)
        mbs = config["train_micro_batch_size_per_gpu"]
        m = config["gradient_accumulation_steps"]
        # One stream per data replica: the tensor-parallel ranks of a stage (innermost in the
        # mesh) must read the same micro-batches. The data set is made before the baseline: it
        # is the user's (up to 256 MiB per rank on the communication workload), not what the
        # planner predicts.
        gen = torch.Generator().manual_seed(1 + (rank // layout["tensor"]) % layout["data"])
        data = iter([_batch(workload, mbs, gen) for _ in range(m * (steps + 2))])
        # The weights too are made before the baseline, and the ranks build the model on the
        # meta device and fill only their own stages from them (pipedialect.plan.weights), as
        # a job whose model is bigger than one rank does: built for real, the whole model stays
        # alive in every rank as long as its engine (the plan keeps every stage's modules), and
        # the measured growth would hold every stage's parameters, which training does not
        # need and the planner does not predict.
        reference = _model(workload, layout["scale"])
        weights, buffers = reference.state_dict(), dict(reference.named_buffers())
        del reference
        gc.collect()
        if threshold is not None:
            ctypes.CDLL(None).malloc_trim(0)
        baseline = _rss()
        used_before, kept_before = _heap() if layout["heap"] else (0, 0)
        file_before = _file_backed()
        with torch.device("meta"):
            model = _model(workload, layout["scale"])
        leaves = None if workload in REAL else LEAVES
        plan = pipedialect.partition(model, **layout["partition"], leaf_modules=leaves)
        module = dialect.pipe_engine(
            plan,
            config=config,
            loss_fn=_loss(workload),
            topology=layout["topology"](dialect),
            init_weights=from_state_dict(weights, plan=plan, buffers=buffers),
            **layout["engine"],
        )
        engine = dialect.runtime_engine(module, config=config)
        del model, plan
        gc.collect()
        with _PeakRSS(layout["heap"]) as peak:
            engine.train_batch(data)
            dist.barrier()
            durations = []
            faults = []
            for _ in range(steps):
                EVENTS.clear()
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                start = time.perf_counter()
                engine.train_batch(data)
                durations.append(time.perf_counter() - start)
                faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        local = [
            k for k, r in enumerate(layout["placement"]) if r == rank // layout["replica_size"]
        ]
        in_flight = {}
        if rank % layout["replica_size"] == 0 and workload not in REAL:
            in_flight = _in_flight(EVENTS, {k: layout["blocks_of"][k] for k in local})
        results.append(
            {
                "steps": durations,
                "faults": faults,
                "in_flight": in_flight,
                "memory": peak.peak - baseline,
                # glibc's bytes in use at their peak and freed-but-kept at the RSS peak, above
                # the baseline (--heap).
                "heap": (
                    peak.peak_used - used_before,
                    peak.kept_at_peak - kept_before,
                    peak.file_at_peak - file_before,
                    (_heap()[0] if layout["heap"] else 0) - used_before,
                ),
                "pipe_rank": rank // layout["replica_size"],
            }
        )
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


def _find(plan: LayoutPlan, spec: Spec) -> Layout:
    _, _, _, schedule, p, v, d, m, recompute, mode, t = spec
    for row in plan.rows:
        lay = row.layout
        if (
            row.prediction is not None
            and (lay.schedule, lay.pipeline, lay.stages_per_rank, lay.data_parallel)
            == (schedule, p, v, d)
            and (lay.data_parallel_mode if d > 1 else "ddp", lay.tensor_parallel) == (mode, t)
            and lay.micro_batches == m
            and lay.recompute == recompute
        ):
            return lay
    raise SystemExit(f"the planner did not predict {spec}")


def _blocks_of(layout: Layout) -> dict[int, list[int]]:
    names = [f"blocks.{k}" for k in range(8)]
    ends = [names.index(p) for p in layout.split_points]
    bounds = [-1, *ends, len(names) - 1]
    return {s: list(range(bounds[s] + 1, bounds[s + 1] + 1)) for s in range(len(bounds) - 1)}


def _payload(
    plan: LayoutPlan, lay: Layout, workload: str, dialect: str, scale: float
) -> dict[str, Any]:
    program = plan.programs[(lay.schedule, lay.pipeline, lay.micro_batches, lay.stages_per_rank)]
    return {
        "workload": workload,
        "dialect": dialect,
        "scale": scale,
        "partition": lay.partition_kwargs(),
        "engine": lay.pipe_engine_kwargs(),
        "config": lay.config(),
        "topology": lay.topology,
        "placement": program.placement,
        # The ranks of one pipeline rank (pipe outermost in the mesh: data x tensor of them).
        "replica_size": lay.data_parallel * lay.tensor_parallel,
        "data": lay.data_parallel,
        "tensor": lay.tensor_parallel,
        "blocks_of": _blocks_of(lay),
        "name": re.sub(
            r"[^A-Za-z0-9=._-]+", "_", f"{workload}-{dialect}-{lay.world_size}-{lay.describe()}"
        ),
    }


def _plan(
    workload: str, dialect: str, world: int, scale: float, repeats: int, runtime_memory: float
) -> LayoutPlan:
    """The planner with nothing but the stored calibration: no bandwidth, latency or
    overheads given. The memory per rank is the workload's plus what the calibration says the
    runtime itself holds (so the compute workload's 32 MiB of blocks still cannot fit one
    rank)."""
    model = _model(workload, scale)
    gen = torch.Generator().manual_seed(0)
    example = _batch(workload, EXAMPLE_BATCH, gen)[0]
    name = "input_ids" if workload in REAL else "x"
    return plan_layout(
        model,
        {name: example},
        world_size=world,
        memory_per_rank=WORKLOADS[workload][4] + runtime_memory,
        global_batch=GLOBAL_BATCH,
        dialect=dialect,
        measure_time=True,
        repeats=repeats,
        optimizer_states=0,
        leaf_modules=None if workload in REAL else LEAVES,
        tensor_parallel=MHGPT_TENSOR_PLAN if workload == "mhgpt" else None,
        recompute="blocks.*",
        exhaustive=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", choices=("torch", "deepspeed"), default=None)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--select", default=None, help="comma-separated indices into LAYOUTS")
    parser.add_argument(
        "--sharded",
        action="store_true",
        help="only the FSDP, tensor-parallel and 3D layouts (with --workloads and --only)",
    )
    parser.add_argument("--scale", type=float, default=1.0, help="times every emulated cost")
    parser.add_argument("--repeats", type=int, default=5, help="measure_time's least runs")
    parser.add_argument(
        "--isolate",
        action="store_true",
        help="one launch per layout: slower, but every measured peak memory is a fresh job's",
    )
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        default=65536,
        help="glibc's mmap threshold in the memory launches (65536: freed tensors leave the "
        "resident set at once and every large tensor is fresh memory, how memory.py measures); "
        "the timed launches keep glibc's own thresholds, as a job runs",
    )
    parser.add_argument(
        "--heap",
        action="store_true",
        help="print per rank of the memory launches glibc's bytes in use at their peak and those "
        "freed but kept at the resident set's peak (mallinfo2), beside the prediction with and "
        "without the runtime's buffers and temporaries (predict(runtime_buffers=False))",
    )
    opts = _smoke.parse_args(parser, {"steps": 1, "scale": 0.05, "select": SMOKE, "repeats": 1})
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"uptime: {load}")
    print(f"{os.cpu_count()} cores, torch {torch.__version__}")
    # The calibrations go to a file of their own, which plan_layout then reads.
    os.environ["PIPEDIALECT_CALIBRATION"] = str(
        Path(tempfile.mkdtemp(prefix="planner-benchmark-")) / "calibration.json"
    )
    wanted = set(opts.workloads.split(","))
    specs = [s for s in LAYOUTS if opts.only in (None, s[1]) and s[0] in wanted]
    if opts.sharded:
        specs = [s for s in specs if s[9] == "fsdp" or s[10] > 1]
    if opts.select:
        specs = [LAYOUTS[int(i)] for i in opts.select.split(",")]
    if opts.out is not None:
        opts.out.mkdir(parents=True, exist_ok=True)
    rows = []
    calibrated = None
    runtime_memory = 0.0
    # Grouped by dialect and world size: the runtime is calibrated once for each.
    for dialect, world, workload in sorted({(s[1], s[2], s[0]) for s in specs}):
        if calibrated != (dialect, world):
            done = calibrate(dialect, world_size=world, steps=max(1, opts.steps))
            print(done.describe())
            calibrated, runtime_memory = (dialect, world), done.memory_overhead
        plan = _plan(workload, dialect, world, opts.scale, opts.repeats, runtime_memory)
        group = [s for s in specs if (s[0], s[1], s[2]) == (workload, dialect, world)]
        chosen = plan.layout
        runs = [_find(plan, s) for s in group]
        if chosen not in runs:
            runs.append(chosen)
        payload = [
            {
                **_payload(plan, lay, workload, dialect, opts.scale),
                "heap": False,
                "mmap_threshold": None,
            }
            for lay in runs
        ]
        # The memory column comes from launches of its own, under --mmap-threshold (one warm-up
        # step and one sampled one: the peak is the same every step), so that the timed
        # launches run on glibc's own thresholds, as a job does. A smoke run measures the
        # first group's memory only (the path runs; its numbers mean nothing anyway).
        memory_payload = (
            [{**one, "heap": opts.heap, "mmap_threshold": opts.mmap_threshold} for one in payload]
            if not opts.smoke or not rows
            else []
        )
        in_memory: list[list[dict[str, Any]]] = [[] for _ in range(world)]
        if opts.isolate:
            # One launch per layout, timed and measured apart: each rank's peak is a one-layout
            # job's (lazy inits and the first engine included), as the memory target needs.
            parts = [
                launch(_run_layouts, world, [one], opts.steps, timeout=3600) for one in payload
            ]
            per_rank = [[part[r][0] for part in parts] for r in range(world)]
            parts = [launch(_run_layouts, world, [one], 1, timeout=3600) for one in memory_payload]
            in_memory = [[part[r][0] for part in parts] for r in range(world)]
        else:
            per_rank = launch(_run_layouts, world, payload, opts.steps, timeout=3600)
            if memory_payload:
                in_memory = launch(_run_layouts, world, memory_payload, 1, timeout=3600)
        for i, lay in enumerate(runs):
            pred = plan.prediction(lay)
            counted: dict[int, int] = {}
            memory: dict[int, int] = {}
            for r in per_rank:
                counted.update(r[i]["in_flight"])
            for r in in_memory:
                if r:
                    rank = r[i]["pipe_rank"]
                    memory[rank] = max(memory.get(rank, 0), r[i]["memory"])
            if opts.heap and memory:
                before = _memory_before(plan, lay)
                for r in in_memory:
                    used, kept, files, between = r[i]["heap"]
                    rank = r[i]["pipe_rank"]
                    print(
                        f"heap {workload} {dialect} {lay.describe()} pipeline rank {rank}: "
                        f"resident set +{r[i]['memory'] / 2**20:.0f} MiB, glibc in use "
                        f"+{used / 2**20:.0f} MiB at its peak (+{between / 2**20:.0f} after the "
                        f"last step), +{kept / 2**20:.0f} MiB freed "
                        f"but kept and +{files / 2**20:.0f} MiB of mapped files (libraries' "
                        "code) at the resident set's peak; predicted "
                        f"{pred.peak_memory[rank] / 2**20:.0f} MiB "
                        f"({before[rank] / 2**20:.0f} without the runtime's buffers and "
                        "temporaries)"
                    )
            rows.append(
                {
                    "before": _before(plan, lay),
                    "workload": workload,
                    "dialect": dialect,
                    "world": world,
                    "layout": lay,
                    "predicted": pred.step_time,
                    "measured": statistics.median(per_rank[0][i]["steps"]),
                    "faults": statistics.median(per_rank[0][i]["faults"]),
                    "in_flight": pred.simulation.in_flight,
                    "counted": tuple(counted[k] for k in sorted(counted)),
                    "memory_predicted": pred.peak_memory,
                    "memory_measured": tuple(memory[k] for k in sorted(memory)),
                    "chosen": lay == chosen,
                }
            )
            if opts.out is not None:
                write_chrome_trace(pred, opts.out / f"{payload[i]['name']}-predicted.json")
    _report(rows)


def _before(plan: LayoutPlan, lay: Layout) -> float:
    """The step ``lay`` is predicted without the calibrated costs of FSDP's units and tensor
    parallelism's modules and without a rank's messages queueing on its link (the model before
    it had them), for the before/after figure of each summary line."""
    import dataclasses

    cluster = dataclasses.replace(plan.cluster, fsdp_unit_overhead=0.0, tensor_module_overhead=0.0)
    program = plan.programs[(lay.schedule, lay.pipeline, lay.micro_batches, lay.stages_per_rank)]
    chain = plan.chains[lay.recompute or ""]
    return predict(
        chain,
        lay,
        cluster,
        program,
        split_first_stage=plan.offer.split_first_stage,
        queue_messages=False,
    ).step_time


def _memory_before(plan: LayoutPlan, lay: Layout) -> tuple[float, ...]:
    """The peak memory per rank ``lay`` is predicted without what the runtime's buffers and
    temporaries hold (boundaries, the model's input and output, a weight gradient before it is
    accumulated, packed gradients: ``predict(runtime_buffers=False)``), for ``--heap``."""
    program = plan.programs[(lay.schedule, lay.pipeline, lay.micro_batches, lay.stages_per_rank)]
    return predict(
        plan.chains[lay.recompute or ""],
        lay,
        plan.cluster,
        program,
        split_first_stage=plan.offer.split_first_stage,
        runtime_buffers=False,
    ).peak_memory


def _verdict(ok: bool) -> str:
    return "met" if ok else "not met"


def _summary(group: Sequence[dict[str, Any]]) -> str:
    """One line: the group's median step error, Spearman and largest memory error per rank."""
    errors = [abs(r["predicted"] / r["measured"] - 1) for r in group]
    median = statistics.median(errors)
    rho = _spearman([r["predicted"] for r in group], [r["measured"] for r in group])
    mem_errors = [
        abs(p / m - 1)
        for r in group
        for p, m in zip(r["memory_predicted"], r["memory_measured"], strict=False)
        if m > 0
    ]
    memory = "peak memory not measured"
    if mem_errors:
        mem = max(mem_errors)
        memory = f"largest peak-memory error per rank {mem:.1%} (<= 15%: {_verdict(mem <= 0.15)})"
    line = (
        f"{len(group)} layouts; median step error {median:.1%} (<= 10%: "
        f"{_verdict(median <= 0.10)}); Spearman {rho:.3f} (>= 0.8: {_verdict(rho >= 0.8)}); "
        f"{memory}"
    )
    before = [r["before"] for r in group]
    if before != [r["predicted"] for r in group]:
        old = statistics.median(
            abs(b / r["measured"] - 1) for b, r in zip(before, group, strict=True)
        )
        rho_old = _spearman(before, [r["measured"] for r in group])
        line += (
            f"; without the FSDP/TP runtime costs and message queueing: median step error "
            f"{old:.1%}, Spearman {rho_old:.3f}"
        )
    return line


def _report(rows: list[dict[str, Any]]) -> None:
    mib = float(1 << 20)
    header = (
        f"{'workload':<8} {'dialect':<9} {'W':>1}  {'layout':<46} {'predicted':>9} "
        f"{'measured':>9} {'error':>7} {'faults':>7}  "
        f"{'memory MiB (predicted / measured)':<34} in flight"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        err = r["predicted"] / r["measured"] - 1
        measured = r["memory_measured"] or (None,) * len(r["memory_predicted"])
        mem = " ".join(
            f"{p / mib:.0f}/{'-' if m is None else f'{m / mib:.0f}'}"
            for p, m in zip(r["memory_predicted"], measured, strict=False)
        )
        flights = ""
        if r["counted"]:
            same = r["in_flight"] == r["counted"]
            flights = f"{list(r['in_flight'])} {'=' if same else '!='} {list(r['counted'])}"
        mark = " <- planner's choice" if r["chosen"] else ""
        print(
            f"{r['workload']:<8} {r['dialect']:<9} {r['world']:>1}  "
            f"{r['layout'].describe():<46} {r['predicted'] * 1e3:>7.0f}ms "
            f"{r['measured'] * 1e3:>7.0f}ms {err:>+7.1%} {r['faults']:>7.0f}  {mem:<34} "
            f"{flights}{mark}"
        )
    print()
    print(f"layouts: {len(rows)}")
    for workload in sorted({r["workload"] for r in rows}):
        group = [r for r in rows if r["workload"] == workload]
        print(f"{workload}: {_summary(group)}")
        for dialect, world in sorted({(r["dialect"], r["world"]) for r in group}):
            sub = [r for r in group if (r["dialect"], r["world"]) == (dialect, world)]
            chosen = next(r for r in sub if r["chosen"])
            fastest = min(sub, key=lambda r: r["measured"])
            ratio = chosen["measured"] / fastest["measured"]
            print(
                f"  {dialect} on {world} ranks: chose {chosen['layout'].describe()} "
                f"({chosen['measured'] * 1e3:.0f} ms), fastest {fastest['layout'].describe()} "
                f"({fastest['measured'] * 1e3:.0f} ms): ratio {ratio:.3f} (<= 1.05: "
                f"{_verdict(ratio <= 1.05)})"
            )
    # Across workloads: the sharded and the tensor-parallel layouts on their own.
    sharded = [
        r
        for r in rows
        if r["layout"].data_parallel > 1 and r["layout"].data_parallel_mode == "fsdp"
    ]
    tensor = [r for r in rows if r["layout"].tensor_parallel > 1]
    if sharded:
        print(f"FSDP layouts (all workloads): {_summary(sharded)}")
    if tensor:
        print(f"tensor-parallel layouts (TP and 3D, all workloads): {_summary(tensor)}")
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"uptime at the end: {load}")


if __name__ == "__main__":
    main()
