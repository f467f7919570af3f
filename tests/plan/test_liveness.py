"""Liveness: what each stage receives, checked against hand-worked tables and the unsplit model.

Includes the Slapo bugs of research/slapo.md section 9: item 2 (stage-0 inputs labelled in the
wrong order when a raw input bypasses stage 0), item 3 (tuple outputs not itemised) and item 16
(``submod_1`` matched as a prefix of ``submod_10``).
"""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import nn

from pipedialect import PartitionError, StageWrapper, TensorCodec, partition
from pipedialect.models import MODELS
from pipedialect.plan.liveness import compute_liveness

HF_INPUTS = [
    "input_ids",
    "past_key_values",
    "attention_mask",
    "token_type_ids",
    "position_ids",
    "head_mask",
    "inputs_embeds",
    "encoder_hidden_states",
    "encoder_attention_mask",
    "labels",
    "use_cache",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
]


def test_slapo_gpt2_worked_example() -> None:
    """research/slapo.md section 3.4: the 4-stage GPT-2 of Slapo PR #105."""
    args = [
        ["input_ids", "position_ids", "attention_mask"],
        ["submod_0"],
        ["submod_1.0", "submod_1.1"],
        ["submod_2", "submod_1.1", "submod_1.2"],
    ]
    defined_by = {"submod_0": 0, "submod_1.0": 1, "submod_1.1": 1, "submod_1.2": 1, "submod_2": 2}
    liveness = compute_liveness(HF_INPUTS, args, defined_by)
    assert liveness == (
        tuple(HF_INPUTS),
        ("submod_0",),
        ("submod_1.0", "submod_1.1", "submod_1.2"),
        ("submod_2", "submod_1.1", "submod_1.2"),
    )


def test_inputs_bypass_to_later_stages() -> None:
    args = [["a"], ["submod_0"], ["submod_1", "b"], ["submod_2", "a"]]
    defined_by = {"submod_0": 0, "submod_1": 1, "submod_2": 2}
    assert compute_liveness(["a", "b"], args, defined_by) == (
        ("a", "b"),
        ("submod_0", "b", "a"),
        ("submod_1", "b", "a"),
        ("submod_2", "a"),
    )


def test_no_prefix_confusion_between_submod_1_and_submod_10() -> None:
    """Twelve stages; stage 11 needs submod_1 and submod_10, stage 2 needs submod_1."""
    args: list[list[str]] = [["x"]] + [[f"submod_{k - 1}"] for k in range(1, 11)]
    args.append(["submod_10", "submod_1"])
    defined_by = {f"submod_{k}": k for k in range(11)}
    liveness = compute_liveness(["x"], args, defined_by)
    assert liveness[1] == ("submod_0",)
    assert liveness[2] == ("submod_1",)
    for k in range(3, 11):
        assert liveness[k] == (f"submod_{k - 1}", "submod_1"), k
    assert liveness[11] == ("submod_10", "submod_1")


