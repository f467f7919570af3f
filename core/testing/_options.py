"""Engine options for the conformance suite: ``--dialect-option [DIALECT:][runtime.]KEY=VALUE``.

A dialect may need keyword arguments the suite cannot know (a schedule name, say). Each option
goes to ``pipe_engine`` as ``KEY=VALUE``, or to ``runtime_engine`` with the ``runtime.`` prefix;
a ``DIALECT:`` prefix limits it to that dialect when several are checked at once. ``VALUE`` is
read as a Python literal when it is one (``2``, ``True``, ``'gpipe'``, ``[1, 2]``), else taken
as a string (``gpipe``).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

__all__ = ["RESERVED_OPTIONS", "EngineOptions", "parse_dialect_options"]

#: Arguments the suite passes itself; an option may not replace them.
RESERVED_OPTIONS = frozenset({"config", "loss_fn", "topology", "stage_modules", "plan", "module"})

_OPTION = re.compile(
    r"^(?:(?P<dialect>[^:=\s]+):)?(?P<runtime>runtime\.)?(?P<key>[A-Za-z_][A-Za-z0-9_]*)=(?P<value>.*)$",
    re.DOTALL,
)


@dataclass(frozen=True)
class EngineOptions:
    """Extra keyword arguments for one dialect's engines."""

    #: Passed to ``Dialect.pipe_engine``.
    pipe: Mapping[str, Any] = field(default_factory=dict)
    #: Passed to ``Dialect.runtime_engine``.
    runtime: Mapping[str, Any] = field(default_factory=dict)

    def key(self) -> str:
        """A stable text form, to tell option sets apart."""
        return repr((sorted(self.pipe.items()), sorted(self.runtime.items())))

    def __bool__(self) -> bool:
        return bool(self.pipe or self.runtime)


def _value(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return text


def parse_dialect_options(options: Iterable[str], dialect: str) -> EngineOptions:
    """Return the options among ``options`` that apply to ``dialect``.

    Raises:
        ConfigError: an option is malformed or names an argument the suite passes itself.
    """
    pipe: dict[str, Any] = {}
    runtime: dict[str, Any] = {}
    for option in options:
        match = _OPTION.match(option)
        if match is None:
            raise ConfigError(
                f"--dialect-option {option!r} is not of the form [DIALECT:][runtime.]KEY=VALUE "
                "(for example schedule=gpipe, or torch:runtime.foo=1)"
            )
        if match["dialect"] is not None and match["dialect"] != dialect:
            continue
        key = match["key"]
        if key in RESERVED_OPTIONS:
            raise ConfigError(
                f"--dialect-option {option!r}: the suite passes {key!r} itself; choose another "
                f"option (reserved: {', '.join(sorted(RESERVED_OPTIONS))})"
            )
        (runtime if match["runtime"] else pipe)[key] = _value(match["value"])
    return EngineOptions(pipe=pipe, runtime=runtime)
