"""Slapo's first pipeline test, through the seed's API on the real DeepSpeed PipelineEngine.

Two ranks (two stages) evaluate one batch of :class:`_slapo_workers.TwelveLinears`, whose
stages are wrapped with the seed's ``DeepSpeedPipeStageWrapper`` and path codec and built by the
seed's ``deepspeed_pipe_engine`` from the config Slapo's ``get_ds_config`` writes; the loss must be
the unsplit model's, computed here. The two keys Slapo's configs carry that DeepSpeed does not know
are accepted there and by ``init_ds_engine``; every other unknown key is still refused.
"""

from __future__ import annotations

import _slapo_workers as workers
import pytest
import torch
from _compare import ATOL, RTOL
from torch import nn

from pipedialect.dialects.deepspeed.engine import init_ds_engine
from pipedialect.dialects.deepspeed.pipeline import (
    SLAPO_CONFIG_KEYS,
    deepspeed_pipe_engine,
    without_slapo_keys,
)
from pipedialect.errors import UnknownConfigKeyError
from pipedialect.plan.partition import partition
from pipedialect.runtime.launch import launch


@pytest.mark.distributed
def test_slapos_first_pipeline_test_evaluates_like_the_unsplit_model() -> None:
    results = launch(workers.seed_api_eval, 2, timeout=300)
    inputs, labels = workers.batch()
    with torch.no_grad():
        expected = float(workers.loss_fn(workers.TwelveLinears()(inputs), labels))
    assert sorted(r["stage"] for r in results) == [0, 1]
    for r in results:
        assert r["codec"] == "PathCodec", r
        assert r["loss"] == pytest.approx(expected, rel=RTOL, abs=ATOL), r


def test_slapos_two_keys_are_left_out_and_nothing_else() -> None:
    config = workers.slapo_ds_config(8, 4)
    assert set(SLAPO_CONFIG_KEYS) == {("help",), ("pipeline", "sequence_parallel")}
    expected = {k: v for k, v in config.items() if k != "help"}
    expected["pipeline"] = {}
    assert without_slapo_keys(config) == expected
    assert config == workers.slapo_ds_config(8, 4)  # the caller's dicts are left as they were


@pytest.mark.parametrize(
    ("section", "key"),
    [("pipeline", "sequence_paralel"), (None, "helps"), (None, "wideresnet_config")],
)
def test_every_other_unknown_key_is_still_refused_by_the_seed_api(
    section: str | None, key: str
) -> None:
    config = workers.slapo_ds_config(4, 4)
    if section is None:
        config[key] = {}
    else:
        config[section] = {**config[section], key: True}
    path = [key] if section is None else [section, key]
    where = "".join(f"[{p!r}]" for p in path)
    plan = partition(workers.TwelveLinears(), [workers.SPLIT])
    with pytest.raises(UnknownConfigKeyError) as info:
        deepspeed_pipe_engine(
            plan, workers.seed_stages(plan), config=config, loss_fn=workers.loss_fn
        )
    assert list(info.value.path) == path
    assert where in str(info.value)
    with pytest.raises(UnknownConfigKeyError) as info:
        init_ds_engine(nn.Linear(1, 1), config=config)
    assert list(info.value.path) == path
