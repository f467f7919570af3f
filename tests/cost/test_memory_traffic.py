"""What a step costs beyond the model's timed work scaled by the samples, all of it work on
memory the timing never saw, hand-computed: the seconds a micro-batch of any size costs
([Note: seconds that do not scale with the micro-batch] in ``cost._profile``: the line through
two timed sizes, the cost model keeping that part whole while it scales the rest,
``measure_time`` finding it in a model that waits a fixed time per call plus a time per
sample), adding each backward's weight gradient into the step's accumulated one ([Note:
gradient accumulation] in ``cost._simulate``) and packing the gradients for a data-parallel sum
([Note: packing the gradients] in ``cost._predict``)."""

from __future__ import annotations

import math
import time

import pytest
import torch
from _layouts import one_stage_layout
from torch import nn

from pipedialect import ConfigError
from pipedialect.cost import Atom, Chain, Cluster, StageTimes, model_chains, predict, simulate
from pipedialect.cost._profile import fixed_seconds
from pipedialect.planner import build_program

_CLUSTER = Cluster(world_size=1, memory_per_rank=1e12, bandwidth=1e12)


def test_the_intercept_of_two_timed_sizes_is_the_fixed_part() -> None:
    """20 ms per call plus 1 ms per sample: 28 ms at 8 samples, 24 ms at 4, so 20 ms fixed;
    all proportional (16 and 8 ms): 0; noise that puts the line below 0 or above the smaller
    timing is clipped to what was measured."""
    assert math.isclose(fixed_seconds(0.028, 0.024, 8, 4), 0.020)
    assert fixed_seconds(0.016, 0.008, 8, 4) == 0.0
    assert fixed_seconds(0.016, 0.007, 8, 4) == 0.0
    assert fixed_seconds(0.020, 0.021, 8, 4) == 0.020


def test_the_fixed_part_stays_whole_at_a_smaller_micro_batch() -> None:
    """Measured at 8 samples: forward 10 ms of which 2 fixed, backward 20 ms of which 8 fixed.
    At 4 samples: forward 2 + 8 / 2 = 6 ms, backward 8 + 12 / 2 = 14 ms (7 input, 7 weight at
    the weight fraction 0.5); one stage, one micro-batch: a step of 20 ms. Scaling everything,
    as before the fixed part was measured, would give 5 + 10 = 15 ms."""
    atom = Atom(forward=0.010, backward=0.020, forward_fixed=0.002, backward_fixed=0.008)
    chain = Chain((atom,), (), (), batch=8)
    layout = one_stage_layout(micro_batch_size=4)
    program = build_program("gpipe", 1, 1, 1)
    pred = predict(chain, layout, _CLUSTER, program)
    (times,) = pred.stage_times
    assert math.isclose(times.forward, 0.006)
    assert math.isclose(times.backward_input, 0.007)
    assert math.isclose(times.backward_weight, 0.007)
    assert math.isclose(pred.step_time, 0.020)
    proportional = Chain((Atom(forward=0.010, backward=0.020),), (), (), batch=8)
    assert math.isclose(predict(proportional, layout, _CLUSTER, program).step_time, 0.015)


def test_a_larger_micro_batch_adds_only_the_proportional_part() -> None:
    """The same atom at 16 samples: forward 2 + 8 * 2 = 18 ms, backward 8 + 12 * 2 = 32 ms."""
    atom = Atom(forward=0.010, backward=0.020, forward_fixed=0.002, backward_fixed=0.008)
    chain = Chain((atom,), (), (), batch=8)
    program = build_program("gpipe", 1, 1, 1)
    pred = predict(chain, one_stage_layout(micro_batch_size=16), _CLUSTER, program)
    assert math.isclose(pred.step_time, 0.050)


def test_a_fixed_part_larger_than_the_seconds_is_refused() -> None:
    with pytest.raises(ConfigError, match="forward_fixed"):
        Atom(forward=0.001, backward=0.0, forward_fixed=0.002)
    with pytest.raises(ConfigError, match="backward_fixed"):
        Atom(forward=0.0, backward=0.001, backward_fixed=-0.001)


