"""Your own optimizer and LR scheduler on every dialect: ``runtime_engine(optimizer=...,
lr_scheduler=...)``, and the global gradient norm of every step.

The reference is the unsplit model trained by hand in this process with the same optimizer
(torch's AdamW over the same no-weight-decay groups, chosen by name), transformers'
``get_cosine_schedule_with_warmup`` stepped after each optimizer step, and
``torch.nn.utils.clip_grad_norm_`` (whose return value is the norm the engine must report, with
or without clipping). Losses, learning rates, norms and every parameter must agree.
"""

from __future__ import annotations

import math
from typing import Any

import _model_registry
import _trainer_workers as workers
import pytest
import torch
from _compare import ATOL, RTOL, assert_tensor_close
from _reference import steps_from, train_unsplit

import pipedialect
from pipedialect import ConfigError, partition
from pipedialect.engine.param_groups import no_weight_decay


def reference(clip: float) -> dict[str, Any]:
    """The unsplit model, the same optimizer, schedule and clipping, by hand."""
    spec = _model_registry.spec_for(workers.MODEL)
    model = spec.build(0)
    named = list(model.named_parameters())  # the tied weight once, as the engines name it
    optimizer = workers.make_optimizer(no_weight_decay()(named))
    schedule = workers.make_schedule(optimizer)
    data = _model_registry.data_stream(spec, workers.STEPS * workers.GAS, workers.MICRO, 0)
    lrs = [[g["lr"] for g in optimizer.param_groups]]

    def step_schedule() -> None:
        schedule.step()
        lrs.append([g["lr"] for g in optimizer.param_groups])

    trained = train_unsplit(
        model,
        optimizer,
        steps_from([data], workers.STEPS, workers.GAS),
        spec.loss_fn,
        clip=clip if clip > 0 else math.inf,  # the norm of every step, clipped or not
        clip_params=[p for _, p in named],
        after_step=step_schedule,
    )
    return {
        "losses": trained.losses,
        "lrs": lrs[:-1],  # the rate before each step
        "norms": trained.norms,
        "params": dict(model.named_parameters(remove_duplicate=False)),
    }


def assert_matches(run: dict[str, Any], ref: dict[str, Any]) -> None:
    assert run["losses"] == pytest.approx(ref["losses"], rel=RTOL, abs=ATOL)
    # The rates follow the schedule exactly: 0 at the first step (warm-up), then up and down.
    assert [lrs[0] for lrs in run["lrs"]] == pytest.approx([lrs[0] for lrs in ref["lrs"]])
    assert all(len(set(lrs)) == 1 for lrs in run["lrs"])  # one schedule drives every group
    assert run["norms"] == pytest.approx(ref["norms"], rel=RTOL)
    assert run["params"], "no parameter compared"
    for name, value in run["params"].items():
        assert_tensor_close(value, ref["params"][name].detach(), name)
    initial = dict(_model_registry.spec_for(workers.MODEL).build(0).named_parameters())
    assert any(not torch.equal(v, initial[n]) for n, v in run["params"].items() if n in initial)


def _local_run(clip: float) -> dict[str, Any]:
    plan, engine, dialect = workers.engine_for("local", clip)
    spec = _model_registry.spec_for(workers.MODEL)
    data = _model_registry.data_stream(spec, workers.STEPS * workers.GAS, workers.MICRO, 0)
    losses, lrs, norms = [], [], []
    for _ in range(workers.STEPS):
        lrs.append(engine.get_lr())
        losses.append(float(engine.train_batch(data)))
        norms.append(engine.get_global_grad_norm())
    params: dict[str, torch.Tensor] = {}
    for stage in dialect.local_stages(engine):
        params.update(_model_registry.local_params(plan, stage))
    assert isinstance(engine.optimizer, torch.optim.AdamW)
    return {"losses": losses, "lrs": lrs, "norms": norms, "params": params}


@pytest.mark.parametrize("clip", [0.0, 0.05], ids=["no-clipping", "clipping"])
def test_local_trains_with_a_client_adamw_and_cosine_schedule_as_the_unsplit_model(
    clip: float,
) -> None:
    ref = reference(clip)
    if clip > 0:  # the clipping case clips: the norms exceed the limit
        assert min(ref["norms"]) > clip
    assert_matches(_local_run(clip), ref)


@pytest.mark.distributed
@pytest.mark.parametrize("dialect_name", ["torch", "deepspeed"])
def test_pipeline_dialects_train_with_a_client_adamw_and_cosine_schedule(
    dialect_name: str,
) -> None:
    from pipedialect.runtime.launch import launch

    for clip in (0.0, 0.05):
        ref = reference(clip)
        results = launch(workers.train, 2, dialect_name, clip, timeout=600)
        for run in results:
            assert run["optimizer"] == "AdamW"
            assert run["optimizer_state_steps"] == [workers.STEPS]
            assert_matches(run, ref)


# -- the factory's arguments, and what is refused ---------------------------------------------


def _module(config: dict[str, Any] | None = None) -> tuple[Any, Any]:
    spec = _model_registry.spec_for(workers.MODEL)
    plan = partition(spec.build(0), spec.split_points_for(2))
    dialect = pipedialect.get_dialect("local")
    return plan, dialect.pipe_engine(
        plan, config=config or workers.config(0.0), loss_fn=spec.loss_fn
    )


