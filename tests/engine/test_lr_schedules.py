"""Learning-rate schedules: every dialect's rate at every step equals DeepSpeed's.

The reference is DeepSpeed's own schedule classes (``deepspeed.runtime.lr_schedules``) stepped
on a separate optimizer, and the unsplit model trained by hand with that class stepped after
each optimizer step, as DeepSpeed's engine steps it.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import _lr_workers
import _model_registry
import pytest
import torch
from _compare import ATOL, RTOL
from _reference import steps_from, train_unsplit

import pipedialect
from pipedialect import ConfigError, partition
from pipedialect.engine.lr_schedules import SCHEDULES, build_schedule
from pipedialect.runtime.launch import launch

ds_lr = pytest.importorskip("deepspeed.runtime.lr_schedules")

STEPS = 7

#: (type, params): log and linear warm-ups, decays, stairs, per-group lists, momentum cycling.
CASES: list[tuple[str, dict[str, Any]]] = [
    ("WarmupLR", {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 3}),
    ("WarmupLR", {"warmup_num_steps": 4, "warmup_type": "linear"}),
    ("WarmupLR", {"warmup_max_lr": [0.01, 0.02], "warmup_num_steps": 1}),
    (
        "WarmupDecayLR",
        {
            "total_num_steps": 6,
            "warmup_max_lr": 0.02,
            "warmup_num_steps": 2,
            "warmup_type": "linear",
        },
    ),
    ("WarmupDecayLR", {"total_num_steps": 5, "warmup_min_lr": 0.03, "warmup_num_steps": 3}),
    (
        "WarmupCosineLR",
        {
            "total_num_steps": 6,
            "warmup_num_steps": 2,
            "warmup_min_ratio": 0.1,
            "cos_min_ratio": 0.05,
        },
    ),
    ("WarmupCosineLR", {"total_num_steps": 9, "warmup_num_steps": 3, "warmup_type": "linear"}),
    (
        "OneCycle",
        {
            "cycle_min_lr": 0.001,
            "cycle_max_lr": 0.01,
            "cycle_first_step_size": 2,
            "cycle_second_step_size": 3,
            "decay_lr_rate": 0.5,
            "decay_step_size": 2,
            "cycle_min_mom": 0.85,
            "cycle_max_mom": 0.95,
            "decay_mom_rate": 0.1,
        },
    ),
    (
        "OneCycle",
        {
            "cycle_min_lr": [0.001, 0.002],
            "cycle_max_lr": 0.01,
            "cycle_first_step_size": 4,
            "cycle_first_stair_count": 2,
        },
    ),
]

IDS = [f"{name}-{i}" for i, (name, _) in enumerate(CASES)]


def _groups(optimizer: torch.optim.Optimizer) -> list[tuple[float, Any]]:
    return [(group["lr"], group.get("betas")) for group in optimizer.param_groups]


def _two_group_adam() -> torch.optim.Optimizer:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    return torch.optim.Adam([{"params": [a]}, {"params": [b], "lr": 0.005}], lr=1e-2)


@pytest.mark.parametrize(("name", "params"), CASES, ids=IDS)
def test_each_schedule_sets_deepspeeds_rate_and_betas_at_every_step(
    name: str, params: dict[str, Any]
) -> None:
    ours_opt, theirs_opt = _two_group_adam(), _two_group_adam()
    ours = build_schedule({"type": name, "params": params}, ours_opt)
    theirs = getattr(ds_lr, name)(theirs_opt, **params)
    assert _groups(ours_opt) == _groups(theirs_opt)  # the rate of the first step
    seen = set()
    for _ in range(3 * STEPS):
        ours.step()
        theirs.step()
        assert _groups(ours_opt) == _groups(theirs_opt)
        assert ours.get_last_lr() == theirs.get_last_lr()
        seen.add(ours_opt.param_groups[0]["lr"])
    assert len(seen) >= 2  # the case does change the rate
    assert ours.state_dict() == theirs.state_dict()


def test_the_four_schedules_are_implemented_and_others_refused_by_name() -> None:
    assert sorted(SCHEDULES) == ["OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]
    config = _lr_workers.config_for({"type": "LRRangeTest", "params": {}})
    with pytest.raises(ConfigError, match="LRRangeTest"):
        pipedialect.get_dialect("local").runtime_engine(_local_module(config), config=config)
    bad = _lr_workers.config_for({"type": "WarmupLR", "params": {"warmup_num_steps": 0}})
    with pytest.raises(ConfigError, match="warmup_num_steps"):
        pipedialect.get_dialect("local").runtime_engine(_local_module(bad), config=bad)
    typo = _lr_workers.config_for({"type": "WarmupLR", "params": {"warmup_steps": 3}})
    with pytest.raises(ConfigError, match=r"WarmupLR.*warmup_steps"):
        pipedialect.get_dialect("local").runtime_engine(_local_module(typo), config=typo)


def _local_module(config: dict[str, Any]) -> Any:
    spec = _model_registry.spec_for(_lr_workers.MODEL)
    plan = partition(spec.build(0), spec.split_points_for(2))
    return pipedialect.get_dialect("local").pipe_engine(plan, config=config, loss_fn=spec.loss_fn)


def reference(section: dict[str, Any] | None, steps: int, client: Any = None) -> dict[str, Any]:
    """The unsplit model, plain Adam, DeepSpeed's schedule class (or ``client(optimizer)``)
    stepped after each optimizer step; the rates before each step and after the last."""
    spec = _model_registry.spec_for(_lr_workers.MODEL)
    model = spec.build(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    if client is not None:
        schedule = client(optimizer)
    else:
        assert section is not None
        schedule = getattr(ds_lr, section["type"])(optimizer, **section["params"])
    data = _model_registry.data_stream(spec, steps * _lr_workers.GAS, _lr_workers.MICRO, 0)
    lrs = [[g["lr"] for g in optimizer.param_groups]]

    def step_schedule() -> None:
        schedule.step()
        lrs.append([g["lr"] for g in optimizer.param_groups])

    batches = steps_from([data], steps, _lr_workers.GAS)
    trained = train_unsplit(model, optimizer, batches, spec.loss_fn, after_step=step_schedule)
    return {"lrs": lrs, "losses": trained.losses}


def _local_run(config: dict[str, Any], steps: int, **kwargs: Any) -> dict[str, Any]:
    engine = pipedialect.get_dialect("local").runtime_engine(
        _local_module(config), config=config, **kwargs
    )
    spec = _model_registry.spec_for(_lr_workers.MODEL)
    data = _model_registry.data_stream(spec, steps * _lr_workers.GAS, _lr_workers.MICRO, 0)
    lrs, losses = [], []
    for _ in range(steps):
        lrs.append(engine.get_lr())
        losses.append(float(engine.train_batch(data)))
    lrs.append(engine.get_lr())
    return {"lrs": lrs, "losses": losses}


def _assert_run_matches(run: dict[str, Any], ref: dict[str, Any]) -> None:
    assert run["lrs"] == ref["lrs"]
    assert run["losses"] == pytest.approx(ref["losses"], rel=RTOL, abs=ATOL)


ENGINE_CASES = [CASES[0], CASES[3], CASES[5], CASES[7]]
ENGINE_SECTIONS = [{"type": name, "params": params} for name, params in ENGINE_CASES]


@pytest.mark.parametrize("section", ENGINE_SECTIONS, ids=[s["type"] for s in ENGINE_SECTIONS])
def test_local_engine_steps_the_config_schedule_as_deepspeed(section: dict[str, Any]) -> None:
    _assert_run_matches(
        _local_run(_lr_workers.config_for(section), STEPS), reference(section, STEPS)
    )


def test_client_lr_scheduler_callable_wins_over_the_config_section() -> None:
    def client(optimizer: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))

    config = _lr_workers.config_for(ENGINE_SECTIONS[0])
    _assert_run_matches(
        _local_run(config, 4, lr_scheduler=client), reference(None, 4, client=client)
    )
    with pytest.raises(ConfigError, match="step"):
        _local_run(config, 1, lr_scheduler=lambda optimizer: object())


def test_local_checkpoint_resumes_the_schedule(tmp_path: Path) -> None:
    section = ENGINE_SECTIONS[3]
    config = _lr_workers.config_for(section)
    local = pipedialect.get_dialect("local")
    spec = _model_registry.spec_for(_lr_workers.MODEL)
    module = _local_module(config)
    fresh = copy.deepcopy(module)
    first = local.runtime_engine(module, config=config)
    data = _model_registry.data_stream(spec, 5 * _lr_workers.GAS, _lr_workers.MICRO, 0)
    for _ in range(3):
        first.train_batch(data)
    first.save_checkpoint(tmp_path)
    second = local.runtime_engine(fresh, config=config)
    second.load_checkpoint(tmp_path)
    lrs = [second.get_lr()]
    for _ in range(2):
        second.train_batch(data)
        lrs.append(second.get_lr())
    assert lrs == reference(section, 5)["lrs"][3:]


@pytest.mark.distributed
@pytest.mark.parametrize("dialect_name", ["torch", "deepspeed"])
def test_pipeline_engines_get_lr_per_step_equals_deepspeeds(dialect_name: str) -> None:
    sections = ENGINE_SECTIONS[1:] if dialect_name == "torch" else ENGINE_SECTIONS[3:]
    results = launch(_lr_workers.lr_run, 2, dialect_name, sections, STEPS, timeout=600)
    for section, *per_rank in zip(sections, *results, strict=True):
        ref = reference(section, STEPS)
        for run in per_rank:
            _assert_run_matches(run, ref)
