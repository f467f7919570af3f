"""The training recipe on the DeepSpeed dialect: ZeRO-1, parameter groups, initialize's arguments.

The multi-process tests train the tied gpt model (its embedding is the LM head: stage 0 holds
``wte.weight``, stage 1 the same weight as ``lm_head.weight``) with the real DeepSpeed
``PipelineEngine`` over gloo, and compare every step's loss and every final parameter, by its
name, with the unsplit model trained here by plain PyTorch on the same micro-batches (the
independent reference). The tolerance is the suite's fp32 one (``_compare``: 1e-6 relative):
the arithmetic is the same, only the order of fp32 sums differs (data-parallel gradients are
summed by an all-reduce and then divided, the reference divides each loss first; ZeRO-1 steps a
flat copy of the parameters instead of each tensor, which is the same element-wise Adam).

The refusals that need no process group run in this process.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import _model_registry
import _recipe_workers as workers
import pytest
import torch
from _compare import ATOL, RTOL, assert_tensor_close
from _reference import steps_from, train_unsplit
from torch import nn

import pipedialect
from pipedialect import ConfigError, partition
from pipedialect.dialect import option_descriptions
from pipedialect.models import get_model
from pipedialect.runtime.launch import launch

GAS, MICRO = 2, 2


def _exempt(name: str) -> bool:
    """Biases and the layer norms' weights: what ``no_weight_decay()`` exempts in gpt."""
    return name.endswith("bias") or name.split(".")[-2:-1] in (["ln1"], ["ln2"], ["ln_f"])


