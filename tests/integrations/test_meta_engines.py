"""``pipe_engine(..., init_weights=fn)`` on every dialect: a plan of a model built on the meta
device trains exactly like the model built normally.

References: the unsplit model built on the CPU from the same seed and trained by hand in this
process (``_model_registry.checkpoint_reference``), and, for GPT-2 and Llama, the unsplit
``from_pretrained`` model of the directory ``save_pretrained`` wrote, trained by hand.
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import _hf_workers as hf
import _meta_workers as meta_workers
import _model_registry
import pytest
import torch
from _compare import ATOL, RTOL, assert_tensor_close
from _reference import steps_from, train_unsplit

import pipedialect
from pipedialect import WeightsError, partition
from pipedialect.plan.weights import from_state_dict
from pipedialect.runtime.launch import launch

SPEC_NAME = meta_workers.MODEL
CLI = [sys.executable, "-m", "pipedialect.cli", "demo"]


def _meta_plan() -> pipedialect.PipelinePlan:
    spec = _model_registry.spec_for(SPEC_NAME)
    with torch.device("meta"):
        model = spec.build(0)
    return partition(model, spec.split_points_for(2))


def _check_run(result: dict[str, Any], ref: dict[str, Any], where: str) -> None:
    assert result["losses"] == pytest.approx(ref["losses"], rel=RTOL, abs=ATOL), where
    assert result["params"], where
    for n, value in result["params"].items():
        assert_tensor_close(value, ref["params"][n].detach(), f"{where}: {n}")


def test_local_meta_plan_with_init_weights_trains_like_the_real_model() -> None:
    """Local dialect: every stage is materialised by pipe_engine, the tie across stages is one
    Parameter, and losses and every parameter equal the unsplit CPU model's."""
    spec = _model_registry.spec_for(SPEC_NAME)
    plan = _meta_plan()
    state = spec.build(0).state_dict()
    config = _model_registry.ds_config("sgd", gas=meta_workers.GAS, micro=meta_workers.MICRO, dp=1)
    dialect = pipedialect.get_dialect("local")
    module = dialect.pipe_engine(
        plan, config=config, loss_fn=spec.loss_fn, init_weights=from_state_dict(state, plan=plan)
    )
    (group,) = [g for g in plan.tie_groups if len({s for _, s in g}) > 1]
    tied = {id(plan.stages[s].get_parameter(n)) for n, s in group}
    assert len(tied) == 1, group
    engine = dialect.runtime_engine(module, config=config)
    data = _model_registry.data_stream(
        spec, meta_workers.STEPS * meta_workers.GAS, meta_workers.MICRO, 0
    )
    losses = [float(engine.train_batch(data_iter=data)) for _ in range(meta_workers.STEPS)]
    params = {
        n: p.detach().clone()
        for stage in plan.stages
        for n, p in stage.named_parameters(remove_duplicate=False)
    }
    _check_run(
        {"losses": losses, "params": params},
        _model_registry.checkpoint_reference(SPEC_NAME),
        "local",
    )


def test_meta_plans_are_refused_by_name_without_complete_weights() -> None:
    """No init_weights, an init_weights that writes nothing, or one that is not callable:
    a WeightsError naming the stage and its parameters, before anything runs."""
    spec = _model_registry.spec_for(SPEC_NAME)
    config = _model_registry.ds_config("sgd", gas=2, micro=2, dp=1)
    dialect = pipedialect.get_dialect("local")
    with pytest.raises(
        WeightsError, match=r"\[Stage 0\] \['wpe', 'wte.weight'.*meta device.*init_we"
    ):
        dialect.pipe_engine(_meta_plan(), config=config, loss_fn=spec.loss_fn)
    with pytest.raises(WeightsError, match=r"\[Stage 0\] init_weights left \[.*'wte.weight'"):
        dialect.pipe_engine(
            _meta_plan(), config=config, loss_fn=spec.loss_fn, init_weights=lambda stage: None
        )
    with pytest.raises(WeightsError, match="init_weights must be a callable"):
        dialect.pipe_engine(
            _meta_plan(), config=config, loss_fn=spec.loss_fn, init_weights="weights.pt"
        )


