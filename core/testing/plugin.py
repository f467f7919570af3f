"""The pytest plugin of pipedialect (entry point ``pytest11``).

It is inert unless asked: it only adds the ``--dialect`` option, which the conformance suite
reads. Installing pipedialect therefore changes nothing about other projects' test runs.
"""

from __future__ import annotations

import pytest

__all__ = ["pytest_addoption"]


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add ``--dialect NAME``: the dialect the conformance suite runs against."""
    group = parser.getgroup("pipedialect")
    group.addoption(
        "--dialect",
        action="append",
        default=[],
        metavar="NAME",
        help="run the pipedialect conformance suite against this installed dialect "
        "(may be given several times)",
    )
