"""The pipeline timeline: spans on every dialect, the Chrome trace, the picture, the bubble.

- Local dialect (one process): a forward and a backward span for every stage and micro-batch,
  each forward before its backward and backwards in reverse stage order; the trace file is the
  Chrome trace event format; the losses are those of the unsplit model trained by hand and of
  an untraced run, bit for bit.
- The bubble is checked on hand-built GPipe timelines against ``(p - 1) / (m + p - 1)``.
- DeepSpeed and torch, two ranks each: spans on every rank, sends and receives of activations
  and gradients on each, an optimizer span, one forward per micro-batch under activation
  checkpointing, and the same losses and weights as an untraced run in the same launch.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import _trace_workers as workers
import pytest
import torch
from _compare import assert_tensor_close

import pipedialect
from pipedialect.models import MODELS
from pipedialect.runtime.launch import launch
from pipedialect.trace import Span, Timeline

GAS, STEPS, STAGES = 4, 2, 4

CONFIG = {
    "train_batch_size": 2 * GAS,
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
}


def _local_engine(model: torch.nn.Module) -> Any:
    spec = MODELS["gpt"]
    plan = pipedialect.partition(model, spec.split_points_for(STAGES))
    dialect = pipedialect.get_dialect("local")
    return dialect.runtime_engine(
        dialect.pipe_engine(plan, config=CONFIG, loss_fn=spec.loss_fn), config=CONFIG
    )


def _batches() -> list[Any]:
    return list(MODELS["gpt"].micro_batches(GAS * STEPS, seed=3))


def _unsplit_losses(model: torch.nn.Module, batches: list[Any]) -> list[float]:
    spec = MODELS["gpt"]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for step in range(STEPS):
        total = torch.zeros(())
        for inputs, labels in batches[step * GAS : (step + 1) * GAS]:
            loss = spec.loss_fn(model(inputs), labels)
            (loss / GAS).backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(total / GAS))
    return losses


def _check_chrome_trace(path: Path) -> list[dict[str, Any]]:
    """The file is a Chrome trace: an object with ``traceEvents``, complete and metadata events
    with the keys and types the format requires."""
    document = json.loads(path.read_text())
    assert isinstance(document, dict) and isinstance(document["traceEvents"], list)
    assert document.get("displayTimeUnit") in ("ms", "ns")
    complete = []
    for event in document["traceEvents"]:
        assert event["ph"] in ("X", "M"), event
        assert isinstance(event["name"], str) and event["name"]
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
        if event["ph"] == "M":
            assert event["name"] in ("process_name", "thread_name")
            assert isinstance(event["args"]["name"], str)
            continue
        assert isinstance(event["ts"], (int, float)) and isinstance(event["dur"], (int, float))
        assert event["ts"] >= 0 and event["dur"] >= 0
        assert isinstance(event.get("args", {}), dict)
        complete.append(event)
    return complete


def _compute(spans: list[Span], step: int | None = None) -> dict[tuple[str, int, int], Span]:
    """Forward and backward spans by (kind, stage, micro-batch); each appears once."""
    found: dict[tuple[str, int, int], Span] = {}
    for s in spans:
        if s.kind in ("forward", "backward") and (step is None or s.step == step):
            assert s.micro_batch is not None
            key = (s.kind, s.stage, s.micro_batch)
            assert key not in found, f"two spans for {key}"
            found[key] = s
    return found


# -- local dialect ------------------------------------------------------------------------------


def test_local_spans_for_every_stage_and_micro_batch(tmp_path: Path) -> None:
    model = MODELS["gpt"].build(0)
    reference = copy.deepcopy(model)
    untraced = _local_engine(copy.deepcopy(model))
    engine = _local_engine(model)
    batches = _batches()
    expected_losses = [float(untraced.train_batch(iter(batches[i * GAS :]))) for i in range(STEPS)]
    data = iter(batches)
    with pipedialect.trace(engine, tmp_path / "t.json") as recorded:
        losses = [float(engine.train_batch(data)) for _ in range(STEPS)]
    timeline = recorded.timeline
    assert timeline is not None

    assert losses == expected_losses  # tracing changes nothing, bit for bit
    assert_tensor_close(
        torch.tensor(losses), torch.tensor(_unsplit_losses(reference, batches)), "losses"
    )
    for step in range(STEPS):
        spans = _compute(timeline.spans, step)
        assert set(spans) == {
            (kind, k, m)
            for kind in ("forward", "backward")
            for k in range(STAGES)
            for m in range(GAS)
        }
        for k in range(STAGES):
            for m in range(GAS):
                f, b = spans["forward", k, m], spans["backward", k, m]
                assert f.name == f"F{m}" and b.name == f"B{m}"
                assert f.end_ns <= b.start_ns <= b.end_ns
                if k + 1 < STAGES:  # the gradient flows from the last stage to the first
                    assert spans["forward", k, m].end_ns <= spans["forward", k + 1, m].start_ns
                    assert spans["backward", k + 1, m].start_ns <= b.start_ns
        assert [s.kind for s in timeline.spans if s.step == step].count("optimizer") == 1

    events = _check_chrome_trace(tmp_path / "t.json")
    assert {e["tid"] for e in events} == set(range(STAGES)) and {e["pid"] for e in events} == {0}
    assert {e["name"] for e in events} >= {"F0", "B3", "opt"}
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # One process runs every stage one after the other: p = 1, no schedule bubble to speak of.
    assert timeline.pipeline_depth() == 1 and timeline.theoretical_bubble() == 0.0
    # Everything was taken off again.
    assert "train_batch" not in vars(engine) and "step" not in vars(engine.optimizer)
    assert not any(s._forward_hooks or s._forward_pre_hooks for s in engine.module.stages)


def test_an_eval_step_records_forwards_only(tmp_path: Path) -> None:
    """An eval step records forwards only and does not count as a training step."""
    engine = _local_engine(MODELS["gpt"].build(0))
    batches = _batches()
    with pipedialect.trace(engine, None, png=False) as recorded:
        engine.eval_batch(iter(batches))
        engine.train_batch(iter(batches))
    timeline = recorded.timeline
    assert timeline is not None
    assert {s.kind for s in timeline.spans if s.step == 0} == {"forward", "step"}
    assert [s.step for s in timeline.steps()] == [1]
    assert not list(tmp_path.iterdir())


def test_a_failed_step_writes_nothing_and_restores_the_engine(tmp_path: Path) -> None:
    engine = _local_engine(MODELS["gpt"].build(0))
    recorded = pipedialect.trace(engine, tmp_path / "t.json")
    with pytest.raises(pipedialect.DataExhaustedError), recorded:
        engine.train_batch(iter(_batches()[:1]))
    assert recorded.timeline is None and not list(tmp_path.iterdir())
    assert "train_batch" not in vars(engine)
    assert not any(s._forward_hooks or s._forward_pre_hooks for s in engine.module.stages)


def test_trace_refuses_what_is_not_a_pipedialect_engine() -> None:
    with pytest.raises(pipedialect.ConfigError, match="cannot tell which dialect built"):
        pipedialect.trace(type("E", (), {"module": torch.nn.Linear(2, 2)})(), None).__enter__()


# -- the bubble against hand-built schedules ---------------------------------------------------


def _gpipe(p: int, m: int, f: int = 10, b: int = 20) -> Timeline:
    """GPipe with forward ``f`` and backward ``b`` ns per stage, stage ``k`` on rank ``k``."""
    spans = []
    for k in range(p):
        for i in range(m):
            start = (k + i) * f
            spans.append(Span("forward", f"F{i}", k, k, 0, i, start, start + f))
        for i in range(m):
            start = (m + p - 1) * f + (p - 1 - k + i) * b
            spans.append(Span("backward", f"B{i}", k, k, 0, i, start, start + b))
    return Timeline(spans, p)


@pytest.mark.parametrize(("p", "m"), [(4, 8), (2, 2), (4, 1), (3, 5)])
def test_bubble_of_a_gpipe_timeline_is_the_textbook_one(p: int, m: int) -> None:
    timeline = _gpipe(p, m)
    expected = (p - 1) / (m + p - 1)
    assert timeline.theoretical_bubble() == pytest.approx(expected)
    for bubble in timeline.bubble().values():
        assert bubble == pytest.approx(expected)
    (step,) = timeline.steps()
    assert step.micro_batches == m and step.window_ns == (m + p - 1) * 30


# -- DeepSpeed and torch on two ranks ----------------------------------------------------------


def _check_launch(results: list[dict[str, Any]], tmp_path: Path, second: str) -> None:
    for rank, result in enumerate(results):
        traced, untraced = result["traced"], result["untraced"]
        assert traced["losses"] == untraced["losses"], f"rank {rank}: tracing changed the loss"
        for name, value in untraced["params"].items():
            assert torch.equal(traced["params"][name], value), f"rank {rank}: {name}"
        assert_tensor_close(
            torch.tensor(result[second]["losses"]), torch.tensor(untraced["losses"]), second
        )
        assert traced["restored"] and result[second]["restored"]
    for run in ("traced", second):
        spans: list[Span] = results[0][run]["spans"]
        assert spans == results[1][run]["spans"]  # every rank holds the merged timeline
        for rank in (0, 1):
            mine = [s for s in spans if s.rank == rank]
            for step in range(workers.STEPS):
                compute = _compute(mine, step)
                assert set(compute) == {
                    (kind, rank, m) for kind in ("forward", "backward") for m in range(workers.GAS)
                }, f"{run} rank {rank} step {step}"
                for m in range(workers.GAS):
                    assert (
                        compute["forward", rank, m].end_ns <= compute["backward", rank, m].start_ns
                    )
            expected = (
                {("send", "activations"), ("recv", "grads")}
                if rank == 0
                else {("recv", "activations"), ("send", "grads")}
            )
            assert _directions(mine) == expected, f"{run} rank {rank}"
            assert sum(s.kind == "optimizer" for s in mine) == workers.STEPS
        assert 0.0 < results[0][run]["theoretical"] < 1.0
        assert set(results[0][run]["bubble"]) == {0, 1}
    events = _check_chrome_trace(tmp_path / "timeline.json")
    assert {e["pid"] for e in events} == {0, 1} and {e["tid"] for e in events} == {0, 1}
    assert (tmp_path / "timeline.png").is_file()


def _directions(spans: list[Span]) -> set[tuple[str, str]]:
    """(send or recv, what it carries) of every communication span; a batched "send/recv" span
    (torch's 1F1B issues a send with a receive) counts for both."""
    found = set()
    for s in spans:
        if s.kind in ("send", "recv", "send/recv"):
            assert s.detail is not None and s.name == s.kind
            found |= set(zip(s.kind.split("/"), s.detail.split("/"), strict=True))
    return found


@pytest.mark.distributed
def test_deepspeed_two_ranks_traced_like_untraced(tmp_path: Path) -> None:
    results = launch(workers.traced_and_untraced, 2, "deepspeed", str(tmp_path), timeout=600)
    _check_launch(results, tmp_path, "recomputed")


@pytest.mark.distributed
def test_torch_two_ranks_traced_like_untraced(tmp_path: Path) -> None:
    results = launch(workers.traced_and_untraced, 2, "torch", str(tmp_path), timeout=600)
    _check_launch(results, tmp_path, "gpipe")
