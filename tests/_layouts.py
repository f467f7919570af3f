"""Planner layouts for the cost-model and planner tests that need no process."""

from __future__ import annotations

from typing import Any

from pipedialect.cost import Layout

#: One stage on one rank, GPipe, one micro-batch of one sample, no parallelism, no
#: recomputation: what a test overrides.
ONE_STAGE: dict[str, Any] = {
    "dialect": "torch",
    "schedule": "gpipe",
    "pipeline": 1,
    "stages_per_rank": 1,
    "data_parallel": 1,
    "data_parallel_mode": "ddp",
    "tensor_parallel": 1,
    "micro_batches": 1,
    "micro_batch_size": 1,
    "recompute": None,
}


def one_stage_layout(**overrides: Any) -> Layout:
    """:data:`ONE_STAGE` with ``overrides``."""
    return Layout(**{**ONE_STAGE, **overrides})
