"""The torch.export capture (``partition(..., example_inputs=...)``) that transformers needs.

References: the unsplit model run eagerly (transformers' own code, or small modules written
here), and structures read off the models' code by hand. Also recorded: the torch.fx route
fails on every transformers model tested, which is why the export route exists.
"""

from __future__ import annotations

import copy
from collections import namedtuple
from typing import Any

import _hf_workers as hf
import pytest
import torch
import transformers
from torch import nn

from pipedialect import (
    CaptureError,
    PartitionError,
    SplitPointError,
    StructureChangedError,
    partition,
)


def _model_state(model: nn.Module) -> tuple[Any, ...]:
    """Everything partition() must leave as it found it."""
    return (
        sorted(vars(model)),
        [n for n, _ in model.named_modules()],
        [(n, id(p)) for n, p in model.named_parameters(remove_duplicate=False)],
        [(n, id(b)) for n, b in model.named_buffers(remove_duplicate=False)],
        model.training,
    )


# -- transformers models ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "bert", "t5"])
def test_torch_fx_cannot_capture_transformers_models(name: str) -> None:
    """Without example_inputs partition() uses torch.fx, which stops on transformers 5 code."""
    case = hf.CASES[name]
    model = case.build(0)
    before = _model_state(model)
    flags = {"use_cache": False} if "use_cache" in case.fixed else {}
    with pytest.raises(CaptureError, match=r"torch\.fx could not capture") as info:
        partition(model, case.split_points[2], concrete_args=flags)
    assert "pass example_inputs={parameter name: tensor" in str(info.value)
    assert _model_state(model) == before


@pytest.mark.parametrize("name", ["gpt2", "bert", "t5"])
def test_stages_compute_the_model_on_new_inputs(name: str) -> None:
    """Outputs and gradients of the chained stages equal the model's on inputs that are not
    the example (other tokens, other padding)."""
    case = hf.CASES[name]
    model = case.build(0)
    reference = copy.deepcopy(model)
    before = _model_state(model)
    plan = case.partition(model, 4)
    assert _model_state(model) == before
    inputs, labels = next(case.micro_batches(1, seed=12345))
    assert not torch.equal(inputs[0], case.example_inputs()["input_ids"])
    ours = plan.graph(*inputs)
    theirs = case.forward(reference, inputs)
    assert isinstance(ours, tuple) and len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    plan.verify(*inputs)  # partition() checked the example; the same check on other inputs
    assert _model_state(model) == before
    case.loss_fn(ours, labels).backward()
    case.loss_fn(theirs, labels).backward()
    grads = {n: p.grad for n, p in reference.named_parameters()}
    for n, p in model.named_parameters():
        assert p.grad is not None, n
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-7, msg=n)


def test_gpt2_plan_structure_and_tie_names() -> None:
    """Read off GPT2LMHeadModel: block 1 ends stage 0; the wte/lm_head tie is named by the module
    that uses it on each stage; stage 1 receives the hidden state and the causal mask."""
    case = hf.CASES["gpt2"]
    model = case.build(0)
    plan = case.partition(model, 2)
    assert plan.input_names == ("input_ids", "attention_mask")
    assert plan.split_points == ("transformer.h.1",)
    names = [dict(s.named_parameters(remove_duplicate=False)) for s in plan.stages]
    assert names[0]["transformer.wte.weight"] is model.transformer.wte.weight
    assert names[1]["lm_head.weight"] is model.lm_head.weight
    assert "lm_head.weight" not in names[0] and "transformer.wte.weight" not in names[1]
    assert {n.split(".")[2] for n in names[0] if n.startswith("transformer.h.")} == {"0", "1"}
    assert {n.split(".")[2] for n in names[1] if n.startswith("transformer.h.")} == {"2", "3"}
    assert [g.members for g in plan.tie_groups] == [
        (("transformer.wte.weight", 0), ("lm_head.weight", 1))
    ]
    assert len(plan.sends(0)) == 2  # the hidden state and the 4-d causal mask


def test_bert_parameter_with_two_names_is_held_under_the_using_module() -> None:
    """BertForMaskedLM's ``cls.predictions.bias`` is ``cls.predictions.decoder.bias``."""
    case = hf.CASES["bert"]
    model = case.build(0)
    plan = case.partition(model, 2)
    last = dict(plan.stages[-1].named_parameters(remove_duplicate=False))
    assert last["cls.predictions.decoder.bias"] is model.cls.predictions.bias
    assert "cls.predictions.bias" not in last
    assert [g.members for g in plan.tie_groups] == [
        (("bert.embeddings.word_embeddings.weight", 0), ("cls.predictions.decoder.weight", 1))
    ]


