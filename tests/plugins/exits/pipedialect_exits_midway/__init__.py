"""A plugin that registers one dialect and then raises ``SystemExit`` in the same hook."""

from __future__ import annotations

import sys
from typing import Any

import pipedialect


class MidwayDialect(pipedialect.Dialect):
    """Registered just before its plugin's hook exits: it must not be listed."""

    name = "midway"

    def _build_pipeline(self, request: Any) -> Any:
        raise NotImplementedError

    def _build_engine(self, request: Any) -> Any:
        raise NotImplementedError


@pipedialect.hookimpl
def register_dialects(register: Any) -> None:
    register(MidwayDialect)
    sys.exit("no GPU here")
