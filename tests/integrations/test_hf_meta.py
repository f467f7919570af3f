"""Hugging Face models in and out, one rough edge at a time.

- In: a model built on the meta device with its default attention (sdpa) partitions with
  ``example_inputs=``: the check against the meta model compares structure, shapes and dtypes
  and reads no value; each stage then loads from a ``save_pretrained`` directory with no other
  argument, non-persistent buffers re-created as the model's own ``__init__`` makes them.
- Out: ``consolidate`` gives every name of the model's ``state_dict`` (``strict=True``) and
  ``export_hf`` writes what ``save_pretrained`` writes, for rotary models too.

References: the same transformers model built on the CPU (``from_pretrained`` of the same
directory, or the model trained in the same process), never the code under test.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import _hf_workers as hf
import pytest
import torch
import transformers
from torch import nn

import pipedialect
from pipedialect import CheckpointError, PartitionError, WeightsError, partition
from pipedialect import checkpoint as ckpt
from pipedialect.plan.weights import from_pretrained, from_state_dict, materialise_stages


def _meta_from(family: hf.Family, directory: Path) -> nn.Module:
    """What a user builds for a big model: the saved config's model, on the meta device."""
    config = family.model_cls.config_class.from_pretrained(directory)
    with torch.device("meta"):
        return family.model_cls._from_config(config).train()


def _partition(
    family: hf.Family, model: nn.Module, verify: bool = True
) -> pipedialect.PipelinePlan:
    return partition(
        model,
        [family.split_point],
        example_inputs=family.example_inputs(),
        concrete_args=family.fixed,
        verify=verify,
    )


# -- in: partition on meta with the default attention ------------------------------------------


@pytest.mark.parametrize("name", ["qwen2", "llama"])
def test_meta_model_with_default_attention_partitions_with_example_inputs(
    name: str, tmp_path: Path
) -> None:
    """sdpa's mask code asks ``mask.all()`` in eager mode, which a meta tensor cannot answer;
    the check runs the meta model on fake tensors instead. The plan, filled with the weights,
    computes the CPU model's logits."""
    family = hf.FAMILIES[name]
    family.build(0).save_pretrained(tmp_path)
    meta = _meta_from(family, tmp_path)
    assert meta.config._attn_implementation == "sdpa"
    plan = _partition(family, meta)
    assert plan.num_stages == 2
    reference = family.model_cls.from_pretrained(tmp_path).train()
    materialise_stages(
        plan, range(plan.num_stages), "cpu", from_state_dict(reference.state_dict(), plan=plan)
    )
    inputs, _ = next(family.micro_batches(1, seed=9))
    with torch.no_grad():
        torch.testing.assert_close(
            plan.graph(*inputs)[0], family.forward(reference, inputs)[0], rtol=1e-6, atol=1e-6
        )


class _ReadsAWeight(nn.Module):
    """Reads a weight's value in eager mode only (export takes the other branch)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if not torch.compiler.is_exporting() and bool(self.a.weight.sum() > 1e9):
            h = h * 2
        out: torch.Tensor = self.b(h)
        return out


def test_a_meta_model_that_reads_a_value_is_refused_by_name() -> None:
    with torch.device("meta"):
        model = _ReadsAWeight()
    x = torch.randn(2, 4, device="meta")
    with pytest.raises(PartitionError, match=r"reads a tensor's value.*verify=False"):
        partition(model, ["a"], example_inputs={"x": x})
    plan = partition(model, ["a"], example_inputs={"x": x}, verify=False)
    assert plan.num_stages == 2


# -- in: per-stage loading re-creates non-persistent buffers ----------------------------------


@pytest.mark.parametrize("name", ["qwen2", "gpt_neox", "bert"])
def test_per_stage_loading_recreates_non_persistent_buffers(name: str, tmp_path: Path) -> None:
    """No ``buffers=``: Qwen2's and GPT-NeoX's rotary ``inv_freq``, BERT's position and token
    type ids are computed as the model's ``__init__`` computes them on the CPU; every other
    tensor is the file's, GPT-NeoX's untied head included (stored as ``embed_out.weight``)."""
    family = hf.FAMILIES[name]
    family.build(0).save_pretrained(tmp_path)
    meta = _meta_from(family, tmp_path)
    plan = _partition(family, meta, verify=False)  # the check on meta has a test of its own
    non_persistent = {n for n, _ in meta.named_buffers()} - set(meta.state_dict())
    materialise_stages(plan, range(plan.num_stages), "cpu", from_pretrained(tmp_path, plan=plan))
    reference = family.model_cls.from_pretrained(tmp_path)
    on_cpu = family.build(0)  # its __init__ computed the buffers on the CPU
    expected = {
        **dict(reference.named_parameters(remove_duplicate=False)),
        **dict(on_cpu.named_buffers()),
    }
    seen = set()
    for stage in plan.stages:
        for n, t in [*stage.named_parameters(), *stage.named_buffers()]:
            assert torch.equal(t, expected[n]), n
            seen.add(n)
    assert non_persistent & seen, "the stages hold buffers no checkpoint holds"


def test_untied_head_is_never_read_from_the_embedding(tmp_path: Path) -> None:
    """GPT-NeoX declares ``lm_head.weight`` tied to the embedding but does not tie them
    (``tie_word_embeddings=False``), and its files store the head as ``embed_out.weight``."""
    family = hf.FAMILIES["gpt_neox"]
    model = family.build(0)
    assert model.lm_head.weight is not model.gpt_neox.embed_in.weight
    model.save_pretrained(tmp_path)
    with torch.device("meta"):
        meta = family.model_cls(model.config)
    plan = _partition(family, meta, verify=False)
    materialise_stages(plan, [1], "cpu", from_pretrained(tmp_path, plan=plan))
    assert torch.equal(plan.stages[1].get_parameter("lm_head.weight"), model.lm_head.weight)


class _Rotary(nn.Module):
    """A hand-written module with a non-persistent table and no initialiser to re-create it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(4.0), persistent=False)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(x) * self.table
        return out


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = _Rotary()
        self.second = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.second(self.first(x))
        return out


