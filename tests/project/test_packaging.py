"""The distribution as a user gets it: installed into a fresh virtual environment, three ways.

The rest of the suite runs against the strict editable install; these tests prove that the wheel
carries every module, the typing marker and the entry points and works without deepspeed
installed, that pytest in another project never loads the suite's (opt-in) plugin, and that
``pipedialect check`` passes from a wheel, a strict editable install and
setuptools' default editable install (an import hook mapping ``pipedialect`` to ``core/``: see
[Note: importing the suite by name] in ``pipedialect.testing.plugin``). One environment serves
every test (installing torch is the slow part), and one install of pipedialect serves every test
that asks for the same kind (:class:`Installs`): the bare wheel, the wheel with its ``testing``
extra, or an editable install; a test asking for another kind gets pipedialect removed and
installed that way. Installs build in their source tree, so they build from a copy of it: this
working tree's own link tree stays as it is.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: What a build of the distribution reads.
SOURCES = ("core", "dialects", "pyproject.toml", "README.md", "LICENSE")

pytestmark = pytest.mark.packaging


def _sources() -> set[str]:
    """Every module the wheel must contain, as paths inside the wheel."""
    expected = {
        f"pipedialect/{p.relative_to(ROOT / 'core')}" for p in (ROOT / "core").rglob("*.py")
    }
    expected |= {
        f"pipedialect/dialects/{p.relative_to(ROOT / 'dialects')}"
        for p in (ROOT / "dialects").rglob("*.py")
    }
    return {e for e in expected if "__pycache__" not in e} | {"pipedialect/py.typed"}


#: Left out of what the tests' commands see: a plugin restriction and a PYTHONPATH would reach
#: past the install under test.
_UNSET = ("PIPEDIALECT_PLUGINS", "PYTHONPATH")
#: Where the commands write bytecode, once the environment exists (``venv``): it installs torch
#: without bytecode, and with ``PYTHONDONTWRITEBYTECODE`` set every interpreter there would
#: compile torch's modules again (2.4 s of CPU each). A tree of its own, so that nothing is
#: written beside an installed or editable module (pip runs without it: what it installs it
#: records, and compiles where it installs).
_PYCACHE: list[Path] = []


def _env(argv: list[str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _UNSET}
    if _PYCACHE and argv[1:3] != ["-m", "pip"]:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(_PYCACHE[0])
    return env


def _run(argv: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in :func:`_env`; raise with its output."""
    env = _env(argv)
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, check=False)
    if proc.returncode != 0:
        raise AssertionError(f"{argv} failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of what a build reads, without caches."""
    tree = tmp_path_factory.mktemp("source")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, tree / name, ignore=ignore)
        else:
            shutil.copy2(path, tree / name)
    return tree


