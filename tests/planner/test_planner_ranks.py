"""Planning under ``torch.distributed``: on every rank by default, one rank alone refused by
name or, asked for, planned locally."""

from __future__ import annotations

import _planner_workers as workers
import pytest

from pipedialect.runtime.launch import launch


@pytest.mark.distributed
def test_every_rank_plans_and_one_rank_alone_is_refused_by_name() -> None:
    results = launch(workers.planning_ranks, 2, timeout=600)
    # Every rank takes rank 0's measurement: the same layout and split points everywhere.
    assert results[0]["every"] == results[1]["every"]
    # Rank 0 alone: a named refusal naming rank 1, not a hang in the broadcast.
    name, field, ranks, message = results[0]["alone"]
    assert (name, field, ranks) == ("PlanDisagreementError", "measurement", (1,))
    assert "every_rank=False" in message
    # every_rank=False: a plan from this rank's own measurement, no collective.
    assert isinstance(results[0]["local"][0], str) and results[0]["local"][0]
