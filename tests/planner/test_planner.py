"""``plan_layout`` on real models: what it proposes, what it reads from the dialect, what it
hands back (partition and pipe_engine arguments, a Chrome trace), and ``pipedialect plan``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import pipedialect
from pipedialect import Capability, ConfigError
from pipedialect.cost import TORCH_SCHEDULES
from pipedialect.dialects.torch import TorchDialect
from pipedialect.dialects.torch._plugin import TorchOptions
from pipedialect.models import TinyGPT
from pipedialect.planner import LayoutPlan, plan_layout

IDS = {"input_ids": torch.zeros(2, 8, dtype=torch.long)}
BASE: dict[str, Any] = {
    "world_size": 4,
    "memory_per_rank": "64MiB",
    "global_batch": 16,
    "bandwidth": "1GB/s",
    "latency": 1e-5,
    "flops_per_second": 1e9,
    "action_overhead": 1e-5,
}


def _plan(**kwargs: Any) -> LayoutPlan:
    return plan_layout(TinyGPT(), IDS, **{**BASE, **kwargs})


def test_the_plan_is_arguments_partition_and_pipe_engine_accept() -> None:
    plan = _plan(recompute="blocks.*")
    layout = plan.layout
    built = pipedialect.partition(TinyGPT(), **plan.partition_kwargs())
    assert built.num_stages == layout.num_stages
    if layout.recompute:
        assert built.recomputed == ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
    dialect = pipedialect.get_dialect("torch")
    options = dialect.parse_options(plan.pipe_engine_kwargs())
    assert options.schedule == layout.schedule
    topology = plan.layout.topology(dialect)
    assert (topology.get_dim("pipe"), topology.get_dim("data")) == (
        layout.pipeline,
        layout.data_parallel,
    )
    config = plan.config()
    assert config["train_batch_size"] == 16
    assert (
        config["train_micro_batch_size_per_gpu"]
        * config["gradient_accumulation_steps"]
        * layout.data_parallel
        == 16
    )


def test_every_proposal_is_a_layout_the_dialect_runs() -> None:
    plan = _plan(exhaustive=True)
    simulated = [r for r in plan.rows if r.prediction is not None]
    assert simulated
    for row in simulated:
        lay = row.layout
        assert lay.schedule in TORCH_SCHEDULES
        assert lay.tensor_parallel == 1
        if lay.data_parallel_mode == "fsdp":  # FSDP runs with one stage per rank
            assert lay.schedule in ("gpipe", "1f1b") and lay.data_parallel > 1
        assert TORCH_SCHEDULES[lay.schedule].stages_per_rank_allowed(lay.stages_per_rank)
        assert lay.world_size == 4
    assert any(r.layout.data_parallel_mode == "fsdp" for r in simulated)
    notes = plan.describe()
    assert "sharded data parallelism (FSDP): not offered by this dialect" not in notes
    assert "tensor parallelism: pass tensor_parallel={glob: style} to consider it" in notes


def test_tensor_parallel_layouts_appear_for_the_torch_dialect_and_run() -> None:
    """The torch dialect declares tensor-parallel: with a plan, TP layouts are simulated, and
    the best TP layout's arguments are ones pipe_engine and make_topology accept."""
    from pipedialect.models import MHGPT_TENSOR_PLAN, MultiHeadGPT

    plan = plan_layout(
        MultiHeadGPT(), IDS, tensor_parallel=MHGPT_TENSOR_PLAN, exhaustive=True, **BASE
    )
    tensor = [r for r in plan.rows if r.prediction is not None and r.layout.tensor_parallel > 1]
    assert tensor, plan.describe()
    layout = tensor[0].layout
    topology = layout.topology(pipedialect.get_dialect("torch"))
    assert topology.get_dim("tensor") == layout.tensor_parallel
    assert topology.world_size() == 4


def test_deepspeed_gets_only_its_1f1b() -> None:
    plan = _plan(dialect="deepspeed", exhaustive=True)
    assert {r.layout.schedule for r in plan.rows} == {"deepspeed_1f1b"}
    assert plan.pipe_engine_kwargs() == {}
    assert plan.layout.topology(pipedialect.get_dialect("deepspeed")).get_dim("pipe") == (
        plan.layout.pipeline
    )


@dataclasses.dataclass(frozen=True)
class _ShardingOptions(TorchOptions):
    tensor_parallel: Any = None


class _ShardingTorch(TorchDialect):
    """The torch dialect as it will declare tensor parallelism."""

    options = _ShardingOptions
    capabilities = TorchDialect.capabilities | {Capability.TENSOR_PARALLEL}


