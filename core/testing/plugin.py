"""The pytest plugin of pipedialect: delivers the conformance suite.

It is opt-in: pytest never loads it by itself (pipedialect declares no ``pytest11`` entry
point), so installing pipedialect changes no other project's test sessions. ``pipedialect
check`` loads it (``-p pipedialect.testing.plugin``); so does ``pytest --pyargs
pipedialect.testing.suite -p pipedialect.testing.plugin --dialect NAME``, and a project that runs
the suite from its own tests names it in its top-level ``conftest.py``::

    pytest_plugins = ["pipedialect.testing.plugin"]

It adds options (``--dialect``, ``--dialect-option``, ``--conformance-timeout``) and markers,
and acts only on the suite's own tests: those collected without a ``--dialect`` (say, a
project whose test module imports the suite but runs without the option) are deselected, never
run and never an error.

With ``--dialect NAME`` (several allowed) the suite's tests are parametrized over the dialects;
the suite (or a test module doing ``from pipedialect.testing.suite import *``) then runs against
each, and a per-area summary ends the output.

[Note: importing the suite by name]
pytest imports a test file by its path: it walks up the directories that hold an
``__init__.py`` and names the module after them, putting the directory above on ``sys.path``.
From a wheel or a strict editable install that gives ``pipedialect.testing.suite.test_x``. From
setuptools' default editable install the files are the source tree's, ``<repo>/core/testing/
suite/`` (the source directory ``core/`` is the package ``pipedialect``), so pytest would import a
second copy of the package, ``core``, whose ``Dialect`` class is not the installed dialects'
(every one then looks broken). So the suite's files and packages are collected by nodes that
import them by their name in pipedialect, whatever the layout.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from ._session import AREA_MARKER, DIALECT_FIXTURE, Outcome, area_of, session
from ._terminal import remember_terminal

__all__ = [
    "pipedialect_name",
    "pytest_addoption",
    "pytest_collect_directory",
    "pytest_collection_modifyitems",
    "pytest_configure",
    "pytest_generate_tests",
    "pytest_pycollect_makemodule",
]

_MARKERS = (
    f"{AREA_MARKER}(name): the conformance-suite contract area a test belongs to",
    "pipedialect_requires(*capabilities): run only against dialects declaring them all",
    "pipedialect_refuses(*capabilities): run only against dialects declaring none of them",
    "pipedialect_runs: the test runs the dialect's stages or engines",
)


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add the options that point the conformance suite at installed dialects."""
    group = parser.getgroup("pipedialect", "pipedialect conformance suite")
    group.addoption(
        "--dialect",
        action="append",
        default=[],
        metavar="NAME",
        help="run the pipedialect conformance suite against this installed dialect "
        "(may be given several times)",
    )
    group.addoption(
        "--dialect-option",
        action="append",
        default=[],
        metavar="[DIALECT:][runtime.]KEY=VALUE",
        help="extra keyword argument for the dialect's pipe_engine (runtime_engine with the "
        "'runtime.' prefix); VALUE is a Python literal or a string (may be given several times)",
    )
    group.addoption(
        "--conformance-timeout",
        type=float,
        default=180.0,
        metavar="SECONDS",
        help="fail a case that makes no progress for this long, in this process or in a "
        "multi-process launch (default 180)",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Register the suite's markers and, when asked for, its per-area summary."""
    for line in _MARKERS:
        config.addinivalue_line("markers", line)
    options = config.getoption("dialect_option", default=[]) or []
    if options:
        from ..errors import ConfigError
        from ._options import parse_dialect_options

        try:
            parse_dialect_options(options, "")
        except ConfigError as exc:
            raise pytest.UsageError(str(exc)) from None
    remember_terminal()
    state = session(config)
    state.raw_options = list(options)
    state.case_timeout = float(config.getoption("conformance_timeout", default=180.0) or 180.0)
    config.pluginmanager.register(_Reporter(config), "pipedialect-conformance-reporter")


#: This package's directory, links resolved (a strict editable install links every file).
_PACKAGE_DIR = Path(__file__).resolve().parent


def _module_name(path: Path) -> str | None:
    """The name ``path`` (a module or a package directory) has in this package, or None."""
    if _PACKAGE_DIR.name not in path.parts:
        return None  # not ours (checked before touching the file system)
    try:
        relative = path.resolve().relative_to(_PACKAGE_DIR)
    except (OSError, ValueError):
        return None
    parts = list(relative.with_suffix("").parts if path.suffix == ".py" else relative.parts)
    if parts and parts[-1] == "__init__":
        parts.pop()
    return ".".join([__name__.rpartition(".")[0], *parts])


def _import_by_name(node: pytest.Collector, name: str) -> ModuleType:
    module = importlib.import_module(name)
    node.config.pluginmanager.consider_module(module)
    return module


class _SuiteModule(pytest.Module):
    """A test file of the suite, imported by its module name ([Note: importing the suite by
    name])."""

    def _getobj(self) -> ModuleType:
        name = _module_name(self.path)
        if name is None:  # not reached: only our files get this node
            raise pytest.UsageError(f"{self.path} is not a module of pipedialect.testing")
        return _import_by_name(self, name)


class _SuitePackage(pytest.Package):
    """A package of the suite, imported by its name; it has no ``setup_module`` to run."""

    def setup(self) -> None:
        name = _module_name(self.path)
        if name is not None:
            _import_by_name(self, name)


@pytest.hookimpl(tryfirst=True)
def pytest_collect_directory(path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    """Collect the suite's package directories with :class:`_SuitePackage`."""
    if (path / "__init__.py").is_file() and _module_name(path) is not None:
        package: pytest.Collector = _SuitePackage.from_parent(parent, path=path)
        return package
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> Any:
    """Collect the suite's test files with :class:`_SuiteModule`."""
    if _module_name(module_path) is None:
        return None
    return _SuiteModule.from_parent(parent, path=module_path)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize the suite's tests with the ``--dialect`` names."""
    if DIALECT_FIXTURE not in metafunc.fixturenames:
        return
    names = list(dict.fromkeys(metafunc.config.getoption("dialect", default=[]) or []))
    if names:
        metafunc.parametrize(DIALECT_FIXTURE, names, ids=names, scope="session")


@pytest.fixture
def pipedialect_name() -> str:
    """The dialect a suite test runs against; set by ``--dialect`` (parametrized)."""
    pytest.skip("no --dialect given")  # unreachable: such tests are deselected


def _parametrized(item: pytest.Item) -> bool:
    callspec = getattr(item, "callspec", None)
    return callspec is not None and DIALECT_FIXTURE in callspec.params


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect suite tests that have no dialect; note what the others need."""
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        needs_name = DIALECT_FIXTURE in getattr(item, "fixturenames", ())
        (drop if needs_name and not _parametrized(item) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    state = session(config)
    for item in keep:
        area = area_of(item)
        if area is None:
            continue
        state.areas[item.nodeid] = area
        callspec = getattr(item, "callspec", None)
        if callspec is not None:
            case = callspec.params.get("case")
            if isinstance(case, str):
                state.wanted.add(case)
            name = callspec.params.get(DIALECT_FIXTURE)
            if isinstance(name, str):
                state.dialects[item.nodeid] = name


def _detail(report: pytest.TestReport) -> str:
    crash: Any = getattr(report.longrepr, "reprcrash", None)
    message = str(getattr(crash, "message", "") or "")
    if message:
        return message.removeprefix("Failed: ").removeprefix("AssertionError: ")
    return report.longreprtext


class _Reporter:
    """Collects suite outcomes by area and prints the summary."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        state = session(self.config)
        area = state.areas.get(report.nodeid)
        if area is None:
            return
        outcome = state.outcomes.setdefault(report.nodeid, Outcome(area, report.nodeid))
        if outcome.status == "failed":
            return
        if report.failed:
            outcome.status, outcome.detail = "failed", _detail(report)
        elif report.skipped:
            reason = _skip_reason(report)
            from ._requirements import CAPABILITY_SKIP_PREFIX

            if reason.startswith(CAPABILITY_SKIP_PREFIX):
                outcome.status = "capability"
                outcome.detail = reason.removeprefix(CAPABILITY_SKIP_PREFIX).strip()
            else:
                outcome.status, outcome.detail = "skipped", reason

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        state = session(self.config)
        if not state.outcomes:
            return
        from ._report import format_summary

        terminalreporter.section("pipedialect conformance summary")
        for line in format_summary(state):
            terminalreporter.write_line(line)


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)
