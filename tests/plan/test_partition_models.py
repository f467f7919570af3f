"""The shared test models: deterministic weights and data, and split points that partition."""

from __future__ import annotations

import pytest
import torch

from pipedialect import ConfigError, partition
from pipedialect.models import MODELS, get_model


@pytest.mark.parametrize("name", sorted(MODELS))
def test_weights_do_not_depend_on_the_global_rng(name: str) -> None:
    spec = MODELS[name]
    torch.manual_seed(1)
    first = spec.build().state_dict()
    torch.manual_seed(2)
    torch.rand(100)
    second = spec.build().state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    other = spec.build(seed=1).state_dict()
    assert any(not torch.equal(first[k], other[k]) for k in first)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_micro_batches_are_deterministic(name: str) -> None:
    spec = MODELS[name]
    torch.manual_seed(3)
    first = list(spec.micro_batches(3, batch_size=4, seed=7))
    torch.manual_seed(4)
    second = list(spec.micro_batches(3, batch_size=4, seed=7))
    flat = [t for pair in first for t in (*_tensors(pair[0]), pair[1])]
    again = [t for pair in second for t in (*_tensors(pair[0]), pair[1])]
    assert all(torch.equal(a, b) for a, b in zip(flat, again, strict=True))
    assert all(t.shape[0] == 4 for t in flat)
    different = next(spec.micro_batches(1, batch_size=4, seed=8))
    assert not torch.equal(different[1], first[0][1])


def _tensors(inputs: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return inputs if isinstance(inputs, tuple) else (inputs,)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("num_stages", [2, 4])
def test_recommended_split_points_partition(name: str, num_stages: int) -> None:
    spec = MODELS[name]
    plan = partition(spec.build(), spec.split_points_for(num_stages))
    assert plan.num_stages == num_stages
    assert plan.input_names == spec.input_names
    inputs, labels = next(spec.micro_batches(1))
    loss = spec.loss_fn(plan.graph(*_tensors(inputs)), labels)
    assert loss.dim() == 0 and loss.requires_grad


def test_lookup_errors() -> None:
    assert get_model("gpt") is MODELS["gpt"]
    with pytest.raises(ConfigError, match="'gtp'"):
        get_model("gtp")
    with pytest.raises(ConfigError, match="not 3"):
        MODELS["gpt"].split_points_for(3)