def test_fsdp_and_tensor_parallel_appear_once_the_dialect_declares_them() -> None:
    plan = _plan(
        dialect=_ShardingTorch(),
        tensor_parallel={"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"},
        exhaustive=True,
    )
    layouts = [r.layout for r in plan.rows if r.prediction is not None]
    fsdp = [lay for lay in layouts if lay.data_parallel_mode == "fsdp"]
    tensor = [lay for lay in layouts if lay.tensor_parallel > 1]
    assert fsdp and tensor
    assert dict(fsdp[0].engine_options)["data_parallel_mode"] == "fsdp"
    assert dict(tensor[0].engine_options)["tensor_parallel"] == {
        "blocks.*.fc1": "colwise",
        "blocks.*.fc2": "rowwise",
    }
    assert not any("not offered" in n for n in plan.offer.not_offered)


def test_fsdp_holds_less_state_than_ddp_from_four_replicas_on() -> None:
    """With Adam, a step under FSDP holds the shards (4 T / d) plus the whole gathered
    parameters and gradients (2 T): as much as DDP's 4 T at d = 2, less at d = 4."""
    plan = _plan(exhaustive=True, micro_batches=[2])
    preds = {
        (r.layout.schedule, r.layout.pipeline, r.layout.data_parallel_mode): r.prediction
        for r in plan.rows
        if r.prediction is not None
    }
    for pipeline in (1, 2):
        ddp = preds[("1f1b", pipeline, "ddp")]
        fsdp = preds[("1f1b", pipeline, "fsdp")]
        assert ddp is not None and fsdp is not None
        if pipeline == 1:  # four replicas
            assert max(fsdp.peak_memory) < max(ddp.peak_memory)
        else:  # two
            assert max(fsdp.peak_memory) == pytest.approx(max(ddp.peak_memory))


def test_nothing_fits_is_a_named_error() -> None:
    with pytest.raises(ConfigError, match="no layout of the torch dialect fits 1,000 B"):
        _plan(memory_per_rank=1000)


def test_it_needs_a_way_to_turn_work_into_seconds() -> None:
    with pytest.raises(ConfigError, match="measure_time=True"):
        plan_layout(TinyGPT(), IDS, **{**BASE, "flops_per_second": None})


def test_the_predicted_trace_has_the_format_of_a_measured_one(tmp_path: Path) -> None:
    plan = _plan(schedules=["1f1b"], micro_batches=[4])
    path = plan.write_chrome_trace(tmp_path / "predicted.json")
    trace = json.loads(path.read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    layout = plan.layout
    forwards = [e for e in events if e["cat"] == "forward"]
    assert len(forwards) == layout.num_stages * layout.micro_batches
    assert {e["tid"] for e in forwards} == set(range(layout.num_stages))
    assert {e["pid"] for e in forwards} == {
        r * layout.data_parallel for r in range(layout.pipeline)
    }
    assert set(trace["otherData"]) >= {"num_stages", "micro_batches", "measured_bubble"}
    predicted = trace["otherData"]["predicted"]
    assert predicted["layout"] == layout.describe()
    assert abs(predicted["step_ms"] - plan.best.step_time * 1e3) < 1e-9
    # pipedialect.trace's bubble of the spans: each rank's computation over the window from
    # the first forward to the last backward.
    sim = plan.best.simulation
    compute = [s for s in sim.spans if s.kind.startswith(("forward", "backward"))]
    window = max(s.end for s in compute) - min(s.start for s in compute)
    bubbles = trace["otherData"]["measured_bubble"]
    for rank, busy in enumerate(sim.busy):
        assert abs(bubbles[str(rank * layout.data_parallel)] - (1 - busy / window)) < 1e-6


def test_plan_on_the_command_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from pipedialect.cli import main

    trace = tmp_path / "p.json"
    argv = [
        "plan", "--model", "gpt", "--world-size", "2", "--memory", "64MiB",
        "--global-batch", "8", "--bandwidth", "1GB/s", "--flops-per-second", "1e9",
        "--trace", str(trace), "--top", "3",
    ]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("Plan for 2 ranks on the torch dialect: ")
    assert "partition(model, split_points=" in out
    assert trace.exists()
    assert main([*argv[:-4], "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["best"]["verdict"] == "best"
    assert data["config"]["train_batch_size"] == 8
    assert main([*argv[:6], "1", *argv[7:-4]]) == 1  # 1 byte per rank: nothing fits
    assert "no layout" in capsys.readouterr().err


def test_a_tensor_parallel_glob_that_matches_nothing_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"tensor_parallel pattern 'blocks\.\*\.mlp' matches no"):
        _plan(dialect=_ShardingTorch(), tensor_parallel={"blocks.*.mlp": "colwise"})
    with pytest.raises(ConfigError, match="style 'diagonal'"):
        _plan(dialect=_ShardingTorch(), tensor_parallel={"blocks.*.fc1": "diagonal"})
