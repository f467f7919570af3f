"""A pytest plugin: the machine's busy CPU time spent during each test, for a serial run.

A test that starts processes (ranks, fresh interpreters, pip) spends most of its CPU outside
the test process, where pytest's durations do not see it. The machine-wide busy time from
``/proc/stat`` does, as long as nothing else runs: use it on an otherwise idle machine,
without xdist (Linux only)::

    PYTHONPATH=benchmarks .venv/bin/pytest -p cpu_per_test -m "distributed or packaging"

Each test appends a JSON line ``{"id", "cpu", "wall"}`` (seconds) to ``$CPU_PER_TEST`` (default
``cpu_per_test.jsonl`` in the current directory); sort it by ``cpu``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator

import pytest

_TICKS = os.sysconf("SC_CLK_TCK")


def _busy_seconds() -> float:
    """CPU seconds the whole machine has spent not idle (nor waiting on I/O) since boot."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, *rest = map(int, f.readline().split()[1:])
    return (user + nice + system + sum(rest)) / _TICKS


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    busy, start = _busy_seconds(), time.monotonic()
    yield
    row = {"id": item.nodeid, "cpu": _busy_seconds() - busy, "wall": time.monotonic() - start}
    with open(os.environ.get("CPU_PER_TEST", "cpu_per_test.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
