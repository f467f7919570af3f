"""Slapo's first pipeline test, through the seed's API on the real DeepSpeed PipelineEngine.

Two ranks (two stages) evaluate one batch of :class:`_slapo_workers.TwelveLinears`, whose
stages are wrapped with the seed's ``DeepSpeedPipeStageWrapper`` and path codec and built by the
seed's ``deepspeed_pipe_engine``; the loss must be the unsplit model's, computed here.
"""

from __future__ import annotations

import _slapo_workers as workers
import pytest
import torch
from _compare import ATOL, RTOL

from pipedialect.runtime.launch import launch

pytestmark = pytest.mark.distributed


def test_slapos_first_pipeline_test_evaluates_like_the_unsplit_model() -> None:
    results = launch(workers.seed_api_eval, 2, timeout=300)
    inputs, labels = workers.batch()
    with torch.no_grad():
        expected = float(workers.loss_fn(workers.TwelveLinears()(inputs), labels))
    assert sorted(r["stage"] for r in results) == [0, 1]
    for r in results:
        assert r["codec"] == "PathCodec", r
        assert r["loss"] == pytest.approx(expected, rel=RTOL, abs=ATOL), r
