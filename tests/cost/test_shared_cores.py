"""Ranks sharing a host's cores: timelines worked out by hand ([Note: ranks sharing cores] in
``cost._simulate``), the cost model passing the measured CPU share and the layout's processes,
and ``measure_time`` telling waiting from computing."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import torch
from _layouts import one_stage_layout
from torch import nn

from pipedialect import ConfigError
from pipedialect.cost import (
    Atom,
    Chain,
    Cluster,
    StageTimes,
    model_chains,
    predict,
    simulate,
    torch_program,
)
from pipedialect.planner import build_program


def _forwards(sim: Any) -> dict[tuple[int, str], tuple[float, float]]:
    return {(s.rank, s.name): (s.start, s.end) for s in sim.spans if s.kind == "forward"}


def _close(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return all(math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12) for x, y in zip(a, b, strict=True))


def _gpipe(
    share: float, cores: float | None, first: float = 10.0, second: float = 10.0, **kw: Any
) -> Any:
    """GPipe on 2 ranks, 2 micro-batches, forwards only (no backward work, free messages)."""
    stages = [
        StageTimes(first, 0.0, 0.0, cpu_share=share),
        StageTimes(second, 0.0, 0.0, cpu_share=share),
    ]
    return simulate(torch_program("gpipe", 2, 2), stages, cores=cores, **kw)


def test_two_ranks_computing_at_once_on_one_core_take_twice_as_long() -> None:
    """F = 10 on both stages, all CPU, one core: rank 0's F0 [0, 10] runs alone; then rank 0's F1
    and rank 1's F0 both start at 10 and share the core, each at half speed: [10, 30]; rank 1's
    F1 runs alone [30, 40]. Without sharing the step is 30."""
    sim = _gpipe(1.0, 1)
    spans = _forwards(sim)
    assert _close(spans[(0, "F0")], (0.0, 10.0))
    assert _close(spans[(0, "F1")], (10.0, 30.0))
    assert _close(spans[(1, "F0")], (10.0, 30.0))
    assert _close(spans[(1, "F1")], (30.0, 40.0))
    assert math.isclose(sim.step_time, 40.0)
    assert math.isclose(_gpipe(1.0, None).step_time, 30.0)


def test_processor_sharing_speeds_up_the_one_left_when_the_other_ends() -> None:
    """Stage 0 F = 10, stage 1 F = 30, one core. From 10, rank 0's F1 (10 of CPU) and rank 1's
    F0 (30) share the core at half speed each; rank 0's ends at 30, when rank 1's has done 10 of
    its 30, and the remaining 20 run alone: F0 on rank 1 is [10, 50], its F1 [50, 80]."""
    sim = _gpipe(1.0, 1, first=10.0, second=30.0)
    spans = _forwards(sim)
    assert _close(spans[(0, "F1")], (10.0, 30.0))
    assert _close(spans[(1, "F0")], (10.0, 50.0))
    assert _close(spans[(1, "F1")], (50.0, 80.0))
    assert math.isclose(sim.step_time, 80.0)
    assert sim.busy == pytest.approx((30.0, 70.0))


def test_waiting_work_is_not_stretched_and_enough_cores_change_nothing() -> None:
    """A computation that sleeps (CPU share 0) leaves the core to the others; two ranks on two
    cores, or two half-waiting ranks on one core (demand 0.5 + 0.5), do not slow each other."""
    for share, cores in ((0.0, 1), (1.0, 2), (0.5, 1)):
        sim = _gpipe(share, cores)
        assert math.isclose(sim.step_time, 30.0), (share, cores)
        assert _close(_forwards(sim)[(1, "F0")], (10.0, 20.0))


def test_only_the_cpu_part_of_a_computation_slows_down() -> None:
    """Share 0.5 with 2 threads per rank: each of the two overlapping forwards demands 1 core,
    2 in all on one core, so their CPU half (5) runs at half speed (10) and the waiting half at
    full speed (5): [10, 25]; rank 1's F1 alone demands 1 core: [25, 35]."""
    sim = _gpipe(0.5, 1, threads=2)
    spans = _forwards(sim)
    assert _close(spans[(0, "F1")], (10.0, 25.0))
    assert _close(spans[(1, "F1")], (25.0, 35.0))
    assert math.isclose(sim.step_time, 35.0)