class _PerCall(nn.Module):
    """Waits 30 ms per call plus 2 ms per sample (as a block whose work on its parameters does
    not depend on the micro-batch would take), then computes almost nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.030 + 0.002 * x.shape[0])
        return x * self.weight


def test_measure_time_tells_the_fixed_part_from_the_part_per_sample() -> None:
    """Timed at 8 samples (46 ms per forward) and at 4 (38 ms): the chain's forward keeps about
    30 ms whole; the model timed at one sample cannot be halved and keeps nothing whole. Sleeps
    overshoot by a fraction of a millisecond and a loaded machine wakes them late, hence the
    tolerance."""
    model = nn.Sequential(_PerCall())
    (chain,) = model_chains(
        model, {"input": torch.ones(8, 4)}, measure_time=True, repeats=1
    ).values()
    forward = sum(a.forward for a in chain.atoms)
    fixed = sum(a.forward_fixed for a in chain.atoms)
    assert forward == pytest.approx(0.046, abs=0.006)
    assert fixed == pytest.approx(0.030, abs=0.006)
    (single,) = model_chains(
        model, {"input": torch.ones(1, 4)}, measure_time=True, repeats=1
    ).values()
    assert all(a.forward_fixed == 0.0 and a.backward_fixed == 0.0 for a in single.atoms)


# -- gradient accumulation ([Note: gradient accumulation] in cost._simulate) -------------------


def _one_stage(schedule: str, times: StageTimes, steps: int = 1) -> float:
    program = build_program(schedule, 1, 3, 1)
    return simulate(program, [times], steps=steps).step_time


def test_every_backward_but_the_first_of_a_step_adds_its_gradient() -> None:
    """One stage, 3 micro-batches, F = 1, B = 2 (I = 1, W = 1), accumulating 0.5: GPipe's and
    1F1B's backwards B1 and B2 add (B0's gradient becomes the accumulated one): 3 * 3 + 2 *
    0.5 = 10. Split (zero bubble) the weight passes W1 and W2 add: 10 again; a stage whose
    backward runs whole in I (``split=False``) adds in I1 and I2: 10. Over two steps the first
    backward of each is free again: a steady period of 10. Without accumulation: 9."""
    times = StageTimes(1.0, 1.0, 1.0, accumulate=0.5)
    assert math.isclose(_one_stage("gpipe", times), 10.0)
    assert math.isclose(_one_stage("1f1b", times), 10.0)
    assert math.isclose(_one_stage("interleaved_zero_bubble", times), 10.0)
    whole = StageTimes(1.0, 1.0, 1.0, split=False, accumulate=0.5)
    assert math.isclose(_one_stage("interleaved_zero_bubble", whole), 10.0)
    assert math.isclose(_one_stage("1f1b", times, steps=2), 10.0)
    assert math.isclose(_one_stage("1f1b", StageTimes(1.0, 1.0, 1.0)), 9.0)


def test_the_accumulation_costs_the_stages_trainable_bytes_at_the_calibrated_rate() -> None:
    """A stage of 4 MB trainable (2 parameters) at 1 ns per byte accumulates for 4 ms per
    micro-batch after the first: 4 micro-batches of F = 10 ms and B = 20 ms take 4 * 30 + 3 *
    4 = 132 ms; frozen state costs nothing; tensor parallelism of 2 halves the bytes of its
    sharded parameters (here all of them): 4 * 30 + 3 * 2 = 126 ms when the work is not
    sharded (none of it is in tensor-parallel modules)."""
    atom = Atom(
        forward=0.010,
        backward=0.020,
        parameters={"a.weight": 3_000_000, "b.weight": 1_000_000},
        state={"frozen": 50_000_000},
        tensor_parameters=frozenset({"a.weight", "b.weight"}),
    )
    chain = Chain((atom,), (), (), batch=1)
    cluster = Cluster(
        world_size=2, memory_per_rank=1e12, bandwidth=1e12, accumulate_seconds_per_byte=1e-9
    )
    program = build_program("gpipe", 1, 4, 1)
    pred = predict(chain, one_stage_layout(micro_batches=4), cluster, program)
    assert math.isclose(pred.stage_times[0].accumulate, 0.004)
    assert math.isclose(pred.step_time, 0.132)
    sharded = one_stage_layout(micro_batches=4, tensor_parallel=2)
    assert math.isclose(predict(chain, sharded, cluster, program).step_time, 0.126)


# -- packing the gradients for a data-parallel sum ([Note: packing the gradients]) -------------


def test_a_data_parallel_gradient_sum_packs_and_unpacks_the_gradients() -> None:
    """One stage of 4 MB gradients on 2 DDP replicas, 1 GB/s collectives, no latency: the ring
    all-reduce takes 2 * 1/2 * 4 MB / 1 GB/s = 4 ms, packing and copying back at 1 ns per
    byte 4 ms more. One micro-batch of F = 10 ms and B = 20 ms: a step of 38 ms (34 without
    the packing); one replica sums nothing (30 ms), and FSDP reduce-scatters in place of it
    (its reduction costs the gather bandwidth: 4 ms on the comm channel after the backward,
    but no packing)."""
    atom = Atom(forward=0.010, backward=0.020, parameters={"w": 4_000_000})
    chain = Chain((atom,), (), (), batch=1)
    cluster = Cluster(world_size=2, memory_per_rank=1e12, bandwidth=1e9, pack_seconds_per_byte=1e-9)
    program = build_program("gpipe", 1, 1, 1)
    ddp = one_stage_layout(data_parallel=2)
    assert math.isclose(predict(chain, ddp, cluster, program).step_time, 0.038)
    unpacked = Cluster(world_size=2, memory_per_rank=1e12, bandwidth=1e9)
    assert math.isclose(predict(chain, ddp, unpacked, program).step_time, 0.034)
    assert math.isclose(predict(chain, one_stage_layout(), cluster, program).step_time, 0.030)
    fsdp = one_stage_layout(data_parallel=2, data_parallel_mode="fsdp")
    fsdp_step = predict(chain, fsdp, cluster, program).step_time
    assert math.isclose(fsdp_step, predict(chain, fsdp, unpacked, program).step_time)
