"""Every example of README.md and docs/*.rst runs as the page shows it, on the CPU.

``_doc_examples`` finds the blocks and reads the marker before each one (how it runs, or why
not). Python programs run as ``python example.py`` or under ``torchrun``, console blocks command
by command; a failure names the page and line. A new page is covered as soon as it exists: its
blocks need markers, or the first test here fails naming them.

A program runs in processes forked from one that imported torch (``tests/_fork_runner.py``),
in an empty directory: one for a ``plain`` program, one per rank with the variables torchrun
gives its workers for a ``torchrun N`` one. Everything else a program imports and does starts
as in a fresh interpreter, and nothing of one program reaches another, while the torch import a
fresh interpreter makes (2 CPU-seconds, on 2 cores shared by the whole distributed tier; a
torchrun program paid it once more for torchrun itself) is made once.
``tests/project/test_quickstart.py`` runs the quickstart under torchrun itself.
"""

from __future__ import annotations

import ast
import json
import os
import select
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator
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


class ForkRunner:
    """``tests/_fork_runner.py``, started once for this module: ``run`` runs one program in a
    process forked from it, as ``subprocess.run([python, program])`` would."""

    SCRIPT = Path(__file__).resolve().parents[1] / "_fork_runner.py"

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None

    def _started(self) -> subprocess.Popen[bytes]:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                [sys.executable, str(self.SCRIPT)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                cwd=self.cwd,
                env=_env(),
                bufsize=0,
                start_new_session=True,  # its children with it in close()
            )
        return self.proc

    def run(
        self, program: Path, cwd: Path, timeout: float, nproc: int = 0
    ) -> subprocess.CompletedProcess[str]:
        """Run ``program`` as ``python`` does, or as ``torchrun --nproc_per_node nproc``."""
        proc = self._started()
        assert proc.stdin is not None and proc.stdout is not None
        out, err = cwd.parent / f"{cwd.name}.stdout", cwd.parent / f"{cwd.name}.stderr"
        request: dict[str, object] = {"program": str(program), "cwd": str(cwd), "stdout": str(out)}
        request["stderr"] = str(err)
        argv = [sys.executable, str(program)]
        if nproc:
            request.update(nproc=nproc, master_port=free_port())
            argv = ["torchrun", "--nproc_per_node", str(nproc), str(program)]
        proc.stdin.write(json.dumps(request).encode() + b"\n")
        answer = b""
        while not answer.endswith(b"\n"):
            ready, _, _ = select.select([proc.stdout], [], [], timeout)
            chunk = os.read(proc.stdout.fileno(), 4096) if ready else b""
            if not chunk:  # timed out, or the runner itself died
                self.close()
                raise AssertionError(f"{program} did not end within {timeout:.0f}s")
            answer += chunk
        returncode = int(json.loads(answer)["returncode"])
        if not nproc:
            return subprocess.CompletedProcess(argv, returncode, out.read_text(), err.read_text())
        ranks = [(r, Path(f"{out}.{r}"), Path(f"{err}.{r}")) for r in range(nproc)]
        stdout = "".join(f"[rank {r}]\n{o.read_text()}" for r, o, _ in ranks if o.exists())
        stderr = "".join(f"[rank {r}]\n{e.read_text()}" for r, _, e in ranks if e.exists())
        return subprocess.CompletedProcess(argv, returncode, stdout, stderr)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()
        self.proc = None


@pytest.fixture(scope="module")
def fork_runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkRunner]:
    runner = ForkRunner(tmp_path_factory.mktemp("fork-runner"))
    yield runner
    runner.close()


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
def test_example_runs_as_written(
    example: docs.Example, tmp_path: Path, fork_runner: ForkRunner
) -> None:
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
    directory = tmp_path / "run"  # empty: the runner's output files lie beside it
    directory.mkdir()
    program = directory / "example.py"
    program.write_text(example.code)
    # A torchrun program's ranks are forked too, with the variables torchrun gives them
    # (tests/_fork_runner.py); test_quickstart.py runs the quickstart under torchrun itself.
    nproc = example.nproc if example.mode == "torchrun" else 0
    proc = fork_runner.run(program, directory, TIMEOUT, nproc=nproc)
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
