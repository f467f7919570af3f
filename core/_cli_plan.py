"""``pipedialect plan``: the planner (:mod:`pipedialect.planner`) on the command line.

``--model`` names one of the built-in test models (:mod:`pipedialect.models`: ``gpt``,
``skip``, ``mixed``, ``encdec``) or a ``module:function`` that returns ``(model,
example_inputs)``; the other options are :func:`~pipedialect.planner.plan_layout`'s. It prints
the chosen layout and the table of the others (``--json``: the same as JSON), and with
``--trace PATH`` writes the chosen layout's predicted step as a Chrome trace. The exit status
is 0 with a plan, 1 when no layout fits, 2 for a usage error. The planner is imported only when
the command runs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any

__all__ = ["add_plan_parser"]


def add_plan_parser(sub: Any) -> None:
    """Add the ``plan`` sub-command to the ``pipedialect`` command's sub-parsers."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "plan",
        help="choose the fastest layout that fits, before running anything",
        description="Measure a model once, predict the step time and peak memory of every "
        "layout the dialect offers (pipeline, data and tensor degrees, schedule, stages per "
        "rank, micro-batches, recomputation, split points) and print the fastest that fits, "
        "with the others and why they lose.",
    )
    parser.add_argument(
        "--model",
        required=True,
        help="a built-in model (gpt, skip, mixed, encdec) or MODULE:FUNCTION returning "
        "(model, example_inputs)",
    )
    parser.add_argument(
        "--batch-size", type=int, default=4, help="samples of the built-in model's example"
    )
    parser.add_argument("--world-size", type=int, required=True, help="ranks")
    parser.add_argument("--memory", required=True, help="memory per rank, e.g. 80GiB")
    parser.add_argument("--global-batch", type=int, required=True, help="samples per step")
    parser.add_argument(
        "--bandwidth",
        help="one link's bandwidth, e.g. 100GB/s (default: the stored calibration's)",
    )
    parser.add_argument(
        "--latency", type=float, help="seconds per message (default: calibrated, else 0)"
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="first measure what the dialect's runtime costs on this machine (per computation, "
        "per step, messages with every link busy, all-reduce, and what sharded data parallelism "
        "adds per FSDP unit and tensor parallelism per sharded module) on --calibrate-ranks "
        "local ranks and store it; plans use the stored calibration",
    )
    parser.add_argument("--calibrate-ranks", type=int, default=2, help="ranks to calibrate on")
    parser.add_argument("--dialect", default="torch", help="the dialect to plan for")
    time = parser.add_mutually_exclusive_group(required=True)
    time.add_argument(
        "--flops-per-second", type=float, help="sustained FLOP/s per rank (FLOPs become time)"
    )
    time.add_argument(
        "--measure-time", action="store_true", help="time the model on this machine instead"
    )
    parser.add_argument(
        "--recompute", action="append", metavar="PATTERN", help="recomputation to consider"
    )
    parser.add_argument("--top", type=int, default=10, help="rows of the table")
    parser.add_argument("--trace", metavar="PATH", help="write the predicted step (Chrome trace)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=_cmd_plan, parser=parser)


def _load(spec: str, batch_size: int) -> tuple[Any, dict[str, Any]]:
    from .models import MODELS

    if spec in MODELS:
        model_spec = MODELS[spec]
        inputs, _ = next(model_spec.micro_batches(1, batch_size=batch_size))
        values = inputs if isinstance(inputs, tuple) else (inputs,)
        return model_spec.build(), dict(zip(model_spec.input_names, values, strict=True))
    module_name, _, function = spec.partition(":")
    if not function:
        raise ValueError(
            f"--model {spec!r} is neither a built-in model ({', '.join(sorted(MODELS))}) nor "
            "MODULE:FUNCTION"
        )
    built = getattr(importlib.import_module(module_name), function)()
    model, example = built
    return model, dict(example)


def _cmd_plan(args: argparse.Namespace) -> int:
    from .errors import ConfigError, PipeDialectError
    from .planner import plan_layout

    try:
        model, example = _load(args.model, args.batch_size)
    except (ImportError, AttributeError, ValueError, TypeError) as exc:
        args.parser.error(f"cannot load --model {args.model!r}: {exc}")
    if args.calibrate:
        from .planner import calibrate, calibration_path

        try:
            done = calibrate(args.dialect, world_size=args.calibrate_ranks)
        except PipeDialectError as exc:
            args.parser.error(str(exc))
        print(f"{done.describe()}; stored in {calibration_path()}")
    try:
        plan = plan_layout(
            model,
            example,
            world_size=args.world_size,
            memory_per_rank=args.memory,
            global_batch=args.global_batch,
            bandwidth=args.bandwidth,
            latency=args.latency,
            dialect=args.dialect,
            recompute=args.recompute,
            measure_time=args.measure_time,
            flops_per_second=args.flops_per_second,
        )
    except ConfigError as exc:
        if str(exc).startswith("no layout"):
            print(f"pipedialect plan: {exc}", file=sys.stderr)
            return 1
        args.parser.error(str(exc))
    except PipeDialectError as exc:
        args.parser.error(str(exc))
    if args.trace:
        plan.write_chrome_trace(args.trace)
    if args.json:
        print(json.dumps(_as_json(plan, args.top), indent=2))
    else:
        print(plan.describe(top=args.top))
        if args.trace:
            print(f"predicted step written to {args.trace}")
    return 0


def _as_json(plan: Any, top: int) -> dict[str, Any]:
    def layout(row: Any) -> dict[str, Any]:
        lay, pred = row.layout, row.prediction
        out = {
            "layout": lay.describe(),
            "schedule": lay.schedule,
            "pipeline": lay.pipeline,
            "stages_per_rank": lay.stages_per_rank,
            "data_parallel": lay.data_parallel,
            "data_parallel_mode": lay.data_parallel_mode,
            "tensor_parallel": lay.tensor_parallel,
            "micro_batches": lay.micro_batches,
            "micro_batch_size": lay.micro_batch_size,
            "recompute": lay.recompute,
            "split_points": list(lay.split_points),
            "verdict": row.verdict,
        }
        if pred is not None:
            out["step_seconds"] = pred.step_time
            out["peak_memory_bytes"] = list(pred.peak_memory)
            out["bubble"] = pred.bubble
        return out

    rows = [r for r in plan.rows if r.prediction is not None][:top]
    return {
        "best": layout(rows[0]),
        "partition": plan.partition_kwargs(),
        "pipe_engine": plan.pipe_engine_kwargs(),
        "config": plan.config(),
        "rows": [layout(r) for r in rows],
        "notes": [*plan.offer.not_offered, *plan.notes],
    }
