"""Calibration: what the runtime itself costs on this machine, measured once and stored.

[Note: calibration]
A prediction is the schedule's work plus what the runtime adds: a cost per computation
(launching a stage's forward or backward, the codec, the hooks), a cost per step (the loss
broadcast, bookkeeping) and the messages. :func:`calibrate` measures them for one dialect on
this machine by running it:

- *the runtime's overheads*: a model of almost no compute, cut into one stage per rank, trains
  a few steps at several micro-batch counts under the dialect's 1F1B; the measured step minus
  what the simulator predicts for its messages alone is fitted, by least squares, to
  ``a * computations on the critical path + c`` (the count from the simulator): ``a`` is
  ``action_overhead``, ``c`` is ``step_overhead``;
- *messages as a layout makes them*: every rank sends to the next and receives from the
  previous one at the same time (as a pipeline's boundaries do, sharing links and cores, never
  one ping-pong alone), at two sizes: the small one gives the latency, the difference the
  bandwidth;
- *collectives at size*: a ring all-reduce of the larger size on every rank, whose time gives the
  bandwidth collectives reach (data-parallel gradient reductions run at it), and an all-gather
  and a reduce-scatter of that size, whose mean gives the bandwidth sharded data parallelism's
  gathers and gradient reductions reach (on gloo about half the all-reduce's, counted per byte
  a ring moves: its all-gather is no faster than its all-reduce of the same tensor);
- *gradient accumulation*: every rank at once adds a 64 MiB tensor into another (what a
  backward after a stage's first in the step does with its weight gradient, [Note: gradient
  accumulation] in ``cost._simulate``): the median rank's seconds per byte are
  ``accumulate_seconds_per_byte``; then packs four 16 MiB tensors into one new flat tensor and
  copies it back into them (what a data-parallel gradient sum does around its all-reduce,
  [Note: packing the gradients] in ``cost._predict``): ``pack_seconds_per_byte``;
- *the runtime's memory*: the resident set each rank grows by while it builds and trains the
  near-free model (the engine's buffers, caches, the process group's, and the library code the
  first steps page in: 31-41 MiB of mapped files in a rank of ``benchmarks/planner.py``'s
  emulated workloads), added to every rank's predicted peak. It is measured first, in the
  fresh rank, before the measurements below run: measured after them it left out the code
  and the heap they had already brought in (31-35 MiB per rank against 58-64 since, on 2 ranks);
- *what each parallel mode adds per computation*: a one-stage model of ``_BLOCKS`` near-free
  blocks (each a column-wise and a row-wise linear layer) trains on every rank as plain data
  parallelism, as sharded data parallelism (one FSDP unit per block plus the root, when the
  dialect offers it) and with its linear layers sharded over a tensor axis of 2 (when it offers
  that), at two micro-batch counts each. The slope of each mode's step time over the
  computations the simulator counts is its cost per computation; what sharding adds over plain
  data parallelism, divided by the units, is ``fsdp_unit_overhead`` (FSDP's hooks gather, free
  and reduce per unit and per computation: on gloo CPUs they cost a step 2-3x plain data
  parallelism's on small models), and what tensor parallelism adds, divided by the sharded
  modules, is ``tensor_module_overhead`` (DTensor's dispatch and redistribution per module and
  per computation, not proportional to the work: on CPUs tens of milliseconds per micro-batch).
  The planner charges every computation of a stage ``action_overhead``, plus
  ``fsdp_unit_overhead`` per unit (its blocks plus one) under ``fsdp``, plus
  ``tensor_module_overhead`` per tensor-parallel module at ``t > 1``.

The result is stored as JSON in the user's cache (``$PIPEDIALECT_CACHE``, default
``~/.cache/pipedialect``, file ``planner-calibration.json``; ``$PIPEDIALECT_CALIBRATION`` names
another file), keyed by dialect, machine (host
name, cores, accelerator) and torch version; :func:`~pipedialect.planner.plan_layout` uses the
stored one for what the caller does not give (``action_overhead``, ``step_overhead``,
``latency``, ``bandwidth``, the collective bandwidths, the accumulation's and the packing's
seconds per byte).
``pipedialect plan --calibrate`` runs it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError

__all__ = ["Calibration", "calibrate", "calibration_path", "load_calibration"]

#: Micro-batch counts of the overhead runs (per pipeline rank: times ``p``).
_COUNTS = (1, 2, 4)
#: Bytes of the small and the large message.
_SMALL, _LARGE = 1 << 10, 8 << 20
#: Bytes of the gradient added into another: larger than this machine kind's caches, as a
#: layer's gradient is.
_ACCUMULATE = 64 << 20
#: Blocks of the one-stage model the parallel modes are measured on, and its micro-batch counts.
_BLOCKS = 4
_MODE_COUNTS = (2, 6)
#: The tensor plan of that model, and its tensor degree.
_TENSOR_PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
_TENSOR = 2


@dataclass(frozen=True)
class Calibration:
    """What :func:`calibrate` measured ([Note: calibration])."""

    #: The dialect, the machine and the torch version it holds for.
    dialect: str
    machine: str
    torch: str
    #: Ranks it ran on.
    world_size: int
    #: Seconds per computation and per step the runtime adds.
    action_overhead: float
    step_overhead: float
    #: Seconds per message and bytes per second of one link, all links busy at once.
    latency: float
    bandwidth: float
    #: Bytes per second a ring all-reduce reaches on ``world_size`` ranks.
    collective_bandwidth: float
    #: When it was measured (seconds since the epoch).
    measured_at: float
    #: Bytes a rank's runtime holds beyond the model's state and activations (the resident set
    #: a near-free model's engine adds, building and training: buffers, caches, the process
    #: group's), which the planner adds to every rank's predicted peak.
    memory_overhead: float = 0.0
    #: Bytes per second (of the whole tensor) an all-gather and a reduce-scatter reach on
    #: ``world_size`` ranks, counted as a ring's ``(n - 1) / n`` of the bytes: what sharded data
    #: parallelism's gathers and gradient reductions cost. Not half an all-reduce on every
    #: backend: gloo's take about as long as its all-reduce of the same bytes, or longer.
    #: 0: not measured (the all-reduce's bandwidth is used).
    shard_bandwidth: float = 0.0
    #: Seconds each FSDP unit adds to every computation of a sharded stage, beyond
    #: ``action_overhead`` (0: not measured, or the dialect has no sharded data parallelism).
    fsdp_unit_overhead: float = 0.0
    #: Seconds each tensor-parallel module adds to every computation (0: not measured, or the
    #: dialect has no tensor parallelism).
    tensor_module_overhead: float = 0.0
    #: Seconds per byte of adding one gradient into another (``acc += grad``, every rank at
    #: once, tensors larger than the caches): what each backward after a stage's first in the
    #: step costs beyond its timed work ([Note: gradient accumulation] in ``cost._simulate``).
    #: 0: not measured.
    accumulate_seconds_per_byte: float = 0.0
    #: Seconds per byte of packing gradients into one new flat buffer and copying the sum back
    #: (every rank at once, 64 MiB of gradients): what a data-parallel gradient sum costs
    #: beside its all-reduce ([Note: packing the gradients] in ``cost._predict``). 0: not
    #: measured.
    pack_seconds_per_byte: float = 0.0

    def describe(self) -> str:
        """One line for tables."""
        return (
            f"calibrated ({self.dialect}, {self.world_size} ranks): "
            f"{self.action_overhead * 1e3:.3f} ms per computation, "
            f"{self.step_overhead * 1e3:.2f} ms per step, messages {self.latency * 1e6:.0f} us "
            f"+ {self.bandwidth / 1e9:.2f} GB/s, all-reduce "
            f"{self.collective_bandwidth / 1e9:.2f} GB/s, all-gather/reduce-scatter "
            f"{self.shard_bandwidth / 1e9:.2f} GB/s, {self.memory_overhead / 2**20:.0f} MiB "
            f"per rank, FSDP {self.fsdp_unit_overhead * 1e3:.3f} ms per unit and computation, "
            f"tensor parallelism {self.tensor_module_overhead * 1e3:.3f} ms per module and "
            f"computation, gradient accumulation "
            f"{self.accumulate_seconds_per_byte * 2**20 * 1e3:.3f} ms per MiB, packing for the "
            f"gradient sum {self.pack_seconds_per_byte * 2**20 * 1e3:.3f} ms per MiB"
        )


def machine() -> str:
    """This machine as calibrations key it: host, cores, accelerator."""
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return f"{platform.node()} {os.cpu_count()} cores {device}"


def calibration_path() -> Path:
    """The JSON file calibrations are stored in: ``$PIPEDIALECT_CALIBRATION``, else
    ``planner-calibration.json`` in ``$PIPEDIALECT_CACHE`` (default ``~/.cache/pipedialect``)."""
    named = os.environ.get("PIPEDIALECT_CALIBRATION")
    if named:
        return Path(named)
    root = os.environ.get("PIPEDIALECT_CACHE") or str(Path.home() / ".cache" / "pipedialect")
    return Path(root) / "planner-calibration.json"


def _key(dialect: str) -> str:
    return f"{dialect}|{machine()}|torch {torch.__version__}"


def load_calibration(dialect: str) -> Calibration | None:
    """The stored calibration of ``dialect`` for this machine and torch version, if any."""
    path = calibration_path()
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    entry = stored.get(_key(dialect)) if isinstance(stored, dict) else None
    if not isinstance(entry, dict):
        return None
    try:
        return Calibration(**entry)
    except TypeError:
        return None


def _store(calibration: Calibration) -> None:
    path = calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        stored = {}
    stored[_key(calibration.dialect)] = dataclasses.asdict(calibration)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(stored, indent=2, sort_keys=True))
    tmp.replace(path)


def calibrate(
    dialect: str = "torch", *, world_size: int = 2, steps: int = 3, store: bool = True
) -> Calibration:
    """Measure ``dialect``'s own costs on this machine ([Note: calibration]) on ``world_size``
    local ranks, store them (unless ``store`` is False) and return them."""
    from ..cost import StageTimes, simulate
    from ..runtime.launch import launch
    from ._search import build_program

    if world_size < 2:
        raise ConfigError(f"calibration needs at least 2 ranks, got {world_size}")
    if steps < 1:
        raise ConfigError(f"steps must be at least 1, got {steps}")
    results = launch(_rank, world_size, dialect, steps, timeout=1800)
    first = results[0]
    latency, bandwidth = first["latency"], first["bandwidth"]
    schedule = first["schedule"]
    counts, targets = [], []
    for m, measured in first["steps"].items():
        program = build_program(schedule, world_size, m, 1)
        free = [StageTimes(0.0, 0.0, 0.0)] * world_size
        messages = simulate(
            program, free, boundaries=[latency + first["boundary"] / bandwidth] * (world_size - 1)
        ).step_time
        one = [StageTimes(0.0, 0.0, 0.0, action_overhead=1.0)] * world_size
        counts.append(simulate(program, one).step_time)
        targets.append(max(0.0, measured - messages))
    slope, intercept = statistics.linear_regression(counts, targets)
    result = Calibration(
        dialect=dialect,
        machine=machine(),
        torch=torch.__version__,
        world_size=world_size,
        action_overhead=max(0.0, slope),
        step_overhead=max(0.0, intercept),
        latency=latency,
        bandwidth=bandwidth,
        collective_bandwidth=first["collective_bandwidth"],
        shard_bandwidth=first["shard_bandwidth"],
        measured_at=time.time(),
        memory_overhead=float(max(r["memory"] for r in results)),
        # The median over ranks: one rank that a busy machine held back is not the rate.
        accumulate_seconds_per_byte=statistics.median(r["accumulate"] for r in results),
        pack_seconds_per_byte=statistics.median(r["pack"] for r in results),
        **_mode_overheads(first["modes"]),
    )
    if store:
        _store(result)
    return result


def computations(schedule: str, micro_batches: int) -> float:
    """Computations (forward, backward and weight passes) one stage alone runs in a step of
    ``schedule``, as the simulator counts them."""
    from ..cost import StageTimes, simulate
    from ._search import build_program

    program = build_program(schedule, 1, micro_batches, 1)
    return simulate(program, [StageTimes(0.0, 0.0, 0.0, action_overhead=1.0)]).step_time


def mode_overheads(
    schedule: str, modes: dict[str, dict[int, float]], *, blocks: int = _BLOCKS
) -> dict[str, float]:
    """``fsdp_unit_overhead`` and ``tensor_module_overhead`` from the one-stage runs:
    ``{mode: {micro-batches: measured step seconds}}`` with mode ``ddp``, ``fsdp``, ``tensor``
    ([Note: calibration]). A mode not measured, or one no dearer than ``ddp``, gives 0."""

    def slope(mode: str) -> float | None:
        steps = modes.get(mode)
        if not steps or len(steps) < 2:
            return None
        xs = [computations(schedule, m) for m in steps]
        return statistics.linear_regression(xs, list(steps.values())).slope

    base = slope("ddp")
    out = {"fsdp_unit_overhead": 0.0, "tensor_module_overhead": 0.0}
    if base is None:
        return out
    fsdp, tensor = slope("fsdp"), slope("tensor")
    if fsdp is not None:
        # One unit per block plus the stage's root ([Note: FSDP on torch] in the torch dialect).
        out["fsdp_unit_overhead"] = max(0.0, fsdp - base) / (blocks + 1)
    if tensor is not None:
        # Two sharded modules per block: its column-wise and its row-wise layer.
        out["tensor_module_overhead"] = max(0.0, tensor - base) / (2 * blocks)
    return out


def _mode_overheads(modes: dict[str, Any]) -> dict[str, float]:
    return mode_overheads(modes["schedule"], modes["steps"])


class _Free(nn.Module):
    """Almost no compute: what a step costs beyond the work is the runtime's."""

    def __init__(self, stages: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(stages))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class _Pair(nn.Module):
    """A near-free block of two linear layers that tensor parallelism can shard (Megatron's
    column-wise then row-wise pair)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 8)
        self.down = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(self.up(x))
        return out


class _Pairs(nn.Module):
    """``_BLOCKS`` near-free blocks: the one-stage model each parallel mode is measured on."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Pair() for _ in range(_BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _median_seconds(fn: Any, rounds: int) -> float:
    import torch.distributed as dist

    times = []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rank(dialect_name: str, steps: int) -> dict[str, Any]:
    """One rank of :func:`calibrate`."""
    import torch.distributed as dist

    from ..cost import Layout
    from ..plugins import get_dialect
    from ._offer import offer_of

    dialect = get_dialect(dialect_name)
    dialect.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    offer = offer_of(dialect)
    schedule = "1f1b" if "1f1b" in offer.schedules else offer.schedules[0]
    measured: dict[int, float] = {}
    import gc

    # First, from a fresh rank: the runtime's memory is what a job's rank grows by, the code
    # its first step pages in included, not what is left after the measurements below ran.
    gc.collect()
    baseline = _rss()
    peak = [baseline]
    for per_rank in _COUNTS:
        m = per_rank * world
        layout = Layout(
            dialect=dialect.name,
            schedule=schedule,
            pipeline=world,
            stages_per_rank=1,
            data_parallel=1,
            data_parallel_mode="ddp",
            tensor_parallel=1,
            micro_batches=m,
            micro_batch_size=2,
            recompute=None,
            split_points=tuple(f"blocks.{k}" for k in range(world - 1)),
            engine_options=(("schedule", schedule),) if offer.schedule_option else (),
        )
        engine = _engine(dialect, layout, _Free(world))
        batches = iter([(torch.randn(2, 4), torch.randn(2, 4)) for _ in range(m * (steps + 1))])
        engine.train_batch(batches)
        peak.append(_rss())
        measured[m] = _median_seconds(functools.partial(engine.train_batch, batches), steps)
        peak.append(_rss())
        del engine

    def exchange(nbytes: int) -> Any:
        out = torch.zeros(nbytes // 4)
        into = torch.empty_like(out)

        def run() -> None:
            # Even ranks send first, odd ones receive first: every link busy at once.
            ops = [dist.P2POp(dist.isend, out, nxt), dist.P2POp(dist.irecv, into, prv)]
            for req in dist.batch_isend_irecv(ops):
                req.wait()

        return run

    small = _median_seconds(exchange(_SMALL), 20)
    large = _median_seconds(exchange(_LARGE), 5)
    bandwidth = (_LARGE - _SMALL) / max(large - small, 1e-9)
    latency = max(small - _SMALL / bandwidth, 0.0)
    grads = torch.zeros(_LARGE // 4)
    reduce = _median_seconds(lambda: dist.all_reduce(grads), 5)
    ring = 2 * (world - 1)
    collective = (ring / world) * _LARGE / max(reduce - ring * latency, 1e-9)
    shard = torch.zeros(_LARGE // 4 // world)
    gathered = torch.empty(shard.numel() * world)
    gather = _median_seconds(lambda: dist.all_gather_into_tensor(gathered, shard), 5)
    scatter = _median_seconds(lambda: dist.reduce_scatter_tensor(shard, gathered), 5)
    half = (world - 1) / world * gathered.numel() * 4
    sharded = half / max((gather + scatter) / 2 - (world - 1) * latency, 1e-9)
    accumulated, gradient = torch.zeros(_ACCUMULATE // 4), torch.ones(_ACCUMULATE // 4)
    accumulate = _median_seconds(lambda: accumulated.add_(gradient), 5) / _ACCUMULATE
    pack = _median_seconds(lambda: _pack(accumulated.chunk(4)), 5) / _ACCUMULATE

    modes = _measure_modes(dialect, offer, schedule, rank, world, steps)
    return {
        "latency": latency,
        "bandwidth": bandwidth,
        "collective_bandwidth": collective,
        "shard_bandwidth": sharded,
        "schedule": schedule,
        "boundary": 2 * 4 * 4,
        "steps": measured,
        "memory": max(peak) - baseline,
        "modes": modes,
        "accumulate": accumulate,
        "pack": pack,
    }


def _pack(grads: Sequence[torch.Tensor]) -> None:
    """What a data-parallel gradient sum does around its all-reduce ([Note: packing the
    gradients] in ``cost._predict``): the gradients into one new flat tensor, and back."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _measure_modes(
    dialect: Any, offer: Any, schedule: str, rank: int, world: int, steps: int
) -> dict[str, Any]:
    """The one-stage runs of each parallel mode the dialect offers ([Note: calibration]):
    ``{"schedule": ..., "steps": {mode: {micro-batches: median step seconds}}}``."""
    from ..cost import Layout

    one = schedule if offer.runs("fsdp", schedule) else None
    runs: list[tuple[str, int, str, int]] = [("ddp", world, "ddp", 1)]
    if offer.fsdp and one is not None:
        runs.append(("fsdp", world, "fsdp", 1))
    if offer.tensor_parallel and world % _TENSOR == 0:
        runs.append(("tensor", world // _TENSOR, "ddp", _TENSOR))
    measured: dict[str, dict[int, float]] = {}
    for name, data, mode, tensor in runs:
        measured[name] = {}
        for m in _MODE_COUNTS:
            layout = Layout(
                dialect=dialect.name,
                schedule=schedule,
                pipeline=1,
                stages_per_rank=1,
                data_parallel=data,
                data_parallel_mode=mode,
                tensor_parallel=tensor,
                micro_batches=m,
                micro_batch_size=2,
                recompute=None,
                engine_options=offer.engine_options(schedule, 1, mode, tensor, _TENSOR_PLAN),
            )
            engine = _engine(dialect, layout, _Pairs())
            # The ranks of one data replica (tensor innermost) read the same micro-batches.
            gen = torch.Generator().manual_seed(1 + rank // tensor)
            batches = iter(
                [
                    (torch.randn(2, 4, generator=gen), torch.randn(2, 4, generator=gen))
                    for _ in range(m * (steps + 1))
                ]
            )
            engine.train_batch(batches)
            measured[name][m] = _median_seconds(
                functools.partial(engine.train_batch, batches), steps
            )
            del engine
    return {"schedule": schedule, "steps": measured}


def _engine(dialect: Any, layout: Any, model: nn.Module) -> Any:
    """The runtime engine ``dialect`` builds for ``model`` under ``layout`` (plain SGD, seeded
    alike on every rank): what each calibration run times."""
    from ..plan.partition import partition

    torch.manual_seed(0)
    plan = partition(model, **layout.partition_kwargs())
    config = {
        **layout.config(),
        "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
        "steps_per_print": 10**9,
    }
    module = dialect.pipe_engine(
        plan,
        config=config,
        loss_fn=_loss,
        topology=layout.topology(dialect),
        **layout.pipe_engine_kwargs(),
    )
    return dialect.runtime_engine(module, config=config)


def _rss() -> int:
    """This process's resident set in bytes (0 where /proc is missing)."""
    import resource

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return 0
