"""``calibrate``: the runtime's own costs measured on this machine, stored, and used."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipedialect import ConfigError
from pipedialect.models import TinyGPT
from pipedialect.planner import load_calibration, plan_layout

IDS = {"input_ids": torch.zeros(2, 8, dtype=torch.long)}
ARGS = {"world_size": 2, "memory_per_rank": "1GiB", "global_batch": 8, "flops_per_second": 1e9}


@pytest.mark.distributed
def test_calibrate_stores_what_the_planner_then_uses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pipedialect plan --calibrate`` runs two real ranks of the torch dialect, stores the
    costs under this dialect, machine and torch version, and the plan made without bandwidth
    or overheads uses them (its note says so); the runtime costs something beyond the work,
    and the links carry at least a megabyte per second."""
    store = tmp_path / "calibration.json"
    monkeypatch.setenv("PIPEDIALECT_CALIBRATION", str(store))
    with pytest.raises(ConfigError, match="--calibrate"):
        plan_layout(TinyGPT(), IDS, **ARGS)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipedialect.cli",
            "plan",
            "--model",
            "gpt",
            "--world-size",
            "2",
            "--memory",
            "1GiB",
            "--global-batch",
            "8",
            "--flops-per-second",
            "1e9",
            "--calibrate",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "calibrated (torch, 2 ranks)" in done.stdout
    (key,) = json.loads(store.read_text())
    assert key.startswith("torch|") and torch.__version__ in key
    calibration = load_calibration("torch")
    assert calibration is not None
    # Least squares over a loaded machine's steps: each part may come out 0, not both.
    assert calibration.action_overhead >= 0 and calibration.step_overhead >= 0
    assert calibration.action_overhead + calibration.step_overhead > 0
    assert calibration.bandwidth > 1e6 and calibration.collective_bandwidth > 1e6
    assert calibration.shard_bandwidth > 1e6  # all-gather and reduce-scatter, measured
    assert calibration.latency >= 0
    assert calibration.memory_overhead > 0  # building an engine grows the resident set
    plan = plan_layout(TinyGPT(), IDS, **ARGS)
    assert any("calibrated (torch, 2 ranks)" in note for note in plan.notes)
    assert plan.cluster.action_overhead == calibration.action_overhead
    assert plan.cluster.bandwidth == calibration.bandwidth
    assert plan.cluster.gather_bandwidth == calibration.shard_bandwidth
    # What FSDP adds per unit and tensor parallelism per module, measured on the torch dialect
    # (which offers both; the fit clamps at 0 when load hides them) and carried into the plan.
    assert calibration.fsdp_unit_overhead >= 0 and calibration.tensor_module_overhead >= 0
    assert "per unit and computation" in done.stdout
    assert plan.cluster.fsdp_unit_overhead == calibration.fsdp_unit_overhead
    assert plan.cluster.tensor_module_overhead == calibration.tensor_module_overhead
    # Adding one 64 MiB tensor into another takes time on any machine (memory-bound: between
    # about 10 us and 100 ms per MiB), and the plan charges it per accumulated gradient.
    assert 1e-5 / 2**20 < calibration.accumulate_seconds_per_byte < 0.1 / 2**20
    assert "gradient accumulation" in done.stdout
    assert plan.cluster.accumulate_seconds_per_byte == calibration.accumulate_seconds_per_byte
    # Packing 64 MiB of gradients into a new flat tensor and copying it back, likewise.
    assert 1e-5 / 2**20 < calibration.pack_seconds_per_byte < 0.1 / 2**20
    assert "packing for the gradient sum" in done.stdout
    assert plan.cluster.pack_seconds_per_byte == calibration.pack_seconds_per_byte
    best = plan.prediction(plan.layout)
    assert min(best.peak_memory) > calibration.memory_overhead
    assert load_calibration("deepspeed") is None
