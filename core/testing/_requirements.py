"""Capability requirements of conformance tests: ``requires`` and ``refuses`` markers.

A test marked ``@requires(Capability.TIED_WEIGHTS)`` runs only against dialects that declare
tied weights; against any other it is skipped with a reason that starts with
:data:`CAPABILITY_SKIP_PREFIX`, which the suite's summary counts as "skipped by capability".
``@refuses(Capability.DYNAMIC_SHAPES)`` is the opposite: the test checks how a dialect that does
*not* declare the capability refuses what it would need (a named error, never a hang or a silent
wrong result). A dialect that declares :attr:`~pipedialect.Capability.CUDA_ONLY` is skipped where
no CUDA device exists.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from ..contracts import Capability
from ..dialect import Dialect

__all__ = [
    "CAPABILITY_SKIP_PREFIX",
    "REFUSES_MARKER",
    "REQUIRES_MARKER",
    "RUNS_MARKER",
    "item_requirements",
    "missing_requirements",
    "refuses",
    "requires",
    "runs_dialect",
]

#: Every skip the capability mechanism issues has a reason starting with this.
CAPABILITY_SKIP_PREFIX = "capability:"
#: The marker :func:`requires` applies.
REQUIRES_MARKER = "pipedialect_requires"
#: The marker :func:`refuses` applies.
REFUSES_MARKER = "pipedialect_refuses"
#: The marker :func:`runs_dialect` applies.
RUNS_MARKER = "pipedialect_runs"


def requires(*capabilities: Capability) -> pytest.MarkDecorator:
    """Mark a test (or a ``pytest.param``) as needing every capability given."""
    mark: pytest.MarkDecorator = getattr(pytest.mark, REQUIRES_MARKER)(*_checked(capabilities))
    return mark


def refuses(*capabilities: Capability) -> pytest.MarkDecorator:
    """Mark a test as checking dialects that declare none of the capabilities given."""
    mark: pytest.MarkDecorator = getattr(pytest.mark, REFUSES_MARKER)(*_checked(capabilities))
    return mark


def runs_dialect() -> pytest.MarkDecorator:
    """Mark a test that runs the dialect's stages or engines (so needs CUDA if it is cuda-only)."""
    mark: pytest.MarkDecorator = getattr(pytest.mark, RUNS_MARKER)()
    return mark


def _checked(capabilities: Iterable[object]) -> tuple[Capability, ...]:
    out = []
    for cap in capabilities:
        if not isinstance(cap, Capability):
            raise TypeError(f"{cap!r} is not a pipedialect.Capability")
        out.append(cap)
    return tuple(out)


def missing_requirements(
    dialect: Dialect,
    required: Iterable[Capability],
    refused: Iterable[Capability] = (),
    *,
    runs: bool = False,
    cuda_available: bool | None = None,
) -> str | None:
    """Return why a test with these requirements does not apply to ``dialect``, or None.

    ``runs``: the test runs the dialect's stages or engines, which a cuda-only dialect can only
    do where a CUDA device exists.
    """
    declared = frozenset(dialect.capabilities)
    name = dialect.name
    missing = sorted(str(c) for c in set(required) - declared)
    if missing:
        return f"{CAPABILITY_SKIP_PREFIX} dialect {name!r} does not declare {', '.join(missing)}"
    present = sorted(str(c) for c in set(refused) & declared)
    if present:
        return (
            f"{CAPABILITY_SKIP_PREFIX} dialect {name!r} declares {', '.join(present)} (this test "
            "checks dialects that do not)"
        )
    if runs and Capability.CUDA_ONLY in declared:
        if cuda_available is None:
            import torch

            cuda_available = torch.cuda.is_available()
        if not cuda_available:
            return (
                f"{CAPABILITY_SKIP_PREFIX} dialect {name!r} declares cuda-only and this machine "
                "has no CUDA device"
            )
    return None


def item_requirements(item: pytest.Item) -> tuple[set[Capability], set[Capability], bool]:
    """Collect what an item requires and refuses, and whether it runs the dialect."""
    required: set[Capability] = set()
    refused: set[Capability] = set()
    for mark in item.iter_markers(REQUIRES_MARKER):
        required.update(mark.args)
    for mark in item.iter_markers(REFUSES_MARKER):
        refused.update(mark.args)
    return required, refused, item.get_closest_marker(RUNS_MARKER) is not None
