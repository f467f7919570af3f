"""Balancing sees what crosses a boundary.

On a Llama-style model ``balance="flops"`` used to cut inside attention (after ``q_proj``,
``v_proj``, ``o_proj``): a few percent fewer FLOPs on the worst stage for 2.5 times the bytes
sent. Now the split points are chosen among the model's own blocks unless ``candidates=`` says
otherwise, and every cut's bytes are priced at a bandwidth. References: the module structure
read off the models by hand, and the byte counts the measurement reports for each cut.
"""

from __future__ import annotations

import _hf_workers as hf
import pytest
import torch
import transformers
from torch import nn

from pipedialect import ConfigError, partition
from pipedialect.cost.balance import profile_model
from pipedialect.models import TinyGPT

FIXED = {"return_dict": False, "use_cache": False}


def _llama(layers: int = 4) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    config = transformers.LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=256,
        use_cache=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(2, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


LAYERS = {f"model.layers.{i}" for i in range(4)}


@pytest.mark.parametrize("num_stages", [2, 3, 4])
def test_flops_plan_of_a_llama_cuts_between_decoder_layers(num_stages: int) -> None:
    model, example = _llama()
    plan = partition(
        model,
        num_stages=num_stages,
        balance="flops",
        example_inputs=example,
        concrete_args=FIXED,
    )
    assert set(plan.split_points) <= LAYERS, plan.split_points
    assert len(plan.split_points) == num_stages - 1
    # Between layers a cut sends at most what a cut inside attention would have sent.
    profile = profile_model(model, example_inputs=example, concrete_args=FIXED)
    assert set(profile.blocks) == LAYERS
    inside = profile.choose(num_stages, "flops", candidates=profile.candidates, bandwidth=None)
    assert not set(inside) <= LAYERS, "free boundaries and every module: cuts inside layers"
    assert plan.costs is not None
    sent = max(s.boundary_bytes or 0 for s in plan.costs.stages)
    sent_inside = max(s.boundary_bytes or 0 for s in profile.costs(inside).stages)
    assert sent < sent_inside


def test_candidates_restrict_the_choice() -> None:
    model, example = _llama()
    allowed = ["model.layers.0", "model.layers.2"]
    plan = partition(
        model,
        num_stages=2,
        balance="flops",
        example_inputs=example,
        concrete_args=FIXED,
        candidates=allowed,
    )
    assert list(plan.split_points) in ([p] for p in allowed)
    tiny = TinyGPT()  # the torch.fx capture, parameters balanced: the same argument
    assert partition(tiny, num_stages=2, candidates=["blocks.0"]).split_points == ("blocks.0",)
    with pytest.raises(ConfigError, match="candidates= choose split points"):
        partition(tiny, ["blocks.1"], candidates=["blocks.0"])


def test_priced_bytes_choose_the_narrow_cut_among_every_candidate() -> None:
    """With every module allowed, the bytes decide: cutting inside a layer sends its residual,
    its queries, keys and values; between layers one hidden state (and the masks)."""
    model, example = _llama()
    profile = profile_model(model, example_inputs=example, concrete_args=FIXED)
    priced = profile.choose(4, "flops", candidates=profile.candidates)
    assert set(priced) <= LAYERS | {"model.norm", "model.embed_tokens", "model.rotary_emb"}


@pytest.mark.parametrize("name", sorted(hf.FAMILIES))
def test_blocks_are_the_layers_of_every_family(name: str) -> None:
    """Read off the transformers classes: the ModuleList children, nothing inside them."""
    family = hf.FAMILIES[name]
    model = family.build(0)
    profile = profile_model(
        model, example_inputs=family.example_inputs(), concrete_args=family.fixed
    )
    lists = {
        path
        for path, module in model.named_modules()
        if isinstance(module, nn.ModuleList)
        and not any(
            path.startswith(f"{other}.")
            for other, m in model.named_modules()
            if isinstance(m, nn.ModuleList) and other != path
        )
    }
    expected = {f"{path}.{i}" for path in lists for i in range(len(model.get_submodule(path)))}
    assert set(profile.blocks) == expected, sorted(set(profile.blocks) ^ expected)
    assert all(".layers." in b or ".h." in b or ".layer." in b or ".block." in b for b in expected)


def test_a_model_with_fewer_blocks_than_stages_uses_every_candidate() -> None:
    """TinyGPT has 4 blocks: 6 stages need 5 cuts, found among all modules."""
    model = TinyGPT()
    ids = {"input_ids": torch.zeros(2, 8, dtype=torch.long)}
    profile = profile_model(model, example_inputs=ids)
    assert profile.blocks == tuple(f"blocks.{i}" for i in range(4))
    assert set(profile.choose(3, "flops")) <= set(profile.blocks)
    points = profile.choose(6, "flops")
    assert len(points) == 5 and not set(points) <= set(profile.blocks)


def test_containers_inside_a_block_and_mixed_sequentials() -> None:
    """Only the outermost containers count; a root Sequential's children are its blocks."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
            self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.mlp(x) + sum(e(x) for e in self.experts)
            return out

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(4, 4)
            self.layers = nn.ModuleList(Block() for _ in range(3))
            self.out = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            for layer in self.layers:
                h = layer(h)
            out: torch.Tensor = self.out(h)
            return out

    profile = profile_model(Net(), example_inputs={"x": torch.randn(2, 4)})
    assert profile.blocks == ("layers.0", "layers.1", "layers.2")
    seq = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    assert profile_model(seq, example_inputs={"input": torch.randn(2, 4)}).blocks == (
        "0",
        "1",
        "2",
    )