def test_the_factory_gets_the_engines_groups_and_under_bf16_the_fp32_masters() -> None:
    seen: list[list[dict[str, Any]]] = []

    def factory(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        seen.append(groups)
        return torch.optim.SGD(groups, lr=0.1)

    _plan, module = _module()
    local = pipedialect.get_dialect("local")
    engine = local.runtime_engine(module, optimizer=factory)
    trainable = [p for p in module.parameters() if p.requires_grad]
    # Without param_groups: one group holding every trainable parameter once (the tie once).
    assert len(seen[-1]) == 1 and {id(p) for p in seen[-1][0]["params"]} == {
        id(p) for p in trainable
    }
    assert len(seen[-1][0]["params"]) == len(trainable)
    assert engine.optimizer is not None and engine.get_global_grad_norm() is None

    bf16 = {**workers.config(0.0), "bf16": {"enabled": True}}
    _plan, module = _module(bf16)
    engine = local.runtime_engine(
        module, config=bf16, param_groups=no_weight_decay(), optimizer=factory
    )
    masters = {id(m) for m in engine.mixed.masters}
    given = [p for group in seen[-1] for p in group["params"]]
    assert len(seen[-1]) == 2 and seen[-1][1]["weight_decay"] == 0.0  # no_weight_decay's
    assert {p.dtype for p in given} == {torch.float32}
    assert {id(p) for p in given} == masters
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    spec = _model_registry.spec_for(workers.MODEL)
    engine.train_batch(_model_registry.data_stream(spec, workers.GAS, workers.MICRO, 0))
    norm = engine.get_global_grad_norm()
    assert norm is not None and math.isfinite(norm) and norm > 0


def test_an_optimizer_object_over_exactly_the_engines_parameters_is_taken() -> None:
    _plan, module = _module()
    local = pipedialect.get_dialect("local")
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    engine = local.runtime_engine(module, optimizer=optimizer, lr_scheduler=schedule)
    assert engine.optimizer is optimizer and engine.lr_scheduler is schedule
    spec = _model_registry.spec_for(workers.MODEL)
    engine.train_batch(_model_registry.data_stream(spec, workers.GAS, workers.MICRO, 0))
    assert engine.get_lr() == [pytest.approx(0.5e-3)]


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("section", r"config has an 'optimizer' section too"),
        ("unsplit", r"holds a parameter of shape .* that this engine does not train"),
        ("short", r"does not hold parameter 'wpe' of this engine, which would not be trained"),
        ("bf16_object", r"optimizer object cannot train a bf16 engine"),
        ("object_and_groups", r"param_groups cannot be used with an optimizer object"),
        ("not_an_optimizer", r"the optimizer factory returned list"),
        ("factory_over_model", r"the optimizer the factory built holds a parameter"),
        ("wrong_type", r"optimizer must be a callable\(param_groups\)"),
        ("foreign_schedule", r"lr_scheduler LambdaLR drives another optimizer"),
        ("no_optimizer", r"no 'optimizer' section and no optimizer was given"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(case: str, match: str) -> None:
    spec = _model_registry.spec_for(workers.MODEL)
    unsplit = spec.build(0)
    config = workers.config(0.0)
    if case == "section":
        config = _model_registry.ds_config("adam", gas=workers.GAS, micro=workers.MICRO, dp=1)
    if case == "bf16_object":
        config = {**config, "bf16": {"enabled": True}}
    _plan, module = _module(config)
    params = list(module.parameters())
    kwargs: dict[str, Any] = {
        "section": {"optimizer": workers.make_optimizer},
        "unsplit": {"optimizer": torch.optim.AdamW(unsplit.parameters())},
        "short": {"optimizer": torch.optim.AdamW(params[1:])},
        "bf16_object": {"optimizer": torch.optim.AdamW(params)},
        "object_and_groups": {
            "optimizer": torch.optim.AdamW(params),
            "param_groups": no_weight_decay(),
        },
        "not_an_optimizer": {"optimizer": lambda groups: groups},
        "factory_over_model": {"optimizer": lambda groups: torch.optim.AdamW(unsplit.parameters())},
        "wrong_type": {"optimizer": "AdamW"},
        "foreign_schedule": {
            "optimizer": workers.make_optimizer,
            "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(
                torch.optim.SGD(unsplit.parameters(), lr=0.1), lambda step: 1.0
            ),
        },
        "no_optimizer": {},
    }[case]
    with pytest.raises(ConfigError, match=match):
        pipedialect.get_dialect("local").runtime_engine(module, config=config, **kwargs)


def test_a_dialect_that_does_not_declare_optimizer_refuses_it_by_name() -> None:
    class NoClientOptimizer(pipedialect.Dialect):
        name = "no-client-optimizer"
        engine_features = frozenset({"check_finite"})

        def _build_pipeline(self, request: Any) -> torch.nn.Module:
            raise AssertionError("never called")

        def _build_engine(self, request: Any) -> Any:
            raise AssertionError("never called")

    with pytest.raises(ConfigError, match=r"does not support optimizer \(of check_finite, "):
        NoClientOptimizer().runtime_engine(torch.nn.Linear(1, 1), optimizer=workers.make_optimizer)