class Chain12(nn.Module):
    """Twelve linear blocks; the output of block 1 is added back at the very end."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(3, 3) for _ in range(12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks[1](self.blocks[0](x))
        skip = h
        for block in self.blocks[2:]:
            h = block(h)
        return h + skip


def test_twelve_stage_partition_carries_submod_1_through_every_stage() -> None:
    model = Chain12()
    reference = copy.deepcopy(model)
    plan = partition(model, [f"blocks.{k}" for k in range(11)])
    assert plan.num_stages == 12
    assert plan.liveness[2] == ("submod_1",)
    for k in range(3, 11):
        assert plan.liveness[k] == (f"submod_{k - 1}", "submod_1")
    assert plan.liveness[11] == ("submod_10", "submod_1")
    x = torch.randn(2, 3)
    assert torch.equal(plan.graph(x), reference(x))


def test_skip_model_liveness() -> None:
    spec = MODELS["skip"]
    plan = partition(spec.build(), spec.split_points_for(4))
    # Stage 0 is stem, tanh and block 0: it produces the skip value (tanh, first in forward)
    # and block 0's output; the skip rides through stages 1 and 2 to the head on stage 3.
    assert plan.liveness == (
        ("x",),
        ("submod_0.1", "submod_0.0"),
        ("submod_1", "submod_0.0"),
        ("submod_2", "submod_0.0"),
    )


def test_liveness_errors() -> None:
    with pytest.raises(PartitionError, match=r"\[Stage 1\] uses 'submod_1'"):
        compute_liveness(["x"], [["x"], ["submod_1"]], {"submod_1": 1})
    with pytest.raises(PartitionError, match="'nowhere'"):
        compute_liveness(["x"], [["x"], ["nowhere"]], {})
    with pytest.raises(PartitionError, match="same name"):
        compute_liveness(["submod_0"], [["submod_0"], ["submod_0"]], {"submod_0": 0})
    with pytest.raises(PartitionError, match="at least one stage"):
        compute_liveness(["x"], [], {})


# -- through the stage wrappers ---------------------------------------------------------------


class JsonCodec(TensorCodec):
    """A minimal codec for these tests only, so they do not depend on SchemaCodec."""

    def encode(
        self, obj: object, device: torch.device | None = None
    ) -> tuple[tuple[torch.Tensor, ...], str]:
        tensors: list[torch.Tensor] = []

        def walk(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                tensors.append(value)
                return {"t": len(tensors) - 1}
            if isinstance(value, (list, tuple)):
                return {"l" if isinstance(value, list) else "u": [walk(v) for v in value]}
            if isinstance(value, dict):
                return {"d": [[k, walk(v)] for k, v in value.items()]}
            return {"v": value}

        tree = walk(obj)
        return tuple(tensors), base64.b64encode(json.dumps(tree).encode()).decode()

    def decode(self, tensors: Sequence[torch.Tensor], metadata: str) -> Any:
        def build(node: dict[str, Any]) -> Any:
            if "t" in node:
                return tensors[node["t"]]
            if "l" in node:
                return [build(v) for v in node["l"]]
            if "u" in node:
                return tuple(build(v) for v in node["u"])
            if "d" in node:
                return {k: build(v) for k, v in node["d"]}
            return node["v"]

        return build(json.loads(base64.b64decode(metadata)))


class Reordered(nn.Module):
    """forward(a, b, c): stage 0 uses c before a; b is used only by stage 2; a again by 1."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(3, 3)
        self.second = nn.Linear(3, 3)
        self.third = nn.Linear(3, 3)

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        h = self.first(c) * a
        h = self.second(h) + a
        return self.third(h) - 2 * b


def test_stage_zero_inputs_keep_their_labels_when_bypassed() -> None:
    model = Reordered()
    reference = copy.deepcopy(model)
    plan = partition(model, ["first", "second"])
    # The precondition of Slapo's bug: stage 0's call order differs from the input order, and
    # inputs it does not use (b) or uses again later (a) ride through it.
    assert plan.stage_arg_names[0] == ("c",)
    assert plan.liveness[0] == ("a", "b", "c")
    assert plan.liveness[1] == ("submod_0", "a", "b")
    assert plan.liveness[2] == ("submod_1", "a", "b")
    wrappers = [
        StageWrapper(s, plan.stage_spec(k), codec=JsonCodec()) for k, s in enumerate(plan.stages)
    ]
    a, b, c = (torch.full((2, 3), float(v)) for v in (1.0, 10.0, 100.0))
    value: Any = wrappers[0](a, b, c)
    for wrapper in wrappers[1:]:
        value = wrapper(value)
    assert torch.equal(value, reference(a, b, c))
    # Named inputs are accepted too, in any order.
    value = wrappers[0](c=c, a=a, b=b)
    for wrapper in wrappers[1:]:
        value = wrapper(value)
    assert torch.equal(value, reference(a, b, c))


def test_nested_tuple_outputs_reach_later_stages() -> None:
    """Slapo bug 3: ``((a, b), (c, d))`` was not itemised, so ``submod_0.0.1`` was unknown.

    Here a stage's value crosses whole and the indexing runs on the stage that uses it.
    """

    class Pairs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], ...]:
            h = self.lin(x)
            return (h, h * 2), (h * 3, h * 4)

    class UsesPairs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pairs = Pairs()
            self.head = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.pairs(x)
            return self.head(out[0][1]) + out[1][0]

    model = UsesPairs()
    reference = copy.deepcopy(model)
    plan = partition(model, ["pairs"])
    assert plan.liveness[1] == ("submod_0",)
    wrappers = [
        StageWrapper(s, plan.stage_spec(k), codec=JsonCodec()) for k, s in enumerate(plan.stages)
    ]
    x = torch.randn(2, 2)
    assert torch.equal(wrappers[1](wrappers[0](x)), reference(x))
