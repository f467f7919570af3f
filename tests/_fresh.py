"""Run pipedialect in a fresh interpreter, as a user's shell would: the tests of ``pipedialect
check`` and of plugin discovery all start one.

The test session restricts plugin discovery (``PIPEDIALECT_PLUGINS``, set in conftest.py); a
fresh interpreter here runs without that restriction, so it finds dialects by their entry points
exactly as in a user's environment, plus the plugins installed in the directories it is given.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

#: ``python -c CHECK args...`` is the ``pipedialect`` command of this interpreter.
CHECK = "import sys; from pipedialect.cli import main; sys.exit(main(sys.argv[1:]))"

#: Hypothesis's storage for every fresh interpreter: it caches there the constants it reads from
#: the source of the (editable, so "local") pipedialect modules before the first property test,
#: about 2 s of CPU per process when each runs in its own empty directory (the same constants
#: either way).
HYPOTHESIS_HOME = Path(__file__).resolve().parents[1] / ".hypothesis" / "fresh"


def fresh_env(
    paths: Iterable[Path] | None = None, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """This environment without the plugin restriction; with ``paths``, ``PYTHONPATH`` is them.

    Hypothesis keeps its storage in :data:`HYPOTHESIS_HOME` (unless the environment names one).
    """
    env = {k: v for k, v in os.environ.items() if k != "PIPEDIALECT_PLUGINS"}
    env.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", str(HYPOTHESIS_HOME))
    if paths is not None:
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in paths)
    env.update(extra or {})
    return env


def run_fresh(
    argv: list[str],
    cwd: Path,
    paths: Iterable[Path] | None = None,
    timeout: float = 900,
    extra: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in ``cwd`` with :func:`fresh_env`, capturing its output (never raising)."""
    return subprocess.run(
        argv,
        cwd=cwd,
        env=fresh_env(paths, extra),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def summary(proc: subprocess.CompletedProcess[str]) -> str:
    """The conformance summary ``pipedialect check`` printed (or everything, to show why not)."""
    _, found, rest = proc.stdout.partition("pipedialect conformance summary")
    return rest if found else proc.stdout[-8000:] + proc.stderr[-4000:]


def torchrun_argv(program: Path, nproc: int, *args: str) -> list[str]:
    """``torchrun --nproc_per_node NPROC program ARGS`` through this interpreter (a venv
    without torchrun's script runs it too), on 127.0.0.1 and a free port."""
    from pipedialect.runtime.launch import free_port

    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(program),
        *args,
    ]


def torchrun(
    program: Path, cwd: Path, *, nproc: int = 2, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """:func:`torchrun_argv` run as a user runs a training script. Output captured and
    unbuffered: a ``print`` of one string is one write, so its text is never cut by another
    rank's (the newline is a write of its own)."""
    return subprocess.run(
        torchrun_argv(program, nproc),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
