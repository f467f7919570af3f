"""A third-party dialect plugin that registers the ``toy`` dialect (registry tests only)."""

from __future__ import annotations

from typing import Any

import pipedialect


class ToyDialect(pipedialect.Dialect):
    """Declares a name, a version and capabilities; builds no engine."""

    name = "toy"
    version = "1.2.3"
    description = "registry test dialect"
    capabilities = frozenset({pipedialect.Capability.TIED_WEIGHTS})

    def _build_pipeline(self, request: Any) -> Any:
        raise NotImplementedError("the toy dialect builds no engine")

    def _build_engine(self, request: Any) -> Any:
        raise NotImplementedError("the toy dialect builds no engine")


@pipedialect.hookimpl
def register_dialects(register: Any) -> None:
    register(ToyDialect)
