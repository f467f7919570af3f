"""The torch dialect on real ``torch.distributed.pipelining``: several processes, gloo, CPU.

Each launch trains several configurations (model x schedule) one after the other in one process
group; the test process trains the unsplit model on the same micro-batches with a plain PyTorch
loop (the independent reference) and compares every step's loss, the evaluation loss and, at the
end, every parameter of every stage by its original name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _torch_workers as workers
import pytest
import torch
from _compare import ATOL, RTOL, assert_tensor_close
from _model_registry import reference_optimizer
from _reference import call_model, steps_from, train_unsplit

from pipedialect import LaunchError
from pipedialect.runtime.launch import launch

pytestmark = pytest.mark.distributed

TIMEOUT = 600.0  # two cores shared with other test runs: generous


def reference(
    name: str, optimizer: str, steps: int, gas: int = 4, micro: int = 2, clip: float = 0.0
) -> tuple[list[float], dict[str, torch.Tensor], float, list[float]]:
    """Train the unsplit model in this process.

    Returns the losses, the parameters by name, the evaluation loss over ``gas`` micro-batches
    and the per-micro-batch evaluation losses of the first two micro-batches of the stream.
    """
    spec = workers.spec_for(name)
    model = spec.build(0)
    opt = reference_optimizer(optimizer, list(model.parameters()))
    stream = workers.data_stream(spec, steps * gas, micro)
    trained = train_unsplit(model, opt, steps_from([stream], steps, gas), spec.loss_fn, clip=clip)
    with torch.no_grad():
        evals = [
            spec.loss_fn(call_model(model, inputs), labels).item()
            for inputs, labels in workers.data_stream(spec, gas, micro)
        ]
    named = dict(model.named_parameters(remove_duplicate=False))
    return trained.losses, named, sum(evals) / len(evals), evals


_REFERENCES: dict[tuple[Any, ...], Any] = {}


def cached_reference(case: dict[str, Any]) -> Any:
    key = (
        case["model"],
        case.get("optimizer", "adam"),
        case.get("steps", 3),
        case.get("gas", 4),
        case.get("micro", 2),
        case.get("clip", 0.0),
    )
    if key not in _REFERENCES:
        _REFERENCES[key] = reference(*key)
    return _REFERENCES[key]


def check_case(per_rank: list[dict[str, Any]], *, expect_match: bool = True) -> list[str]:
    """Compare one case's results (one dict per rank) with the unsplit model.

    With ``expect_match`` every check must pass; without it, returns the checks that failed.
    """
    case = per_rank[0]["case"]
    ref_losses, ref_params, ref_eval, ref_evals = cached_reference(case)
    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            failures.append(what)

    stages_seen: set[int] = set()
    for r in per_rank:
        label = f"{case} rank {r['rank']} stages {r['stages']}"
        check(r["losses"] == pytest.approx(ref_losses, rel=RTOL, abs=ATOL), f"{label} losses")
        check(r["eval_loss"] == pytest.approx(ref_eval, rel=RTOL, abs=ATOL), f"{label} eval")
        stages_seen.update(r["stages"])
        for name, value in r["params"].items():
            try:
                assert_tensor_close(value, ref_params[name].detach(), f"{label} {name}")
            except AssertionError as exc:
                failures.append(str(exc))
        if r["short_eval"] is not None:
            mean, logits = r["short_eval"]
            count = case["eval_micro"]
            expected = sum(ref_evals[:count]) / count
            check(mean == pytest.approx(expected, rel=RTOL, abs=ATOL), f"{label} short eval")
            holds_last = case["stages"] - 1 in r["stages"]
            check((logits is not None) == holds_last, f"{label} logits only on the last stage")
    if expect_match:
        assert not failures, "\n".join(failures)
        assert stages_seen == set(range(case["stages"]))
        trained = set().union(*(r["params"] for r in per_rank))
        assert trained == set(ref_params)  # every parameter was trained by some stage
        untrained = workers.spec_for(case["model"]).build(0).state_dict()
        assert any(not torch.equal(untrained[n], p) for n, p in ref_params.items())
    return failures


def by_case(launched: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Regroup what each rank returned: one list of per-rank results per case."""
    return [list(group) for group in zip(*(r["results"] for r in launched), strict=True)]


