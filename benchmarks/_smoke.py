"""``--smoke``: every benchmark script's tiny run, so that ``make test`` notices when one breaks.

A smoke run checks that the script still runs end to end against the package as it is (a
renamed argument, a moved module, a changed return value), in seconds; its numbers mean
nothing. ``tests/project/test_benchmarks.py`` runs every script so, all of them in one process
(``python benchmarks/_smoke.py --report FILE SCRIPT...``, :func:`run_smokes`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["parse_args", "run_smokes"]


def parse_args(
    parser: argparse.ArgumentParser, small: dict[str, Any], argv: Sequence[str] | None = None
) -> argparse.Namespace:
    """Parse ``argv`` with ``--smoke`` added: given, the defaults become ``small`` (arguments
    written on the command line still win)."""
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes that check the script runs (seconds); the numbers mean nothing",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**small)
        args = parser.parse_args(argv)
    return args


def run_smokes(scripts: Sequence[str], report: Path) -> None:
    """Run every script's smoke mode in turn in this one process, writing to ``report`` (JSON,
    by script name) whether each passed, how long it took and the end of what it printed.

    One process for all of them: a script's own interpreter would import torch, pipedialect
    and DeepSpeed again and start a fork server of its own for its ranks
    (``pipedialect.runtime.launch``), seconds of CPU each, where here the first script's fork
    server serves every later launch. Each script still runs from its ``main()`` with its
    ``--smoke`` command line, so a change that breaks one fails it, by name. The report is
    rewritten before and after each script, so a run killed in the middle still says which
    script it was in.
    """
    results: dict[str, dict[str, Any]] = {}
    for script in scripts:
        results[script] = {"ok": False, "seconds": 0.0, "output": "(still running: killed?)"}
        report.write_text(json.dumps(results))
        out = io.StringIO()
        argv, environ = list(sys.argv), dict(os.environ)
        start = time.perf_counter()
        ok = False
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                sys.argv = [str(Path(__file__).with_name(script)), "--smoke"]
                importlib.import_module(Path(script).stem).main()
            ok = True
        except SystemExit as exc:  # a script's own verdict: sys.exit("what went wrong")
            ok = exc.code in (None, 0)
            out.write(f"SystemExit: {exc.code}\n")
        except Exception:
            out.write(traceback.format_exc())
        finally:
            sys.argv = argv
            os.environ.clear()
            os.environ.update(environ)
        results[script] = {
            "ok": ok,
            "seconds": round(time.perf_counter() - start, 2),
            "output": out.getvalue()[-6000:],
        }
        report.write_text(json.dumps(results))
        print(f"{script}: {'passed' if ok else 'FAILED'} in {results[script]['seconds']} s")


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(description="run benchmark scripts' smoke modes in turn")
    _parser.add_argument("--report", type=Path, required=True, help="where to write the JSON")
    _parser.add_argument("scripts", nargs="+", help="script file names in benchmarks/")
    _args = _parser.parse_args()
    run_smokes(_args.scripts, _args.report)
