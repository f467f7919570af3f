"""Every benchmark script runs, in its smoke mode (``--smoke``: tiny sizes, seconds).

The numbers of a smoke run mean nothing; what it shows is that the script still runs end to end
against the package as it is, so that a renamed argument or a moved module breaks a test, not
the next person who measures. The full runs and their results are in benchmarks/README.md.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
#: Every script (a ``_``-module is a helper; cpu_per_test is a pytest plugin, run below).
SCRIPTS = sorted(
    p.name
    for p in BENCHMARKS.glob("*.py")
    if not p.name.startswith("_") and p.stem != "cpu_per_test"
)
#: Scripts that run pip (codec compares with Slapo's published wheel, fetched once).
PIP = {"codec.py"}


def _run(args: list[str], timeout: float, **env_vars: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(BENCHMARKS), **env_vars}
    return subprocess.run(
        args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def test_every_script_is_covered() -> None:
    """A new script gets a smoke run by being in benchmarks/: this list is the directory."""
    assert "planner.py" in SCRIPTS and "memory.py" in SCRIPTS
    for name in SCRIPTS:
        assert "_smoke.parse_args(" in (BENCHMARKS / name).read_text(), f"{name} has no --smoke"


@pytest.mark.distributed
@pytest.mark.parametrize(
    "script",
    [pytest.param(s, marks=[pytest.mark.packaging] if s in PIP else []) for s in SCRIPTS],
)
def test_smoke(script: str) -> None:
    done = _run([sys.executable, str(BENCHMARKS / script), "--smoke"], timeout=900)
    assert done.returncode == 0, (
        f"{script} --smoke failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )


@pytest.mark.distributed
def test_cpu_per_test_plugin(tmp_path: Path) -> None:
    """The plugin records one line per test it sees."""
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    out = tmp_path / "cpu.jsonl"
    done = _run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "cpu_per_test",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            str(tmp_path / "test_one.py"),
        ],
        timeout=300,
        CPU_PER_TEST=str(out),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert out.exists(), done.stdout
    assert "test_one" in out.read_text()
