"""Dropout and ``randn``-style noise give the unsplit model's numbers on every dialect, depth and
schedule ([Note: random streams] in ``pipedialect.runtime.randomness``).

The reference is the unsplit model trained by the plain loop of ``tests/_reference.py``, its
forwards run under ``ReferenceStreams`` of the plan's split points and seed. Checked: the local
dialect at depths 2 and 4, with and without recomputation; DeepSpeed at depth 4 and at depth 2
with two data-parallel replicas and activation checkpointing (its forward re-run in backward);
torch's GPipe and 1F1B at depth 2 (one recomputed), interleaved 1F1B and ZBV zero bubble at
depth 4 (two stages per rank). One launch per multi-process dialect.
"""

from __future__ import annotations

import _random_workers as workers
import pytest
import torch

import pipedialect
from pipedialect.runtime import ReferenceStreams, stream_seed
from pipedialect.runtime.launch import launch

TIMEOUT = 600


@pytest.mark.parametrize(
    "case",
    [
        {"stages": 2},
        {"stages": 4},
        {"stages": 4, "recompute": ["blocks.*"]},
    ],
)
def test_local_dialect_draws_the_unsplit_models_numbers(case: dict) -> None:
    result = workers.train(pipedialect.get_dialect("local"), case)
    workers.compare(result, workers.reference(case))
    with pytest.raises(AssertionError):  # the comparison can fail: other streams, other masks
        workers.compare(result, workers.reference(case, seed=workers.SEED + 1))


def test_local_engine_refuses_a_step_after_trainability_changed() -> None:
    workers.check_trainability(
        workers.trainability_run(pipedialect.get_dialect("local"), {"stages": 2})
    )


@pytest.mark.parametrize("written", ["renorm", "running"])
def test_local_engine_refuses_a_forward_that_writes_a_tied_parameter(written: str) -> None:
    result = workers.written_tie_run(pipedialect.get_dialect("local"), {"written": written})
    workers.check_written_tie(result)


def test_recomputing_a_module_that_writes_a_parameter_is_refused_by_name() -> None:
    """Recomputation would write the running ``nn.Parameter`` a second time in backward."""

    class Centered(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(workers.DIM, 3)
            self.center = torch.nn.Parameter(torch.zeros(workers.DIM), requires_grad=False)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                self.center.mul_(0.5).add_(h.mean(0))
            out: torch.Tensor = self.lin(h - self.center)
            return out

    model = torch.nn.Sequential(torch.nn.Linear(workers.DIM, workers.DIM), Centered())
    plan = pipedialect.partition(model, split_points=["0"], recompute=["1"])
    local = pipedialect.get_dialect("local")
    conf = workers.config()
    engine = local.runtime_engine(
        local.pipe_engine(plan, config=conf, loss_fn=workers.loss_fn), config=conf
    )
    with pytest.raises(pipedialect.RecomputeError, match="parameter 'center'") as caught:
        engine.train_batch(iter(workers.stream(0, workers.GAS)))
    assert "register_buffer" in str(caught.value)
    assert engine.global_steps == 0


def test_fsdp_refuses_a_stage_that_writes_a_parameter_in_forward() -> None:
    """FSDP would drop the write with the gathered copy: the torch dialect's build refuses it
    (before any process group is needed), naming the parameter."""
    from pipedialect.dialects.torch._build import _refuse_written_parameters

    plan = pipedialect.partition(workers.RunningSolo(), split_points=["first"])
    stages = pipedialect.get_dialect("torch").wrap_stages(plan)
    with pytest.raises(pipedialect.ConfigError, match=r"\[Stage 1\].*'center'.*'ddp'"):
        _refuse_written_parameters(stages)
    _refuse_written_parameters(stages[:1])  # stage 0 writes nothing


def test_the_stage_streams_differ_and_leave_the_callers_generator_alone() -> None:
    """Every component of a stream's key changes it; a stage's forward and the reference's
    micro-batch consume none of the caller's random numbers."""
    base = (0, "train", 1, 0, 0, 0)
    seeds = {stream_seed(*base)}
    for i, changed in enumerate((1, "eval", 2, 1, 1, 1)):
        key = list(base)
        key[i] = changed
        seeds.add(stream_seed(*key))
    assert len(seeds) == 7
    model = workers.NoisyNet()
    streams = ReferenceStreams(model, workers.SPLITS[2], seed=0)
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    with streams.micro_batch("train", 1, 0):
        model(torch.randn(2, workers.DIM))
    torch.testing.assert_close(torch.rand(4), expected, rtol=0, atol=0)
    with pytest.raises(pipedialect.ConfigError, match="nowhere"):
        ReferenceStreams(model, ["nowhere"])


@pytest.mark.distributed
def test_torch_schedules_at_depths_2_and_4_draw_the_unsplit_models_numbers() -> None:
    cases = [
        {"stages": 2, "schedule": "gpipe"},
        {"stages": 2, "schedule": "1f1b", "recompute": ["blocks.0", "blocks.3"]},
        {"stages": 4, "schedule": "interleaved_1f1b"},
        {"stages": 4, "schedule": "zbv_zero_bubble"},
    ]
    others = [
        {"stages": 2, "schedule": "1f1b", "trainability": True},
        {"solo": True, "schedule": "gpipe"},
        {"written": "renorm", "schedule": "gpipe"},  # last: a refused forward ends the group
    ]
    launched = launch(workers.run_cases, 2, "torch", [*cases, *others], timeout=TIMEOUT)
    refs = [workers.reference(case) for case in cases]
    solo = workers.solo_reference()
    for per_rank in launched:
        for result, ref in zip(per_rank[: len(cases)], refs, strict=True):
            workers.compare(result, ref)
        trainability, alone, renorm = per_rank[len(cases) :]
        workers.check_trainability(trainability)
        workers.compare(alone, solo)  # the set-up run left the running parameter alone
        workers.check_written_tie(renorm)


@pytest.mark.distributed
def test_deepspeed_at_depth_4_and_data_parallel_with_recomputation_draws_the_same() -> None:
    """Four ranks: four stages; then two stages by two replicas whose stages DeepSpeed's
    activation checkpointing runs again in backward."""
    cases = [{"stages": 4}, {"stages": 2, "interval": 1, "dp": 2}]
    others = [{"stages": 4, "trainability": True}, {"written": "running"}]
    launched = launch(workers.run_cases, 4, "deepspeed", [*cases, *others], timeout=TIMEOUT)
    refs = [workers.reference(case) for case in cases]
    for per_rank in launched:
        for result, ref in zip(per_rank[: len(cases)], refs, strict=True):
            workers.compare(result, ref)
        workers.check_trainability(per_rank[len(cases)])
        workers.check_written_tie(per_rank[len(cases) + 1])
