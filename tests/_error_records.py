"""What a rank saw of an error, as plain data a test can compare across ranks.

The multi-process error tests run a phase on every rank, inject a fault on one, and compare what
each rank raised: its type and classes (a named error, under the root exception), its message,
the context attributes it carries (``.stage``, ``.rank``, ...) and how long the rank took.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["error_record", "timed_attempt"]


def error_record(exc: BaseException, attrs: Iterable[str]) -> dict[str, Any]:
    """``exc``'s type, classes, message and those of ``attrs`` it has."""
    return {
        "error": type(exc).__name__,
        "bases": [c.__name__ for c in type(exc).__mro__],
        "message": str(exc),
        "attrs": {a: getattr(exc, a) for a in attrs if hasattr(exc, a)},
    }


def timed_attempt(fn: Callable[[], Any], attrs: Iterable[str]) -> dict[str, Any]:
    """Run ``fn``; the error it raised (:func:`error_record`, ``{"error": None}`` without
    one) and the ``seconds`` it took."""
    start = time.monotonic()
    record: dict[str, Any] = {"error": None}
    try:
        fn()
    except Exception as exc:
        record = error_record(exc, attrs)
    record["seconds"] = time.monotonic() - start
    return record
