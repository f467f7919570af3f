"""Every benchmark script runs, in its smoke mode (``--smoke``: tiny sizes, seconds).

The numbers of a smoke run mean nothing; what it shows is that the script still runs end to end
against the package as it is, so that a renamed argument or a moved module breaks a test, not
the next person who measures. The full runs and their results are in benchmarks/README.md.

The scripts' smoke runs share one process (``benchmarks/_smoke.py``'s ``run_smokes``), started
once for every selected script by a module fixture: a process of its own per script would
import torch and DeepSpeed again and start another fork server for its ranks. Each script still
has its test, which fails with that script's own output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

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


@pytest.fixture(scope="module")
def smoke_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Any]]:
    """The smoke run of every script this session selected (bar :data:`PIP`'s), all in one
    process: by script, whether it passed and the end of its output."""
    selected = [
        item.callspec.params["script"]
        for item in request.session.items
        if item.path == Path(__file__) and item.originalname == "test_smoke"
    ]
    scripts = [s for s in SCRIPTS if s in selected and s not in PIP]
    report = tmp_path_factory.mktemp("smoke") / "report.json"
    args = [sys.executable, str(BENCHMARKS / "_smoke.py"), "--report", str(report), *scripts]
    try:
        done = _run(args, timeout=1800)
        tail = f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    except subprocess.TimeoutExpired as exc:
        tail = f"the smoke runs took over {exc.timeout} s"
    results: dict[str, dict[str, Any]] = json.loads(report.read_text()) if report.exists() else {}
    for script in scripts:
        if script not in results:
            results[script] = {"ok": False, "output": "never started"}
        if not results[script]["ok"]:
            results[script]["output"] += f"\n-- the process that ran the smoke runs:\n{tail}"
    return results


@pytest.mark.distributed
@pytest.mark.parametrize(
    "script",
    [pytest.param(s, marks=[pytest.mark.packaging] if s in PIP else []) for s in SCRIPTS],
)
def test_smoke(script: str, request: pytest.FixtureRequest) -> None:
    if script in PIP:  # pip runs: alone, so that a selection without packaging skips it
        done = _run([sys.executable, str(BENCHMARKS / script), "--smoke"], timeout=900)
        assert done.returncode == 0, (
            f"{script} --smoke failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
        return
    result = request.getfixturevalue("smoke_runs")[script]
    assert result["ok"], f"{script} --smoke failed:\n{result['output']}"


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
