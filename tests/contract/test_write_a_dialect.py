"""The dialect of docs/write-a-dialect.rst, copied from the page, installed, passes the suite.

The page's ``file PATH`` blocks are written out as a distribution, which is installed apart
(``pip install --target``, put on ``PYTHONPATH`` only for the commands run here: the shared
environment never sees it). Then exactly what the page says to run: ``pipedialect list``,
``pipedialect check mine``, and pytest on the page's two test modules.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import _doc_examples as docs
import pytest
from _fresh import fresh_env

PAGE = docs.ROOT / "docs" / "write-a-dialect.rst"
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def installed(
    tmp_path_factory: pytest.TempPathFactory, install_plugin: Callable[[Path], Path]
) -> tuple[Path, dict[str, str]]:
    """The page's distribution, written out and installed apart: (its directory, the env)."""
    base = tmp_path_factory.mktemp("write-a-dialect")
    source = base / "pipedialect-mine"
    files = docs.collect().files[PAGE]
    assert {"pyproject.toml", "mine/__init__.py", "mine/_dialect.py"} <= set(files)
    for path, code in files.items():
        (source / path).parent.mkdir(parents=True, exist_ok=True)
        (source / path).write_text(code)
    site = install_plugin(source)  # pipedialect and torch are this environment's
    env = fresh_env()
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return source, env


def _run(argv: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.distributed
def test_the_page_dialect_is_listed(installed: tuple[Path, dict[str, str]]) -> None:
    source, env = installed
    proc = _run(["pipedialect", "list"], source, env)
    assert proc.returncode == 0, proc.stderr
    (row,) = [line for line in proc.stdout.splitlines() if line.startswith("mine ")]
    assert "pipedialect-mine" in row and "ok" in row and "tied-weights" in row, proc.stdout


@pytest.mark.distributed
def test_the_page_dialect_passes_pipedialect_check(installed: tuple[Path, dict[str, str]]) -> None:
    source, env = installed
    proc = _run(["pipedialect", "check", "mine"], source, env)
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:] + proc.stderr[-3000:]
    assert "conformance of 'mine': PASSED" in out
    assert "training             8       0" in out  # every training case it declares ran
    # engine_state: portable checkpoints to and from the local dialect, and a trace
    assert "portability          3       0                     0" in out
    assert "tracing              2       0                     0" in out


@pytest.mark.distributed
def test_the_page_test_modules_run_under_pytest(installed: tuple[Path, dict[str, str]]) -> None:
    source, env = installed
    pytest_argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    star = _run(
        [*pytest_argv, "tests/test_conformance.py", "--dialect", "mine", "-k", "Reg"], source, env
    )
    assert star.returncode == 0, star.stdout[-4000:] + star.stderr[-2000:]
    assert "5 passed" in star.stdout
    inert = _run([*pytest_argv, "tests/test_conformance.py"], source, env)
    assert inert.returncode == 5, inert.stdout[-2000:]  # without --dialect: all deselected
    pinned = _run([*pytest_argv, "tests/test_pinned.py", "-k", "plain"], source, env)
    assert pinned.returncode == 0, pinned.stdout[-4000:] + pinned.stderr[-2000:]
    assert " passed" in pinned.stdout and "failed" not in pinned.stdout


BROKEN = '''
import dataclasses

import pytest

import mine._dialect as page
from mine import MyDialect
from pipedialect.engine.config import clip_gradients
from pipedialect.testing.suite import TestTraining


class NoClipEngine(page.MyEngine):
    """Forgets gradient_clipping."""

    def __init__(self, module, config):
        super().__init__(module, config)
        self.config = dataclasses.replace(self.config, gradient_clipping=0.0)


class StageClipEngine(NoClipEngine):
    """Clips each stage by its own norm instead of the global one."""

    def __init__(self, module, config):
        super().__init__(module, config)
        max_norm, step = page.parse_config(config).gradient_clipping, self.optimizer.step

        def clipped_step(*args, **kwargs):
            for stage in module.stages:
                clip_gradients(list(stage.parameters()), max_norm)
            return step(*args, **kwargs)

        self.optimizer.step = clipped_step


def broken(engine_class):
    class Broken(MyDialect):
        name = "mine-" + engine_class.__name__.lower()

        def _build_engine(self, request):
            return engine_class(request.module, request.config or request.module.config)

    return Broken()


class TestNoClip(TestTraining):
    @pytest.fixture
    def dialect(self):
        return broken(NoClipEngine)


class TestStageClip(TestTraining):
    @pytest.fixture
    def dialect(self):
        return broken(StageClipEngine)
'''


@pytest.mark.distributed
def test_a_broken_training_rule_is_named(
    installed: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """The page's dialect with clipping broken two ways: the suite names the rule each breaks."""
    _, env = installed
    (tmp_path / "test_broken.py").write_text(BROKEN)
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "plain-2"]
    proc = _run([*argv, "test_broken.py"], tmp_path, env)
    out = proc.stdout
    assert proc.returncode == 1, out[-4000:] + proc.stderr[-2000:]
    assert "2 failed" in out, out[-4000:]
    failures = out.split(" FAILURES ", 1)[-1]
    no_clip, stage_clip = failures.split("TestStageClip.test_matches_unsplit", 1)
    assert "rule broken: gradient clipping" in no_clip, out[-6000:]
    assert "trained without clipping: gradient_clipping=0.05 must scale" in no_clip, out[-6000:]
    assert "rule broken: gradient clipping" in stage_clip, out[-6000:]
    assert "each stage clipped by its own gradient norm" in stage_clip, out[-6000:]
