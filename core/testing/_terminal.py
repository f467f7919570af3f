"""A copy of the process's stderr, kept before pytest captures it.

Apart from the session state so that the suite's runner can read it without importing the
session (which builds the runs, which use the runner).
"""

from __future__ import annotations

import os
import sys

__all__ = ["remember_terminal", "terminal_fd"]

_terminal: list[int] = []


def remember_terminal() -> None:
    """Keep a copy of this process's stderr, before pytest captures it for a test.

    The suite's in-process watchdog writes there when it must end the process: whatever a test
    writes while it is captured is lost when the process ends.
    """
    if not _terminal:
        try:
            _terminal.append(os.dup(sys.stderr.fileno()))
        except (AttributeError, OSError, ValueError):  # no real stderr (a notebook, say)
            _terminal.append(-1)


def terminal_fd() -> int | None:
    """The descriptor :func:`remember_terminal` kept, or None."""
    return _terminal[0] if _terminal and _terminal[0] >= 0 else None
