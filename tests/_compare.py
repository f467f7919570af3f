"""How the multi-process tests compare a pipeline run with the unsplit model."""

from __future__ import annotations

import torch

#: Relative tolerance for losses and parameters (fp32 on CPU).
RTOL = 1e-6
#: Absolute floor for losses near zero.
ATOL = 1e-7


def assert_tensor_close(
    actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float = RTOL
) -> None:
    """Equal within ``rtol`` (1e-6) relative, measured on the whole tensor.

    Adam divides each gradient by its own running magnitude, so an element whose gradient is
    float noise in both runs can differ by more than 1e-6 of itself after a few steps even when
    every gradient agrees to 1e-7; the tensor-wide relative error is the meaningful measure.
    """
    assert actual.shape == expected.shape, what
    err = (actual.double() - expected.double()).norm().item()
    scale = expected.double().norm().item()
    assert err <= rtol * max(scale, 1.0), f"{what}: relative error {err / max(scale, 1.0):.2e}"
