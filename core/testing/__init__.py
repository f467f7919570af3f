"""Helpers for testing pipedialect and its dialects.

:mod:`pipedialect.models` holds small deterministic models, each with its loss
function, recommended split points and micro-batch generator; the project's tests, the
conformance suite and the demo all train these.
"""

from __future__ import annotations

__all__: list[str] = []
