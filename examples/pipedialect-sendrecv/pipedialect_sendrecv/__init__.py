"""pipedialect-sendrecv: GPipe over torch.distributed send/recv, as a third party would write it.

The package is a pipedialect plugin: its entry point (group ``pipedialect.dialects``) names this
module, whose :func:`register_dialects` hook registers :class:`SendRecvDialect`.
"""

from __future__ import annotations

from collections.abc import Callable

from pipedialect.sdk import Dialect, hookimpl

from ._dialect import SendRecvDialect
from ._engine import SendRecvEngine, SendRecvPipeline

__all__ = ["SendRecvDialect", "SendRecvEngine", "SendRecvPipeline", "register_dialects"]


@hookimpl
def register_dialects(register: Callable[[type[Dialect]], None]) -> None:
    """Register the ``sendrecv`` dialect."""
    register(SendRecvDialect)