def test_t5_shared_embedding_ties_three_modules_over_the_stages() -> None:
    case = hf.CASES["t5"]
    model = case.build(0)
    plan = case.partition(model, 4)
    assert [g.members for g in plan.tie_groups] == [
        (
            ("encoder.embed_tokens.weight", 0),
            ("decoder.embed_tokens.weight", 1),
            ("lm_head.weight", 3),
        )
    ]
    # With return_dict=False the output holds the encoder's last hidden state, so it rides
    # past decoder.block.1 to the last stage beside the decoder's hidden state.
    assert len(plan.sends(2)) == 2


@pytest.mark.parametrize("name", ["gpt2", "bert", "t5"])
def test_a_plan_captured_on_the_cpu_runs_on_another_device(name: str) -> None:
    """export writes the capture device into factory calls and ``.to()``; the stages must
    follow their own tensors instead. The meta device stands in for a GPU: a CPU tensor made by
    a stage would meet meta tensors and fail."""
    case = hf.CASES[name]
    plan = case.partition(case.build(0), 4)
    inputs, _ = next(case.micro_batches(1))
    env: dict[str, Any] = dict(zip(plan.input_names, (x.to("meta") for x in inputs), strict=True))
    out: Any = None
    for k, stage in enumerate(plan.stages):
        moved = copy.deepcopy(stage).to("meta")  # the copy: the model keeps its parameters
        out = moved(*(env[n] for n in plan.stage_arg_names[k]))
        env[plan.stage_names[k]] = out
        if isinstance(out, tuple):
            env.update({f"{plan.stage_names[k]}.{i}": item for i, item in enumerate(out)})
    assert out[0].device.type == "meta"
    assert out[0].shape == case.forward(case.build(0), inputs)[0].shape


