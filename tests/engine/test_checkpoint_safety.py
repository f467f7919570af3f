"""Crash-safe checkpoints and the soak test.

A rank SIGKILLed inside ``save_checkpoint`` (a new tag; a reused tag, killed between renaming
the old one aside and putting the new one in place) leaves the previous checkpoint loadable and
``latest`` unchanged, on every dialect (``_ckpt_workers.crash_phase``; 2 processes on deepspeed
and torch, 1 on local); 64 flipped bytes are a :class:`~pipedialect.CheckpointError` naming the
file; a dropout model resumes with the same later losses as an uninterrupted run. What a resumed
run loaded is compared with the unsplit model trained by a plain PyTorch loop.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import _ckpt_workers as workers
import pytest
import torch
from _compare import assert_tensor_close
from _reliability_workers import reference, step_batches

import pipedialect
from pipedialect import CheckpointError, LaunchError
from pipedialect.plan.partition import partition
from pipedialect.runtime.launch import launch

LAUNCH_TIMEOUT = 600.0
#: How a launch with a SIGKILLed rank fails: that rank, or a peer that lost it first.
KILLED = r"killed by signal SIGKILL|Connection (closed|reset) by peer"


def _assert_previous(loaded: dict[str, Any]) -> None:
    """``loaded`` is checkpoint ``a``: one step, the unsplit model's parameters after it."""
    _, params = reference([step_batches(0)])
    assert loaded["latest"] == "a"
    assert loaded["global_steps"] == 1
    assert {"a", "a.old"} & set(Path(loaded["path"]).parts), loaded["path"]
    for name, value in loaded["params"].items():
        assert_tensor_close(value, params[name], name)


@pytest.mark.distributed
@pytest.mark.parametrize(("dialect", "ranks"), [("local", 1), ("torch", 2), ("deepspeed", 2)])
def test_a_rank_killed_in_save_leaves_the_previous_checkpoint_and_latest(
    dialect: str, ranks: int, tmp_path: Path
) -> None:
    # Phase 1: tag "a" saved, the last rank killed while saving the new tag "b".
    with pytest.raises(LaunchError, match=KILLED):
        launch(workers.crash_phase, ranks, dialect, str(tmp_path), 1, timeout=LAUNCH_TIMEOUT)
    assert (tmp_path / "latest").read_text() == "a"
    assert not (tmp_path / "b").exists()
    # Phase 2: "a" loads; rank 0 killed while publishing the reused tag "a".
    with pytest.raises(LaunchError, match=KILLED):
        launch(workers.crash_phase, ranks, dialect, str(tmp_path), 2, timeout=LAUNCH_TIMEOUT)
    for rank in range(ranks):
        _assert_previous(torch.load(tmp_path / f"phase2-rank{rank}.result"))
    assert (tmp_path / "latest").read_text() == "a"
    assert not (tmp_path / "a").exists() and (tmp_path / "a.old").is_dir()
    # Phase 3: "a" loads through the recovery rule; then 64 flipped bytes are named.
    results = launch(workers.crash_phase, ranks, dialect, str(tmp_path), 3, timeout=LAUNCH_TIMEOUT)
    victim = results[0]["victim"]
    for r in results:
        _assert_previous(r["loaded"])
        assert r["flipped"]["error"] == "CheckpointError", r["flipped"]
        assert f"checkpoint file {victim} is corrupted" in r["flipped"]["message"]


def _local_engine(model: torch.nn.Module, split: list[str]) -> Any:
    from _reliability_workers import config

    dialect = pipedialect.get_dialect("local")
    module = dialect.pipe_engine(
        partition(model, split), config=config(), loss_fn=torch.nn.functional.mse_loss
    )
    return dialect.runtime_engine(module, config=config())


class _Dropout(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 16)
        self.drop = torch.nn.Dropout(0.5)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.relu(self.a(x))))


def _dropout_batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(50 + step)
    return [(torch.randn(2, 8, generator=g), torch.randn(2, 4, generator=g)) for _ in range(4)]


def test_local_dropout_model_resumes_with_the_same_later_losses(tmp_path: Path) -> None:
    engine = _local_engine(_Dropout(), ["drop"])
    for step in range(2):
        engine.train_batch(iter(_dropout_batches(step)))
    engine.save_checkpoint(tmp_path, tag="s2")
    straight = [float(engine.train_batch(iter(_dropout_batches(s)))) for s in range(2, 5)]
    resumed_engine = _local_engine(_Dropout(), ["drop"])
    resumed_engine.load_checkpoint(tmp_path)
    resumed = [float(resumed_engine.train_batch(iter(_dropout_batches(s)))) for s in range(2, 5)]
    assert resumed == straight


def test_local_checkpoint_without_manifest_or_truncated_is_named(tmp_path: Path) -> None:
    engine = _local_engine(workers.get_model("skip").factory(seed=0, dim=16), ["blocks.1"])
    engine.train_batch(iter(step_batches(0)))
    engine.save_checkpoint(tmp_path, tag="t")
    file = tmp_path / "t" / "local_engine.pt"
    file.write_bytes(file.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=rf"{file} cannot be read as saved.*truncated"):
        engine.load_checkpoint(tmp_path)
    (tmp_path / "t" / "MANIFEST.json").unlink()
    with pytest.raises(CheckpointError, match=r"has no MANIFEST.json: its save never finished"):
        engine.load_checkpoint(tmp_path, tag="t")
    with pytest.raises(CheckpointError, match=r"tag '.x' cannot be used"):
        engine.save_checkpoint(tmp_path, tag=".x")


#: The soak run's kill: which rank, before which step (seeded, so a failure can be replayed).
_SOAK_RANDOM = random.Random(17)
SOAK_KILL_RANK = _SOAK_RANDOM.randrange(4)
SOAK_KILL_STEP = _SOAK_RANDOM.randrange(workers.SOAK_EVERY + 1, workers.SOAK_STEPS)


@pytest.mark.soak
@pytest.mark.distributed
def test_soak_deepspeed_pp2_dp2_killed_and_resumed_equals_an_uninterrupted_run(
    tmp_path: Path,
) -> None:
    straight = launch(workers.soak, 4, str(tmp_path / "straight"), -1, -1, timeout=LAUNCH_TIMEOUT)
    crashed = tmp_path / "crashed"
    with pytest.raises(LaunchError):  # which rank reports first varies: see the marker
        launch(
            workers.soak, 4, str(crashed), SOAK_KILL_RANK, SOAK_KILL_STEP, timeout=LAUNCH_TIMEOUT
        )
    assert (crashed / f"killed-rank{SOAK_KILL_RANK}-step{SOAK_KILL_STEP}").is_file()
    last_saved = SOAK_KILL_STEP // workers.SOAK_EVERY * workers.SOAK_EVERY
    assert (crashed / "latest").read_text() == f"step{last_saved}"
    resumed = launch(workers.soak, 4, str(crashed), -1, -1, timeout=LAUNCH_TIMEOUT)
    for a, b in zip(straight, resumed, strict=True):
        assert b["resumed"] and not a["resumed"]
        assert a["global_steps"] == b["global_steps"] == workers.SOAK_STEPS
        assert a["params"].keys() == b["params"].keys()
        for name, value in a["params"].items():
            # Exact: the same operations on the same values in the same order.
            assert torch.equal(value, b["params"][name]), (a["rank"], name)
