"""The DeepSpeed dialect on the real DeepSpeed PipelineEngine: several processes, gloo, CPU.

Each launch trains a partitioned model; the test process trains the unsplit model on the same
micro-batches with a plain PyTorch loop (the independent reference) and compares every step's
loss and, at the end, every parameter of every stage by its original name.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _ds_workers as workers
import _model_registry
import pytest
import torch
from _compare import ATOL, RTOL, assert_tensor_close

from pipedialect import LaunchError
from pipedialect.runtime.launch import free_port, launch

pytestmark = pytest.mark.distributed


def assert_matches_reference(
    results: list[dict[str, Any]], ref: Any, num_stages: int, model: str
) -> None:
    ref_losses, ref_params, ref_eval = ref
    stages_seen = set()
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, rel=RTOL, abs=ATOL), r["stage"]
        assert r["eval_loss"] == pytest.approx(ref_eval, rel=RTOL, abs=ATOL)
        stages_seen.add(r["stage"])
        for name, value in r["params"].items():
            assert_tensor_close(value, ref_params[name].detach(), f"stage {r['stage']} {name}")
    assert stages_seen == set(range(num_stages))
    all_names = set().union(*(r["params"] for r in results))
    assert all_names == set(ref_params)  # every parameter was trained by some stage
    untrained = _model_registry.spec_for(model).build(0).state_dict(keep_vars=False)
    assert any(not torch.equal(untrained[n], p) for n, p in ref_params.items())  # it trained


def test_pp2_gpt_with_tied_embedding_adam() -> None:
    # The tied weight starts different on rank 1: the engine must make it equal first.
    results = launch(workers.train, 2, "gpt", 2, 1, "adam", 4, perturb_ties=True, timeout=600)
    assert all(r["engine_holds_only_local_stage"] for r in results)
    assert_matches_reference(results, workers.unsplit_reference("gpt", 1, "adam", 4), 2, "gpt")
    # The tied LM head on stage 1 is DeepSpeed's replicated copy; stage 0 owns the weight.
    by_stage = {r["stage"]: r for r in results}
    assert by_stage[0]["replicated"] == []
    assert by_stage[1]["replicated"] == ["lm_head.weight"]


def test_single_stage_pipeline() -> None:
    results = launch(workers.train, 1, "skip", 1, 1, "adam", 3, timeout=600)
    assert_matches_reference(results, workers.unsplit_reference("skip", 1, "adam", 3), 1, "skip")


def test_pp2_sgd_and_deepspeed_adamw_semantics() -> None:
    results = launch(workers.train, 2, "gpt", 2, 1, "sgd", 3, timeout=600)
    assert_matches_reference(results, workers.unsplit_reference("gpt", 1, "sgd", 3), 2, "gpt")
    results = launch(workers.train, 2, "skip", 2, 1, "adamw", 3, timeout=600)
    assert_matches_reference(results, workers.unsplit_reference("skip", 1, "adamw", 3), 2, "skip")


def test_pp2_dp2_four_processes() -> None:
    results = launch(workers.train, 4, "gpt", 2, 2, "adam", 3, timeout=600)
    assert sorted((r["stage"], r["dp_rank"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert_matches_reference(results, workers.unsplit_reference("gpt", 2, "adam", 3), 2, "gpt")


def test_pp4_skip_connection_and_tie_between_first_and_last_stage() -> None:
    results = launch(workers.train, 4, "skiptied", 4, 1, "adam", 3, timeout=600)
    assert_matches_reference(
        results, workers.unsplit_reference("skiptied", 1, "adam", 3), 4, "skiptied"
    )


def test_mixed_boundary_dict_none_bool_int_nograd_float_number() -> None:
    results = launch(workers.train, 2, "mixed", 2, 1, "adam", 3, timeout=600)
    assert_matches_reference(results, workers.unsplit_reference("mixed", 1, "adam", 3), 2, "mixed")


def test_pp4_encoder_decoder_several_gradient_tensors_per_boundary() -> None:
    results = launch(workers.train, 4, "encdec", 4, 1, "adam", 3, timeout=600)
    assert_matches_reference(
        results, workers.unsplit_reference("encdec", 1, "adam", 3), 4, "encdec"
    )


def test_middle_stage_receiving_a_big_mask_and_sending_two_floats() -> None:
    results = launch(workers.train, 3, "pooltrap", 3, 1, "adam", 3, timeout=600)
    assert_matches_reference(
        results, workers.unsplit_reference("pooltrap", 1, "adam", 3), 3, "pooltrap"
    )


def test_received_value_used_without_gradient_path_gets_a_zero_gradient() -> None:
    results = launch(workers.train, 2, "argmax", 2, 1, "sgd", 3, timeout=600)
    assert_matches_reference(results, workers.unsplit_reference("argmax", 1, "sgd", 3), 2, "argmax")


def test_dynamic_shapes_let_sequence_lengths_change_between_micro_batches() -> None:
    results = launch(workers.train, 2, "gptvarlen", 2, 1, "adam", 3, timeout=600)
    assert_matches_reference(
        results, workers.unsplit_reference("gptvarlen", 1, "adam", 3), 2, "gptvarlen"
    )


def test_gradient_clipping_uses_the_global_norm() -> None:
    clip = 0.05  # small enough that every step clips
    results = launch(workers.train, 2, "gpt", 2, 1, "sgd", 3, 4, 2, clip, timeout=600)
    assert_matches_reference(
        results, workers.unsplit_reference("gpt", 1, "sgd", 3, clip=clip), 2, "gpt"
    )


def test_checkpoint_resume_continues_with_the_uninterrupted_losses(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    first = launch(workers.checkpoint_run, 2, "gpt", 2, "adam", ckpt, 2, 5, timeout=600)
    files = sorted(p.name for p in (tmp_path / "ckpt" / "step2").iterdir())
    layer_files = [f for f in files if f.startswith("layer_")]
    assert len(layer_files) == 2
    # The tied weight is saved once: by its owner (stage 0), not by stage 1's replicated copy.
    saved = [
        set(torch.load(tmp_path / "ckpt" / "step2" / f, weights_only=True)) for f in layer_files
    ]
    tied_copies = [
        k for keys in saved for k in keys if k.endswith(("wte.weight", "lm_head.weight"))
    ]
    assert tied_copies == ["mod.wte.weight"], tied_copies
    resumed = launch(workers.checkpoint_run, 2, "gpt", 2, "adam", ckpt, 2, 5, timeout=600)
    for a, b in zip(
        sorted(first, key=lambda r: r["stage"]),
        sorted(resumed, key=lambda r: r["stage"]),
        strict=True,
    ):
        assert b["losses"] == a["losses"][2:]  # exactly, not approximately
        for name, value in a["params"].items():
            assert torch.equal(value, b["params"][name]), name


def test_a_rank_that_raises_makes_every_process_exit(tmp_path: Path) -> None:
    """No launcher here to kill the others: each process must stop on its own."""
    port = free_port()
    procs = []
    start = time.monotonic()
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        log = (tmp_path / f"rank{rank}.log").open("w")
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, "-c", "import _ds_workers as w; w.fail_mid_step('gpt')"],
                    cwd=Path(__file__).resolve().parents[2],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                ),
                log,
            )
        )
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, 120 - (time.monotonic() - start))))
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
    elapsed = time.monotonic() - start
    assert all(code != 0 for code in codes), codes
    assert "injected failure in stage 1" in (tmp_path / "rank1.log").read_text()
    # Start-up (imports, the process group) takes a few seconds; the failure itself must
    # bring everything down well within 60 s.
    assert elapsed < 60 + 20, elapsed


@pytest.mark.parametrize("case", ["stages", "missing"])
def test_mistakes_are_named_errors_raised_before_any_collective(case: str) -> None:
    messages = launch(workers.build_errors, 2, case, timeout=300)
    assert messages[0] == messages[1]
    if case == "stages":
        assert messages[0].startswith("TopologyError:") and "the plan has 2" in messages[0]
    else:
        assert messages[0].startswith("ConfigError:")
        assert "loss_fn=" in messages[0] and "config=" in messages[0]  # both named at once


#: The tensors stage 0 sends in each step of each wire-state case, per micro-batch (2 a step):
#: the boundary's values; the metadata tensor, with dynamic shapes every time, with a frozen
#: layout only in the first micro-batch (after each reset); and DeepSpeed's own tensor-meta
#: message, which it sends at the same times. ``emit`` sends a bit-cast float, the activation and
#: a mask; the gpt one activation.
WIRE_STATE_SENDS = {
    "dynamic": [(3 + 1 + 1) * 2] * 4,
    "static": [(3 + 1 + 1) + 3, 3 + 3, 3 + 3, 3 + 3],
    "reset": [(1 + 1 + 1) + 1, 1 + 1, 1 + 1, (1 + 1 + 1) + 1, 1 + 1, 1 + 1, 1 + 1],
}


def test_eval_and_train_in_any_order_and_reset_activation_shape() -> None:
    """Dynamic shapes: eval before training, then alternating; static: the same the other way
    round; static gpt: length 16, ``reset_activation_shape()``, length 8 (eval first)."""
    results = launch(workers.wire_state_run, 2, "deepspeed", timeout=600)
    workers.assert_wire_state_matches(results, tuple(c[0] for c in workers.WIRE_STATE_CASES))
    first = {r["case"]: r["sends"] for rank in results for r in rank if r["stage"] == 0}
    assert first == WIRE_STATE_SENDS


def test_a_new_shape_without_reset_activation_shape_is_the_named_error() -> None:
    with pytest.raises(LaunchError) as info:
        launch(workers.shape_change_without_reset, 2, timeout=300)
    message = str(info.value)
    # Every rank raises it (pipedialect.runtime.agreement [Note: one error, every rank]): whichever
    # rank the launcher reports, the message names the sending stage.
    assert "StructureChangedError: " in message, message
    assert "[Stage 0] tensor at" in message, message
    assert "changed shape from (2, 16, 16) to (2, 8, 16)" in message
    assert "reset_activation_shape()" in message


def test_activation_checkpoint_interval_trains_exactly_like_the_unsplit_model() -> None:
    """Every way to set it (the config, with either use_reentrant, or pipe_engine's argument)
    checkpoints each whole stage: the same losses and gradients, and each stage really ran
    twice per training micro-batch (forward, then recomputation in backward)."""
    results = launch(workers.checkpointing_run, 2, timeout=600)
    cases = {c[0]: c for c in workers.CHECKPOINT_CASES}
    seen = set()
    for rank_results in results:
        *trained, refusals = rank_results
        assert refusals["still"], refusals
        assert refusals["refused"].startswith("activation_checkpoint_func="), refusals
        assert "plain deepspeed.pipe.PipelineModule" in refusals["plain_refused"], refusals
        for r in trained:
            name, model_name, pipeline, interval = cases[r["case"]]
            ref = _model_registry.checkpoint_reference(model_name)
            assert r["losses"] == pytest.approx(ref["losses"], rel=RTOL, abs=ATOL), name
            assert len(r["grads"]) == len(ref["grads"]) == 3
            for step, (ours, theirs) in enumerate(zip(r["grads"], ref["grads"], strict=True)):
                assert ours.keys() <= theirs.keys()
                for n, g in ours.items():
                    assert_tensor_close(g, theirs[n], f"{name}: stage {r['stage']} step {step} {n}")
            for n, value in r["params"].items():
                assert_tensor_close(value, ref["params"][n].detach(), f"{name}: {n}")
            recomputed = max(
                (pipeline or {}).get("activation_checkpoint_interval", 0), interval or 0
            )
            assert r["interval"] == recomputed
            assert r["forward_calls"] == (2 if recomputed else 1) * 3 * 2, name
            seen.add((name, r["stage"]))
    assert seen == {(c, s) for c in cases for s in (0, 1)}
