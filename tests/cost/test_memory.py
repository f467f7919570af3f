"""The planner's memory model with recomputation: the re-materialised activations count."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from pipedialect.cost import Atom, Chain, Cluster, Layout, model_chains, predict
from pipedialect.cost._predict import boundary_memory
from pipedialect.planner import build_program

DIM, HIDDEN, BATCH = 16, 64, 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        *(
            nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, DIM))
            for _ in range(4)
        )
    )


def test_a_recomputed_stage_holds_one_blocks_activations_again_in_its_backward() -> None:
    """Each block saves its input (BATCH x DIM floats) and the ReLU's output (BATCH x HIDDEN,
    read by both the ReLU's and the second product's backward): 1280 bytes. Recomputed, a
    stage keeps each block's input per micro-batch in flight, and while a backward runs one
    block's 1280 bytes again; the predicted peak of 1F1B's first stage (two micro-batches in
    flight) is its state plus 2 x 2 x 256 plus 1280 bytes, by hand. Beside them the boundary
    (BATCH x DIM floats, 256 bytes): the stage's output per micro-batch in flight (2 x 256) and
    torch's receive buffers for the output's gradient, one per micro-batch of the step
    (4 x 256); and while the second micro-batch's backward runs (two in flight then too), the
    gradient of the largest weight (HIDDEN x DIM floats, 4096 bytes) made before it is added
    into the accumulated one."""
    per_block = BATCH * (DIM + HIDDEN) * 4
    boundary = BATCH * DIM * 4
    buffers = 4 * boundary + 2 * boundary + HIDDEN * DIM * 4
    chains = model_chains(
        _model(),
        {"input": torch.randn(BATCH, DIM)},
        recompute_options=[None, ["*"]],
        flops_per_second=1e9,
    )
    plain, recomputed = chains[""], chains["*"]
    # The model's input and output, BATCH x DIM floats each; the largest parameter per stage.
    assert (plain.input_bytes, plain.output_bytes) == (boundary, boundary)
    assert [s.largest_parameter_bytes for s in plain.stages((1,))] == [HIDDEN * DIM * 4] * 2
    assert [s.rematerialized_bytes for s in plain.stages((1,))] == [0, 0]
    assert [s.rematerialized_bytes for s in recomputed.stages((1,))] == [per_block, per_block]
    assert [s.activation_bytes for s in recomputed.stages((1,))] == [2 * BATCH * DIM * 4] * 2

    cluster = Cluster(world_size=2, memory_per_rank=1 << 30, bandwidth=1e9, optimizer_states=0)
    program = build_program("1f1b", 2, 4, 1)
    params = sum(p.numel() * 4 for p in _model()[:2].parameters())
    for chain, label in ((plain, None), (recomputed, "*")):
        layout = Layout(
            dialect="torch",
            schedule="1f1b",
            pipeline=2,
            stages_per_rank=1,
            data_parallel=1,
            data_parallel_mode="ddp",
            tensor_parallel=1,
            micro_batches=4,
            micro_batch_size=BATCH,
            recompute=label,
            split_points=("1",),
            cuts=(1,),
        )
        peak = predict(chain, layout, cluster, program).peak_memory[0]
        state = 2 * params  # weights and gradients
        if label is None:
            assert peak == pytest.approx(state + 2 * 2 * per_block + buffers)
        else:
            assert peak == pytest.approx(state + 2 * 2 * BATCH * DIM * 4 + per_block + buffers)


def test_a_sharded_stage_holds_its_shards_beside_the_whole_parameters_and_gradients() -> None:
    """FSDP2 keeps each parameter's shard and all-gathers into a separate whole-size buffer;
    the gradients of a step accumulate whole until the reduce-scatter after the last backward
    writes the gradient's shard. Measured on this machine's torch with two 64 MiB units over 2
    and 4 gloo ranks: the resident set during a step grows by the whole parameters and the whole
    gradients on top of the shards, whatever the number of replicas. So at the reduce-scatter of
    rank 0 (1F1B, p=2, d replicas, no optimizer state) the peak is, by hand: the parameter and
    gradient shards (2 x T / d), the gathered parameters (T), the whole gradients (T), and the
    activations of the micro-batch in flight then (one: the last backward), and the boundary's
    buffers ([Note: boundary buffers]): the stage's output per micro-batch in flight and one
    receive buffer per micro-batch for its gradient; and while a backward runs with two in
    flight, the largest weight's gradient (HIDDEN x DIM floats) before it is accumulated."""
    per_block = BATCH * (DIM + HIDDEN) * 4
    boundary = BATCH * DIM * 4
    chain = model_chains(_model(), {"input": torch.randn(BATCH, DIM)}, flops_per_second=1e9)[""]
    program = build_program("1f1b", 2, 4, 1)
    params = sum(p.numel() * 4 for p in _model()[:2].parameters())
    for d in (2, 4):
        cluster = Cluster(
            world_size=2 * d, memory_per_rank=1 << 30, bandwidth=1e9, optimizer_states=0
        )
        layout = Layout(
            dialect="torch",
            schedule="1f1b",
            pipeline=2,
            stages_per_rank=1,
            data_parallel=d,
            data_parallel_mode="fsdp",
            tensor_parallel=1,
            micro_batches=4,
            micro_batch_size=BATCH,
            recompute=None,
            split_points=("1",),
            cuts=(1,),
        )
        peak = predict(chain, layout, cluster, program).peak_memory[0]
        # The largest of: two micro-batches in flight before any gradient exists, or the
        # whole gradients from the first backward on (then at most two in flight).
        expected = 2 * params / d + params + params + 2 * (2 * per_block + boundary)
        expected += 4 * boundary + HIDDEN * DIM * 4
        assert peak == pytest.approx(expected), d


