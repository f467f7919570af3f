"""Where the planner cuts by default: after the model's blocks, never inside one."""

from __future__ import annotations

import types

import torch
from torch import nn

from pipedialect.cost import model_chains
from pipedialect.cost.balance import profile_model
from pipedialect.planner import plan_layout


class _Attention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.o_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        att = torch.softmax(q @ k.transpose(-1, -2) / x.shape[-1] ** 0.5, dim=-1)
        return self.o_proj(att @ v)


class _Layer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.self_attn = _Attention(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(x)
        return x + self.mlp(x)


class _Decoder(nn.Module):
    """Embedding, decoder layers (a ModuleList), a norm; the layout of a Llama base model."""

    def __init__(self, dim: int = 16, layers: int = 4) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(64, dim)
        self.layers = nn.ModuleList(_Layer(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class _CausalLM(nn.Module):
    """A Hugging Face-shaped model: ``model`` the base, a config with ``base_model_pp_plan``,
    and a longer ModuleList elsewhere that is not the decoder's layers."""

    base_model_prefix = "model"

    def __init__(self) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(
            base_model_pp_plan={
                "embed_tokens": (["input_ids"], ["inputs_embeds"]),
                "layers": (["hidden_states"], ["hidden_states"]),
                "norm": (["hidden_states"], ["hidden_states"]),
            }
        )
        self.model = _Decoder()
        self.heads = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model(input_ids)
        for head in self.heads:
            x = head(x)
        return x.sum(-1)


IDS = {"input_ids": torch.zeros(2, 8, dtype=torch.long)}


def test_the_planner_cuts_between_decoder_layers_only() -> None:
    """Every module of the attention can end a stage (so a cut between ``k_proj`` and
    ``v_proj`` is possible), yet every split point the planner considers, and every one of its
    layouts, falls after a whole decoder layer."""
    model = _Decoder()
    layers = {f"layers.{i}" for i in range(4)}
    profile = profile_model(model, example_inputs=IDS)
    assert "layers.0.self_attn.k_proj" in profile.candidates
    (chain,) = model_chains(model, IDS, flops_per_second=1e9).values()
    assert set(chain.cuts) <= layers
    plan = plan_layout(
        model,
        IDS,
        world_size=4,
        memory_per_rank="1GiB",
        global_batch=8,
        bandwidth="1GB/s",
        flops_per_second=1e9,
        exhaustive=True,
    )
    for row in plan.rows:
        assert set(row.layout.split_points) <= layers, row.layout.split_points


def test_any_module_on_request() -> None:
    model = _Decoder()
    wanted = ["layers.0.self_attn.k_proj", "layers.1", "layers.2.mlp"]
    (chain,) = model_chains(model, IDS, flops_per_second=1e9, candidates=wanted).values()
    assert list(chain.cuts) == wanted


def test_a_hugging_face_models_blocks_are_its_pp_plans_layers() -> None:
    """``base_model_pp_plan`` names the decoder's layers; the longer ``heads`` list is not
    where a person would cut a causal LM."""
    profile = profile_model(_CausalLM(), example_inputs=IDS)
    assert profile.blocks == tuple(f"model.layers.{i}" for i in range(4))


def test_a_measured_plan_times_with_one_ranks_share_of_the_cores() -> None:
    """Outside torch.distributed, ``world_size`` ranks will share this machine: the model is
    timed with the cores divided among them, and the plan's notes say so."""
    import os

    cores = len(os.sched_getaffinity(0))
    plan = plan_layout(
        _Decoder(),
        IDS,
        world_size=2,
        memory_per_rank="1GiB",
        global_batch=8,
        bandwidth="1GB/s",
        measure_time=True,
        repeats=2,
    )
    (note,) = [n for n in plan.notes if n.startswith("the model was timed")]
    assert f"timed with {max(1, cores // 2)} thread(s)" in note
