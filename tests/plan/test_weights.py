"""Meta-device models on both capture paths, and ``pipedialect.plan.weights`` loading per stage.

References: the real model (built on the CPU from the same seed) for structure, names and
ties; and, for loading, the unsplit transformers model loaded with ``from_pretrained`` from
the directory ``save_pretrained`` wrote, trained by hand for three steps.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import _hf_workers as hf
import pytest
import safetensors
import safetensors.torch
import torch
from _compare import assert_tensor_close
from _model_registry import ds_config
from _reference import steps_from, train_unsplit
from torch import nn

import pipedialect
from pipedialect import WeightsError, partition
from pipedialect.models import TinyGPT
from pipedialect.plan.weights import (
    from_pretrained,
    from_safetensors,
    from_state_dict,
    materialise_stages,
)

# -- meta-device models on the torch.fx and torch.export paths ---------------------------------


@pytest.mark.parametrize("path", ["fx", "export-cpu-inputs", "export-meta-inputs"])
def test_a_meta_model_partitions_like_the_real_one(path: str) -> None:
    """Stage parameters keep the real model's names and shapes, stay on meta, and the tie
    between the embedding (stage 0) and the head (stage 2) is one Parameter in the plan."""
    ids = torch.zeros(2, 8, dtype=torch.long)
    real = TinyGPT()
    with torch.device("meta"):
        meta = TinyGPT()
    kwargs: dict[str, Any] = {}
    real_kwargs: dict[str, Any] = {}
    if path != "fx":
        kwargs["example_inputs"] = {"input_ids": ids.to("meta") if "meta" in path else ids}
        real_kwargs["example_inputs"] = {"input_ids": ids}
    points = ["blocks.0", "blocks.2"]
    ours, theirs = partition(meta, points, **kwargs), partition(real, points, **real_kwargs)
    for a, b in zip(ours.stages, theirs.stages, strict=True):
        shapes = {n: p.shape for n, p in a.named_parameters(remove_duplicate=False)}
        assert shapes == {n: p.shape for n, p in b.named_parameters(remove_duplicate=False)}
        assert all(p.is_meta for p in a.parameters())
    assert [g.members for g in ours.tie_groups] == [g.members for g in theirs.tie_groups]
    (group,) = ours.tie_groups
    assert [m[1] for m in group.members] == [0, 2]
    (a_name, a_stage), (b_name, b_stage) = group.members
    assert ours.stages[a_stage].get_parameter(a_name) is ours.stages[b_stage].get_parameter(b_name)


# -- materialise_stages and the loaders ---------------------------------------------------------


def _meta_plan(points: list[str]) -> pipedialect.PipelinePlan:
    with torch.device("meta"):
        meta = TinyGPT()
    return partition(meta, points)


def test_materialise_only_the_local_stages_and_keep_ties() -> None:
    """Stages 0 and 2 (which share the tied embedding) get real storage and the values of a
    CPU model's state dict; stage 1 stays on meta; the tie is one Parameter again."""
    real = TinyGPT()
    plan = _meta_plan(["blocks.0", "blocks.2"])
    state = real.state_dict()
    del state["lm_head.weight"]  # tied: only one name in the file, as save_pretrained does
    materialise_stages(plan, [0, 2], "cpu", from_state_dict(state, plan=plan))
    assert all(p.is_meta for p in plan.stages[1].parameters())
    wte, head = (
        plan.stages[0].get_parameter("wte.weight"),
        plan.stages[2].get_parameter("lm_head.weight"),
    )
    assert wte is head and not wte.is_meta
    expected = dict(real.named_parameters(remove_duplicate=False))
    for k in (0, 2):
        for name, p in plan.stages[k].named_parameters(remove_duplicate=False):
            torch.testing.assert_close(p, expected[name], rtol=0, atol=0, msg=name)


def test_loading_errors_name_the_stage_and_the_tensors() -> None:
    real = TinyGPT()
    plan = _meta_plan(["blocks.1"])
    state = real.state_dict()
    with pytest.raises(WeightsError, match=r"\[Stage 1\].*'lm_head.weight'.*plan=") as info:
        materialise_stages(plan, [1], "cpu", from_state_dict({}))
    assert info.value.stage == 1
    bad = dict(state, **{"ln_f.weight": torch.zeros(3)})
    with pytest.raises(WeightsError, match=r"'ln_f.weight' has shape \(16,\).*\(3,\)"):
        materialise_stages(_meta_plan(["blocks.1"]), [1], "cpu", from_state_dict(bad))
    with pytest.raises(WeightsError, match=r"\[Stage 0\] init_weights left \['wpe', 'wte.weight'"):
        materialise_stages(_meta_plan(["blocks.1"]), [0], "cpu", lambda stage: None)

    def partly(stage: nn.Module) -> None:  # fills every tensor but one, silently
        with torch.no_grad():
            for name, t in stage.named_parameters():
                if name != "blocks.0.fc1.bias":
                    t.copy_(state[name])

    with pytest.raises(WeightsError, match=r"\['blocks.0.fc1.bias'\]"):
        materialise_stages(_meta_plan(["blocks.1"]), [0], "cpu", partly)
    with pytest.raises(WeightsError, match="not stages"):
        materialise_stages(plan, [5], "cpu", from_state_dict(state))