@pytest.fixture(scope="module")
def wheel(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    pip = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation"]
    _run([*pip, "--wheel-dir", str(out), str(source)])
    (found,) = out.glob("pipedialect-*.whl")
    return found


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh environment holding torch only."""
    path = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", str(path)])
    # torch first, pinned, as the README does: pip must never choose a torch build itself.
    # --no-compile: the modules the tests import are compiled when first imported (_PYCACHE).
    pip = [str(path / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-compile"]
    _run([*pip, "torch==2.13.0"])
    _PYCACHE[:] = [path / "pycache"]
    return path


class Installs:
    """The environment's pipedialect: installed the way a test asks, once for every test in a
    row that asks for the same way (each pip run and each removal costs seconds of CPU)."""

    def __init__(self, venv: Path, source: Path, wheel: Path) -> None:
        self.venv, self.source, self.wheel = venv, source, wheel
        self.pip = [str(venv / "bin" / "python"), "-m", "pip"]
        self.current: str | None = None

    def ensure(self, how: str) -> None:
        """Have pipedialect installed as ``how``: ``wheel`` (no extras), ``wheel[testing]``,
        ``strict-editable`` or ``default-editable`` (both with ``testing``)."""
        if how == self.current:
            return
        install = [*self.pip, "install", "--quiet"]
        if how == "wheel[testing]" and self.current == "wheel":
            _run([*install, f"{self.wheel}[testing]"])  # adds the extra's packages only
        else:
            if self.current is not None:
                _run([*self.pip, "uninstall", "--yes", "--quiet", "pipedialect"])
            self.current = None
            if how == "wheel":
                _run([*install, str(self.wheel)])
            elif how == "wheel[testing]":
                _run([*install, f"{self.wheel}[testing]"])
            else:
                strict = how == "strict-editable"
                mode = ["--config-settings", "editable_mode=strict"] if strict else []
                _run([*install, *mode, "--editable", f"{self.source}[testing]"])
        self.current = how


@pytest.fixture(scope="module")
def installs(venv: Path, source: Path, wheel: Path) -> Installs:
    return Installs(venv, source, wheel)


def test_wheel_contains_every_module_and_entry_point(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        missing = _sources() - names
        assert not missing, f"modules missing from the wheel: {sorted(missing)}"
        (ep_file,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        entry_points = zf.read(ep_file).decode()
    assert "[pipedialect.dialects]" in entry_points
    assert "deepspeed = pipedialect.dialects.deepspeed" in entry_points
    assert "local = pipedialect.dialects.local" in entry_points
    assert "torch = pipedialect.dialects.torch" in entry_points
    assert "pipedialect = pipedialect.cli:main" in entry_points
    assert "[pytest11]" not in entry_points  # the suite's pytest plugin is opt-in


def test_wheel_works_in_a_fresh_venv(venv: Path, installs: Installs) -> None:
    """The wheel without extras: no deepspeed, and no pytest (the ``testing`` extra), which
    the environment must not hold yet (the tests that install the extra come after this one)."""
    installs.ensure("wheel")
    code = (
        "import importlib.util, sys\n"
        "print(importlib.util.find_spec('pytest') is None)\n"
        "import pipedialect, pipedialect.dialects.deepspeed, pipedialect.dialects.local\n"
        "names = sorted(i.name for i in pipedialect.list_dialects())\n"
        "print(pipedialect.__file__)\n"
        "print(names, 'deepspeed' in sys.modules)\n"
    )
    proc = _run([str(venv / "bin" / "python"), "-c", code])
    without_pytest, location, listing = proc.stdout.splitlines()
    assert without_pytest == "True", "pytest is installed: this checks the wheel without it"
    assert location.startswith(str(venv)), location
    assert listing == "['deepspeed', 'local', 'torch'] False"
    cli = _run([str(venv / "bin" / "pipedialect"), "list"])
    assert "deepspeed" in cli.stdout and "pipedialect" in cli.stdout


#: An unrelated project's only test: pipedialect (and so torch) must stay out of its session.
UNRELATED_TEST = """
import sys


def test_nothing_of_pipedialect_is_loaded(pytestconfig):
    loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("pipedialect"))
    assert loaded == []
    assert pytestconfig.pluginmanager.get_plugin("pipedialect.testing.plugin") is None
