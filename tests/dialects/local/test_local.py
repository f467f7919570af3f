"""The local dialect: the same losses and parameters as the unsplit model trained by hand.

The reference is a deep copy of the model made before partitioning, trained by a plain loop
with an explicitly constructed torch optimizer on the same micro-batches.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _reference import steps_from, train_unsplit
from torch import nn

import pipedialect
from pipedialect import (
    CheckpointError,
    ConfigError,
    GridTopology,
    StructureChangedError,
    TieError,
    TopologyError,
    partition,
)
from pipedialect.dialects.local import LocalDialect
from pipedialect.dialects.local.engine import LocalEngine, LocalPipeline
from pipedialect.engine.config import build_optimizer, parse_config
from pipedialect.models import MODELS, ModelSpec

GAS = 4
STEPS = 3
RTOL = 1e-6
ATOL = 1e-8

OptFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def _config(optimizer: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "train_batch_size": 2 * GAS,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "steps_per_print": 1000,
        "optimizer": optimizer,
        **extra,
    }


def _args(inputs: Any) -> tuple[Any, ...]:
    return inputs if isinstance(inputs, tuple) else (inputs,)


def _reference_run(
    spec: ModelSpec,
    model: nn.Module,
    make_opt: OptFactory,
    batches: list[Any],
    clip: float | None = None,
) -> tuple[list[float], list[float]]:
    """Train the unsplit model by hand; return per-step mean losses and pre-clip norms."""
    optimizer = make_opt(list(model.parameters()))
    steps = steps_from([iter(batches)], STEPS, GAS)
    trained = train_unsplit(model, optimizer, steps, spec.loss_fn, clip=clip or 0.0)
    return trained.losses, trained.norms


def _train_local(
    spec: ModelSpec, num_stages: int, config: dict[str, Any]
) -> tuple[nn.Module, nn.Module, list[torch.Tensor], list[Any]]:
    model = spec.build()
    reference = copy.deepcopy(model)
    plan = partition(model, spec.split_points_for(num_stages))
    dialect = pipedialect.get_dialect("local")
    module = dialect.pipe_engine(plan, config=config, loss_fn=spec.loss_fn)
    engine = dialect.runtime_engine(module, config=config)
    batches = list(spec.micro_batches(GAS * STEPS))
    data = iter(batches)
    losses = [engine.train_batch(data) for _ in range(STEPS)]
    return model, reference, losses, batches


def _assert_same_parameters(model: nn.Module, reference: nn.Module) -> None:
    ours = dict(model.named_parameters(remove_duplicate=False))
    theirs = dict(reference.named_parameters(remove_duplicate=False))
    assert ours.keys() == theirs.keys()
    for name, param in ours.items():
        torch.testing.assert_close(param, theirs[name], rtol=RTOL, atol=ATOL, msg=name)


EQUIVALENCE = [
    (
        "gpt",
        2,
        {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    ),
    (
        "gpt",
        4,
        {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
        lambda p: torch.optim.AdamW(p, lr=0.01),  # torch's AdamW defaults: weight_decay 0.01
    ),
    (
        "skip",
        2,
        {"type": "Adam", "params": {"lr": 0.01}},
        lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.0),  # FusedAdam's defaults
    ),
    (
        "skip",
        4,
        {"type": "SGD", "params": {"lr": 0.05}},
        lambda p: torch.optim.SGD(p, lr=0.05),
    ),
    (
        "mixed",
        2,
        {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True, "adam_w_mode": False}},
        lambda p: torch.optim.Adam(p, lr=0.01),
    ),
    (
        "mixed",
        4,
        {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1, "betas": [0.8, 0.99]}},
        lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, betas=(0.8, 0.99)),
    ),
    (
        "encdec",
        2,
        {"type": "SGD", "params": {"lr": 0.1}},
        lambda p: torch.optim.SGD(p, lr=0.1),
    ),
    (
        "encdec",
        4,
        {"type": "Adam", "params": {"lr": 0.005, "adam_w_mode": False, "weight_decay": 0.01}},
        lambda p: torch.optim.Adam(p, lr=0.005, weight_decay=0.01),
    ),
]


@pytest.mark.parametrize(
    ("name", "num_stages", "optimizer", "make_opt"),
    EQUIVALENCE,
    ids=[f"{c[0]}-{c[1]}-{c[2]['type']}" for c in EQUIVALENCE],
)
def test_local_pipeline_equals_unsplit_model(
    name: str, num_stages: int, optimizer: dict[str, Any], make_opt: OptFactory
) -> None:
    spec = MODELS[name]
    model, reference, losses, batches = _train_local(spec, num_stages, _config(optimizer))
    expected, _ = _reference_run(spec, reference, make_opt, batches)
    for step, (ours, theirs) in enumerate(zip(losses, expected, strict=True)):
        assert ours.dim() == 0 and not ours.requires_grad
        assert float(ours) == pytest.approx(theirs, rel=RTOL), f"step {step}"
    _assert_same_parameters(model, reference)
    _assert_trained(spec, model)


def _assert_trained(spec: ModelSpec, model: nn.Module) -> None:
    """Every parameter moved: the comparison is not between two models that stood still."""
    initial = dict(spec.build().named_parameters())
    for name, param in model.named_parameters():
        assert not torch.equal(param, initial[name]), f"{name} did not change"


@pytest.mark.parametrize("clipping", [0.5, None])
def test_gradient_clipping_uses_the_global_norm(clipping: float | None) -> None:
    spec = MODELS["gpt"]
    extra = {} if clipping is None else {"gradient_clipping": clipping}
    config = _config({"type": "SGD", "params": {"lr": 0.5}})
    del config["gradient_clipping"]
    config.update(extra)
    model, reference, losses, batches = _train_local(spec, 4, config)
    max_norm = 1.0 if clipping is None else clipping  # DeepSpeed 0.19.8's default is 1.0
    expected, norms = _reference_run(
        spec, reference, lambda p: torch.optim.SGD(p, lr=0.5), batches, clip=max_norm
    )
    assert max(norms) > max_norm  # clipping was active
    assert [float(x) for x in losses] == pytest.approx(expected, rel=RTOL)
    _assert_same_parameters(model, reference)


def test_eval_batch_returns_the_mean_loss_and_changes_nothing() -> None:
    spec = MODELS["encdec"]
    model = spec.build()
    reference = copy.deepcopy(model)
    plan = partition(model, spec.split_points_for(4))
    config = _config({"type": "SGD", "params": {"lr": 0.1}})
    dialect = pipedialect.get_dialect("local")
    engine = dialect.runtime_engine(
        dialect.pipe_engine(plan, config=config, loss_fn=spec.loss_fn), config=config
    )
    batches = list(spec.micro_batches(GAS))
    loss = engine.eval_batch(iter(batches))
    with torch.no_grad():
        expected = sum(spec.loss_fn(reference(*_args(i)), lab) for i, lab in batches) / GAS
    assert float(loss) == pytest.approx(float(expected), rel=RTOL)
    _assert_same_parameters(model, reference)
    loss2, logits = engine.eval_batch(iter(batches), return_logits=True, num_micro_batches=1)
    assert torch.equal(logits, reference(*_args(batches[0][0])).detach())
    assert float(loss2) == pytest.approx(float(spec.loss_fn(logits, batches[0][1])), rel=RTOL)


def test_pipeline_module_is_callable_like_the_model() -> None:
    spec = MODELS["mixed"]
    model = spec.build()
    reference = copy.deepcopy(model)
    plan = partition(model, spec.split_points_for(4))
    config = _config({"type": "SGD", "params": {"lr": 0.1}})
    module = LocalDialect().pipe_engine(plan, config=config, loss_fn=spec.loss_fn)
    assert isinstance(module, LocalPipeline)
    (x, ids), _ = next(spec.micro_batches(1))
    assert torch.equal(module(x, ids), reference(x, ids))


def test_the_boundary_really_carries_every_kind_of_value() -> None:
    spec = MODELS["mixed"]
    plan = partition(spec.build(), spec.split_points_for(2))
    wrappers = LocalDialect().wrap_stages(plan)
    (x, ids), _ = next(spec.micro_batches(1))
    wire = wrappers[0](x, ids)
    (state,) = wrappers[1].receive((wire,), {})
    assert isinstance(state, dict)
    assert state["h"].requires_grad and state["h"].dtype == torch.float32
    assert state["mask"].dtype == torch.bool
    assert state["ids"].dtype == torch.int64
    assert state["scale"].dtype == torch.float32 and not state["scale"].requires_grad
    assert state["extra"] is None
    assert state["factor"] == 0.5 and isinstance(state["factor"], float)


def test_dynamic_shapes() -> None:
    spec = MODELS["gpt"]
    varied = []
    for i, (ids, labels) in enumerate(spec.micro_batches(2 * GAS)):
        length = 8 if i % 2 == 0 else 5
        varied.append((ids[:, :length], labels[:, :length]))
    config = _config({"type": "SGD", "params": {"lr": 0.1}})
    dialect = pipedialect.get_dialect("local")

    plan = partition(spec.build(), spec.split_points_for(2))
    engine = dialect.runtime_engine(
        dialect.pipe_engine(plan, config=config, loss_fn=spec.loss_fn), config=config
    )
    with pytest.raises(StructureChangedError, match=r"\[Stage 0\]"):
        engine.train_batch(iter(varied))

    model = spec.build()
    reference = copy.deepcopy(model)
    plan = partition(model, spec.split_points_for(2))
    engine = dialect.runtime_engine(
        dialect.pipe_engine(plan, config=config, loss_fn=spec.loss_fn, dynamic_shapes=True),
        config=config,
    )
    data = iter(varied)
    losses = [float(engine.train_batch(data)) for _ in range(2)]
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    steps = steps_from([iter(varied)], 2, GAS)
    expected = train_unsplit(reference, optimizer, steps, spec.loss_fn).losses
    assert losses == pytest.approx(expected, rel=RTOL)
    _assert_same_parameters(model, reference)


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    spec = MODELS["gpt"]
    config = _config({"type": "Adam", "params": {"lr": 0.01}})
    dialect = pipedialect.get_dialect("local")
    batches = list(spec.micro_batches(GAS * 4))

    def engine() -> LocalEngine:
        plan = partition(spec.build(), spec.split_points_for(4))
        module = dialect.pipe_engine(plan, config=config, loss_fn=spec.loss_fn)
        built = dialect.runtime_engine(module, config=config)
        assert isinstance(built, LocalEngine)
        return built

    first = engine()
    data = iter(batches)
    for _ in range(2):
        first.train_batch(data)
    first.save_checkpoint(tmp_path, client_state={"epoch": 3})
    later = [float(first.train_batch(data)) for _ in range(2)]

    second = engine()
    path, client = second.load_checkpoint(tmp_path)
    assert path is not None and path.endswith("global_step2/local_engine.pt")
    assert client == {"epoch": 3}
    assert second.global_steps == 2
    data = iter(batches[2 * GAS :])
    assert [float(second.train_batch(data)) for _ in range(2)] == later
    assert engine().load_checkpoint(tmp_path / "nothing") == (None, None)

    plan = partition(spec.build(), spec.split_points_for(2))
    other = dialect.runtime_engine(
        dialect.pipe_engine(plan, config=config, loss_fn=spec.loss_fn), config=config
    )
    assert isinstance(other, LocalEngine)
    with pytest.raises(CheckpointError, match="different pipeline plan"):
        other.load_checkpoint(tmp_path)


def test_local_stages_and_capabilities() -> None:
    spec = MODELS["skip"]
    plan = partition(spec.build(), spec.split_points_for(4))
    config = _config({"type": "SGD", "params": {"lr": 0.1}})
    dialect = pipedialect.get_dialect("local")
    assert isinstance(dialect, LocalDialect)
    engine = dialect.runtime_engine(
        dialect.pipe_engine(
            plan, config=config, loss_fn=spec.loss_fn, topology=GridTopology(pipe=4)
        ),
        config=config,
    )
    assert list(dialect.local_stages(engine)) == [0, 1, 2, 3]
    assert isinstance(engine, pipedialect.RuntimeEngine)
    assert pipedialect.Capability.TIED_WEIGHTS in dialect.capabilities


# -- errors ----------------------------------------------------------------------------------


def _plan(name: str = "gpt", num_stages: int = 4) -> Any:
    spec = MODELS[name]
    return partition(spec.build(), spec.split_points_for(num_stages))


def test_missing_config_or_loss_fn() -> None:
    plan = _plan()
    config = _config({"type": "SGD", "params": {"lr": 0.1}})
    dialect = LocalDialect()
    with pytest.raises(ConfigError, match="config"):
        dialect.pipe_engine(plan, loss_fn=MODELS["gpt"].loss_fn)
    with pytest.raises(ConfigError, match="loss_fn"):
        dialect.pipe_engine(plan, config=config)
    module = dialect.pipe_engine(plan, config=config, loss_fn=MODELS["gpt"].loss_fn)
    # without config=, the engine trains with the config pipe_engine was given
    assert dialect.runtime_engine(module).gradient_accumulation_steps() == GAS
    with pytest.raises(ConfigError, match="pipe_engine built"):
        dialect.runtime_engine(nn.Linear(1, 1), config=config)
    with pytest.raises(ConfigError, match="unknown argument 'topolgy'"):
        dialect.pipe_engine(plan, config=config, loss_fn=MODELS["gpt"].loss_fn, topolgy=None)


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"fp16": {"enabled": True}}, "'fp16'"),
        ({"zero_optimization": {"stage": 1}}, "'zero_optimization'"),
        ({"scheduler": {"type": "LRRangeTest", "params": {}}}, "'scheduler'"),
        ({"scheduler": {"type": "WarmupLR", "params": [1]}}, "'scheduler'"),
        ({"optimizer": {"type": "Lamb", "params": {}}}, "Lamb"),
        ({"optimizer": {"type": "sgd", "params": {"lr": 0.1}}}, "'sgd'"),
        ({"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}}, "max_grad_norm"),
        ({"optimizer": {"type": "Adam", "params": {"amsgrad": True}}}, "amsgrad"),
        ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "betas": 1}}}, "SGD"),
        ({"optimizer": None}, "'optimizer'"),
        ({"gradient_clipping": -1.0}, "gradient_clipping"),
        ({"train_batch_size": 9}, "train_batch_size (9)"),
        ({"gradient_accumulation_steps": "auto"}, "gradient_accumulation_steps"),
    ],
)
def test_config_errors_name_the_key(change: dict[str, Any], key: str) -> None:
    config = {**_config({"type": "SGD", "params": {"lr": 0.1}}), **change}
    with pytest.raises(ConfigError) as info:
        build_optimizer(parse_config(config), nn.Linear(1, 1).parameters())
    assert key in str(info.value)


def test_disabled_sections_and_logging_keys_are_accepted() -> None:
    config = _config(
        {"type": "SGD", "params": {"lr": 0.1}},
        fp16={"enabled": False},
        zero_optimization={"stage": 0},
        wall_clock_breakdown=False,
        tensorboard={"enabled": True},
    )
    assert parse_config(config).gradient_accumulation_steps == GAS


BATCH_CASES = [
    {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2},
    {"train_batch_size": 8, "gradient_accumulation_steps": 2},
    {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5},
    {"train_batch_size": 6},
    {"train_micro_batch_size_per_gpu": 4},
    {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 6},
    {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 5},
    {"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2},
    {"train_batch_size": 3, "gradient_accumulation_steps": 4},
    {"gradient_accumulation_steps": 4},
    {},
]


def test_batch_sizes_resolve_as_deepspeed_resolves_them() -> None:
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    for case in BATCH_CASES:
        try:
            ds = ds_config.DeepSpeedConfig(dict(case))
        except AssertionError:
            with pytest.raises(ConfigError):
                parse_config({**case, "optimizer": {"type": "SGD"}})
            continue
        ours = parse_config({**case, "optimizer": {"type": "SGD"}})
        assert (
            ours.train_batch_size,
            ours.micro_batch_size,
            ours.gradient_accumulation_steps,
        ) == (
            ds.train_batch_size,
            ds.train_micro_batch_size_per_gpu,
            ds.gradient_accumulation_steps,
        ), case


@pytest.mark.parametrize(
    ("optimizer", "cls", "defaults"),
    [
        ({"type": "Adam"}, torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.0, "eps": 1e-8}),
        (
            {"type": "Adam", "params": {"torch_adam": True}},
            torch.optim.AdamW,
            {"weight_decay": 0.01},
        ),
        (
            {"type": "Adam", "params": {"adam_w_mode": False}},
            torch.optim.Adam,
            {"weight_decay": 0.0},
        ),
        ({"type": "AdamW", "params": {"adam_w_mode": False}}, torch.optim.AdamW, {}),
        ({"type": "adamw", "params": {"lr": 0.5}}, torch.optim.AdamW, {"lr": 0.5}),
        (
            {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
            torch.optim.SGD,
            {"momentum": 0.9},
        ),
        ({"type": "RMSprop", "params": {"lr": 0.1}}, torch.optim.RMSprop, {"lr": 0.1}),
    ],
)
def test_optimizer_mapping_follows_deepspeed(
    optimizer: dict[str, Any], cls: type[torch.optim.Optimizer], defaults: dict[str, Any]
) -> None:
    built = build_optimizer(parse_config(_config(optimizer)), nn.Linear(2, 2).parameters())
    assert type(built) is cls
    for key, value in defaults.items():
        assert built.defaults[key] == value, key


def test_topology_must_match_one_replica_of_the_stages() -> None:
    plan = _plan()
    config = _config({"type": "SGD", "params": {"lr": 0.1}})
    dialect = LocalDialect()
    loss_fn = MODELS["gpt"].loss_fn
    with pytest.raises(TopologyError, match="has 4 stages"):
        dialect.pipe_engine(plan, config=config, loss_fn=loss_fn, topology=GridTopology(pipe=3))
    with pytest.raises(TopologyError, match=r"does not declare data-parallel.*data axis of 2"):
        dialect.pipe_engine(
            plan, config=config, loss_fn=loss_fn, topology=GridTopology(pipe=4, data=2)
        )


def test_stage_modules_with_an_untied_copy_are_tied_again_or_refused() -> None:
    plan = _plan()
    config = _config({"type": "SGD", "params": {"lr": 0.1}})
    stages = LocalDialect().wrap_stages(plan)
    stages[3] = copy.deepcopy(stages[3])
    dialect = LocalDialect()
    dialect.pipe_engine(plan, stages, config=config, loss_fn=MODELS["gpt"].loss_fn)
    assert stages[3].mod.lm_head.weight is stages[0].mod.wte.weight  # one parameter again
    stages[3] = copy.deepcopy(stages[3])
    stages[3].mod.lm_head.weight.requires_grad_(False)
    with pytest.raises(TieError, match="tie0_wte_weight"):
        dialect.pipe_engine(plan, stages, config=config, loss_fn=MODELS["gpt"].loss_fn)
    with pytest.raises(ConfigError, match="3 stage modules for a plan of 4"):
        dialect.pipe_engine(plan, stages[:3], config=config, loss_fn=MODELS["gpt"].loss_fn)


def test_bad_micro_batches() -> None:
    spec = MODELS["gpt"]
    config = _config({"type": "SGD", "params": {"lr": 0.1}})
    dialect = LocalDialect()
    engine = dialect.runtime_engine(
        dialect.pipe_engine(_plan(), config=config, loss_fn=spec.loss_fn), config=config
    )
    ids, _ = next(spec.micro_batches(1))
    with pytest.raises(ConfigError, match=r"\(inputs, labels\) pairs"):
        engine.train_batch(iter([ids] * GAS))
    with pytest.raises(ConfigError, match="needs a data_iter"):
        engine.train_batch()
