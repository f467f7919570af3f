"""partition(): stage structure, original parameter names, errors, determinism.

References are independent of the code under test: the unsplit model (deep-copied before
partitioning), and plan structures worked out by hand from the models' forward code.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import pipedialect
from pipedialect import (
    CaptureError,
    PartitionError,
    PipelinePlan,
    SplitPointError,
    StageWrapper,
    partition,
)
from pipedialect.dialects.deepspeed.pipeline import analyze_pipeline_module
from pipedialect.models import MODELS, GPTBlock, ModelSpec

CASES = [(name, stages) for name in MODELS for stages in (2, 4)]


def _args(inputs: Any) -> tuple[Any, ...]:
    return inputs if isinstance(inputs, tuple) else (inputs,)


def _all_params(module: nn.Module) -> dict[str, nn.Parameter]:
    return dict(module.named_parameters(remove_duplicate=False))


def _run_stages_by_hand(plan: PipelinePlan, inputs: tuple[Any, ...]) -> Any:
    """Run the stage GraphModules following the plan's names, without wrappers or codec."""
    env = dict(zip(plan.input_names, inputs, strict=True))
    out: Any = None
    for k, stage in enumerate(plan.stages):
        assert set(plan.liveness[k]) <= set(env), f"stage {k} receives undefined values"
        out = stage(*(env[name] for name in plan.stage_arg_names[k]))
        name = plan.stage_names[k]
        env[name] = out
        if isinstance(out, tuple):
            env.update({f"{name}.{i}": item for i, item in enumerate(out)})
    return out


@pytest.mark.parametrize(("name", "num_stages"), CASES)
def test_stages_compute_what_the_model_computes(name: str, num_stages: int) -> None:
    spec = MODELS[name]
    model = spec.build()
    reference = copy.deepcopy(model)
    plan = partition(model, spec.split_points_for(num_stages))
    assert plan.num_stages == num_stages
    inputs, _ = next(spec.micro_batches(1))
    expected = reference(*_args(inputs))
    assert torch.equal(plan.graph(*_args(inputs)), expected)
    assert torch.equal(_run_stages_by_hand(plan, _args(inputs)), expected)


@pytest.mark.parametrize(("name", "num_stages"), CASES)
def test_stage_parameters_keep_original_names_and_objects(name: str, num_stages: int) -> None:
    spec = MODELS[name]
    model = spec.build()
    original = _all_params(model)
    plan = partition(model, spec.split_points_for(num_stages))
    seen: set[str] = set()
    for stage in plan.stages:
        for pname, param in _all_params(stage).items():
            assert param is original[pname], pname
            seen.add(pname)
        assert set(dict(stage.named_parameters())) <= set(original)
    assert seen == set(original)


def test_gpt_four_stages_structure() -> None:
    spec = MODELS["gpt"]
    plan = partition(spec.build(), ["blocks.0", "blocks.1", "blocks.2"])
    assert plan.input_names == ("input_ids",)
    assert plan.stage_names == ("submod_0", "submod_1", "submod_2", "submod_3")
    assert plan.stage_arg_names == (("input_ids",), ("submod_0",), ("submod_1",), ("submod_2",))
    assert plan.liveness == plan.stage_arg_names
    assert plan.split_points == ("blocks.0", "blocks.1", "blocks.2")
    owners = [sorted({_owner(n) for n in _all_params(stage)}) for stage in plan.stages]
    assert owners == [
        ["blocks.0", "wpe", "wte"],
        ["blocks.1"],
        ["blocks.2"],
        ["blocks.3", "lm_head", "ln_f"],
    ]
    assert [tuple(g.members) for g in plan.tie_groups] == [
        (("wte.weight", 0), ("lm_head.weight", 3))
    ]


def _owner(name: str) -> str:
    atoms = name.split(".")
    return ".".join(atoms[:2]) if atoms[0] == "blocks" else atoms[0]


def test_split_point_is_one_call_even_for_custom_modules() -> None:
    plan = partition(MODELS["gpt"].build(), ["blocks.1"])
    targets = [n.target for n in plan.stages[0].graph.nodes if n.op == "call_module"]
    assert targets.count("blocks.1") == 1
    assert not any(str(t).startswith("blocks.1.") for t in targets)
    # A custom block that is not a split point is traced through down to torch.nn leaves.
    assert "blocks.0.attn.q" in targets and "blocks.0" not in targets
    assert isinstance(plan.stages[0].get_submodule("blocks.1"), GPTBlock)


