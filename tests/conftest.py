"""Shared test configuration.

- One intra-op thread: the machine has two cores shared with every spawned rank, and tiny ops on
  many threads are slower (thread contention) than on one.
- This environment's ``bin`` first on ``PATH``, for the test process and every process it starts,
  as for a user with the environment activated (and as tests/project/test_docs_examples.py runs the
  pages' examples). DeepSpeed builds its C++ ops with the first ``ninja`` on ``PATH``, and two
  ninjas (this environment's 1.13, the system's 1.11) hash the build commands differently: every
  switch between them rebuilt the cached ops (1-2 min on two cores), twice per run of the suite.
- The cuda tier skips itself where no CUDA device exists.
- A test that starts a process without the ``distributed`` or ``packaging`` marker fails (below).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import pytest
import torch

torch.set_num_threads(1)

# The planner uses a stored calibration of this machine for what a test does not give; tests
# (and the processes they start) see none unless they calibrate themselves.
os.environ["PIPEDIALECT_CALIBRATION"] = str(
    Path(tempfile.mkdtemp(prefix="pipedialect-calibration-")) / "calibration.json"
)

_BIN = str(Path(sys.executable).parent)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _BIN:
    os.environ["PATH"] = f"{_BIN}{os.pathsep}{os.environ.get('PATH', '')}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "install_plugin" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.packaging)  # it runs pip (see install_plugin)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (cuda tier)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# -- one way to install a plugin distribution --------------------------------------------------


@pytest.fixture(scope="session")
def install_plugin(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path], Path]:
    """``install(source)``: pip-install the distribution at ``source`` into a target directory
    of its own (once per session) and return that directory, for a fresh interpreter's
    ``PYTHONPATH``: its entry points are then found exactly as in a user's environment, and the
    shared environment never sees it. The sources are copied first (pip writes ``build/`` and
    ``*.egg-info`` beside them). A test asking for this fixture is marked ``packaging``.
    """
    root = tmp_path_factory.mktemp("plugins")
    installed: dict[Path, Path] = {}

    def install(source: Path) -> Path:
        source = source.resolve()
        if source not in installed:
            name = f"{len(installed)}-{source.name}"
            copy = root / f"{name}-src"
            shutil.copytree(source, copy, ignore=shutil.ignore_patterns("build", "*.egg-info"))
            target = root / name
            pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps"]
            proc = subprocess.run(
                [*pip, "--no-build-isolation", "--target", str(target), str(copy)],
                capture_output=True,
                text=True,
                check=False,
            )
            assert proc.returncode == 0, f"pip install {source}:\n{proc.stdout}\n{proc.stderr}"
            installed[source] = target
        return installed[source]

    return install


# -- tests that start processes say so ---------------------------------------------------------
#
# A test that starts a process (a launched rank, a fresh interpreter, pip) carries the
# `distributed` or `packaging` marker, so that `make quick` (-m "not distributed and not
# packaging") stays in the test process. Every process start is seen here (subprocess and
# multiprocessing both end in these two calls) and an unmarked test that started one fails,
# naming the command.

_PROCESS_MARKERS = ("distributed", "packaging")
_started: list[str] | None = None  # the current unmarked test's process starts, else None


def _note(what: str) -> None:
    if _started is not None:
        _started.append(what)


def _guard_process_starts() -> None:
    popen_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]
    process_start = BaseProcess.start

    def execute_child(self: subprocess.Popen[Any], args: Any, *rest: Any, **kw: Any) -> Any:
        _note(f"subprocess {args if isinstance(args, str) else ' '.join(map(str, args))[:200]}")
        return popen_child(self, args, *rest, **kw)

    def start(self: BaseProcess) -> None:
        _note(f"multiprocessing {self.name} ({getattr(self, '_target', None)})")
        process_start(self)

    subprocess.Popen._execute_child = execute_child  # type: ignore[attr-defined]
    BaseProcess.start = start  # type: ignore[method-assign]


_guard_process_starts()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    global _started
    marked = any(item.get_closest_marker(m) for m in _PROCESS_MARKERS)
    _started = None if marked else []
    try:
        return (yield)
    finally:
        _started = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    result = yield
    if _started:
        raise pytest.fail.Exception(
            f"{item.nodeid} started {len(_started)} process(es) without a "
            f"@pytest.mark.distributed or @pytest.mark.packaging marker (make quick would "
            f"run it): {_started[0]}"
        )
    return result
