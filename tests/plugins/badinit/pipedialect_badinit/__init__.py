"""A plugin registering two dialects whose constructors raise, and one that works."""

from __future__ import annotations

import sys
from typing import Any

import pipedialect


class _Base(pipedialect.Dialect):
    capabilities = frozenset({pipedialect.Capability.MULTI_PROCESS})

    def _build_pipeline(self, request: Any) -> Any:
        raise NotImplementedError

    def _build_engine(self, request: Any) -> Any:
        raise NotImplementedError


class NeedsGpuDialect(_Base):
    """Its constructor raises, as one probing for hardware that is not there would."""

    name = "needs-gpu"

    def __init__(self) -> None:
        raise RuntimeError("no CUDA device: the needs-gpu dialect requires one")


class QuitsDialect(_Base):
    """Its constructor calls ``sys.exit``."""

    name = "quits"

    def __init__(self) -> None:
        sys.exit(4)


class FineDialect(_Base):
    """Registered by the same plugin; it works."""

    name = "fine"


@pipedialect.hookimpl
def register_dialects(register: Any) -> None:
    register(NeedsGpuDialect)
    register(QuitsDialect)
    register(FineDialect)
