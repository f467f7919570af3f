"""Comparing values the way the conformance suite needs: structure first, then numbers.

:func:`first_difference` walks two values side by side and returns a sentence naming the first
place they differ (``at [1]['mask']: dtype torch.int64 instead of torch.bool``), or None. Types
are compared exactly (a tuple is not a list, ``True`` is not ``1``), dict keys with their order,
tensors by dtype, shape and value: bit for bit when ``rtol`` is 0, else by the tensor-wide
relative error ``|a - e| / max(|e|, 1)`` (2-norms), the measure the design's "1e-6 relative"
means (an element that is float noise in both runs may differ by more than 1e-6 of itself).
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["describe", "first_difference", "relative_error"]

_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``|actual - expected| / max(|expected|, 1)`` over the whole tensor, in float64."""
    a = actual.detach().cpu().double()
    e = expected.detach().cpu().double()
    return float((a - e).norm().item()) / max(float(e.norm().item()), 1.0)


def describe(value: Any) -> str:
    """A short description of ``value`` for messages (no tensor data)."""
    if isinstance(value, torch.Tensor):
        return f"tensor({value.dtype}, shape {tuple(value.shape)})"
    if isinstance(value, dict):
        return f"dict with keys {list(value)}"
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        return f"{type(value).__name__} of length {len(value)}"
    return f"{type(value).__name__} {value!r}"


def _same_float(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


def _tensor_difference(a: torch.Tensor, e: torch.Tensor, rtol: float) -> str | None:
    if a.dtype != e.dtype:
        return f"dtype {a.dtype} instead of {e.dtype}"
    if a.shape != e.shape:
        return f"shape {tuple(a.shape)} instead of {tuple(e.shape)}"
    a = a.detach().cpu()
    e = e.detach().cpu()
    if a.numel() == 0:
        return None
    if rtol > 0 and (a.is_floating_point() or a.is_complex()):
        if a.is_complex():
            a, e = torch.view_as_real(a), torch.view_as_real(e)
        err = relative_error(a, e)
        if not err <= rtol:  # also catches NaN
            return f"values differ (relative error {err:.2e} > {rtol:.0e})"
        return None
    if a.is_floating_point() or a.is_complex():
        if a.is_complex():
            a, e = torch.view_as_real(a), torch.view_as_real(e)
        width = a.element_size()
        a_bits = a.contiguous().view(_BITS[width])
        e_bits = e.contiguous().view(_BITS[width])
        both_nan = torch.isnan(a) & torch.isnan(e)
        same = (a_bits == e_bits) | both_nan
    else:
        same = a == e
    if not bool(same.all()):
        index = tuple(int(i) for i in (~same).nonzero()[0])
        return f"element {list(index)} is {a[index].item()!r} instead of {e[index].item()!r}"
    return None


def first_difference(
    actual: Any, expected: Any, *, rtol: float = 0.0, path: str = ""
) -> str | None:
    """Return where and how ``actual`` first differs from ``expected``, or None if it does not."""
    where = f"at {path}" if path else "at the top level"
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return f"{where}: {describe(actual)} instead of {describe(expected)}"
        detail = _tensor_difference(actual, expected, rtol)
        return None if detail is None else f"{where}: {detail}"
    if type(actual) is not type(expected):
        return f"{where}: {describe(actual)} instead of {describe(expected)}"
    if isinstance(expected, dict):
        if list(actual) != list(expected):
            missing = [k for k in expected if k not in actual]
            extra = [k for k in actual if k not in expected]
            detail = f"dict keys {list(actual)} instead of {list(expected)}"
            if missing or extra:
                detail += f" (missing {missing}, unexpected {extra})"
            else:
                detail += " (same keys, another order)"
            return f"{where}: {detail}"
        for key in expected:
            found = first_difference(actual[key], expected[key], rtol=rtol, path=f"{path}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(expected, (list, tuple)):
        if len(actual) != len(expected):
            return f"{where}: {describe(actual)} instead of {describe(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            found = first_difference(a, e, rtol=rtol, path=f"{path}[{i}]")
            if found:
                return found
        return None
    if isinstance(expected, float):
        same = (
            _same_float(actual, expected)
            if rtol == 0
            else math.isclose(actual, expected, rel_tol=rtol)
        )
        return None if same else f"{where}: {actual!r} instead of {expected!r}"
    if actual != expected:
        return f"{where}: {actual!r} instead of {expected!r}"
    return None
