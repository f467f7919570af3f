"""The fixtures every conformance test class shares: :class:`SuiteBase`.

``dialect`` comes from ``--dialect`` (through the plugin's ``pipedialect_name`` fixture); a third
party may instead override it in a subclass, fsspec-style::

    class TestMyTraining(TestTraining):
        @pytest.fixture
        def dialect(self):
            return MyDialect()

``dialect_options`` (the engine keyword arguments) may be overridden the same way. An autouse
fixture skips a test whose capability requirements the dialect does not meet.
"""

from __future__ import annotations

import pytest

from ...dialect import Dialect
from ...plugins import get_dialect
from .._options import EngineOptions
from .._requirements import item_requirements, missing_requirements
from .._session import session
from ._driver import CaseResult, DialectRun

__all__ = ["SuiteBase"]


class SuiteBase:
    """Fixtures of the conformance suite; every suite test class derives from it."""

    @pytest.fixture
    def dialect(self, pipedialect_name: str) -> Dialect:
        """The dialect under test: ``--dialect NAME``, looked up in the plugin registry."""
        return get_dialect(pipedialect_name)

    @pytest.fixture
    def dialect_options(self, request: pytest.FixtureRequest, dialect: Dialect) -> EngineOptions:
        """Extra engine keyword arguments: the ``--dialect-option`` values for this dialect."""
        return session(request.config).options_for(dialect.name)

    @pytest.fixture
    def dialect_run(
        self, request: pytest.FixtureRequest, dialect: Dialect, dialect_options: EngineOptions
    ) -> DialectRun:
        """The session's runs of the dialect's engines (shared by every test that reads one)."""
        return session(request.config).run_for(dialect, dialect_options, request)

    @pytest.fixture(autouse=True)
    def _pipedialect_applies(self, request: pytest.FixtureRequest, dialect: Dialect) -> None:
        """Skip the test if the dialect's declared capabilities do not call for it."""
        session(request.config).note_dialect(request.node.nodeid, dialect)
        required, refused, runs = item_requirements(request.node)
        reason = missing_requirements(dialect, required, refused, runs=runs)
        if reason is not None:
            pytest.skip(reason)

    @staticmethod
    def case_result(run: DialectRun, case: str) -> CaseResult:
        """The result of case ``case`` (running it, and every other wanted case, if needed)."""
        return run.result(case)