def _peak(chain: Chain, schedule: str, **kwargs: Any) -> tuple[float, ...]:
    """Peak bytes per rank of ``chain`` on two ranks, four micro-batches, nothing but memory
    counted (no optimizer state, a link that is never the limit)."""
    cluster = Cluster(world_size=2, memory_per_rank=1e9, bandwidth=1e9, optimizer_states=0)
    program = build_program(schedule, 2, 4, 1)
    return predict(chain, _pipeline(schedule), cluster, program, **kwargs).peak_memory


def _boundary_chain(
    stages: int,
    parameter: int = 10,
    input_bytes: int = 0,
    output_bytes: int = 0,
    pieces: int = 1,
) -> Chain:
    """``stages`` atoms of ``parameter`` trainable bytes (in ``pieces`` equal parameters),
    each saving 100 bytes per micro-batch, 50 bytes across every cut, at one sample per
    micro-batch."""
    atoms = tuple(
        Atom(
            forward=1.0,
            backward=2.0,
            parameters={f"w{k}.{i}": parameter // pieces for i in range(pieces)},
            saved={k: 100},
        )
        for k in range(stages)
    )
    return Chain(
        atoms,
        tuple(f"a{k}" for k in range(stages - 1)),
        (50,) * (stages - 1),
        input_bytes=input_bytes,
        output_bytes=output_bytes,
    )


def _pipeline(schedule: str, v: int = 1, m: int = 4) -> Layout:
    return Layout(
        dialect="deepspeed" if schedule == "deepspeed_1f1b" else "torch",
        schedule=schedule,
        pipeline=2,
        stages_per_rank=v,
        data_parallel=1,
        data_parallel_mode="ddp",
        tensor_parallel=1,
        micro_batches=m,
        micro_batch_size=1,
        recompute=None,
        split_points=tuple(f"a{k}" for k in range(2 * v - 1)),
        cuts=tuple(range(2 * v - 1)),
    )


def test_the_boundaries_hold_the_runtimes_buffers_by_hand() -> None:
    """Two stages of 20 bytes of state (weights and gradients) and 100 saved per micro-batch,
    50 bytes across the cut, 4 micro-batches ([Note: boundary buffers]).

    torch's 1F1B (its ``PipelineStage`` allocates a receive buffer per micro-batch): rank 0
    keeps two micro-batches in flight, each with its output (50), and 4 receive buffers for the
    output's gradient, and the weight's gradient (10) made in a backward before it is added
    into the accumulated one: 20 + 2 x (100 + 50) + 4 x 50 + 10 = 530. Rank 1: one in flight, 4
    receive buffers for the activations, and the input gradient (50) and the weight's (10) while
    its backward runs: 20 + 100 + 4 x 50 + 50 + 10 = 380.

    DeepSpeed's 1F1B (one receive buffer each way, the activation copied out of it): rank 0:
    20 + 2 x (100 + 50) + 50 + 10 = 380; rank 1: 20 + (100 + 50) + 50 + 50 + 10 = 280 in its
    backward (its forward, on a copy of the received activation: 20 + 150 + 50 + 50 = 270).
    Without the boundaries both would read 220 and 120."""
    chain = _boundary_chain(2)
    assert _peak(chain, "1f1b") == pytest.approx((530.0, 380.0))
    assert _peak(chain, "deepspeed_1f1b") == pytest.approx((380.0, 280.0))
    without = _peak(chain, "deepspeed_1f1b", runtime_buffers=False)
    assert without == pytest.approx((220.0, 120.0))


def test_the_models_own_input_and_output_by_hand() -> None:
    """The boundaries of the chain above, and the model's input (30 bytes per micro-batch) and
    output (40). The last stage keeps the output per micro-batch in flight until its backward
    (torch's output cache, DeepSpeed's output buffers; the loss reads it), and its backward
    makes the loss's gradient, output-sized: torch's rank 1 holds 20 + (100 + 40) + 4 x 50 +
    (50 + 40 + 10) = 460 (380 without the output). The first stage's input is the data's own
    tensor under torch (rank 0: 530, as before), while DeepSpeed copies each loaded input into
    its input buffer for the micro-batch in flight, and each forward computes on a copy of its
    input buffer: rank 0 peaks in its second forward, 20 + 2 x (100 + 50 + 30) + 50 + 30 = 460
    (its backwards: 440), rank 1 in its backward, 20 + (100 + 50 + 40) + 50 + (50 + 40 + 10) =
    360 (its forward: 20 + 190 + 50 + 50 = 310)."""
    chain = _boundary_chain(2, input_bytes=30, output_bytes=40)
    assert _peak(chain, "1f1b") == pytest.approx((530.0, 460.0))
    assert _peak(chain, "deepspeed_1f1b") == pytest.approx((460.0, 360.0))


def test_deepspeed_packs_the_gradients_without_replicas() -> None:
    """Stages of 1000 trainable bytes in two parameters of 500, no data replicas. DeepSpeed's
    engine still flattens the rank's gradients into one new tensor to all-reduce them over its
    data group of one: with one micro-batch (no gradient accumulated, so none exists twice in
    a backward) the last rank peaks at its ALL_REDUCE with 2000 (weights and gradients) + 50
    (its receive buffer) + 1000 (the packed gradients) = 3050, above its backward (2000 + 50 +
    (100 + 50) + 50 = 2250). torch's runtime sums nothing without replicas: with two
    micro-batches its last rank peaks in the second backward, 2000 + 2 x 50 (a receive buffer
    per micro-batch) + 100 + 50 + 500 (one parameter's gradient before it is accumulated) =
    2750, where packing would have made 2000 + 100 + 1000 = 3100."""
    chain = _boundary_chain(2, parameter=1000, pieces=2)
    cluster = Cluster(world_size=2, memory_per_rank=1e9, bandwidth=1e9, optimizer_states=0)
    deepspeed_peak = predict(
        chain,
        _pipeline("deepspeed_1f1b", m=1),
        cluster,
        build_program("deepspeed_1f1b", 2, 1, 1),
    ).peak_memory
    assert deepspeed_peak[1] == pytest.approx(3050.0)
    torch_peak = predict(
        chain, _pipeline("1f1b", m=2), cluster, build_program("1f1b", 2, 2, 1)
    ).peak_memory
    assert torch_peak[1] == pytest.approx(2750.0)


def test_a_neighbour_on_the_same_rank_needs_no_receive_buffer() -> None:
    """ZBV on 2 ranks places stages 0 and 3 on rank 0, 1 and 2 on rank 1: stage 1 hands its
    output to stage 2 in the same process. Receive buffers (4 micro-batches of 50 bytes) only
    where the neighbour is remote: stage 0 for its output's gradient, stage 1 for its input,
    stage 2 for its output's gradient, stage 3 for its input; every stage but the last keeps
    its output per micro-batch in flight, every stage but the first makes an input gradient."""
    program = build_program("zbv_zero_bubble", 2, 4, 2)
    assert program.placement == (0, 1, 1, 0)
    chain = _boundary_chain(4)
    layout = _pipeline("zbv_zero_bubble", v=2)
    got = boundary_memory(chain.stages(layout.cuts), layout, chain, program)
    assert [b.kept for b in got] == [200.0, 200.0, 200.0, 200.0]
    assert [b.per_micro_batch for b in got] == [50.0, 50.0, 50.0, 0.0]
    assert [b.backward for b in got] == [0.0, 50.0, 50.0, 50.0]