def test_one_rank_alone_is_unchanged_but_its_data_parallel_peers_share_its_cores() -> None:
    """One rank, F = 10, B = 20, all CPU, one core: alone 30; with a data-parallel peer
    computing in step (2 processes per rank) both halves take twice as long: 60."""
    program = torch_program("gpipe", 1, 1)
    stages = [StageTimes(10.0, 20.0, 0.0, cpu_share=1.0)]
    assert math.isclose(simulate(program, stages, cores=1).step_time, 30.0)
    assert math.isclose(simulate(program, stages, cores=1, processes_per_rank=2).step_time, 60.0)


def test_the_runtime_cost_per_computation_is_not_stretched() -> None:
    """F = 10 and 2 of runtime per computation, all CPU, one core: the overlapping forwards'
    work is shared ([10, 30]) and their runtime cost added after it: [12, 34] on rank 0 (it
    starts after F0's 12), and the step ends with rank 1's F1 alone."""
    stages = [StageTimes(10.0, 0.0, 0.0, action_overhead=2.0, cpu_share=1.0)] * 2
    sim = simulate(torch_program("gpipe", 2, 2), stages, cores=1)
    spans = _forwards(sim)
    assert _close(spans[(0, "F0")], (0.0, 12.0))
    assert _close(spans[(0, "F1")], (12.0, 34.0))
    assert _close(spans[(1, "F0")], (12.0, 34.0))
    assert _close(spans[(1, "F1")], (34.0, 46.0))


def test_bad_sharing_arguments_are_refused() -> None:
    with pytest.raises(ConfigError, match="cpu_share"):
        StageTimes(1.0, 1.0, 0.0, cpu_share=1.5)
    with pytest.raises(ConfigError, match="cores"):
        _gpipe(1.0, 0)
    with pytest.raises(ConfigError, match="threads"):
        _gpipe(1.0, 1, threads=0)
    with pytest.raises(ConfigError, match="cores"):
        Cluster(world_size=1, memory_per_rank=1.0, bandwidth=1.0, cores=0)


def test_four_data_parallel_ranks_on_two_cores_compute_at_half_speed() -> None:
    """One stage, F = 1 and B = 2 seconds measured with 1 thread, all CPU; 4 DDP replicas on a
    host of 2 cores compute in step: 4 cores demanded of 2, so 2 micro-batches take
    2 * (2 + 4) = 12 s instead of 6; on 4 cores, or with a chain measured on an accelerator (no
    CPU share), 6."""
    atom = Atom(forward=1.0, backward=2.0)
    chain = Chain((atom,), (), (), cpu_share=1.0, threads=1)
    cluster = Cluster(world_size=4, memory_per_rank=1e9, bandwidth=1e12, cores=2)
    program = build_program("gpipe", 1, 2, 1)
    layout = one_stage_layout(data_parallel=4, micro_batches=2)
    assert math.isclose(predict(chain, layout, cluster, program).step_time, 12.0)
    wide = Cluster(world_size=4, memory_per_rank=1e9, bandwidth=1e12, cores=4)
    assert math.isclose(predict(chain, layout, wide, program).step_time, 6.0)
    unmeasured = Chain((atom,), (), ())
    assert math.isclose(predict(unmeasured, layout, cluster, program).step_time, 6.0)


class _Wait(nn.Module):
    """A block that waits instead of computing (as the planner benchmark's emulated blocks do)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.02)
        return x * self.weight


def test_measure_time_finds_a_waiting_model_leaves_the_cores_free() -> None:
    """A model whose forward sleeps 20 ms per block and computes almost nothing: its CPU share is
    small (the sleep takes no CPU time, however loaded the machine), and its chain carries the
    share and the threads it was timed with."""
    model = nn.Sequential(_Wait(), _Wait())
    chains = model_chains(model, {"input": torch.ones(2, 4)}, measure_time=True, repeats=1)
    (chain,) = chains.values()
    assert chain.cpu_share is not None
    assert chain.cpu_share < 0.5
    assert chain.threads >= 1
    flops = model_chains(model, {"input": torch.ones(2, 4)}, flops_per_second=1e9)
    assert next(iter(flops.values())).cpu_share is None
