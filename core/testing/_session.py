"""The conformance suite's per-session state, kept in ``config.stash`` by the pytest plugin.

It records which cases the selected tests need (so that one launch serves them all), holds one
:class:`~pipedialect.testing._harness._driver.DialectRun` per dialect and option set, and collects
test outcomes by contract area for the summary :mod:`pipedialect.testing._report` prints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from ..dialect import Dialect
    from ._harness._driver import DialectRun
    from ._options import EngineOptions

__all__ = [
    "AREA_MARKER",
    "DIALECT_FIXTURE",
    "Outcome",
    "SuiteSession",
    "session",
]

#: The marker naming a suite test's contract area.
AREA_MARKER = "pipedialect_area"
#: The fixture the plugin parametrizes with the ``--dialect`` names.
DIALECT_FIXTURE = "pipedialect_name"


@dataclass
class Outcome:
    """One suite test's result, for the per-area summary."""

    #: The contract area (``codec``, ``ties``, ...).
    area: str
    #: The test's node id.
    nodeid: str
    #: ``passed``, ``failed``, ``capability`` (skipped by capability) or ``skipped``.
    status: str = "passed"
    #: The skip reason or the first lines of the failure.
    detail: str = ""


@dataclass
class SuiteSession:
    """What one pytest session knows about the conformance suite."""

    #: The ``--dialect-option`` values as given.
    raw_options: list[str] = field(default_factory=list)
    #: Seconds a case may go without progress before it is stopped (in process or launched).
    case_timeout: float = 180.0
    #: Case ids the selected tests read.
    wanted: set[str] = field(default_factory=set)
    #: Contract area of each selected suite test, by node id.
    areas: dict[str, str] = field(default_factory=dict)
    #: Dialect name of each suite test, by node id.
    dialects: dict[str, str] = field(default_factory=dict)
    #: Outcomes by node id.
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    runs: dict[tuple[str, str, str], DialectRun] = field(default_factory=dict)
    capabilities: dict[str, list[str]] = field(default_factory=dict)

    def options_for(self, name: str) -> EngineOptions:
        """The engine options that apply to dialect ``name``."""
        from ._options import parse_dialect_options

        return parse_dialect_options(self.raw_options, name)

    def run_for(
        self, dialect: Dialect, options: EngineOptions, request: pytest.FixtureRequest
    ) -> DialectRun:
        """The session's run of ``dialect`` with ``options`` (created on first use)."""
        from ._harness._driver import DialectRun

        cls = type(dialect)
        key = (dialect.name, f"{cls.__module__}.{cls.__qualname__}", options.key())
        run = self.runs.get(key)
        if run is None:
            factory: pytest.TempPathFactory = request.getfixturevalue("tmp_path_factory")
            workdir = factory.mktemp(f"pipedialect-{dialect.name}", numbered=True)
            run = DialectRun(
                dialect, options, workdir, case_timeout=self.case_timeout, wanted=self.wanted
            )
            self.runs[key] = run
        return run

    def note_dialect(self, nodeid: str, dialect: Dialect) -> None:
        """Remember which dialect a test ran against (for the summary)."""
        self.dialects[nodeid] = dialect.name
        self.capabilities[dialect.name] = sorted(str(c) for c in dialect.capabilities)


_KEY = pytest.StashKey[SuiteSession]()


def session(config: pytest.Config) -> SuiteSession:
    """The session state of ``config`` (created on first use)."""
    state = config.stash.get(_KEY, None)
    if state is None:
        state = SuiteSession()
        config.stash[_KEY] = state
    return state


def area_of(item: Any) -> str | None:
    """The contract area of a collected item, or None if it is not a suite test."""
    mark = item.get_closest_marker(AREA_MARKER)
    return None if mark is None else str(mark.args[0])