def test_nested_split_points_in_one_model() -> None:
    spec = MODELS["encdec"]
    plan = partition(spec.build(), ["encoder.layers.1", "decoder.layers.0", "decoder.layers.1"])
    # Stage 0 ends inside the encoder: its norm, the target embedding and the first decoder
    # layer form stage 1, which therefore produces the memory (numbered first, it comes first
    # in forward) and the decoder state; the later stages all need the memory.
    assert plan.stage_arg_names == (
        ("src",),
        ("submod_0", "tgt"),
        ("submod_1.1", "submod_1.0"),
        ("submod_2", "submod_1.0"),
    )
    assert plan.liveness == (
        ("src", "tgt"),
        ("submod_0", "tgt"),
        ("submod_1.1", "submod_1.0"),
        ("submod_2", "submod_1.0"),
    )
    assert {n for n in _all_params(plan.stages[1]) if n.startswith("encoder")} == {
        "encoder.norm.weight",
        "encoder.norm.bias",
    }


def test_no_parameter_crosses_a_boundary_as_a_value() -> None:
    class FunctionalTie(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.mid = nn.Linear(4, 4)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.mid(self.emb(ids))
            return F.linear(torch.tanh(h), self.emb.weight)

    model = FunctionalTie()
    reference = copy.deepcopy(model)
    plan = partition(model, ["mid"])
    value = re.compile(r"^(ids|submod_\d+(\.\d+)*)$")
    assert all(value.match(n) for names in plan.liveness for n in names)
    get_attrs = [
        [n.target for n in stage.graph.nodes if n.op == "get_attr"] for stage in plan.stages
    ]
    assert get_attrs == [[], ["emb.weight"]]
    assert [g.members for g in plan.tie_groups] == [(("emb.weight", 0), ("emb.weight", 1))]
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(plan.graph(ids), reference(ids))


def test_last_stage_returns_the_whole_output() -> None:
    class TwoOutputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = nn.Linear(3, 3)
            self.c = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> dict[str, Any]:
            h0 = torch.relu(self.a(x))
            h1 = self.b(h0)
            return {"logits": self.c(h1), "early": h0, "input": x}

    model = TwoOutputs()
    reference = copy.deepcopy(model)
    plan = partition(model, ["a", "b"])
    # Stage 1 is relu then b: it produces h0 (used by the output) and h1, in that order.
    assert plan.stage_arg_names == (("x",), ("submod_0",), ("submod_1.1", "submod_1.0", "x"))
    assert plan.liveness == (("x",), ("submod_0", "x"), ("submod_1.1", "submod_1.0", "x"))
    x = torch.randn(2, 3)
    out = _run_stages_by_hand(plan, (x,))
    expected = reference(x)
    assert list(out) == list(expected)
    for key in expected:
        assert torch.equal(out[key], expected[key])


def test_buffers_and_tensor_constants() -> None:
    class WithBuffer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.b = nn.Linear(2, 2)
            self.register_buffer("shift", torch.tensor([0.5, -0.5]))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x)) + self.shift + torch.tensor([1.0, 2.0])

    model = WithBuffer()
    reference = copy.deepcopy(model)
    attrs_before = dict(vars(model))
    plan = partition(model, ["a"])
    assert dict(vars(model)).keys() == attrs_before.keys()  # fx's constants did not stay
    assert plan.stages[1].get_buffer("shift") is model.shift
    x = torch.randn(3, 2)
    assert torch.equal(plan.graph(x), reference(x))


def test_single_stage_plan() -> None:
    spec = MODELS["skip"]
    model = spec.build()
    reference = copy.deepcopy(model)
    plan = partition(model, [])
    assert plan.num_stages == 1
    assert plan.liveness == (("x",),)
    x, _ = next(spec.micro_batches(1))
    assert torch.equal(plan.graph(x), reference(x))


def test_sequential_and_aliased_split_points() -> None:
    class Aliased(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
            self.head = nn.Linear(2, 1)
            self.alias = self.seq  # the same module under a second name

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.seq(x))

    plan = partition(Aliased(), ["alias"])
    targets = [n.target for n in plan.stages[0].graph.nodes if n.op == "call_module"]
    assert targets == ["seq"]


