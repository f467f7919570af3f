"""Unmodified transformers models (GPT-2, BERT, T5) pipelined by naming their block boundaries.

The reference is the unsplit transformers model itself, deep-copied before partitioning and
trained by a plain torch loop (``torch.optim.Adam``) on the same micro-batches, called the way
transformers users call it (keyword inputs). Every step's loss and every parameter, by its
original name, must agree within 1e-6 relative (tensor-wide norm, as in test_deepspeed).
"""

from __future__ import annotations

import copy
from typing import Any

import _hf_workers as hf
import pytest
import torch
from _compare import ATOL, RTOL, assert_tensor_close
from _reference import steps_from, train_unsplit
from torch import nn

import pipedialect
from pipedialect.runtime.launch import launch

STEPS = 3
GAS = 2
MICRO = 2


def reference_run(
    case: hf.HFCase,
    model: nn.Module,
    optimizer_name: str,
    steps: int = STEPS,
    gas: int = GAS,
    micro: int = MICRO,
) -> tuple[list[float], float]:
    """Train the unsplit model by hand: per-step mean losses, and the eval loss afterwards."""
    optimizer = hf.OPTIMIZERS[optimizer_name][1](model.parameters())
    data = case.micro_batches(steps * gas, batch_size=micro)
    steps_ = steps_from([data], steps, gas)
    losses = train_unsplit(model, optimizer, steps_, case.loss_fn, forward=case.forward).losses
    with torch.no_grad():
        evals = [
            case.loss_fn(case.forward(model, inputs), labels).item()
            for inputs, labels in case.micro_batches(gas, batch_size=micro)
        ]
    return losses, sum(evals) / len(evals)


def assert_every_parameter_staged(model: nn.Module, staged_names: set[str], what: str) -> None:
    """Every parameter object of the model is on some stage, under one of its names.

    A tensor with several names (BERT's ``cls.predictions.bias`` is
    ``cls.predictions.decoder.bias``) is held under the name of the module that uses it.
    """
    names_of: dict[int, set[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), set()).add(n)
    missing = [sorted(names) for names in names_of.values() if not names & staged_names]
    assert not missing, f"{what}: parameters on no stage: {missing}"
    assert staged_names <= set().union(*names_of.values()), what


def assert_trained(case: hf.HFCase, params: dict[str, torch.Tensor]) -> None:
    """The comparison is not between two models that stood still."""
    initial = dict(case.build(0).named_parameters(remove_duplicate=False))
    moved = [n for n, p in params.items() if not torch.equal(p, initial[n])]
    assert len(moved) == len(params), sorted(set(params) - set(moved))


@pytest.mark.parametrize("num_stages", [2, 4])
@pytest.mark.parametrize("name", ["gpt2", "bert", "t5"])
def test_local_pipeline_equals_unsplit_transformers_model(name: str, num_stages: int) -> None:
    case = hf.CASES[name]
    model = case.build(0)
    reference = copy.deepcopy(model)
    plan = case.partition(model, num_stages, batch_size=MICRO)
    assert plan.num_stages == num_stages
    assert plan.input_names == case.input_names
    config = hf.ds_config(GAS, MICRO, "adam")
    dialect = pipedialect.get_dialect("local")
    engine = dialect.runtime_engine(
        dialect.pipe_engine(plan, config=config, loss_fn=case.loss_fn), config=config
    )
    data = case.micro_batches(STEPS * GAS, batch_size=MICRO)
    losses = [float(engine.train_batch(data)) for _ in range(STEPS)]
    eval_loss = float(engine.eval_batch(case.micro_batches(GAS, batch_size=MICRO)))

    expected, expected_eval = reference_run(case, reference, "adam")
    assert losses == pytest.approx(expected, rel=RTOL, abs=ATOL)
    assert eval_loss == pytest.approx(expected_eval, rel=RTOL, abs=ATOL)
    ours = dict(model.named_parameters(remove_duplicate=False))
    theirs = dict(reference.named_parameters(remove_duplicate=False))
    assert ours.keys() == theirs.keys()
    for param_name, value in ours.items():
        assert_tensor_close(value.detach(), theirs[param_name].detach(), param_name)
    # The stages hold the model's own Parameter objects: training them trained the model.
    staged = {
        n: p for stage in plan.stages for n, p in stage.named_parameters(remove_duplicate=False)
    }
    assert all(p is ours[n] for n, p in staged.items())
    assert_every_parameter_staged(model, set(staged), name)
    assert_trained(case, {n: p.detach() for n, p in ours.items()})


