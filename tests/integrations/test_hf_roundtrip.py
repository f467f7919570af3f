"""A new user's whole path with a transformers model, for every family the HF tests partition.

From a small config (nothing from the hub): ``save_pretrained``, build the model on the meta
device from the saved config, partition it with its default attention (``example_inputs=``:
the plan is checked against the meta model), load each stage from the saved directory
(``init_weights=from_pretrained(dir, plan=plan)``, which re-creates the non-persistent
buffers), train 3 steps on the local dialect, save a portable checkpoint, ``export_hf`` it and
``from_pretrained`` the export.

References: the unsplit model ``from_pretrained(dir)`` loads, trained by a plain torch loop on
the same micro-batches (losses and every parameter within 1e-6 relative); and, for the export,
that model's class loaded with the consolidated weights, whose ``save_pretrained`` the export
must equal file for file and tensor for tensor, and whose logits the reloaded export must give
bit for bit. The same path runs on two processes on DeepSpeed and torch.distributed.pipelining
for a rotary model and one whose files rename its head.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import _hf_workers as hf
import pytest
import torch
from _compare import ATOL, RTOL, assert_tensor_close
from _reference import steps_from, train_unsplit
from safetensors.torch import load_file

import pipedialect
from pipedialect import checkpoint as ckpt
from pipedialect import partition
from pipedialect.plan.weights import from_pretrained
from pipedialect.runtime.launch import launch

STEPS = 3
GAS = 2
MICRO = 2


def _hand_trained(family: hf.Family, directory: Path) -> tuple[Any, list[float]]:
    """The unsplit ``from_pretrained`` model trained by hand with Adam; its per-step losses."""
    model = family.model_cls.from_pretrained(directory).train()
    optimizer = hf.OPTIMIZERS["adam"][1](model.parameters())
    steps = steps_from([family.micro_batches(STEPS * GAS, batch_size=MICRO)], STEPS, GAS)
    losses = train_unsplit(model, optimizer, steps, hf.token_loss, forward=family.forward).losses
    return model, losses


def _files(directory: Path) -> dict[str, Any]:
    """What a save_pretrained directory holds: file names, tensors, the two configs."""
    out: dict[str, Any] = {"names": sorted(p.name for p in directory.iterdir())}
    out["tensors"] = load_file(directory / "model.safetensors")
    for name in ("config.json", "generation_config.json"):
        if (directory / name).is_file():
            out[name] = json.loads((directory / name).read_text())
    return out


def _run(family: hf.Family, tmp_path: Path) -> None:
    saved = tmp_path / "pretrained"
    family.build(0).save_pretrained(saved)
    config = family.model_cls.config_class.from_pretrained(saved)
    with torch.device("meta"):
        meta = family.model_cls._from_config(config).train()
    assert meta.config._attn_implementation == "sdpa", "the model's default attention"
    plan = partition(
        meta,
        [family.split_point],
        example_inputs=family.example_inputs(MICRO),
        concrete_args=family.fixed,
    )
    train_config = hf.ds_config(GAS, MICRO, "adam")
    dialect = pipedialect.get_dialect("local")
    module = dialect.pipe_engine(
        plan,
        config=train_config,
        loss_fn=hf.token_loss,
        init_weights=from_pretrained(saved, plan=plan),
    )
    engine = dialect.runtime_engine(module, config=train_config)
    data = family.micro_batches(STEPS * GAS, batch_size=MICRO)
    losses = [float(engine.train_batch(data)) for _ in range(STEPS)]

    reference, expected = _hand_trained(family, saved)
    assert losses == pytest.approx(expected, rel=RTOL, abs=ATOL), family.name
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    staged = {
        n: p for stage in plan.stages for n, p in stage.named_parameters(remove_duplicate=False)
    }
    assert staged, family.name
    for name, value in staged.items():
        assert_tensor_close(value.detach(), ref_params[name].detach(), f"{family.name} {name}")

    ckpt.save(engine, tmp_path / "ckpt")
    state = ckpt.consolidate(tmp_path / "ckpt")
    trained = family.model_cls.from_pretrained(saved)
    trained.load_state_dict(state, strict=True)
    out = ckpt.export_hf(tmp_path / "ckpt", tmp_path / "export", config=trained.config)
    trained.save_pretrained(tmp_path / "by_save_pretrained")
    exported, written = _files(out), _files(tmp_path / "by_save_pretrained")
    assert exported["names"] == written["names"], family.name
    assert exported.keys() == written.keys()
    assert exported["tensors"].keys() == written["tensors"].keys(), family.name
    for name, value in written["tensors"].items():
        assert torch.equal(exported["tensors"][name], value), (family.name, name)
    for name in ("config.json", "generation_config.json"):
        assert exported.get(name) == written.get(name), (family.name, name)
    assert not any("inv_freq" in n for n in exported["tensors"])

    reloaded = family.model_cls.from_pretrained(out).eval()
    trained.eval()
    reference.eval()
    plan.graph.eval()
    inputs, _ = next(family.micro_batches(1, batch_size=MICRO, seed=77))
    with torch.no_grad():
        logits = family.forward(reloaded, inputs)[0]
        assert torch.equal(logits, family.forward(trained, inputs)[0]), family.name
        assert_tensor_close(logits, family.forward(reference, inputs)[0], family.name)
        assert_tensor_close(logits, plan.graph(*inputs)[0], f"{family.name} pipeline")


@pytest.mark.parametrize("name", sorted(hf.FAMILIES))
def test_pretrained_meta_model_trains_exports_and_reloads(name: str, tmp_path: Path) -> None:
    _run(hf.FAMILIES[name], tmp_path)


def _sgd_reference(family: hf.Family, directory: Path) -> tuple[Any, list[float]]:
    """The unsplit ``from_pretrained`` model trained by hand with the multi-process SGD."""
    model = family.model_cls.from_pretrained(directory).train()
    optimizer = hf.OPTIMIZERS["sgd"][1](model.parameters())
    steps = steps_from([family.micro_batches(STEPS * GAS, batch_size=MICRO)], STEPS, GAS)
    losses = train_unsplit(model, optimizer, steps, hf.token_loss, forward=family.forward).losses
    return model, losses


@pytest.mark.distributed
@pytest.mark.parametrize("dialect", ["deepspeed", "torch"])
def test_pretrained_meta_model_on_two_ranks(dialect: str, tmp_path: Path) -> None:
    """The same path on 2 processes: each rank reads only its stage from the directory
    (Qwen2: rotary table, tied head; GPT-NeoX: a head stored as ``embed_out.weight``)."""
    names = ["qwen2", "gpt_neox"]
    directories = {}
    for name in names:
        directories[name] = str(tmp_path / name / "pretrained")
        hf.FAMILIES[name].build(0).save_pretrained(directories[name])
    runs = launch(
        hf.pretrained_roundtrip,
        2,
        directories,
        dialect,
        str(tmp_path),
        STEPS,
        GAS,
        MICRO,
        timeout=600,
    )
    for name in names:
        family = hf.FAMILIES[name]
        reference, expected = _sgd_reference(family, Path(directories[name]))
        ref_params = dict(reference.named_parameters(remove_duplicate=False))
        per_rank = [run[name] for run in runs]
        assert sorted(k for r in per_rank for k in r["stages"]) == [0, 1], name
        for r in per_rank:
            assert r["losses"] == pytest.approx(expected, rel=RTOL, abs=ATOL), (name, r["stages"])
            for param, value in r["params"].items():
                assert_tensor_close(value, ref_params[param].detach(), f"{name} {param}")
        reloaded = family.model_cls.from_pretrained(tmp_path / name / "export").eval()
        inputs, _ = next(family.micro_batches(1, batch_size=MICRO, seed=77))
        with torch.no_grad():
            assert_tensor_close(
                family.forward(reloaded, inputs)[0],
                family.forward(reference.eval(), inputs)[0],
                f"{dialect} {name} exported logits",
            )