def test_export_stages_follow_train_and_eval_mode() -> None:
    """export bakes the mode into one capture, so each mode is captured: a plan made in train
    mode drops out under ``train()`` and not under ``eval()``, whatever mode it was made in."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 4))
    x = torch.randn(2, 4)
    for made_in in (model.train(), model.eval()):
        plan = partition(made_in, ["0"], example_inputs={"input": x})
        plan.graph.eval()
        model.eval()
        torch.testing.assert_close(plan.graph(x), model(x))
        plan.graph.train()
        model.train()
        torch.manual_seed(0)
        dropped = plan.graph(x)
        torch.manual_seed(0)
        torch.testing.assert_close(dropped, model(x))
        assert not torch.equal(dropped, model.eval()(x))


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_the_mask_is_an_input_not_a_constant(attention: str) -> None:
    """Captured on an all-ones mask, the plan still honours padding in later micro-batches
    (the sdpa path of transformers may skip a mask that is all ones: not when exported)."""
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=hf.VOCAB,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
        attn_implementation=attention,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config).eval()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, hf.VOCAB, (2, hf.SEQ))
    plan = partition(
        model,
        ["transformer.h.0"],
        example_inputs={"input_ids": ids, "attention_mask": torch.ones_like(ids)},
        concrete_args={"return_dict": False},
    )
    padded = torch.ones_like(ids)
    padded[1, 3:] = 0
    theirs = reference(input_ids=ids, attention_mask=padded, return_dict=False)[0]
    assert not torch.allclose(theirs, reference(input_ids=ids, return_dict=False)[0])
    torch.testing.assert_close(plan.graph(ids, padded)[0], theirs)


def test_plan_inputs_follow_the_signature_not_the_mapping_order() -> None:
    case = hf.CASES["gpt2"]
    example = case.example_inputs()
    reordered = {"attention_mask": example["attention_mask"], "input_ids": example["input_ids"]}
    plan = partition(
        case.build(0), ["transformer.h.1"], example_inputs=reordered, concrete_args=case.fixed
    )
    assert plan.input_names == ("input_ids", "attention_mask")


def test_one_tensor_given_for_two_inputs_still_makes_two_inputs() -> None:
    """torch.export merges inputs that alias; the capture copies the second one first."""
    case = hf.CASES["t5"]
    model = case.build(0)
    reference = copy.deepcopy(model)
    ids = torch.randint(2, hf.VOCAB, (2, hf.SEQ))
    example = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "decoder_input_ids": ids}
    plan = partition(model, ["decoder.block.0"], example_inputs=example, concrete_args=case.fixed)
    inputs, _ = next(case.micro_batches(1, seed=3))
    inputs = (inputs[0], inputs[1], torch.randint(2, hf.VOCAB, (2, hf.SEQ)))
    torch.testing.assert_close(plan.graph(*inputs)[0], case.forward(reference, inputs)[0])


def test_micro_batch_of_another_shape_is_refused_at_stage_zero() -> None:
    case = hf.CASES["bert"]
    plan = case.partition(case.build(0), 2, batch_size=2)
    inputs, _ = next(case.micro_batches(1, batch_size=3))
    with pytest.raises(StructureChangedError, match=r"\[Stage 0\] input 'input_ids' has shape"):
        plan.stages[0](*inputs)
    wrong_dtype = (inputs[0][:2].int(), *(x[:2] for x in inputs[1:]))
    with pytest.raises(StructureChangedError, match=r"dtype torch.int32.*torch.int64"):
        plan.stages[0](*wrong_dtype)


def test_model_output_object_is_refused_with_the_flag_to_set() -> None:
    case = hf.CASES["gpt2"]
    model = case.build(0)
    before = _model_state(model)
    with pytest.raises(CaptureError, match=r"CausalLMOutputWithCrossAttentions.*return_dict"):
        partition(model, ["transformer.h.1"], example_inputs=case.example_inputs())
    assert _model_state(model) == before


def test_flags_reach_a_forward_through_its_kwargs() -> None:
    """``return_dict`` is not a parameter of GPT2LMHeadModel.forward: it travels in **kwargs."""
    case = hf.CASES["gpt2"]
    plan = partition(
        case.build(0),
        ["transformer.h.1"],
        example_inputs=case.example_inputs(),
        concrete_args={"return_dict": False},
    )
    assert isinstance(plan.graph(*case.example_inputs().values()), tuple)


@pytest.mark.parametrize("family", ["llama", "bart"])
def test_other_families_outputs_and_gradients(family: str) -> None:
    """Llama (rotary embeddings, grouped-query attention, the default sdpa attention) and BART
    (encoder-decoder, learned positions) partition at their block boundaries too."""
    if family == "llama":  # untied, over LlamaConfig's default positions
        overrides: dict[str, Any] = {"tie_word_embeddings": False, "max_position_embeddings": 2048}
        points = ["model.layers.0"]
    else:
        overrides = {}
        points = ["model.encoder.layers.1", "model.decoder.layers.0"]
    config = hf.family_config(family, use_cache=False, **overrides)
    model_cls = hf.FAMILIES[family].model_cls
    names = list(hf.FAMILIES[family].input_names)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = model_cls(config).train()
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(5)

    def batch() -> list[torch.Tensor]:
        values = [torch.randint(2, hf.VOCAB, (2, hf.SEQ), generator=gen), torch.ones(2, hf.SEQ)]
        values[1] = values[1].long()
        values[1][1, 5:] = 0
        if len(names) == 3:
            values.append(torch.randint(2, hf.VOCAB, (2, hf.SEQ), generator=gen))
        return values

    fixed = {"return_dict": False, "use_cache": False}
    plan = partition(
        model, points, example_inputs=dict(zip(names, batch(), strict=True)), concrete_args=fixed
    )
    assert plan.num_stages == len(points) + 1
    inputs = batch()
    ours = plan.graph(*inputs)
    theirs = reference(**dict(zip(names, inputs, strict=True)), **fixed)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-6, atol=1e-6)
    ours[0].square().mean().backward()
    theirs[0].square().mean().backward()
    grads = {n: p.grad for n, p in reference.named_parameters()}
    for n, p in model.named_parameters():
        assert p.grad is not None, n
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-7, msg=n)


# -- the export route on small modules ---------------------------------------------------------


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Chain(nn.Module):
    """Three blocks; a tensor constant made in forward; a buffer; a dict output with None."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.register_buffer("offset", torch.full((4,), 0.5))
        self.head = nn.Linear(4, 2)
        self.head.weight = nn.Parameter(self.blocks[0].lin.weight[:2].detach().clone())

    def forward(
        self, x: torch.Tensor, scale: torch.Tensor, flag: bool = True, **kwargs: Any
    ) -> dict[str, Any]:
        h = x * scale
        for block in self.blocks:
            h = block(h)
        weights = torch.tensor([1.0, 2.0, 3.0, 4.0])
        h = h * weights + self.offset
        return {"out": self.head(h) if flag else h, "none": None, "extra": kwargs.get("extra")}


def _chain_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(3, 4, generator=gen), "scale": torch.rand(3, 1, generator=gen)}


def test_small_model_constants_buffers_and_dict_output() -> None:
    model = Chain()
    reference = copy.deepcopy(model)
    before = _model_state(model)
    plan = partition(
        model,
        ["blocks.0", "blocks.2"],
        example_inputs=_chain_inputs(),
        concrete_args={"extra": 7},
    )
    assert _model_state(model) == before  # the constant sits on the stage, not on the model
    assert plan.input_names == ("x", "scale")
    inputs = _chain_inputs(seed=1)
    ours = plan.graph(*inputs.values())
    theirs = reference(**inputs, extra=7)
    assert set(ours) == {"out", "none", "extra"} and ours["none"] is None and ours["extra"] == 7
    torch.testing.assert_close(ours["out"], theirs["out"])
    last = dict(plan.stages[-1].named_buffers())
    assert torch.equal(last["offset"], model.offset)
    constants = [b for n, b in last.items() if n != "offset"]
    assert [c.tolist() for c in constants] == [[1.0, 2.0, 3.0, 4.0]]