"""


def test_pytest_in_an_unrelated_project_does_not_load_the_plugin(
    venv: Path, installs: Installs, tmp_path: Path
) -> None:
    """pipedialect installed (with pytest) changes nothing in another project's pytest: no
    option, no marker, no plugin, and collecting its tests imports neither torch nor us."""
    installs.ensure("wheel[testing]")
    (tmp_path / "test_unrelated.py").write_text(UNRELATED_TEST)
    pytest_argv = [str(venv / "bin" / "python"), "-m", "pytest", "-p", "no:cacheprovider"]
    proc = _run([*pytest_argv, "-q"], cwd=tmp_path)
    assert "1 passed" in proc.stdout, proc.stdout
    options = _run([*pytest_argv, "--help"], cwd=tmp_path).stdout
    assert "--dialect" not in options and "pipedialect" not in options
    markers = _run([*pytest_argv, "--markers"], cwd=tmp_path).stdout
    assert "pipedialect" not in markers, markers
    env = _env(pytest_argv)
    refused = subprocess.run(
        [*pytest_argv, "--dialect", "local"], cwd=tmp_path, capture_output=True, text=True, env=env
    )
    assert refused.returncode == pytest.ExitCode.USAGE_ERROR, refused.stdout + refused.stderr
    assert "unrecognized arguments: --dialect" in refused.stderr


def test_the_example_dialect_installed_beside_the_wheel_saves_resumes_and_traces(
    venv: Path, installs: Installs, tmp_path: Path
) -> None:
    """examples/pipedialect-sendrecv pip-installed into the fresh environment next to the
    wheel: ``pipedialect check sendrecv`` finds it by its entry point and passes the
    portable-checkpoint cases (saved on it, resumed on local, and back) and the trace case,
    through the engine_state and instrument hooks it implements."""
    installs.ensure("wheel[testing]")
    example = tmp_path / "pipedialect-sendrecv"
    shutil.copytree(
        ROOT / "examples" / "pipedialect-sendrecv",
        example,
        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"),
    )
    python = str(venv / "bin" / "python")
    try:
        _run([*installs.pip, "install", "--quiet", "--no-deps", str(example)])
        proc = _run(
            [str(venv / "bin" / "pipedialect"), "check", "sendrecv", "-k", "Portab or Tracing"],
            cwd=tmp_path,
        )
    finally:
        subprocess.run(
            [python, "-m", "pip", "uninstall", "--yes", "--quiet", "pipedialect-sendrecv"],
            capture_output=True,
            check=False,
        )
    assert "conformance of 'sendrecv': PASSED" in proc.stdout, proc.stdout[-3000:]
    assert "  portability          3       0                     0" in proc.stdout
    assert "  tracing              2       0                     0" in proc.stdout


@pytest.mark.parametrize("how", ["wheel", "strict-editable", "default-editable"])
def test_check_passes_from_every_kind_of_install(
    how: str, source: Path, venv: Path, installs: Installs, tmp_path: Path
) -> None:
    """``pipedialect check local`` runs the suite against the installed package, whose files
    lie in site-packages, in a link tree, or (default editable) in the source tree's ``core/``,
    which pytest must not import as a package of its own. The wheel runs the whole suite; the
    editable installs, where what can break is how the suite's modules are found and collected
    (every module is collected either way), run its registration, portability and trace
    cases. ``-v`` lists every test it ran by its file: each lies where the install puts it."""
    if how == "wheel":
        installs.ensure("wheel[testing]")
        expected = venv
    else:
        installs.ensure(how)
        expected = source / ("build" if how == "strict-editable" else "core")
    select = [] if how == "wheel" else ["-k", "Registration or Portable or Tracing"]
    proc = _run([str(venv / "bin" / "pipedialect"), "check", "local", "-v", *select], cwd=tmp_path)
    files = {
        os.path.normpath(tmp_path / f)
        for f in re.findall(r"^(\S+?\.py)::", proc.stdout, flags=re.MULTILINE)
    }
    assert files, proc.stdout[-3000:]
    elsewhere = sorted(f for f in files if not f.startswith(f"{expected}{os.sep}"))
    assert not elsewhere, f"suite modules outside {expected}: {elsewhere}"
    assert "conformance of 'local': PASSED" in proc.stdout, proc.stdout[-3000:]
    assert " failed" not in proc.stdout.splitlines()[-1]
    # The installed package's suite has the portable-checkpoint and trace cases, and runs them.
    assert "  portability          3       0" in proc.stdout, proc.stdout[-3000:]
    assert "  tracing              2       0" in proc.stdout, proc.stdout[-3000:]
