"""The ``pipedialect`` command line.

- ``pipedialect list [--json]`` shows the installed dialects: name, version, distribution,
  capabilities and status (a broken plugin is listed with the reason it failed).
- ``pipedialect demo [--dialect D] [--stages N] [--dp N] [--steps N] [--meta] [--trace PATH]
  [--bf16] [--fsdp] [--tp N]`` trains a small GPT over pipeline stages and compares every
  step's loss with the unsplit model in one process.
- ``pipedialect plan --model M --world-size N --memory X --global-batch B --bandwidth Y ...``
  predicts every layout the dialect offers and prints the fastest that fits (see
  ``pipedialect.planner``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ._cli_check import add_check_parser
from ._cli_plan import add_plan_parser
from .plugins import DialectInfo, list_dialects

if TYPE_CHECKING:
    from .demo import DemoSettings

__all__ = ["demo_settings", "main"]


def _cmd_list(args: argparse.Namespace) -> int:
    infos = list_dialects()
    if args.json:
        print(json.dumps([i.as_dict() for i in infos], indent=2))
        return 0
    if not infos:
        print("no dialects installed")
        return 0
    print(_table(infos))
    for info in infos:
        if info.error:
            print(f"\n{info.name} ({info.status}): {info.error}")
    return 0


def _table(infos: Sequence[DialectInfo]) -> str:
    header = ("NAME", "VERSION", "DISTRIBUTION", "STATUS", "CAPABILITIES")
    rows = [
        (
            i.name,
            i.version or "-",
            i.distribution or "(in-process)",
            i.status,
            ", ".join(sorted(str(c) for c in i.capabilities)) or "-",
        )
        for i in infos
    ]
    widths = [max(len(r[c]) for r in (header, *rows)) for c in range(len(header) - 1)]
    lines = []
    for row in (header, *rows):
        cells = [cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=True)]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    return "\n".join(lines)


def demo_settings(args: argparse.Namespace) -> DemoSettings:
    """The demo's settings from its command line; ``--fsdp`` alone runs the torch dialect (the
    one that shards stages) over two replicas, and ``--tp N`` runs the torch dialect too."""
    from .demo import DemoSettings

    return DemoSettings(
        dialect=args.dialect or ("torch" if args.fsdp or args.tp > 1 else "deepspeed"),
        stages=args.stages,
        dp=args.dp if args.dp is not None else (2 if args.fsdp else 1),
        steps=args.steps,
        output=None if args.no_plot else args.output,
        cpu=args.cpu,
        meta=args.meta,
        trace=args.trace,
        bf16=args.bf16,
        fsdp=args.fsdp,
        tp=args.tp,
    )


def _failure_summary(message: str) -> str:
    """One line of a launch failure: which rank failed and the error it named, without the
    traceback or the log tail that follow it (the rank logs the CLI points to keep those).

    ``"rank 0 of 2 failed (exit code 1):"`` alone tells a user nothing: the named error on the
    next line (``ExtensionBuildError: ... Delete it (rm ...)``) is what says what to do.
    """
    kept: list[str] = []
    for line in message.strip().splitlines():
        if not line.strip() or line.startswith(("Traceback", "--- last ")):
            break
        kept.append(line.strip())
    return " ".join(kept) or "a rank failed"


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import DemoFailedError, check_settings, run_demo
    from .errors import ConfigError, DialectNotFoundError

    settings = demo_settings(args)
    try:
        check_settings(settings)
    except (ConfigError, DialectNotFoundError) as exc:
        args.parser.error(str(exc))  # usage, the message, exit status 2
    try:
        run_demo(settings)
    except DemoFailedError as exc:
        print(
            f"pipedialect demo failed: {_failure_summary(str(exc))}; every rank's log is kept in "
            f"{exc.log_dir}",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted: every process the demo started has been stopped", file=sys.stderr)
        return 130
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the ``pipedialect`` command."""
    parser = argparse.ArgumentParser(
        prog="pipedialect",
        description="Pipeline-parallel training of one partitioned model on several runtimes.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p_list = sub.add_parser("list", help="show the installed dialects and their capabilities")
    p_list.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p_list.set_defaults(func=_cmd_list)

    p_demo = sub.add_parser(
        "demo",
        help="train a small GPT over pipeline stages and compare with one process",
        description="Train a small GPT-style model (tied embedding and LM head) over pipeline "
        "stages in processes the demo starts, then compare every step's loss with the unsplit "
        "model trained in one process.",
    )
    p_demo.add_argument(
        "--dialect", default=None, help="dialect to train with (deepspeed; torch with --fsdp)"
    )
    p_demo.add_argument("--stages", type=int, default=2, help="pipeline stages (1-8)")
    p_demo.add_argument(
        "--dp", type=int, default=None, help="data-parallel replicas (1; 2 with --fsdp)"
    )
    p_demo.add_argument("--steps", type=int, default=30, help="training steps")
    p_demo.add_argument("--output", default="pipedialect-demo.png", help="loss-curve PNG to write")
    p_demo.add_argument("--no-plot", action="store_true", help="write no PNG")
    p_demo.add_argument("--cpu", action="store_true", help="use gloo on CPUs even with GPUs")
    p_demo.add_argument(
        "--meta", action="store_true", help="build the model on meta; ranks fill their stages"
    )
    p_demo.add_argument(
        "--trace",
        metavar="PATH",
        help="write the run's timeline as a Chrome trace JSON (and a PNG beside it)",
    )
    p_demo.add_argument(
        "--bf16", action="store_true", help="train in bf16 and show its curve beside fp32"
    )
    p_demo.add_argument(
        "--fsdp",
        action="store_true",
        help="shard each stage over the replicas (FSDP2; torch dialect, 2 replicas by default)",
    )
    p_demo.add_argument(
        "--tp",
        type=int,
        default=1,
        help="shard each stage's MLPs and vocabulary over N ranks (tensor parallel; torch)",
    )
    p_demo.set_defaults(func=_cmd_demo, parser=p_demo)
    add_check_parser(sub)
    add_plan_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    status: int = args.func(args)
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
