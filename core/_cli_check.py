"""``pipedialect check NAME...``: run the conformance suite against installed dialects.

It runs pytest in this process on ``--pyargs pipedialect.testing.suite`` with ``--dialect NAME``
for each name and the suite's plugin loaded (``-p pipedialect.testing.plugin``: the plugin is
opt-in, pytest never loads it by itself), under a neutral configuration (an empty ini file in a
temporary directory, no cache), so the result does not depend on the directory it is run from.
pytest's output ends with the suite's per-area summary. The exit status is 0 when every test
passed or was skipped by capability, 1 when one failed, 2 for a usage error or an unknown
dialect, 5 when ``-k`` selected nothing.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["add_check_parser", "run_check"]

_SUITE = "pipedialect.testing.suite"


def add_check_parser(sub: Any) -> None:
    """Add the ``check`` sub-command to the ``pipedialect`` command's sub-parsers."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "check",
        help="run the conformance suite against installed dialects",
        description="Run pipedialect's conformance suite against each dialect named and print "
        "a summary per contract area (registration, codec, stages, ties, training, "
        "portability, tracing, errors). "
        "Exits non-zero when a test fails.",
    )
    parser.add_argument("names", nargs="+", metavar="NAME", help="installed dialect to check")
    parser.add_argument(
        "-o",
        "--dialect-option",
        action="append",
        default=[],
        metavar="[DIALECT:][runtime.]KEY=VALUE",
        help="extra keyword argument for pipe_engine (runtime_engine with 'runtime.'); VALUE "
        "is a Python literal or a string; may be repeated",
    )
    parser.add_argument("-k", metavar="EXPRESSION", help="only tests matching (as pytest -k)")
    parser.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first failure")
    parser.add_argument("-v", "--verbose", action="store_true", help="list every test")
    parser.add_argument(
        "--timeout",
        type=float,
        default=180.0,
        metavar="SECONDS",
        help="fail a case that makes no progress for this long, in this process or in a "
        "multi-process launch (default 180)",
    )
    parser.add_argument(
        "--pytest-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="pass ARG to pytest as it is (may be repeated)",
    )
    parser.set_defaults(func=run_check)


def _suite_dir() -> str:
    """The suite package's directory (found without importing the suite's modules)."""
    import importlib.util

    spec = importlib.util.find_spec(_SUITE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"cannot find {_SUITE}; is pipedialect installed completely?")
    return str(next(iter(spec.submodule_search_locations)))


def _pytest_args(args: argparse.Namespace, ini: Path) -> list[str]:
    argv = [
        "--pyargs",
        _SUITE,
        "-c",
        str(ini),
        "--rootdir",
        _suite_dir(),
        "-p",
        "pipedialect.testing.plugin",
        "-p",
        "no:cacheprovider",
        "--tb=short",
        "-W",
        "ignore::DeprecationWarning",
        "-W",
        "ignore::pytest.PytestAssertRewriteWarning",
        "-v" if args.verbose else "-q",
        "-rN",  # the suite's summary lists the failures
        "--conformance-timeout",
        str(args.timeout),
    ]
    for name in args.names:
        argv += ["--dialect", name]
    for option in args.dialect_option:
        argv += ["--dialect-option", option]
    if args.k:
        argv += ["-k", args.k]
    if args.exitfirst:
        argv.append("-x")
    return argv + list(args.pytest_arg)


def run_check(args: argparse.Namespace) -> int:
    """Run the suite as ``args`` asks; return the exit status."""
    from .errors import ConfigError, PluginError
    from .plugins import get_dialect
    from .testing._options import parse_dialect_options

    try:
        for name in args.names:
            get_dialect(name)
            parse_dialect_options(args.dialect_option, name)
    except (PluginError, ConfigError) as exc:
        print(f"pipedialect check: {exc}", file=sys.stderr)
        return 2
    import pytest

    with tempfile.TemporaryDirectory(prefix="pipedialect-check-") as tmp:
        ini = Path(tmp) / "pytest.ini"
        ini.write_text("[pytest]\naddopts =\n")
        code = int(pytest.main(_pytest_args(args, ini)))
    if code in (pytest.ExitCode.USAGE_ERROR, pytest.ExitCode.INTERRUPTED):
        return 2
    if code == pytest.ExitCode.NO_TESTS_COLLECTED:
        return 5
    return 0 if code == pytest.ExitCode.OK else 1
