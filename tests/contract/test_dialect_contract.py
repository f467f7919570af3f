"""The shared ``Dialect.pipe_engine`` / ``runtime_engine``: one set of checks for every dialect.

Each check here runs before any process group is needed, so every built-in dialect is tried in
this process; a dialect written against the hooks alone shows what the base hands it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

import pipedialect
from pipedialect import ConfigError, Dialect, PluginError, SchemaCodec, StageWrapper
from pipedialect.dialect import EngineRequest, NoOptions, PipelineRequest
from pipedialect.models import get_model

BUILT_IN = ["local", "torch", "deepspeed"]


def _plan() -> pipedialect.PipelinePlan:
    spec = get_model("skip")
    return pipedialect.partition(spec.build(0), spec.split_points_for(2))


def _config() -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }


def _loss(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, labels)


@pytest.mark.parametrize("name", BUILT_IN)
def test_missing_shared_arguments_are_the_same_error_on_every_dialect(name: str) -> None:
    dialect = pipedialect.get_dialect(name)
    with pytest.raises(ConfigError) as info:
        dialect.pipe_engine(_plan())
    assert str(info.value) == (
        f"the {name} pipe_engine() needs config=<a DeepSpeed-style config dict> and "
        "loss_fn=<callable(outputs, labels)>"
    )
    with pytest.raises(ConfigError, match="loss_fn must be callable"):
        dialect.pipe_engine(_plan(), config=_config(), loss_fn="mse")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="needs the PipelinePlan returned by"):
        dialect.pipe_engine(nn.Linear(2, 2), config=_config(), loss_fn=_loss)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", BUILT_IN)
def test_an_unknown_option_is_refused_naming_what_the_dialect_accepts(name: str) -> None:
    dialect = pipedialect.get_dialect(name)
    accepted = sorted(
        {
            "config",
            "loss_fn",
            "topology",
            "dynamic_shapes",
            "init_weights",
            *(o["name"] for o in _options(name)),
        }
    )
    with pytest.raises(ConfigError) as info:
        dialect.pipe_engine(_plan(), config=_config(), loss_fn=_loss, shedule="gpipe")
    assert str(info.value) == (
        f"unknown argument 'shedule' for the {name} dialect's pipe_engine(); accepted: "
        + ", ".join(accepted)
    )


def _options(name: str) -> list[dict[str, Any]]:
    (info,) = [i for i in pipedialect.list_dialects() if i.name == name]
    return list(info.options)


def test_list_json_shows_each_dialects_options() -> None:
    import contextlib
    import io

    from pipedialect.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["list", "--json"]) == 0
    listed = {d["name"]: d for d in json.loads(out.getvalue())}
    torch_options = {o["name"]: o for o in listed["torch"]["options"]}
    assert set(torch_options) == {
        "schedule",
        "stages_per_rank",
        "device",
        "data_parallel_mode",
        "tensor_parallel",
    }
    assert torch_options["schedule"]["type"] == "str | None" and torch_options["schedule"]["doc"]
    assert {"model_parameters", "training_data"} <= {
        o["name"] for o in listed["deepspeed"]["engine_options"]
    }
    # optimizer= is a shared argument now, not a DeepSpeed engine option
    assert "optimizer" not in {o["name"] for o in listed["deepspeed"]["engine_options"]}
    assert listed["local"]["options"] == []
    assert listed["local"]["engine_features"] == [
        "check_finite",
        "lr_scheduler",
        "optimizer",
        "param_groups",
    ]


@pytest.mark.parametrize("name", BUILT_IN)
def test_engine_features_name_only_shared_arguments(name: str) -> None:
    features = pipedialect.get_dialect(name).engine_features
    assert "check_finite" in features and features <= {
        "check_finite",
        "lr_scheduler",
        "optimizer",
        "param_groups",
    }


# -- a dialect written against the hooks alone --------------------------------------------


class _Codec(SchemaCodec):
    """A codec this dialect declares: the stages must be wrapped with it."""


class _Wrapper(StageWrapper):
    """A stage wrapper this dialect declares."""


class _Recorder(Dialect):
    name = "recorder"
    capabilities = frozenset({pipedialect.Capability.DYNAMIC_SHAPES})
    engine_features = frozenset({"check_finite"})
    seen: ClassVar[list[Any]] = []

    @property
    def stage_wrapper(self) -> type[StageWrapper]:
        return _Wrapper

    @property
    def codec(self) -> SchemaCodec:
        return _Codec()

    def _build_pipeline(self, request: PipelineRequest[NoOptions]) -> nn.Module:
        self.seen.append(request)
        return nn.ModuleList(request.stages)

    def _build_engine(self, request: EngineRequest[NoOptions]) -> Any:
        self.seen.append(request)
        return request


def test_the_base_wraps_with_the_dialects_own_wrapper_and_codec(tmp_path: Path) -> None:
    dialect = _Recorder()
    config = _config()
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    plan = _plan()
    module = dialect.pipe_engine(plan, config=str(path), loss_fn=_loss, dynamic_shape=True)
    request = dialect.seen[-1]
    assert [type(s) for s in request.stages] == [_Wrapper, _Wrapper]
    assert all(type(s.codec) is _Codec for s in request.stages)
    assert request.stages[0].codec is not request.stages[1].codec  # one codec per stage
    assert request.dynamic_shapes and all(s.dynamic_shapes for s in request.stages)
    assert request.config == config  # read from the JSON file, as DeepSpeed reads it
    assert list(module.children()) == list(request.stages)
    engine = dialect.runtime_engine(module, check_finite=True)
    assert engine.check_finite and engine.config is None
    with pytest.raises(ConfigError, match="does not support lr_scheduler"):
        dialect.runtime_engine(module, lr_scheduler=object())


def test_what_a_dialect_does_not_declare_is_refused_before_the_hook() -> None:
    class Plain(_Recorder):
        capabilities = frozenset()  # neither dynamic-shapes nor data-parallel

    dialect = Plain()
    calls = len(dialect.seen)
    with pytest.raises(ConfigError, match="does not declare dynamic-shapes"):
        dialect.pipe_engine(_plan(), config=_config(), loss_fn=_loss, dynamic_shapes=True)
    grid = pipedialect.GridTopology(pipe=2, data=2)
    with pytest.raises(pipedialect.TopologyError, match="does not declare data-parallel"):
        dialect.pipe_engine(_plan(), config=_config(), loss_fn=_loss, topology=grid)
    assert len(dialect.seen) == calls  # the hook never ran


def test_given_stage_modules_are_passed_through_and_counted() -> None:
    dialect = _Recorder()
    plan = _plan()
    stages = [StageWrapper(s, plan.stage_spec(k)) for k, s in enumerate(plan.stages)]
    dialect.pipe_engine(plan, stages, config=_config(), loss_fn=_loss)
    assert list(dialect.seen[-1].stages) == stages
    with pytest.raises(ConfigError, match="got 1 stage modules for a plan of 2 stages"):
        dialect.pipe_engine(plan, stages[:1], config=_config(), loss_fn=_loss)


def test_a_dialect_that_implements_no_hook_is_refused_at_registration() -> None:
    class Empty(Dialect):
        name = "empty"

    class Plugin:
        @pipedialect.hookimpl
        def register_dialects(self, register: Callable[[type[Dialect]], None]) -> None:
            register(Empty)

    with pytest.raises(PluginError, match="_build_engine, _build_pipeline"):
        pipedialect.plugins.register_plugin(Plugin(), name="empty-plugin")