GPT_SCHEDULES = [
    ("1f1b", 2),
    ("gpipe", 2),
    ("interleaved_1f1b", 4),
    ("looped_bfs", 4),
    ("interleaved_zero_bubble", 4),
    ("zbv_zero_bubble", 4),
    ("dualpipev", 4),
]


def test_every_schedule_trains_gpt_with_its_tie_like_the_unsplit_model() -> None:
    """The tie joins stage 0 and the last stage: two ranks, or one rank on V schedules."""
    from pipedialect.dialects.torch import available_schedules

    offered = set(available_schedules())
    assert {"gpipe", "1f1b", "interleaved_1f1b"} <= offered
    assert offered & {"interleaved_zero_bubble", "zbv_zero_bubble"}  # torch 2.13 has both
    cases = [
        {"model": "gpt", "stages": stages, "schedule": schedule, "eval_micro": 2}
        for schedule, stages in GPT_SCHEDULES
        if schedule in offered
    ]
    cases[-1].pop("eval_micro")  # DualPipeV needs as many micro-batches as stages
    cases += [
        {"model": "gpt", "stages": 2, "schedule": "1f1b", "optimizer": "sgd"},
        # Clipping with the global norm, counting the tied weight once (every step clips).
        {"model": "gpt", "stages": 2, "schedule": "gpipe", "optimizer": "sgd", "clip": 0.05},
        {"model": "gpt", "stages": 4, "schedule": "interleaved_1f1b", "clip": 0.05},
        {"model": "gpt", "stages": 4, "schedule": "zbv_zero_bubble", "clip": 0.05},
    ]
    launched = launch(workers.run_cases, 2, cases, timeout=TIMEOUT)
    for per_rank in by_case(launched):
        check_case(per_rank)


def test_rich_boundaries_dicts_none_ints_bools_nograd_floats_several_gradients() -> None:
    cases = [
        # dict with a bool mask, an int tensor, a no-grad float, None and a Python number
        {"model": "mixed", "stages": 2, "schedule": "1f1b", "optimizer": "adamw"},
        {"model": "mixed", "stages": 4, "schedule": "zbv_zero_bubble"},
        {"model": "mixed", "stages": 4, "schedule": "interleaved_zero_bubble"},
        # every decoder stage needs the encoder output: several gradient tensors per boundary
        {"model": "encdec", "stages": 4, "schedule": "interleaved_1f1b"},
        {"model": "encdec", "stages": 4, "schedule": "interleaved_zero_bubble"},
        # a value from stage 0 rides through stages 1 and 2 to stage 3
        {"model": "skip", "stages": 4, "schedule": "looped_bfs"},
        # tie between stages 0 and 3 (the same rank on a V) and a skip connection
        {"model": "skiptied", "stages": 4, "schedule": "dualpipev"},
        # a received value that needs a gradient but reaches no output: a zero gradient
        {"model": "argmax", "stages": 2, "schedule": "gpipe", "optimizer": "sgd"},
    ]
    launched = launch(workers.run_cases, 2, cases, timeout=TIMEOUT)
    for per_rank in by_case(launched):
        check_case(per_rank)


