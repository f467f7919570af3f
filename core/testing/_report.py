"""The per-area summary of a conformance run, printed at the end of pytest's output.

One table per dialect: for each contract area the tests that passed, failed, were skipped
because the dialect does not declare what they need ("by capability"), or were skipped for
another reason; then what was skipped by capability and why, then the failures' first lines.
"""

from __future__ import annotations

from collections.abc import Iterable

from ._session import Outcome, SuiteSession

__all__ = ["AREAS", "format_summary", "summary_failed"]

#: The contract areas, in the order the suite presents them.
AREAS = (
    "registration",
    "codec",
    "stages",
    "ties",
    "training",
    "portability",
    "tracing",
    "errors",
)

_DETAIL_LINES = 3


def _order(area: str) -> tuple[int, str]:
    return (AREAS.index(area), area) if area in AREAS else (len(AREAS), area)


def _by_dialect(state: SuiteSession) -> dict[str, list[Outcome]]:
    out: dict[str, list[Outcome]] = {}
    for nodeid, outcome in state.outcomes.items():
        out.setdefault(state.dialects.get(nodeid, "(unknown dialect)"), []).append(outcome)
    return out


def summary_failed(state: SuiteSession) -> bool:
    """Whether any suite test failed."""
    return any(o.status == "failed" for o in state.outcomes.values())


#: Where the explanation of a failure ends and Hypothesis' or pytest's report of it begins.
_NOISE = ("Failing test case:", "Falsifying example:", "Traceback", "You can reproduce")


def _short(text: str, lines: int = _DETAIL_LINES) -> str:
    """The first few unindented lines of a failure (one per broken contract, no tracebacks)."""
    kept: list[str] = []
    for line in text.strip().splitlines():
        if line.startswith(_NOISE):
            break
        if line.strip() and not line[0].isspace():
            kept.append(line)
    return "\n      ".join(kept[:lines])


def _test_name(nodeid: str) -> str:
    return nodeid.split("::", 1)[-1]


def format_summary(state: SuiteSession) -> list[str]:
    """The summary's lines (empty when no suite test ran)."""
    lines: list[str] = []
    for name, outcomes in sorted(_by_dialect(state).items()):
        lines += _dialect_summary(name, outcomes, state.capabilities.get(name, []))
    return lines


def _dialect_summary(name: str, outcomes: Iterable[Outcome], capabilities: list[str]) -> list[str]:
    outcomes = list(outcomes)
    areas = sorted({o.area for o in outcomes}, key=_order)
    lines = [
        f"dialect {name!r} declares: {', '.join(capabilities) or '(nothing)'}",
        f"  {'AREA':<14}{'PASSED':>8}{'FAILED':>8}{'SKIPPED (capability)':>22}{'SKIPPED':>9}",
    ]
    for area in areas:
        counts = {s: 0 for s in ("passed", "failed", "capability", "skipped")}
        for o in outcomes:
            if o.area == area:
                counts[o.status] += 1
        lines.append(
            f"  {area:<14}{counts['passed']:>8}{counts['failed']:>8}"
            f"{counts['capability']:>22}{counts['skipped']:>9}"
        )
    reasons: dict[str, int] = {}
    for o in outcomes:
        if o.status == "capability":
            reasons[o.detail] = reasons.get(o.detail, 0) + 1
    if reasons:
        lines.append("  skipped by capability:")
        lines += [f"    {count} test(s): {reason}" for reason, count in sorted(reasons.items())]
    failed = [o for o in outcomes if o.status == "failed"]
    if failed:
        lines.append("  failed:")
        for o in sorted(failed, key=lambda o: (_order(o.area), o.nodeid)):
            lines.append(f"    [{o.area}] {_test_name(o.nodeid)}")
            lines.append(f"      {_short(o.detail)}")
    total = len(outcomes)
    verdict = (
        f"FAILED: {len(failed)} of {total} test(s) failed"
        if failed
        else f"PASSED: {sum(o.status == 'passed' for o in outcomes)} of {total} test(s) passed, "
        "the rest skipped"
    )
    lines.append(f"  conformance of {name!r}: {verdict}")
    lines.append("")
    return lines