def test_fixed_flag_steers_the_capture() -> None:
    plan = partition(
        Chain(), ["blocks.1"], example_inputs=_chain_inputs(), concrete_args={"flag": False}
    )
    out = plan.graph(*_chain_inputs().values())["out"]
    assert out.shape == (3, 4)  # the head was skipped
    assert all("head" not in n for s in plan.stages for n, _ in s.named_parameters())


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.nothing = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.nothing(self.a(self.a(x))))


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return h if h.sum() > 0 else -h


class _BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.a(x))


_Pair = namedtuple("_Pair", ["left", "right"])


class _NamedTupleOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> _Pair:
        h = self.a(x)
        return _Pair(h, -h)


X = {"x": torch.randn(2, 4)}


@pytest.mark.parametrize(
    ("model", "points", "kwargs", "error", "fragments"),
    [
        (Chain(), ["blocks.0"], {"example_inputs": {"y": X["x"]}}, CaptureError, ["'y'", "'x'"]),
        (Chain(), ["blocks.0"], {"example_inputs": {"x": 1.0}}, CaptureError, ["not a tensor"]),
        (Chain(), ["blocks.0"], {"example_inputs": {}}, CaptureError, ["empty"]),
        (
            Chain(),
            ["blocks.0"],
            {"example_inputs": X, "concrete_args": {"scale": torch.ones(1)}},
            CaptureError,
            ["'scale'", "move 'scale' to example_inputs"],
        ),
        (
            Chain(),
            ["blocks.0"],
            {"example_inputs": X, "concrete_args": {"x": 1}},
            CaptureError,
            ["'x' is both"],
        ),
        (
            _Twice(),
            ["b"],
            {"example_inputs": X, "concrete_args": {"extra": 1}},
            CaptureError,
            ["'extra'", "does not take"],
        ),
        (
            Chain(),
            ["blocks.0"],
            {"example_inputs": X, "leaf_modules": ["blocks.1"]},
            PartitionError,
            ["leaf_modules", "torch.export"],
        ),
        (_Twice(), ["a"], {"example_inputs": X}, SplitPointError, ["'a' is called 2 times"]),
        (_Twice(), ["nothing"], {"example_inputs": X}, SplitPointError, ["computes nothing"]),
        (_Twice(), ["b"], {"example_inputs": X}, SplitPointError, ["last computation"]),
        (
            _DataDependent(),
            ["a"],
            {"example_inputs": X},
            CaptureError,
            ["torch.export could not capture _DataDependent.forward", "concrete_args"],
        ),
        (_NamedTupleOut(), [], {"example_inputs": X}, CaptureError, ["returns a _Pair"]),
    ],
    ids=[
        "unknown-input",
        "non-tensor-input",
        "no-inputs",
        "tensor-fixed",
        "input-and-fixed",
        "unknown-fixed",
        "leaf-modules",
        "called-twice",
        "no-computation",
        "empty-last-stage",
        "data-dependent",
        "namedtuple-output",
    ],
)
def test_mistakes_are_named_errors(
    model: nn.Module,
    points: list[str],
    kwargs: dict[str, Any],
    error: type[Exception],
    fragments: list[str],
) -> None:
    model = copy.deepcopy(model).train()
    before = _model_state(model)
    with pytest.raises(error) as info:
        partition(model, points, **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    assert _model_state(model) == before


class _Counter(nn.Module):
    """Replaces a buffer in forward: export records it as an in-place copy."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count = self.count + 1
        return self.b(self.a(x)) * self.count


@pytest.mark.parametrize("cls", [_BatchNormNet, _Counter])
def test_buffer_updates_happen_as_in_the_model(cls: type[nn.Module]) -> None:
    model = cls().train()
    reference = copy.deepcopy(model)
    plan = partition(model, ["a"], example_inputs=X)
    for seed in range(3):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(plan.graph(x), reference(x))
    buffers = dict(reference.named_buffers())
    for name, value in model.named_buffers():
        torch.testing.assert_close(value, buffers[name], msg=name)
    assert any(not torch.equal(b, cls().state_dict()[n]) for n, b in buffers.items())


def test_split_points_out_of_order() -> None:
    with pytest.raises(SplitPointError, match=r"out of execution order at 'blocks\.2'"):
        partition(Chain(), ["blocks.2", "blocks.0"], example_inputs=_chain_inputs())