@pytest.mark.distributed
def test_deepspeed_and_torch_meta_plans_train_like_the_real_model() -> None:
    """Two ranks on DeepSpeed's PipelineEngine and on torch.distributed.pipelining: each rank
    materialises only its stage (the other stays on meta), the tied embedding and head are
    synchronised across the ranks, and losses and parameters equal the unsplit model's."""
    ref = _model_registry.checkpoint_reference(SPEC_NAME)
    for dialect in ("deepspeed", "torch"):
        results = launch(meta_workers.tinygpt_meta_run, 2, dialect, timeout=300)
        assert sorted(s for r in results for s in r["stages"]) == [0, 1], dialect
        for r in results:
            (stage,) = r["stages"]
            assert r["on_meta"] == [1 - stage], (dialect, r["on_meta"])
            _check_run(r, ref, f"{dialect} stage {stage}")


def _from_pretrained_reference(name: str, directory: Path) -> dict[str, Any]:
    """The unsplit model ``from_pretrained(directory)`` loads, trained by hand: SGD, the same
    micro-batches, each step's loss the mean over its micro-batches (what train_batch returns)."""
    model_cls, _ = meta_workers.PRETRAINED[name]
    reference = model_cls.from_pretrained(directory, attn_implementation="eager").train()
    batches = copy.deepcopy(meta_workers.pretrained_batches())
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)

    def forward(model: Any, args: Any) -> Any:
        names = ("input_ids", "attention_mask")
        return model(**dict(zip(names, args, strict=True)), **meta_workers.PRETRAINED_FIXED)

    steps = steps_from([iter(batches)], meta_workers.STEPS, 4)
    losses = train_unsplit(reference, opt, steps, hf.token_loss, forward=forward).losses
    return {"losses": losses, "params": dict(reference.named_parameters(remove_duplicate=False))}


@pytest.mark.distributed
def test_deepspeed_loads_pretrained_gpt2_and_llama_per_stage_like_from_pretrained(
    tmp_path: Path,
) -> None:
    """save_pretrained (random init, sharded) of GPT-2 and of a tied Llama, then, in one launch,
    2 DeepSpeed ranks train each from a meta model whose stage is loaded with
    init_weights=from_pretrained(dir) (Llama's rotary tables from ``buffers=``): losses and
    weights of the unsplit from_pretrained model trained by hand with SGD."""
    directories = {name: tmp_path / name for name in meta_workers.PRETRAINED}
    torch.manual_seed(0)
    hf.CASES["gpt2"].factory().save_pretrained(directories["gpt2"], max_shard_size="20KB")
    torch.manual_seed(0)
    hf.tiny_llama().save_pretrained(directories["llama"], max_shard_size="20KB")
    for directory in directories.values():
        assert (directory / "model.safetensors.index.json").is_file()  # sharded
    runs = launch(
        meta_workers.pretrained_checkpoint_runs,
        2,
        {name: str(d) for name, d in directories.items()},
        timeout=420,
    )
    for name, directory in directories.items():
        ref = _from_pretrained_reference(name, directory)
        results = [run[name] for run in runs]
        assert sorted(s for r in results for s in r["stages"]) == [0, 1], name
        for r in results:
            (stage,) = r["stages"]
            assert r["on_meta"] == [1 - stage], (name, r["on_meta"])
            _check_run(r, ref, f"deepspeed {name} stage {stage}")
        # Not vacuous: both stages report parameters, together every name of the model.
        names = {n for r in results for n in r["params"]}
        assert names == set(ref["params"]), (name, sorted(set(ref["params"]) ^ names))


@pytest.mark.distributed
def test_demo_with_meta_builds_on_meta_and_matches_its_reference(tmp_path: Path) -> None:
    """``pipedialect demo --meta`` on the local dialect: the same losses as the unsplit model
    trained in the demo's own process."""
    proc = subprocess.run(
        [*CLI, "--dialect", "local", "--meta", "--stages", "4", "--steps", "3", "--no-plot"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    match = re.search(r"largest difference from the single-process reference: (\S+)", proc.stdout)
    assert match and float(match.group(1)) < 1e-5, proc.stdout
