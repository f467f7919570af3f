"""Parameter groups: no weight decay on biases and norms, with a tied weight, as the unsplit model.

The reference is the unsplit model trained by hand with torch's AdamW over groups chosen by
hand (names ending in ``bias`` or under an ``ln`` module decay-free).
"""

from __future__ import annotations

from typing import Any

import _model_registry
import pytest
import torch
from _compare import ATOL, RTOL, assert_tensor_close
from _reference import steps_from, train_unsplit

import pipedialect
from pipedialect import ConfigError, partition
from pipedialect.engine.param_groups import no_weight_decay

GAS, MICRO, STEPS = 2, 2, 4


def _config() -> dict[str, Any]:
    # DeepSpeed's "Adam" with torch_adam and weight_decay: torch's AdamW, weight_decay 0.1.
    return _model_registry.ds_config("adamw", gas=GAS, micro=MICRO, dp=1)


def _exempt(name: str) -> bool:
    return name.endswith("bias") or name.split(".")[-2:-1] in (["ln1"], ["ln2"], ["ln_f"])


def _reference(groups: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    spec = _model_registry.spec_for("gpt")
    model = spec.build(0)
    named = list(model.named_parameters())  # the tied weight once
    if groups:
        params: Any = [
            {"params": [p for n, p in named if not _exempt(n)]},
            {"params": [p for n, p in named if _exempt(n)], "weight_decay": 0.0},
        ]
    else:
        params = [p for _, p in named]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    data = _model_registry.data_stream(spec, STEPS * GAS, MICRO, 0)
    losses = train_unsplit(model, optimizer, steps_from([data], STEPS, GAS), spec.loss_fn).losses
    return losses, dict(model.named_parameters(remove_duplicate=False))


def _local(**kwargs: Any) -> tuple[Any, Any, list[float]]:
    spec = _model_registry.spec_for("gpt")
    plan = partition(spec.build(0), spec.split_points_for(2))
    dialect = pipedialect.get_dialect("local")
    module = dialect.pipe_engine(plan, config=_config(), loss_fn=spec.loss_fn)
    engine = dialect.runtime_engine(module, config=_config(), **kwargs)
    data = _model_registry.data_stream(spec, STEPS * GAS, MICRO, 0)
    losses = [float(engine.train_batch(data)) for _ in range(STEPS)]
    return plan, engine, losses


def test_local_no_weight_decay_groups_with_a_tie_match_the_unsplit_model() -> None:
    plan, engine, losses = _local(param_groups=no_weight_decay())
    ref_losses, ref_params = _reference(groups=True)
    assert losses == pytest.approx(ref_losses, rel=RTOL, abs=ATOL)
    for stage in plan.stages:
        for name, value in stage.named_parameters(remove_duplicate=False):
            assert_tensor_close(value.detach(), ref_params[name].detach(), name)
    # The tied embedding / LM head is one parameter, in one group, decayed.
    tied = plan.stages[0].get_parameter("wte.weight")
    where = [
        i for i, g in enumerate(engine.optimizer.param_groups) for p in g["params"] if p is tied
    ]
    assert len(where) == 1
    assert engine.optimizer.param_groups[where[0]]["weight_decay"] == 0.1
    # The groups change the numbers: without them, every parameter decays.
    assert _reference(groups=False)[0][-1] != pytest.approx(ref_losses[-1], rel=1e-4)


def test_param_groups_refuse_a_parameter_twice_or_missing_by_name() -> None:
    def twice(named: list[tuple[str, torch.nn.Parameter]]) -> list[dict[str, Any]]:
        return [{"params": [p for _, p in named]}, {"params": [named[1][1]]}]

    def missing(named: list[tuple[str, torch.nn.Parameter]]) -> list[dict[str, Any]]:
        return [{"params": [p for _, p in named[1:]]}]

    with pytest.raises(ConfigError, match=r"'wte\.weight' is in groups 0 and 1"):
        _local(param_groups=twice)
    with pytest.raises(ConfigError, match=r"'wpe'.*in no group"):
        _local(param_groups=missing)
