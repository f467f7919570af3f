"""The simulator's rules on small programs whose timelines are worked out by hand."""

from __future__ import annotations

import math

import pytest

from pipedialect import ConfigError
from pipedialect.cost import (
    Action,
    ActionKind,
    Program,
    StageMemory,
    StageTimes,
    deepspeed_program,
    simulate,
    torch_program,
)

K = ActionKind


def test_an_asynchronous_message_delays_only_its_consumer() -> None:
    """GPipe on 2 ranks, one micro-batch, F = 1, B = 2, a message 0.25: F0 [0, 1], its output
    arrives at 1.25, F1 [1.25, 2.25], B1 [2.25, 4.25], the gradient arrives at 4.5, B0
    [4.5, 6.5]."""
    sim = simulate(torch_program("gpipe", 2, 1), [StageTimes(1.0, 1.0, 1.0)] * 2, boundaries=0.25)
    assert math.isclose(sim.step_time, 6.5)
    spans = {(s.rank, s.name): (s.start, s.end) for s in sim.spans if s.kind == "backward"}
    assert spans[(1, "B0")] == (2.25, 4.25)
    assert spans[(0, "B0")] == (4.5, 6.5)


def test_a_ranks_messages_queue_on_its_link() -> None:
    """GPipe on 2 ranks, 3 micro-batches, F = 1, no backward work, a message 3: rank 0 ends
    its forwards at 1, 2, 3, but its link carries one message at a time, so they arrive at 4, 7
    and 10 (not 4, 5, 6); rank 1 computes F0 [4, 5], F1 [7, 8], F2 [10, 11], then its three
    gradients leave one after another and arrive at 14, 17 and 20: the step ends at 20."""
    sim = simulate(torch_program("gpipe", 2, 3), [StageTimes(1.0, 0.0, 0.0)] * 2, boundaries=3.0)
    forwards = sorted((s.start, s.end) for s in sim.spans if s.kind == "forward" and s.rank == 1)
    assert forwards == [(4.0, 5.0), (7.0, 8.0), (10.0, 11.0)]
    assert math.isclose(sim.step_time, 20.0)
    # Messages that may overlap: they arrive at 4, 5, 6, rank 1 ends its forwards at 7 and the
    # gradients all arrive at 10.
    free = simulate(
        torch_program("gpipe", 2, 3),
        [StageTimes(1.0, 0.0, 0.0)] * 2,
        boundaries=3.0,
        queue_messages=False,
    )
    assert math.isclose(free.step_time, 10.0)


def test_blocking_sends_and_receives_meet() -> None:
    """DeepSpeed's 1F1B, 2 stages, 2 micro-batches, F = 1, B = 2, a message 0.5 (worked out from
    its instruction order: stage 0 runs F0, SEND_F0, F1, RECV_B0, SEND_F1, B0, RECV_B1, B1;
    stage 1 RECV_F0, F0, B0, SEND_B0, RECV_F1, F1, B1, SEND_B1): the transfers take
    [1, 1.5], [4.5, 5], [5, 5.5] and [8.5, 9], and stage 0's last backward ends at 11."""
    program = deepspeed_program(2, 2)
    assert [str(a) for a in program.ranks[0][:8]] == [
        "0F0", "0SEND_F0", "0F1", "0RECV_B0", "0SEND_F1", "0B0", "0RECV_B1", "0B1",
    ]  # fmt: skip
    sim = simulate(program, [StageTimes(1.0, 1.0, 1.0)] * 2, boundaries=0.5)
    assert math.isclose(sim.step_time, 11.0)
    sends = sorted((s.start, s.end) for s in sim.spans if s.kind == "send")
    assert sends == [(1.0, 1.5), (4.5, 5.0), (5.0, 5.5), (8.5, 9.0)]
    # Stage 0 waits in RECV_B0 from 2.5 to 5 and in RECV_B1 from 7.5 to 9, and sends twice.
    assert math.isclose(sim.communication[0], 0.5 + 2.5 + 0.5 + 1.5)


def test_collectives_run_beside_the_computation_and_end_the_step() -> None:
    """One stage, one micro-batch, F = 1, B = 2, its gather 3 and its reduction 4: F waits for
    the gather (3 to 4), B runs 4 to 6, the reduction 6 to 10; the step ends at 10. Memory:
    the gathered 5 bytes from the gather to the reshard, 7 bytes of gradients from the backward
    to the reduction, 1 byte of activations while the micro-batch is in flight: during the
    backward all of them at once, 113 with the base 100."""
    times = StageTimes(1.0, 1.0, 1.0, all_gather=3.0, reduce_grad=4.0)
    sim = simulate(
        torch_program("gpipe", 1, 1),
        [times],
        memory=[StageMemory(activation=1.0, gathered=5.0, gradient=7.0)],
        base_memory=100.0,
    )
    assert math.isclose(sim.step_time, 10.0)
    assert sim.peak_memory == (113.0,)