def reference(
    optimizer: str,
    steps: int,
    *,
    dp: int,
    groups: bool = False,
    batches: list[list[Any]] | None = None,
    clip: float = 0.0,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train the unsplit gpt model; return the losses and the parameters by every name.

    ``optimizer``: ``adam`` (torch's Adam) or ``adamw`` (DeepSpeed's "Adam" with weight decay
    is torch's AdamW); ``groups``: biases and norm weights without weight decay, chosen here by
    name, independently of ``no_weight_decay``. ``batches``: one list of micro-batches per
    data-parallel rank (default: ``_model_registry.data_stream``'s). ``clip``: the gradients'
    global norm (the tied weight counted once) clipped to it before each step.
    """
    spec = get_model("gpt")
    model = spec.build(0)
    named = list(model.named_parameters())  # the tied weight once
    params: Any = [p for _, p in named]
    if groups:
        params = [
            {"params": [p for n, p in named if not _exempt(n)]},
            {"params": [p for n, p in named if _exempt(n)], "weight_decay": 0.0},
        ]
    opt: torch.optim.Optimizer
    if optimizer == "adam":
        opt = torch.optim.Adam(params, lr=1e-2)
    else:
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if batches is None:
        batches = [
            list(_model_registry.data_stream(spec, steps * GAS, MICRO, r)) for r in range(dp)
        ]
    streams = [iter(b) for b in batches]
    tied_once = [p for _, p in named]
    steps_ = steps_from(streams, steps, GAS)
    trained = train_unsplit(model, opt, steps_, spec.loss_fn, clip=clip, clip_params=tied_once)
    return trained.losses, dict(model.named_parameters(remove_duplicate=False))


def assert_matches(results: list[dict[str, Any]], ref: Any) -> None:
    """Every rank's losses and parameters equal the reference's; every parameter is covered."""
    ref_losses, ref_params = ref
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, rel=RTOL, abs=ATOL), r["stage"]
        for name, value in r["params"].items():
            assert_tensor_close(value, ref_params[name].detach(), f"stage {r['stage']} {name}")
    assert set().union(*(r["params"] for r in results)) == set(ref_params)
    assert {r["stage"] for r in results} == {0, 1}
    # The tied weight is one weight again: stage 0's wte equals stage 1's lm_head.
    by_stage = {r["stage"]: r["params"] for r in results}
    assert torch.equal(by_stage[0]["wte.weight"], by_stage[1]["lm_head.weight"])
    untrained = get_model("gpt").build(0).state_dict()
    assert not torch.equal(untrained["wte.weight"], ref_params["wte.weight"].detach())


# -- ZeRO ---------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_zero1_with_a_tied_weight_and_dp2_matches_the_unsplit_model(clip: float) -> None:
    """With ``clip=0.05`` every step is clipped (the gradient norms are 0.5 to 1.6): ZeRO-1's
    norm is the global one, each stage's parameters and the tied weight once."""
    results = launch(workers.zero_run, 4, 2, 2, "adam", 3, zero_stage=1, clip=clip, timeout=600)
    assert sorted((r["stage"], r["dp_rank"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in results:
        assert r["optimizer"] == "DeepSpeedZeroOptimizer" and r["zero_stage"] == 1
        # Each data-parallel rank holds only its half of the stage's Adam state.
        assert r["exp_avg_numel"] * 2 == pytest.approx(r["local_numel"], abs=2)
    ref = reference("adam", 3, dp=2, clip=clip)
    assert_matches(results, ref)
    if clip:
        assert reference("adam", 3, dp=2)[0][-1] != pytest.approx(ref[0][-1], rel=1e-4)


def _zero_config(stage: int) -> dict[str, Any]:
    return workers.recipe_config("adam", gas=GAS, micro=MICRO, dp=1, zero_stage=stage)


@pytest.mark.parametrize("stage", [2, 3])
def test_zero2_and_zero3_are_refused_by_name_before_deepspeed_runs(stage: int) -> None:
    spec = get_model("gpt")
    plan = partition(spec.build(0), spec.split_points_for(2))
    dialect = pipedialect.get_dialect("deepspeed")
    # No process group here: DeepSpeed could not even start, so the refusal comes first.
    with pytest.raises(ConfigError, match=rf"zero_optimization\.stage={stage} is refused"):
        dialect.pipe_engine(
            plan,
            config=_zero_config(stage),
            loss_fn=spec.loss_fn,
            topology=dialect.make_topology(2, 1),
        )
    with pytest.raises(ConfigError, match=rf"zero_optimization\.stage={stage} is refused"):
        dialect.runtime_engine(nn.Linear(2, 2), config=_zero_config(stage))


@pytest.mark.parametrize("section", [{"stage": "2"}, {"stage": 5}, "yes"])
def test_a_zero_section_that_is_not_understood_is_refused(section: Any) -> None:
    config = {**_zero_config(0), "zero_optimization": section}
    with pytest.raises(ConfigError, match="zero_optimization"):
        pipedialect.get_dialect("deepspeed").runtime_engine(nn.Linear(2, 2), config=config)


# -- parameter groups ---------------------------------------------------------------------------


@pytest.mark.distributed
def test_param_groups_with_a_tie_match_the_unsplit_model_with_the_same_groups() -> None:
    results = launch(workers.zero_run, 2, 2, 1, "adamw", 4, groups=True, timeout=600)
    ref = reference("adamw", 4, dp=1, groups=True)
    assert_matches(results, ref)
    for r in results:
        for name, decay in r["groups"].items():
            # Every parameter in exactly one group; the tied weight decayed on both stages.
            assert decay == (0.0 if _exempt(name) else 0.1), (r["stage"], name)
    # The groups change the numbers: without them every parameter decays.
    plain = reference("adamw", 4, dp=1)[0]
    assert plain[-1] != pytest.approx(ref[0][-1], rel=1e-4)


@pytest.mark.distributed
def test_param_groups_with_zero1_and_dp2_match_the_unsplit_model() -> None:
    results = launch(workers.zero_run, 4, 2, 2, "adamw", 3, zero_stage=1, groups=True, timeout=600)
    assert all(r["optimizer"] == "DeepSpeedZeroOptimizer" for r in results)
    assert_matches(results, reference("adamw", 3, dp=2, groups=True))


@pytest.mark.distributed
def test_grouping_mistakes_are_named_on_every_rank() -> None:
    """A tied weight whose stages group it differently, model_parameters that leave out a
    parameter or hold another stage's, and a client optimizer that leaves one out: each a
    ConfigError on both ranks, before DeepSpeed."""
    results = launch(workers.grouping_errors, 2, timeout=600)
    assert results[0]["tie"] == results[1]["tie"]
    tie = results[0]["tie"]
    assert tie.startswith("ConfigError:") and "'wte.weight' on stage 0" in tie
    assert "'lm_head.weight' on stage 1" in tie
    for rank, r in enumerate(results):
        assert r["missing"].startswith("ConfigError:") and "in no group" in r["missing"]
        assert f"[Stage {rank}] model_parameters" in r["missing"]
        assert "does not train" in r["foreign"] and "of another stage" in r["foreign"]
        assert f"[Stage {rank}] the client optimizer does not hold parameter" in r["optimizer"]
        assert r["after"] == "trained"  # the failed builds left the process group usable


# -- deepspeed.initialize's arguments -----------------------------------------------------------


def _config() -> dict[str, Any]:
    return _model_registry.ds_config("adam", gas=GAS, micro=MICRO, dp=1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mpu": object()}, r"refuses mpu: a PipelineModule brings its own process grid"),
        ({"distributed_port": 29500}, r"refuses distributed_port: .*MASTER_PORT"),
        ({"mesh_param": (2, 1)}, r"refuses mesh_param: .*device mesh"),
        ({"config_params": {"train_batch_size": 4}}, r"given twice \(config and config_params\)"),
        (
            {"args": SimpleNamespace(deepspeed_config="ds.json")},
            r"given twice \(config and args\.deepspeed_config\)",
        ),
        ({"args": SimpleNamespace(local_rank="0")}, r"args\.local_rank must be an int"),
        (
            {
                "param_groups": lambda named: [{"params": [p for _, p in named]}],
                "model_parameters": [],
            },
            r"param_groups or model_parameters, not both",
        ),
        (
            {
                "param_groups": lambda named: [],
                "optimizer": torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1),
            },
            r"param_groups cannot be used with an optimizer object",
        ),
        ({"not_an_argument": 1}, r"unknown argument 'not_an_argument'"),
    ],
)
def test_initialize_arguments_a_pipeline_cannot_take_are_refused_by_name(
    kwargs: dict[str, Any], match: str
) -> None:
    dialect = pipedialect.get_dialect("deepspeed")
    with pytest.raises(ConfigError, match=match):
        dialect.runtime_engine(nn.Linear(2, 2), config=_config(), **kwargs)


def test_args_local_rank_must_match_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ConfigError, match=r"args\.local_rank=0 but the launcher set LOCAL_RANK=1"):
        pipedialect.get_dialect("deepspeed").runtime_engine(
            nn.Linear(2, 2), config=_config(), args=SimpleNamespace(local_rank=0)
        )


def test_the_config_may_come_from_config_params_or_args(tmp_path: Path) -> None:
    """Read from either source, and checked (ZeRO-2 refused) before the module is looked at."""
    dialect = pipedialect.get_dialect("deepspeed")
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_zero_config(2)))
    for kwargs in (
        {"config_params": str(path)},
        {"args": SimpleNamespace(deepspeed_config=str(path))},
    ):
        with pytest.raises(ConfigError, match=r"zero_optimization\.stage=2 is refused"):
            dialect.runtime_engine(nn.Linear(2, 2), **kwargs)
    # With a valid config the next check is the module's.
    path.write_text(json.dumps(_config()))
    with pytest.raises(ConfigError, match="needs the PipelineModule built by pipe_engine"):
        dialect.runtime_engine(nn.Linear(2, 2), args=SimpleNamespace(deepspeed_config=str(path)))
    with pytest.raises(ConfigError, match="needs config="):
        dialect.runtime_engine(nn.Linear(2, 2), args=SimpleNamespace(local_rank=-1))


def test_every_engine_option_is_documented_and_the_refused_ones_say_so() -> None:
    from pipedialect.dialects.deepspeed._plugin import DeepSpeedEngineOptions
    from pipedialect.dialects.deepspeed.engine import (
        PASSED_INITIALIZE_ARGS,
        REFUSED_INITIALIZE_ARGS,
    )

    docs = {d["name"]: d["doc"] for d in option_descriptions(DeepSpeedEngineOptions)}
    assert all(docs.values()), docs
    for name in set(REFUSED_INITIALIZE_ARGS) - {"model"}:
        assert docs[name].startswith("refused:"), name
    shared = {"lr_scheduler", "optimizer"}  # shared runtime_engine arguments, passed on
    passed = set(PASSED_INITIALIZE_ARGS) - shared
    for name in (*passed, "args", "config_params", "model_parameters"):
        assert not docs[name].startswith("refused"), name
    assert {"param_groups", *shared} <= pipedialect.get_dialect("deepspeed").engine_features


@pytest.mark.distributed
def test_training_data_through_collate_fn_matches_the_unsplit_model() -> None:
    """No iterator given to train_batch: DeepSpeed's loader reads training_data in order, each
    micro-batch made by the collate_fn."""
    results = launch(workers.training_data_run, 2, 3, timeout=600)
    batches = workers.lm_batches(3 * GAS, MICRO, seed=5)
    assert_matches(results, reference("adam", 3, dp=1, batches=[batches]))
