"""Testing dialects: the conformance suite and the pytest plugin that runs it.

:mod:`pipedialect.testing.suite` holds the suite's test classes (what a third party imports);
:mod:`pipedialect.testing.plugin` is the opt-in pytest plugin that points them at installed
dialects (``--dialect NAME``); ``pipedialect check NAME`` runs both.
"""

from __future__ import annotations

__all__: list[str] = []
