"""What each rank runs in the planner's multi-process tests (tests/planner/)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import pipedialect
from pipedialect import PlanDisagreementError
from pipedialect.cost import _profile
from pipedialect.planner import plan_layout


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)) for _ in range(4))
    )


def _plan(**kwargs: Any) -> tuple[str, tuple[str, ...]]:
    plan = plan_layout(
        _model(),
        {"input": torch.randn(4, 16)},
        world_size=2,
        memory_per_rank="1GiB",
        global_batch=8,
        bandwidth="1GB/s",
        dialect="torch",
        measure_time=True,
        repeats=2,
        **kwargs,
    )
    return plan.layout.describe(), plan.layout.split_points


def planning_ranks() -> dict[str, Any]:
    """Every rank plans (the default); rank 0 alone plans (refused by name after a short
    wait, not a hang); rank 0 alone plans with ``every_rank=False`` (works)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    pipedialect.get_dialect("torch").init_distributed()
    rank = dist.get_rank()
    out: dict[str, Any] = {"every": _plan()}
    dist.barrier()
    _profile.ARRIVAL_TIMEOUT = 5.0
    if rank == 0:
        try:
            _plan()
        except PlanDisagreementError as error:
            out["alone"] = (type(error).__name__, error.field, error.ranks, str(error))
        out["local"] = _plan(every_rank=False)
    dist.barrier()
    return out
