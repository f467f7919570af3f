"""The planner's memory model with recomputation: the re-materialised activations count."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipedialect.cost import Cluster, Layout, model_chains, predict
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
    flight) is its state plus 2 x 2 x 256 plus 1280 bytes, by hand."""
    per_block = BATCH * (DIM + HIDDEN) * 4
    chains = model_chains(
        _model(),
        {"input": torch.randn(BATCH, DIM)},
        recompute_options=[None, ["*"]],
        flops_per_second=1e9,
    )
    plain, recomputed = chains[""], chains["*"]
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
            assert peak == pytest.approx(state + 2 * 2 * per_block)
        else:
            assert peak == pytest.approx(state + 2 * 2 * BATCH * DIM * 4 + per_block)


def test_a_sharded_stage_holds_its_shards_beside_the_whole_parameters_and_gradients() -> None:
    """FSDP2 keeps each parameter's shard and all-gathers into a separate whole-size buffer;
    the gradients of a step accumulate whole until the reduce-scatter after the last backward
    writes the gradient's shard. Measured on this machine's torch with two 64 MiB units over 2
    and 4 gloo ranks: the resident set during a step grows by the whole parameters and the whole
    gradients on top of the shards, whatever the number of replicas. So at the reduce-scatter of
    rank 0 (1F1B, p=2, d replicas, no optimizer state) the peak is, by hand: the parameter and
    gradient shards (2 x T / d), the gathered parameters (T), the whole gradients (T), and the
    activations of the micro-batch in flight then (one: the last backward)."""
    per_block = BATCH * (DIM + HIDDEN) * 4
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
        expected = 2 * params / d + params + params + 2 * 2 * per_block
        assert peak == pytest.approx(expected), d