def test_the_all_reduce_blocks_and_the_optimizer_takes_its_time() -> None:
    sim = simulate(
        torch_program("1f1b", 2, 2),
        [StageTimes(1.0, 1.0, 1.0)] * 2,
        all_reduce=[2.0, 0.5],
        optimizer=1.0,
    )
    # 1F1B on 2 ranks, 2 micro-batches: (m + p - 1)(F + B) = 9; rank 0 ends last, then its
    # all-reduce and optimizer.
    assert math.isclose(sim.step_time, 9.0 + 2.0 + 1.0)


def test_memory_counts_each_stages_micro_batches_in_flight() -> None:
    """1F1B on 2 ranks with 4 micro-batches: stage 0 holds 2 at its peak, stage 1 holds 1."""
    sim = simulate(
        torch_program("1f1b", 2, 4),
        [StageTimes(1.0, 1.0, 1.0)] * 2,
        memory=[StageMemory(activation=10.0)] * 2,
        base_memory=[100.0, 50.0],
    )
    assert sim.in_flight == (2, 1)
    assert sim.peak_memory == (120.0, 60.0)


def test_a_stage_whose_backward_is_not_split_frees_at_its_input_pass() -> None:
    """ZB-H1 on 2 ranks: with the first stage's backward whole (the torch dialect's first stage),
    its weight passes cost nothing and it frees each micro-batch at the input pass."""
    program = torch_program("interleaved_zero_bubble", 2, 4, 1)
    split = simulate(program, [StageTimes(1.0, 1.0, 1.0)] * 2)
    whole = simulate(program, [StageTimes(1.0, 1.0, 1.0, split=False), StageTimes(1.0, 1.0, 1.0)])
    assert split.in_flight == (2, 2)
    assert whole.in_flight[0] <= split.in_flight[0]
    assert math.isclose(sum(s.end - s.start for s in whole.spans if s.rank == 0), 4 * 3.0)
    w0 = [s for s in whole.spans if s.rank == 0 and s.kind == "backward_weight"]
    assert all(s.end == s.start for s in w0)


def test_a_program_that_waits_for_itself_is_refused() -> None:
    program = Program("broken", 1, 1, (0,), ((Action(K.BACKWARD, 0, 0), Action(K.FORWARD, 0, 0)),))
    with pytest.raises(ConfigError, match="deadlocks"):
        simulate(program, [StageTimes(1.0, 1.0, 1.0)])


def test_costs_must_fit_the_program() -> None:
    with pytest.raises(ConfigError, match="2 stages but 1"):
        simulate(torch_program("1f1b", 2, 2), [StageTimes(1.0, 1.0, 1.0)])
    with pytest.raises(ConfigError, match="boundaries needs 1"):
        simulate(torch_program("1f1b", 2, 2), [StageTimes(1.0, 1.0, 1.0)] * 2, boundaries=[1, 2])


def test_several_steps_with_a_barrier_repeat_the_makespan() -> None:
    program = torch_program("1f1b", 3, 6)
    one = simulate(program, [StageTimes(1.0, 0.5, 0.5)] * 3, boundaries=0.1)
    three = simulate(program, [StageTimes(1.0, 0.5, 0.5)] * 3, boundaries=0.1, steps=3)
    assert math.isclose(one.step_time, three.step_time)


def test_each_computation_holds_its_own_temporaries() -> None:
    """One stage, one micro-batch, 10 bytes of activations while it is in flight, and what
    one action holds while it runs: a forward's copy of its input (1), a backward's transient
    bytes (100, in the input pass), the weight gradient before it is accumulated (1000, in the
    pass that makes the weight gradients). Split (F, I, W): F 10 + 1, I 10 + 100, W 10 +
    1000: peak 1010. Whole (the dialect runs the backward at I, W empty, the micro-batch freed
    at I): I holds 10 + 100 + 1000 = 1110. With a forward copy of 5000 the forward is the
    peak: 5010."""
    program = Program(
        "hand",
        1,
        1,
        (0,),
        (
            (
                Action(K.FORWARD, 0, 0),
                Action(K.BACKWARD_INPUT, 0, 0),
                Action(K.BACKWARD_WEIGHT, 0, 0),
            ),
        ),
    )
    memory = StageMemory(activation=10.0, transient=100.0, weight_gradient=1000.0, forward_copy=1)

    def peak(split: bool, stage: StageMemory) -> float:
        times = StageTimes(1.0, 1.0, 1.0, split=split)
        result = simulate(program, [times], memory=[stage]).peak_memory
        assert result is not None
        return result[0]

    assert peak(True, memory) == 1010.0
    assert peak(False, memory) == 1110.0
    assert peak(True, StageMemory(activation=10.0, forward_copy=5000.0)) == 5010.0
