"""Every example of README.md and docs/*.rst runs as the page shows it, on the CPU.

``_doc_examples`` finds the blocks and reads the marker before each one (how it runs, or why
not). Python programs run with ``python`` or under ``torchrun``, console blocks command by
command; a failure names the page and line. A new page is covered as soon as it exists: its
blocks need markers, or the first test here fails naming them.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import _doc_examples as docs
import pytest
from _fresh import fresh_env

from pipedialect.runtime.launch import free_port

FOUND = docs.collect()
BIN = Path(sys.executable).parent
TIMEOUT = 600
QUICKSTART = docs.ROOT / "examples" / "quickstart.py"
#: Programs another test runs as the page shows them, and checks more closely than "it exits
#: 0" (the losses): not run twice. The README and the quickstart page quote the quickstart.
RUN_ELSEWHERE = {("torchrun", 2, QUICKSTART.read_text()): "test_example_trains_under_torchrun"}


def _env() -> dict[str, str]:
    """The user's environment, on the CPU, with this virtual environment's commands first.

    One intra-op thread per process, as ``torchrun`` gives its ranks (and the pages tell users of
    the ``deepspeed`` launcher to set): on two shared cores, tiny ops on two threads contend.
    """
    env = fresh_env()
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _params() -> list[object]:
    params = []
    for example in FOUND.examples:
        if (example.mode, example.nproc, example.code) in RUN_ELSEWHERE:
            continue
        # Every example runs in a process of its own (a torchrun example in several).
        params.append(pytest.param(example, id=example.id, marks=[pytest.mark.distributed]))
    return params


def _report(proc: subprocess.CompletedProcess[str], what: str) -> str:
    return f"{what} exited with {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}\n" + (
        f"--- stderr ---\n{proc.stderr[-4000:]}"
    )


def test_every_block_has_a_marker_that_fits_it() -> None:
    assert not FOUND.problems, "\n".join(FOUND.problems)


def test_the_pages_hold_runnable_examples() -> None:
    """The collector sees the pages' blocks (guards against a parser that finds nothing)."""
    pages = {b.page.name for e in FOUND.examples for b in e.blocks}
    assert {"README.md", "quickstart.rst", "deepspeed.rst", "torch.rst"} <= pages
    assert {"plain", "torchrun", "shell"} <= {e.mode for e in FOUND.examples}


@pytest.mark.parametrize("example", _params())
def test_example_runs_as_written(example: docs.Example, tmp_path: Path) -> None:
    if example.mode == "shell":
        for command in docs.commands(example.code):
            command = docs.with_port(command, free_port())
            proc = subprocess.run(
                ["bash", "-c", command],
                cwd=docs.ROOT,
                env=_env(),
                capture_output=True,
                text=True,
                timeout=TIMEOUT,
            )
            assert proc.returncode == 0, _report(proc, f"{example.id}: $ {command}")
        return
    program = tmp_path / "example.py"
    program.write_text(example.code)
    if example.mode == "plain":
        argv = [sys.executable, str(program)]
    else:
        argv = [
            str(BIN / "torchrun"),
            "--nproc_per_node",
            str(example.nproc),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            str(program),
        ]
    proc = subprocess.run(
        argv, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=TIMEOUT
    )
    assert proc.returncode == 0, _report(proc, example.id)
    assert "terminate called" not in proc.stderr, _report(proc, example.id)


def test_programs_run_elsewhere_are_run_there() -> None:
    """tests/project/test_quickstart.py runs examples/quickstart.py under torchrun, as the pages
    say."""
    import test_quickstart

    assert test_quickstart.EXAMPLE == QUICKSTART
    for key, name in RUN_ELSEWHERE.items():
        assert callable(getattr(test_quickstart, name))
        assert any((e.mode, e.nproc, e.code) == key for e in FOUND.examples), key


def test_package_files_are_valid_python_and_toml() -> None:
    """The ``file PATH`` blocks parse; tests/contract/test_write_a_dialect.py installs and checks
    them."""
    assert set(FOUND.files) == {docs.ROOT / "docs" / "write-a-dialect.rst"}, (
        "a page with 'file PATH' blocks needs a test that builds its package, as "
        "tests/contract/test_write_a_dialect.py does for write-a-dialect.rst"
    )
    for files in FOUND.files.values():
        for path, code in files.items():
            if path.endswith(".py"):
                ast.parse(code, filename=path)
            elif path.endswith(".toml"):
                tomllib.loads(code)