@pytest.mark.distributed
def test_deepspeed_pp2_gpt2_bert_t5() -> None:
    """One 2-process launch trains all three on the real DeepSpeed PipelineEngine (gloo)."""
    names = ["gpt2", "bert", "t5"]
    results = launch(hf.train_deepspeed, 2, names, 2, "sgd", STEPS, GAS, MICRO, timeout=900)
    for name in names:
        case = hf.CASES[name]
        reference = case.build(0)
        expected, expected_eval = reference_run(case, reference, "sgd")
        ref_params = dict(reference.named_parameters(remove_duplicate=False))
        per_rank = [r[name] for r in results]
        assert sorted(r["stage"] for r in per_rank) == [0, 1], name
        for r in per_rank:
            assert r["losses"] == pytest.approx(expected, rel=RTOL, abs=ATOL), (name, r["stage"])
            assert r["eval_loss"] == pytest.approx(expected_eval, rel=RTOL, abs=ATOL), name
            for param_name, value in r["params"].items():
                assert_tensor_close(
                    value,
                    ref_params[param_name].detach(),
                    f"{name} stage {r['stage']} {param_name}",
                )
        trained: dict[str, Any] = {}
        for r in per_rank:
            trained.update(r["params"])
        assert_every_parameter_staged(reference, set(trained), name)
        assert_trained(case, trained)
    # The tied embedding/LM head pairs: the last stage holds DeepSpeed's replicated copy.
    by_stage = {r["gpt2"]["stage"]: r for r in results}
    assert by_stage[0]["gpt2"]["replicated"] == []
    assert by_stage[1]["gpt2"]["replicated"] == ["lm_head.weight"]
    assert by_stage[1]["bert"]["replicated"] == ["cls.predictions.decoder.weight"]
    assert by_stage[1]["t5"]["replicated"] == ["lm_head.weight"]


@pytest.mark.distributed
def test_torch_dialect_gpt2_bert_t5() -> None:
    """torch.distributed.pipelining on 2 processes: 2 stages under 1F1B, and 4 stages, two per
    rank, under interleaved 1F1B (one launch for all six runs)."""
    names = ["gpt2", "bert", "t5"]
    layouts = [(2, "1f1b"), (4, "interleaved_1f1b")]
    results = launch(hf.train_torch, 2, names, layouts, "sgd", STEPS, GAS, MICRO, timeout=900)
    for name in names:
        case = hf.CASES[name]
        reference = case.build(0)
        expected, expected_eval = reference_run(case, reference, "sgd")
        ref_params = dict(reference.named_parameters(remove_duplicate=False))
        for num_stages, schedule in layouts:
            key = f"{num_stages}-{schedule}/{name}"
            per_rank = [r[key] for r in results]
            assert sorted(k for r in per_rank for k in r["stages"]) == list(range(num_stages))
            trained: dict[str, Any] = {}
            for r in per_rank:
                assert r["losses"] == pytest.approx(expected, rel=RTOL, abs=ATOL), (
                    key,
                    r["stages"],
                )
                assert r["eval_loss"] == pytest.approx(expected_eval, rel=RTOL, abs=ATOL), key
                for param_name, value in r["params"].items():
                    assert_tensor_close(
                        value, ref_params[param_name].detach(), f"{key} {r['stages']} {param_name}"
                    )
                trained.update(r["params"])
            assert_every_parameter_staged(reference, set(trained), key)
            assert_trained(case, trained)