def test_a_buffer_nothing_can_recreate_is_refused_by_name_without_talk_of_ties() -> None:
    with torch.device("meta"):
        meta = _Net()
    plan = partition(meta, ["first"], example_inputs={"x": torch.randn(2, 4, device="meta")})
    state = _Net().state_dict()
    with pytest.raises(WeightsError, match=r"\['first\.table'\] are not persistent") as info:
        materialise_stages(plan, [0], "cpu", from_state_dict(state, plan=plan))
    assert "_Net has no per-module initialiser" in str(info.value)
    assert "Tied" not in str(info.value)
    assert info.value.stage == 0
    materialise_stages(
        plan,
        [0],
        "cpu",
        from_state_dict(state, plan=plan, buffers={"first.table": _Net().first.table}),
    )
    assert torch.equal(plan.stages[0].get_buffer("first.table"), torch.arange(4.0))


# -- out: consolidate and export_hf --------------------------------------------------------------


def _trained_checkpoint(family: hf.Family, tmp_path: Path) -> tuple[nn.Module, Path]:
    """One step of a CPU model on the local dialect (the stages hold the model's parameters),
    saved as a portable checkpoint."""
    model = family.build(0)
    plan = _partition(family, model)
    config = hf.ds_config(1, 2, "sgd")
    dialect = pipedialect.get_dialect("local")
    engine = dialect.runtime_engine(
        dialect.pipe_engine(plan, config=config, loss_fn=hf.token_loss), config=config
    )
    engine.train_batch(family.micro_batches(1))
    return model, ckpt.save(engine, tmp_path / "ckpt")


@pytest.mark.parametrize("name", ["qwen2", "mistral", "gpt_neox", "t5", "bart", "bert"])
def test_consolidate_is_a_strict_state_dict_and_export_hf_reloads(
    name: str, tmp_path: Path
) -> None:
    """Rotary models: no ``inv_freq`` (not persistent). T5, BART: the shared embedding the
    stages hold under other names (``shared.weight``). BERT: ``cls.predictions.bias``, a second
    name of the decoder's bias."""
    family = hf.FAMILIES[name]
    model, saved = _trained_checkpoint(family, tmp_path)
    state = ckpt.consolidate(saved)
    assert state.keys() == model.state_dict().keys()
    fresh = family.build(1)
    fresh.load_state_dict(state, strict=True)
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    config = copy.deepcopy(model.config)
    config.architectures = [family.model_cls.__name__]
    out = ckpt.export_hf(saved, tmp_path / "export", config=config)
    reloaded = family.model_cls.from_pretrained(out).eval()
    inputs, _ = next(family.micro_batches(1, seed=5))
    with torch.no_grad():
        assert torch.equal(
            family.forward(reloaded, inputs)[0], family.forward(model.eval(), inputs)[0]
        )


def test_export_hf_refuses_a_config_that_ties_what_the_checkpoint_holds_apart(
    tmp_path: Path,
) -> None:
    """Trained untied, exported with a config that ties the head to the embedding: loading
    both into one tensor would silently keep one of them."""
    family = hf.FAMILIES["mistral"]
    model, saved = _trained_checkpoint(family, tmp_path)
    assert not model.config.tie_word_embeddings
    tied: Any = copy.deepcopy(model.config)
    tied.tie_word_embeddings = True
    with pytest.raises(CheckpointError, match=r"holds different values for 'model\.embed_tokens"):
        ckpt.export_hf(saved, tmp_path / "export", config=tied, model_cls=family.model_cls)
    untied = ckpt.export_hf(saved, tmp_path / "ok", config=model.config, model_cls=family.model_cls)
    reloaded = transformers.MistralForCausalLM.from_pretrained(untied)
    assert torch.equal(reloaded.lm_head.weight, model.lm_head.weight)
