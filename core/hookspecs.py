"""The hooks a pipedialect plugin implements.

A plugin is a module (or any object) named by an entry point in the ``pipedialect.dialects``
group. It implements :func:`register_dialects` with the :data:`~pipedialect.hookimpl` marker::

    import pipedialect

    @pipedialect.hookimpl
    def register_dialects(register):
        register(MyDialect)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from .dialect import Dialect

__all__ = ["hookimpl", "hookspec", "register_dialects"]

PROJECT_NAME = "pipedialect"

#: Marks the hook specifications below.
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
#: Marks a plugin's hook implementations.
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def register_dialects(register: Callable[[type[Dialect] | Dialect], None]) -> None:
    """Register this plugin's dialects by calling ``register`` once per dialect.

    ``register`` takes a :class:`~pipedialect.Dialect` subclass (instantiated on first use,
    and by ``pipedialect list``; one whose constructor raises is listed as broken) or an
    instance. Registering a name another plugin also registers is reported as a conflict that
    names both distributions. A hook that raises leaves none of the plugin's dialects behind.
    """