# -- errors --------------------------------------------------------------------------------


def _gpt() -> nn.Module:
    return MODELS["gpt"].build()


@pytest.mark.parametrize(
    ("points", "fragments"),
    [
        (["blocks.9"], ["'blocks.9'", "not a module", "blocks.0"]),
        (["blok.1"], ["'blok.1'", "close matches", "blocks.1"]),
        (["wte.weight"], ["'wte.weight'", "parameter"]),
        (["blocks.2", "blocks.0"], ["out of execution order", "['blocks.0', 'blocks.2']"]),
        (["blocks.1", "blocks.1"], ["'blocks.1'", "more than once"]),
        ([""], ["whole model"]),
        (["lm_head"], ["'lm_head'", "last computation"]),
        (["blocks.1.attn", "blocks.1"], ["'blocks.1.attn' is inside split point 'blocks.1'"]),
    ],
)
def test_split_point_errors(points: list[str], fragments: list[str]) -> None:
    with pytest.raises(SplitPointError) as info:
        partition(_gpt(), points)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_split_point_given_as_a_string() -> None:
    with pytest.raises(SplitPointError, match=r"\['blocks.1'\]"):
        partition(_gpt(), "blocks.1")


def test_split_point_never_called() -> None:
    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(2, 2)
            self.spare = nn.Linear(2, 2)
            self.last = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.last(self.used(x))

    with pytest.raises(SplitPointError, match="'spare' is never called"):
        partition(Unused(), ["spare"])


def test_split_point_inside_another_split_point_or_leaf() -> None:
    encdec = MODELS["encdec"].build()
    with pytest.raises(SplitPointError, match="inside split point 'encoder'"):
        partition(encdec, ["encoder", "encoder.layers.0"])
    with pytest.raises(SplitPointError, match="inside leaf module 'encoder'"):
        partition(encdec, ["encoder.layers.0"], leaf_modules=["encoder"])

    class WithMHA(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(4, 1, batch_first=True)
            self.head = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.attn(x, x, x)[0])

    with pytest.raises(SplitPointError, match=r"inside 'attn', a torch\.nn module"):
        partition(WithMHA(), ["attn.out_proj"])


def test_split_point_called_twice() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Linear(2, 2)
            self.head = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.block(self.block(x)))

    with pytest.raises(SplitPointError, match="'block' is called 2 times"):
        partition(Twice(), ["block"])