def test_safetensors_shards_are_read_per_stage(tmp_path: Path, monkeypatch: Any) -> None:
    """A sharded checkpoint: each stage reads exactly its own tensors, nothing else."""
    real = TinyGPT()
    state = {n: t.contiguous() for n, t in real.state_dict().items() if n != "lm_head.weight"}
    names = sorted(state)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        safetensors.torch.save_file({n: state[n] for n in part}, tmp_path / f"s{i}.safetensors")
        weight_map.update({n: f"s{i}.safetensors" for n in part})
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(__import__("json").dumps({"weight_map": weight_map}))
    read: list[str] = []
    original = safetensors.safe_open

    class Spy:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._f = original(*args, **kwargs)

        def __enter__(self) -> Spy:
            self._f.__enter__()
            return self

        def __exit__(self, *exc: Any) -> None:
            self._f.__exit__(*exc)

        def keys(self) -> Any:
            return self._f.keys()

        def get_tensor(self, name: str) -> torch.Tensor:
            read.append(name)
            return self._f.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    plan = _meta_plan(["blocks.1"])
    loader = from_safetensors(index, plan=plan)
    materialise_stages(plan, [1], "cpu", loader)
    stage1 = {n for n, _ in plan.stages[1].named_parameters(remove_duplicate=False)}
    stage1 |= {n for n, _ in plan.stages[1].named_buffers(remove_duplicate=False)}
    assert sorted(read) == sorted((stage1 - {"lm_head.weight"}) | {"wte.weight"})
    for name, p in plan.stages[1].named_parameters(remove_duplicate=False):
        torch.testing.assert_close(p, real.get_parameter(name), rtol=0, atol=0, msg=name)


# -- a Hugging Face checkpoint, loaded per stage, trains like from_pretrained -------------------


def _rotary_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The non-persistent rotary tables, computed on the CPU by a fresh rotary module."""
    rotary = type(model.model.rotary_emb)(model.config)
    return {f"model.rotary_emb.{n}": b for n, b in rotary.named_buffers()}


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_pretrained_checkpoint_loaded_per_stage_trains_like_from_pretrained(
    name: str, tmp_path: Path
) -> None:
    """save_pretrained (random init), then: the unsplit from_pretrained model trained by hand
    against a meta-device plan whose stages are each filled from the directory, on the local
    dialect, three SGD steps: the same losses and weights."""
    if name == "gpt2":
        case = hf.CASES["gpt2"]
        factory, fixed = case.factory, case.fixed
        inputs = ("input_ids", "attention_mask")
    else:
        factory, fixed = hf.tiny_llama, {"return_dict": False, "use_cache": False}
        inputs = ("input_ids", "attention_mask")
    torch.manual_seed(0)
    factory().save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()  # sharded
    model_cls = type(factory())
    reference = model_cls.from_pretrained(tmp_path, attn_implementation="eager").train()
    with torch.device("meta"):
        meta = model_cls(reference.config).train()
    gen = torch.Generator().manual_seed(3)
    batches = [hf._gpt2_batch(gen, 2) for _ in range(12)]
    example = dict(zip(inputs, batches[0][0], strict=True))
    plan = partition(
        meta,
        ["model.layers.1" if name == "llama" else "transformer.h.1"],
        example_inputs=example,
        concrete_args=fixed,
    )
    assert plan.tie_groups  # the embedding and the head share one Parameter across stages
    buffers = _rotary_buffers(reference) if name == "llama" else None
    loader = from_pretrained(tmp_path, plan=plan, buffers=buffers)
    for k in range(plan.num_stages):  # each rank would do only its own
        materialise_stages(plan, [k], "cpu", loader)
    config = ds_config("sgd", gas=4, micro=2, dp=1)
    dialect = pipedialect.get_dialect("local")
    engine = dialect.runtime_engine(
        dialect.pipe_engine(plan, config=config, loss_fn=hf.token_loss), config=config
    )
    data = iter(copy.deepcopy(batches))
    losses = [float(engine.train_batch(data)) for _ in range(3)]
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)

    def forward(model: Any, args: Any) -> Any:
        return model(**dict(zip(inputs, args, strict=True)), **fixed)

    steps = steps_from([iter(batches)], 3, 4)
    expected = train_unsplit(reference, opt, steps, hf.token_loss, forward=forward).losses
    assert_tensor_close(torch.tensor(losses), torch.tensor(expected), "losses")
    theirs = dict(reference.named_parameters(remove_duplicate=False))
    for k, stage in enumerate(plan.stages):
        for pname, p in stage.named_parameters(remove_duplicate=False):
            assert_tensor_close(p.detach(), theirs[pname].detach(), f"[Stage {k}] {pname}")
