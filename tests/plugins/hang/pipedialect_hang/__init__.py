"""Single-process dialects that build a working local engine whose ``train_batch`` hangs.

``hang`` sleeps forever, as a runtime waiting on a queue nobody fills would. ``hang-deaf`` also
blocks ``SIGALRM`` first, as code that masks signals would (it still runs Python every half
second). ``hang-native`` blocks it and then never returns from one call into C, as a hang inside
native code would.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import pipedialect
from pipedialect.dialects.local import LocalDialect


class _Hanging:
    """A local engine whose ``train_batch`` never returns; everything else is the engine's."""

    def __init__(self, engine: Any, deaf: bool, native: bool) -> None:
        self._engine = engine
        self._deaf = deaf
        self._native = native

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def train_batch(self, data_iter: Any = None) -> Any:
        if self._deaf:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        while True:
            time.sleep(3600 if self._native else 0.5)

    def eval_batch(self, data_iter: Any = None, **kwargs: Any) -> Any:
        return self._engine.eval_batch(data_iter, **kwargs)


class HangDialect(LocalDialect):
    """The local dialect, except that training never finishes."""

    name = "hang"
    description = "train_batch sleeps forever"
    deaf = False
    native = False

    def _build_engine(self, request: Any) -> Any:
        return _Hanging(super()._build_engine(request), self.deaf, self.native)

    def local_stages(self, engine: Any) -> Any:
        return super().local_stages(engine._engine)


class DeafHangDialect(HangDialect):
    """Hangs where no signal handler can run."""

    name = "hang-deaf"
    description = "train_batch blocks SIGALRM, then sleeps forever"
    deaf = True


class NativeHangDialect(DeafHangDialect):
    """Hangs where neither a signal handler nor an asynchronous exception can run."""

    name = "hang-native"
    description = "train_batch blocks SIGALRM, then never returns from one sleep"
    native = True


@pipedialect.hookimpl
def register_dialects(register: Any) -> None:
    register(HangDialect)
    register(DeafHangDialect)
    register(NativeHangDialect)
