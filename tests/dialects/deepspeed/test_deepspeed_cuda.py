"""The DeepSpeed dialect on GPUs: NCCL, each rank on its local device (cuda tier).

Skipped where CUDA is absent (see conftest.py); the two-stage test needs two GPUs, because NCCL
cannot place two ranks on one device.
"""

from __future__ import annotations

import _ds_workers as workers
import pytest
import torch

from pipedialect.runtime.launch import launch

pytestmark = [pytest.mark.cuda, pytest.mark.distributed]

# GPU kernels sum in other orders than the CPU reference; fp32 without TF32 stays this close.
GPU_RTOL = 1e-5


def _check(results: list[dict], name: str, stages: int, optimizer: str, steps: int) -> None:
    ref_losses, ref_params, _ = workers.unsplit_reference(name, 1, optimizer, steps)
    for r in results:
        assert r["device"] == f"cuda:{r['stage']}", r["device"]
        assert r["losses"] == pytest.approx(ref_losses, rel=GPU_RTOL)
        for pname, value in r["params"].items():
            err = (value.double() - ref_params[pname].detach().double()).norm()
            assert err <= GPU_RTOL * max(ref_params[pname].double().norm().item(), 1.0), pname
    assert {r["stage"] for r in results} == set(range(stages))


def test_one_stage_on_one_gpu_with_nccl() -> None:
    results = launch(workers.train, 1, "skip", 1, 1, "adam", 3, timeout=600)
    _check(results, "skip", 1, "adam", 3)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (one per NCCL rank)")
def test_two_stages_with_a_tie_over_nccl() -> None:
    results = launch(workers.train, 2, "gpt", 2, 1, "adam", 3, timeout=600)
    _check(results, "gpt", 2, "adam", 3)


#: fp16 activations and parameters (fp32 master weights): the loss curve stays this close to the
#: fp32 unsplit model over a few steps of the small test models.
FP16_BAND = 2e-2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (one per NCCL rank)")
def test_fp16_with_dynamic_loss_scaling_follows_the_fp32_model() -> None:
    """DeepSpeed's fp16 (dynamic loss scale) through the dialect: fp16 parameters on each rank,
    no step skipped (the scale starts at 2**8: these models never overflow it), and every loss
    within FP16_BAND of the fp32 unsplit model trained the same steps."""
    steps = 6
    results = launch(workers.fp16_train, 2, "gpt", 2, steps, timeout=600)
    ref_losses, _, _ = workers.unsplit_reference("gpt", 1, "adam", steps)
    assert {r["stage"] for r in results} == {0, 1}
    for r in results:
        assert r["dtype"] == "torch.float16", r["dtype"]
        assert r["skipped"] == 0, r
        assert r["losses"] == pytest.approx(ref_losses, rel=FP16_BAND)
