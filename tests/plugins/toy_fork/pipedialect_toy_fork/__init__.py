"""A plugin that registers a second dialect named ``toy`` (conflict tests only)."""

from __future__ import annotations

from typing import Any

import pipedialect


class ToyForkDialect(pipedialect.Dialect):
    """Claims the name ``toy``, which the pipedialect-toy distribution also registers."""

    name = "toy"
    version = "0.9.0"

    def _build_pipeline(self, request: Any) -> Any:
        raise NotImplementedError

    def _build_engine(self, request: Any) -> Any:
        raise NotImplementedError


@pipedialect.hookimpl
def register_dialects(register: Any) -> None:
    register(ToyForkDialect)