class Gate(nn.Module):
    """Data-dependent control flow: fx cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.lin(x)
        return -self.lin(x)


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(3, 3)
        self.gate = Gate()
        self.post = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.gate(self.pre(x)))


def test_capture_error_names_the_module_and_what_to_try() -> None:
    model = Gated()
    with pytest.raises(CaptureError) as info:
        partition(model, ["pre"])
    message = str(info.value)
    assert "'gate'" in message
    assert "control flow" in message  # fx's own reason
    assert "concrete_args" in message and "leaf_modules=['gate']" in message
    assert "example_inputs={parameter name: tensor" in message  # the route that always works
    assert isinstance(info.value, PartitionError)


@pytest.mark.parametrize("leaf", ["gate", Gate])
def test_leaf_modules_make_untraceable_code_capturable(leaf: str | type[nn.Module]) -> None:
    model = Gated()
    reference = copy.deepcopy(model)
    plan = partition(model, ["pre"], leaf_modules=[leaf])
    targets = [n.target for n in plan.stages[1].graph.nodes if n.op == "call_module"]
    assert targets == ["gate", "post"]
    for sign in (1.0, -1.0):
        x = sign * torch.ones(2, 3)
        assert torch.equal(plan.graph(x), reference(x))


def test_variadic_inputs() -> None:
    class Variadic(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.b = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor, *rest: torch.Tensor, **extra: Any) -> torch.Tensor:
            return self.b(self.a(x))

    plan = partition(Variadic(), ["a"])
    assert plan.input_names == ("x",)

    class UsesVariadic(Variadic):
        def forward(self, x: torch.Tensor, *rest: torch.Tensor, **extra: Any) -> torch.Tensor:
            return self.b(self.a(x)) + rest[0]

    model = UsesVariadic()
    attrs = set(vars(model))
    with pytest.raises(CaptureError, match="variadic parameter '\\*rest'"):
        partition(model, ["a"])
    assert set(vars(model)) == attrs


def test_unknown_leaf_module() -> None:
    with pytest.raises(PartitionError, match=r"'gat'.*close matches.*'gate'"):
        partition(Gated(), ["pre"], leaf_modules=["gat"])


class Flagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, double: bool = True
    ) -> torch.Tensor:
        h = self.a(x)
        if mask is not None:
            h = h + mask
        if double:
            h = h * 2
        return self.b(h)


def test_concrete_args_fix_flags_and_none_inputs() -> None:
    model = Flagged()
    reference = copy.deepcopy(model)
    with pytest.raises(CaptureError, match="concrete_args"):
        partition(model, ["a"])
    plan = partition(model, ["a"], concrete_args={"mask": None, "double": False})
    assert plan.input_names == ("x",)
    x = torch.randn(2, 3)
    assert torch.equal(plan.graph(x), reference(x, None, False))
    leftovers = [
        n
        for stage in plan.stages
        for n in stage.graph.nodes
        if str(n.target).startswith(("mask", "double"))
        or getattr(n.target, "__name__", "") in ("_assert", "_assert_is_none")
    ]
    assert leftovers == []
    with pytest.raises(CaptureError, match=r"\['dubble'\].*\['x', 'mask', 'double'\]"):
        partition(model, ["a"], concrete_args={"dubble": True})
    plan = partition(model, ["a"], concrete_args={"double": True})
    assert plan.input_names == ("x", "mask")
    mask = torch.randn(2, 3)
    assert torch.equal(plan.graph(x, mask), reference(x, mask, True))


# -- the plan object ---------------------------------------------------------------------------


def test_plan_helpers_use_the_seed_formats() -> None:
    plan = partition(MODELS["skip"].build(), ["blocks.0", "blocks.1", "blocks.2"])
    arg_names, _, liveness = analyze_pipeline_module(plan)
    assert liveness == {k: list(v) for k, v in enumerate(plan.liveness)}
    assert arg_names == {
        -1: ["x"],
        0: ["x"],
        1: ["submod_0.1"],
        2: ["submod_1"],
        3: ["submod_2", "submod_0.0"],
    }
    assert plan.sends(0) == ("submod_0.1", "submod_0.0")
    assert plan.sends(3) == ()
    wrappers = [
        StageWrapper(stage, plan.stage_spec(k), dynamic_shapes=True)
        for k, stage in enumerate(plan.stages)
    ]
    assert [type(w) for w in wrappers] == [StageWrapper] * 4
    assert [(w.stage_id, w.name, w.total_stages) for w in wrappers] == [
        (k, f"submod_{k}", 4) for k in range(4)
    ]
    assert all(w.dynamic_shapes for w in wrappers)
    assert wrappers[2].mod is plan.stages[2]

    class MyWrapper(StageWrapper):
        pass

    mine = [MyWrapper(stage, plan.stage_spec(k)) for k, stage in enumerate(plan.stages)]
    assert all(isinstance(w, MyWrapper) for w in mine)
    text = plan.describe()
    assert "[Stage 3] submod_3" in text and "receives:  ['submod_2', 'submod_0.0']" in text
    assert "PipelinePlan(num_stages=4" in repr(plan)
    with pytest.raises(AttributeError):
        plan.stages = ()  # type: ignore[misc]


@pytest.mark.distributed
def test_plan_is_deterministic_across_builds_and_hash_seeds() -> None:
    spec: ModelSpec = MODELS["encdec"]
    points = spec.split_points_for(4)
    first = partition(spec.build(), points)
    second = partition(spec.build(), points)
    assert first.describe() == second.describe()
    assert first.fingerprint() == second.fingerprint()
    code = (
        "from pipedialect.models import MODELS; import pipedialect; "
        "s = MODELS['encdec']; "
        "print(pipedialect.partition(s.build(), s.split_points_for(4)).fingerprint())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == first.fingerprint()


def test_plan_is_exported() -> None:
    assert pipedialect.partition is partition
    assert pipedialect.PipelinePlan is PipelinePlan
    assert isinstance(partition(_gpt(), ["blocks.1"]).graph, fx.GraphModule)
