"""``--smoke``: every benchmark script's tiny run, so that ``make test`` notices when one breaks.

A smoke run checks that the script still runs end to end against the package as it is (a
renamed argument, a moved module, a changed return value), in seconds; its numbers mean
nothing. ``tests/project/test_benchmarks.py`` runs every script so.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

__all__ = ["parse_args"]


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