def test_checkpoint_resume_continues_with_the_uninterrupted_losses(tmp_path: Path) -> None:
    """Saved after 2 of 4 steps (interleaved, tie across ranks, Adam state), resumed into an
    engine built from other initial weights: the last 2 steps are the uninterrupted ones."""
    launched = launch(workers.run_cases, 2, [], True, (), str(tmp_path), timeout=TIMEOUT)
    for r in launched:
        run = r["resumed"]
        assert run["resumed"] == run["losses"][2:]  # exactly, not approximately
        assert run["params_equal"]
        assert run["client"] == {"step": 2}
        assert run["global_steps"] == 4
        assert run["path"] == str(tmp_path / "mid")
        assert run["refused"].startswith("CheckpointError"), run["refused"]
    assert sorted(p.name for p in (tmp_path / "mid").iterdir()) == [
        "MANIFEST.json",  # checksums, written last (crash-safe publishing)
        "rng_rank0.pt",
        "rng_rank1.pt",
        "torch_engine_rank0.pt",
        "torch_engine_rank1.pt",
    ]


def test_tie_sync_is_what_makes_split_ties_exact() -> None:
    """With the all-reduce of tied gradients switched off, ties across ranks break."""
    cases = [
        {"model": "gpt", "stages": 2, "schedule": "1f1b"},
        {"model": "gpt", "stages": 4, "schedule": "interleaved_1f1b"},
        # V placement: stages 0 and 3 share rank 0 and so one Parameter: no sync needed.
        {"model": "gpt", "stages": 4, "schedule": "zbv_zero_bubble"},
    ]
    launched = launch(workers.run_cases, 2, cases, False, timeout=TIMEOUT)
    split_tie, split_tie_interleaved, same_rank_tie = by_case(launched)
    for per_rank in (split_tie, split_tie_interleaved):
        failures = check_case(per_rank, expect_match=False)
        assert any("losses" in f for f in failures), failures
        assert any("wte.weight" in f or "lm_head.weight" in f for f in failures), failures
        # the first step's loss does not depend on the sync; the later ones do
        ref_losses = cached_reference(per_rank[0]["case"])[0]
        assert per_rank[0]["losses"][0] == pytest.approx(ref_losses[0], rel=RTOL)
        assert per_rank[0]["losses"][2] != pytest.approx(ref_losses[2], rel=1e-4)
    check_case(same_rank_tie)


def test_three_ranks_middle_rank_reads_no_data_and_bad_placements_fail_alike() -> None:
    cases = [
        # a middle stage that receives a big bool mask and sends two gradient floats; the
        # middle rank passes data_iter=None, as with DeepSpeed
        {"model": "pooltrap", "stages": 3, "schedule": "1f1b", "none_in_middle": True},
    ]
    errors = (
        {"stages": 2, "kwargs": {"schedule": "1f1b"}},  # 2 stages on 3 ranks
        {"stages": 4, "kwargs": {"schedule": "interleaved_1f1b"}},  # 4 stages on 3 ranks
        {"stages": 2, "kwargs": {"topology": _grid(2)}},  # topology of 2 ranks, 3 launched
    )
    launched = launch(workers.run_cases, 3, cases, True, errors, timeout=TIMEOUT)
    for per_rank in by_case(launched):
        check_case(per_rank)
    messages = [r["errors"] for r in launched]
    assert messages[0] == messages[1] == messages[2]  # every rank failed the same way
    fits, looped, world = messages[0]
    assert fits.startswith("TopologyError") and "2 stages" in fits and "3" in fits, fits
    assert looped.startswith("TopologyError") and "4 stages" in looped, looped
    assert world.startswith("TopologyError") and "process group has 3" in world, world


def test_a_changed_boundary_shape_is_the_named_error_not_torchs_runtime_error() -> None:
    """Torch wraps what a stage raises in a RuntimeError; the engine surfaces ours."""
    with pytest.raises(LaunchError) as info:
        launch(workers.new_shape_mid_run, 2, timeout=TIMEOUT)
    message = str(info.value)
    # Every rank raises it (pipedialect.runtime.agreement [Note: one error, every rank]): whichever
    # rank the launcher reports, the message names the sending stage.
    assert "StructureChangedError: " in message, message
    assert "[Stage 0] tensor at" in message, message
    assert "changed shape from (2, 8, 16) to (2, 6, 16)" in message, message


def _grid(pipe: int) -> Any:
    from pipedialect import GridTopology

    return GridTopology(pipe=pipe)
