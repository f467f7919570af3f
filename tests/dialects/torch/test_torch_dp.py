"""Data parallelism on the torch dialect: PP=2 x DP=2, four processes, gloo, CPU.

Each launch trains a few schedules one after the other; the test process trains the unsplit
model with a plain PyTorch loop on both replicas' micro-batches of each step (each loss divided
by ``gas * replicas``, as DeepSpeed's semantics have it) and compares every step's loss on every
rank, the evaluation loss and every parameter of every stage by its original name. The model is
the tied GPT, so the tie's gradients are summed across the pipeline and averaged across the
replicas; clipping, where set, is tight enough to act on every step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _model_registry
import _torch_dp_workers as workers
import pytest
import torch
from _compare import ATOL, RTOL, assert_tensor_close
from _reference import call_model, steps_from, train_unsplit

from pipedialect.runtime.launch import launch

pytestmark = pytest.mark.distributed

TIMEOUT = 900.0  # four ranks on two shared cores
DP = workers.DP


def _case(schedule: str, stages: int, clip: float = 0.0, steps: int = 3) -> dict[str, Any]:
    return {
        "model": "gpt",
        "schedule": schedule,
        "stages": stages,
        "gas": 2,
        "micro": 2,
        "steps": steps,
        "clip": clip,
    }


def reference(case: dict[str, Any]) -> tuple[list[float], dict[str, torch.Tensor], float]:
    """The unsplit model trained on every replica's micro-batches: losses, parameters, eval."""
    spec = _model_registry.spec_for(case["model"])
    model = spec.build(0)
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=1e-2)
    gas, micro, steps = case["gas"], case["micro"], case["steps"]
    streams = [_model_registry.data_stream(spec, steps * gas, micro, d) for d in range(DP)]
    batches = steps_from(streams, steps, gas)
    losses = train_unsplit(model, opt, batches, spec.loss_fn, clip=case["clip"]).losses
    evals = []
    with torch.no_grad():
        for d in range(DP):
            for inputs, labels in _model_registry.data_stream(spec, gas, micro, DP + d):
                evals.append(spec.loss_fn(call_model(model, inputs), labels).item())
    return losses, dict(model.named_parameters(remove_duplicate=False)), sum(evals) / len(evals)


def check(per_rank: list[dict[str, Any]]) -> None:
    """Every rank's losses, eval loss and parameters are the unsplit model's."""
    case = per_rank[0]["case"]
    ref_losses, ref_params, ref_eval = reference(case)
    failures = []
    coverage: dict[int, list[int]] = {}
    for r in per_rank:
        label = (
            f"{case['schedule']} rank {r['rank']} (replica {r['replica']}, stages {r['stages']})"
        )
        if r["losses"] != pytest.approx(ref_losses, rel=RTOL, abs=ATOL):
            failures.append(f"{label} losses {r['losses']} != {ref_losses}")
        if r["eval_loss"] != pytest.approx(ref_eval, rel=RTOL, abs=ATOL):
            failures.append(f"{label} eval {r['eval_loss']} != {ref_eval}")
        for k in r["stages"]:
            coverage.setdefault(k, []).append(r["replica"])
        for name, value in r["params"].items():
            try:
                assert_tensor_close(value, ref_params[name].detach(), f"{label} {name}")
            except AssertionError as exc:
                failures.append(str(exc))
    assert not failures, "\n".join(failures)
    # Every stage is trained once in each replica, and every parameter somewhere.
    assert {k: sorted(v) for k, v in coverage.items()} == {
        k: list(range(DP)) for k in range(case["stages"])
    }
    assert set().union(*(r["params"] for r in per_rank)) == set(ref_params)


def by_case(launched: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    return [list(group) for group in zip(*(r["results"] for r in launched), strict=True)]


def test_1f1b_and_gpipe_pp2_dp2_train_like_the_unsplit_model_on_both_replicas_batches() -> None:
    # GPipe's replicas build different initial weights: they start from replica 0's.
    cases = [_case("1f1b", 2, clip=0.05), {**_case("gpipe", 2), "seed_per_replica": True}]
    launched = launch(workers.run_cases, 4, cases, timeout=TIMEOUT)
    for per_rank in by_case(launched):
        check(per_rank)


def test_interleaved_and_v_shaped_pp2_dp2_and_a_checkpoint_resumes_exactly(
    tmp_path: Path,
) -> None:
    cases = [_case("interleaved_1f1b", 4, clip=0.05), _case("zbv_zero_bubble", 4)]
    resume = _case("1f1b", 2, steps=4)
    launched = launch(workers.run_cases, 4, cases, resume, str(tmp_path), timeout=TIMEOUT)
    for per_rank in by_case(launched):
        check(per_rank)
    for r in launched:
        resumed = r["resumed"]
        assert resumed["resumed"] == resumed["losses"][2:], r["rank"]  # exact, not approximate
        assert resumed["params_equal"], r["rank"]
        assert resumed["global_steps"] == 4
    # Each rank saved its own file: replicas hold whole stages.
    saved = {p.name for p in (tmp_path / "mid").iterdir()}
    assert {f"torch_engine_rank{r}.pt" for r in range(4)} <= saved
