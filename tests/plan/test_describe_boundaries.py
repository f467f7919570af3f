"""``describe()`` names every boundary value by where it comes from.

``submod_0.3`` said nothing; now each value a stage sends is a module's output at a path
(``model.layers.0 -> output``, ``model.rotary_emb -> [0]``), a value computed inside a forward,
a plan input or a buffer, with its shape, dtype and bytes per micro-batch. References: the
modules' own outputs computed here by calling them (forward hooks on the unsplit model), and
sizes computed by hand.
"""

from __future__ import annotations

from typing import Any

import _hf_workers as hf
import torch
from torch import nn

from pipedialect import partition
from pipedialect.models import TinyGPT


def _outputs_of(model: nn.Module, paths: list[str], call: Any) -> dict[str, Any]:
    """What each module returns when ``call()`` runs the model (forward hooks)."""
    seen: dict[str, Any] = {}
    handles = [
        model.get_submodule(p).register_forward_hook(lambda m, a, out, p=p: seen.setdefault(p, out))
        for p in paths
    ]
    try:
        with torch.no_grad():
            call()
    finally:
        for h in handles:
            h.remove()
    return seen


def _sent(plan: Any, stage: int, inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The values ``stage`` sends, by the plan's names, computed by running the stages."""
    env: dict[str, Any] = dict(inputs)
    with torch.no_grad():
        for k in range(stage + 1):
            out = plan.stages[k](*(env[n] for n in plan.stage_arg_names[k]))
            name = plan.stage_names[k]
            if isinstance(out, tuple):
                env.update({f"{name}.{i}": v for i, v in enumerate(out)})
            else:
                env[name] = out
    return {n: env[n] for n in plan.sends(stage)}


def test_a_llama_boundary_is_named_by_module_and_output_path() -> None:
    family = hf.FAMILIES["llama"]
    model = family.build(0).eval()
    example = family.example_inputs()
    plan = partition(
        model, [family.split_point], example_inputs=example, concrete_args=family.fixed
    )
    values = {v.name: v for v in plan.boundary_values(0)}
    assert set(values) == set(plan.sends(0))
    sent = _sent(plan, 0, example)
    real = _outputs_of(
        model,
        ["model.layers.0", "model.rotary_emb"],
        lambda: family.forward(model, tuple(example.values())),
    )
    cos, sin = real["model.rotary_emb"]
    by_source = {v.source(): v for v in values.values()}
    hidden = by_source["model.layers.0 -> output"]
    assert torch.equal(sent[hidden.name], real["model.layers.0"])
    assert torch.equal(sent[by_source["model.rotary_emb -> [0]"].name], cos)
    assert torch.equal(sent[by_source["model.rotary_emb -> [1]"].name], sin)
    mask = by_source["inside model's forward (LlamaModel)"]
    assert mask.kind == "inside" and mask.dtype == torch.bool
    # Sizes by hand: batch 2, sequence 8, hidden 32, float32.
    assert (hidden.shape, hidden.dtype, hidden.nbytes) == ((2, hf.SEQ, 32), torch.float32, 2048)
    assert mask.nbytes == 2 * 1 * hf.SEQ * hf.SEQ
    text = plan.describe()
    total = sum(v.nbytes or 0 for v in values.values())
    assert f"sends:     4 value(s), {total:,} B per micro-batch" in text
    assert f"{hidden.name}: model.layers.0 -> output, float32 [2, 8, 32], 2,048 B" in text
    assert "receives:  ['submod_0.3', 'submod_0.1', 'submod_0.2', 'submod_0.0']" in text


def test_on_meta_two_leaves_alike_are_both_named() -> None:
    """cos and sin have one shape and dtype: on meta the check cannot tell which is which."""
    family = hf.FAMILIES["qwen2"]
    with torch.device("meta"):
        model = family.model_cls(family.config())
    plan = partition(
        model,
        [family.split_point],
        example_inputs=family.example_inputs(),
        concrete_args=family.fixed,
    )
    rotary = [v for v in plan.boundary_values(0) if v.module == "model.rotary_emb"]
    assert len(rotary) == 2
    assert all(v.output == ("[0]", "[1]") for v in rotary)
    assert "model.rotary_emb -> [0] or [1], float32 [1, 8, 8], 256 B" in plan.describe()


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lin(x)
        return h, h.sum(-1)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pair = _Pair()
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        h, total = self.pair(x)
        out: torch.Tensor = self.head(h) * total.unsqueeze(-1) * scale
        return out


def test_fx_values_are_named_from_the_graph_and_sized_by_verify() -> None:
    """The torch.fx capture calls the split point as one op: its output is named by the graph
    alone (here the whole tuple ``pair`` returns, and ``[1]`` of an LSTM's, a torch.nn module
    fx calls as one op); sizes are known once a check ran."""
    plan = partition(_Net(), ["pair"])
    sources = {v.source() for v in plan.boundary_values(0)}
    assert sources == {"pair -> output", "input 'scale'"}
    assert all(v.shape is None and v.nbytes is None for v in plan.boundary_values(0))
    assert "shape unknown" in plan.describe()
    x, scale = torch.randn(3, 4), torch.randn(3, 1)
    plan.verify(x, scale)
    sizes = {v.source(): (v.shape, v.other, v.nbytes) for v in plan.boundary_values(0)}
    assert sizes == {
        "pair -> output": (None, "a tuple of 2 tensor(s)", 3 * 6 * 4 + 3 * 4),
        "input 'scale'": ((3, 1), None, 3 * 4),
    }
    assert "shape unknown" not in plan.describe()
    lstm = partition(_Recurrent(), ["mid"])
    assert {v.source() for v in lstm.boundary_values(0)} == {"rnn -> [1]", "mid -> output"}


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(4, 4, batch_first=True)
        self.mid = nn.Linear(4, 4)
        self.out = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq, state = self.rnn(x)
        h = self.mid(seq)
        out: torch.Tensor = self.out(h) + state[0].transpose(0, 1)
        return out


def test_tinygpt_block_output() -> None:
    model = TinyGPT()
    plan = partition(model, ["blocks.1"])
    ids = torch.zeros(2, 8, dtype=torch.long)
    plan.verify(ids)
    (value,) = plan.boundary_values(0)
    real = _outputs_of(model, ["blocks.1"], lambda: model(ids))["blocks.1"]
    assert value.source() == "blocks.1 -> output"
    assert value.shape == tuple(real.shape) and value.dtype == real.dtype
    assert value.nbytes == real.numel() * real.element_size()
