"""bf16 with DeepSpeed's semantics on every dialect (``pipedialect.engine.precision``).

Three kinds of comparison, each with the tolerance it reaches and why:

- the local dialect against an independent bf16 recipe of the unsplit model written in
  ``_bf16_workers.reference_bf16`` (plain PyTorch): *bitwise equal* -- the same bf16 operations
  in the same order, the same fp32 Adam on the same masters;
- the torch dialect (2 ranks) against DeepSpeed's real PipelineEngine (2 ranks, gloo, CPU, its
  ``BF16_Optimizer``): *bitwise equal* over 30 steps with gradient clipping, tie included --
  both accumulate each stage's bf16 micro-batch gradients into a buffer, sum the tied weight's
  two buffers, clip by the same global norm and step fp32 masters. Against local bf16: bitwise
  for a model without a tie across ranks; with the demo model's tied embedding / LM head,
  within 2% per loss, because local (one process, one Parameter) adds the tie's two gradient
  contributions in one bf16 autograd sum per micro-batch while a pipeline adds two separately
  accumulated bf16 buffers: a different rounding each step, which Adam carries on;
- bf16 against the fp32 unsplit model over 30 steps: every loss within 2% relative. A bf16 loss
  is itself rounded to 8 significant bits (0.4-0.8% near the demo model's losses of 2-4), and
  the measured gap is under 1%.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import _bf16_workers as workers
import pytest
import torch
from _compare import assert_tensor_close

import pipedialect
from pipedialect import ConfigError
from pipedialect.engine.config import parse_config
from pipedialect.models import get_model
from pipedialect.plan.partition import partition
from pipedialect.runtime.launch import launch

#: bf16 loss curve vs the fp32 one, relative, per step (see the module docstring).
FP32_BAND = 0.02
#: A pipeline with a tie across ranks vs local bf16, relative, per step.
TIE_BAND = 0.02
STEPS = 30


def _gather(results: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    params: dict[str, torch.Tensor] = {}
    for r in results:
        params.update(r["params"])
    return params


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert set(a) == set(b), what
    different = {n: int((a[n] != b[n]).sum()) for n in a if not torch.equal(a[n], b[n])}
    assert not different, f"{what}: elements that differ, by parameter: {different}"


def _within(actual: list[float], expected: list[float], band: float) -> float:
    gaps = [abs(x - y) / abs(y) for x, y in zip(actual, expected, strict=True)]
    assert max(gaps) <= band, f"largest relative gap {max(gaps):.3%} > {band:.0%}: {gaps}"
    return max(gaps)


# -- the config ------------------------------------------------------------------------------


def _cfg(**extra: Any) -> dict[str, Any]:
    return {**workers.config(2, 2, bf16=False), **extra}


def test_bf16_config_resolves_as_deepspeed_does() -> None:
    p = parse_config(_cfg(bf16={"enabled": True})).precision
    # DeepSpeed 0.19.8: grad_accum_dtype defaults to the model dtype, communication to bf16.
    assert (p.param_dtype, p.grad_accum_dtype, p.communication_dtype) == (torch.bfloat16,) * 3
    p = parse_config(
        _cfg(
            bfloat16={"enabled": True, "immediate_grad_update": True},
            data_types={"grad_accum_dtype": "fp32"},
            communication_data_type="fp32",
        )
    ).precision
    assert (p.grad_accum_dtype, p.communication_dtype) == (torch.float32, torch.float32)
    assert not parse_config(_cfg(bf16={"enabled": False})).precision.bf16


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"fp16": {"enabled": True}}, ["'fp16'", "loss scaling", "bf16"]),
        ({"bf16": {"enabled": True, "bf16_optimizer_states": True}}, ["bf16_optimizer_states"]),
        ({"bf16": {"enabled": True, "loss_scale": 0}}, ["loss_scale"]),
        (
            {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp16"}},
            ["grad_accum_dtype", "'fp16'"],
        ),
        ({"data_types": {"grad_accum_dtype": "bf16"}}, ["grad_accum_dtype", "bf16 is not"]),
        ({"bf16": {"enabled": True}, "communication_data_type": "fp16"}, ["'fp16'"]),
        ({"communication_data_type": "bf16"}, ["communication_data_type"]),
        ({"data_types": {"keep_in_fp32_modules": ["ln"]}}, ["keep_in_fp32_modules"]),
    ],
)
def test_precision_mistakes_are_refused_by_name(extra: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(_cfg(**extra))
    for word in words:
        assert word in str(info.value)


# -- local: against the independent recipe ----------------------------------------------------


@pytest.mark.parametrize("model", ["gpt", "skip"])
@pytest.mark.parametrize(("accum", "comm"), [(None, None), ("fp32", "fp32"), ("fp32", None)])
def test_local_bf16_is_bitwise_the_independent_recipe(
    model: str, accum: str | None, comm: str | None
) -> None:
    run = workers.train("local", model, 2, 4, 2, 2, accum=accum, comm=comm)
    dtype = {None: torch.bfloat16, "fp32": torch.float32, "bf16": torch.bfloat16}
    ref = workers.reference_bf16_model(
        model, 4, 2, 2, accum=dtype[accum], comm=dtype[comm] if comm else torch.bfloat16
    )
    assert run["dtypes"] == ["torch.bfloat16"]
    assert run["losses"] == ref["losses"]
    _assert_bitwise(run["params"], ref["params"], f"local {model} bf16")


def _local_engine(config: dict[str, Any], model: str = "gpt") -> tuple[Any, Any, Any]:
    spec = get_model(model)
    plan = partition(spec.build(0), spec.split_points_for(2))
    dialect = pipedialect.get_dialect("local")
    module = dialect.pipe_engine(plan, config=config, loss_fn=spec.loss_fn)
    return dialect.runtime_engine(module, config=config), plan, spec


def test_master_weights_and_optimizer_state_are_fp32_and_clipping_matches() -> None:
    config = workers.config(2, 2, clip=0.05)
    engine, plan, spec = _local_engine(config)
    data = iter(workers.batches(spec, 6, 2, bf16=True))
    losses = [float(engine.train_batch(data_iter=data)) for _ in range(3)]
    assert {p.dtype for p in plan.stages[0].parameters()} == {torch.bfloat16}
    for group in engine.optimizer.param_groups:
        for master in group["params"]:
            assert master.dtype == torch.float32
            assert {t.dtype for t in engine.optimizer.state[master].values() if t.dim()} == {
                torch.float32
            }
    # The tied weight is one parameter, with one master, in one process.
    assert plan.stages[0].get_parameter("wte.weight") is plan.stages[1].get_parameter(
        "lm_head.weight"
    )
    assert len(engine.mixed.masters) == len(list(engine.module.parameters()))
    data = iter(workers.batches(spec, 6, 2, bf16=True))
    ref = workers.reference_bf16(spec.build(0), spec.loss_fn, data, 3, 2, clip=0.05)
    assert losses == ref["losses"]
    names = dict(plan.stages[0].named_parameters()) | dict(plan.stages[1].named_parameters())
    for name, param in names.items():
        assert torch.equal(param.detach().float(), ref["params"][name]), name


def test_a_non_finite_gradient_skips_the_step_as_deepspeed_does() -> None:
    """DeepSpeed's BF16 optimizer skips a step whose gradient norm is not finite (the
    parameters and the schedule stay as they were) and still counts the step."""
    config = workers.config(2, 2)
    config["scheduler"] = {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2, "warmup_num_steps": 10},
    }
    engine, plan, spec = _local_engine(config, "skip")
    batches = workers.batches(spec, 4, 2, bf16=True)
    before = {n: p.detach().clone() for n, p in plan.stages[0].named_parameters()}
    bad_inputs = batches[0][0].clone()
    bad_inputs[0, 0] = float("inf")
    lr = engine.get_lr()
    iteration = engine.lr_scheduler.last_batch_iteration
    engine.train_batch(data_iter=iter([(bad_inputs, batches[0][1]), batches[1]]))
    assert engine.skipped_steps == 1 and engine.global_steps == 1
    assert engine.get_lr() == lr and engine.lr_scheduler.last_batch_iteration == iteration
    for name, param in plan.stages[0].named_parameters():
        assert torch.equal(param, before[name]), name
    loss = engine.train_batch(data_iter=iter(batches[2:]))  # the next step trains again
    assert math.isfinite(float(loss)) and engine.skipped_steps == 1
    assert engine.lr_scheduler.last_batch_iteration == iteration + 1
    assert any(not torch.equal(p, before[n]) for n, p in plan.stages[0].named_parameters())


def test_a_bf16_checkpoint_resumes_with_its_fp32_master_weights(tmp_path: Path) -> None:
    config = workers.config(2, 2)
    spec = get_model("gpt")
    batches = workers.batches(spec, 8, 2, bf16=True)
    whole, _, _ = _local_engine(config)
    straight = [
        float(whole.train_batch(data_iter=iter(batches[2 * i : 2 * i + 2]))) for i in range(4)
    ]
    first, _, _ = _local_engine(config)
    for i in range(2):
        first.train_batch(data_iter=iter(batches[2 * i : 2 * i + 2]))
    first.save_checkpoint(tmp_path)
    resumed, _, _ = _local_engine(config)
    resumed.load_checkpoint(tmp_path)
    # The bf16 parameters alone are not the masters: resuming from them would change the run.
    for a, b in zip(resumed.mixed.masters, first.mixed.masters, strict=True):
        assert torch.equal(a, b)
    again = [float(resumed.train_batch(data_iter=iter(batches[2 * i : 2 * i + 2]))) for i in (2, 3)]
    assert again == straight[2:]


def test_bf16_demo_model_stays_within_the_band_of_fp32() -> None:
    bf16 = workers.train("local", "gpt", 2, STEPS, 2, 4, clip=1.0)
    fp32 = workers.reference_fp32("gpt", STEPS, 2, 4, clip=1.0)
    _within(bf16["losses"], fp32["losses"], FP32_BAND)


# -- torch and deepspeed: 2 ranks ---------------------------------------------------------------


@pytest.mark.distributed
def test_torch_and_deepspeed_bf16_are_bitwise_equal_and_near_fp32() -> None:
    """30 steps of the demo model (tie across the two ranks) with clipping, DeepSpeed's
    default bf16 (bf16 gradient accumulation)."""
    args = ("gpt", 2, STEPS, 2, 4)
    torch_run = launch(workers.train, 2, "torch", *args, clip=1.0, timeout=600)
    ds_run = launch(workers.train, 2, "deepspeed", *args, clip=1.0, timeout=600)
    assert ds_run[0]["optimizer"] == "BF16_Optimizer"
    assert {d for r in torch_run + ds_run for d in r["dtypes"]} == {"torch.bfloat16"}
    for r in torch_run + ds_run:
        assert r["losses"] == torch_run[0]["losses"]
    _assert_bitwise(_gather(torch_run), _gather(ds_run), "torch vs deepspeed")
    local = workers.train("local", *args, clip=1.0)
    assert local["losses"][0] == torch_run[0]["losses"][0]
    _within(torch_run[0]["losses"], local["losses"], TIE_BAND)
    fp32 = workers.reference_fp32("gpt", STEPS, 2, 4, clip=1.0)
    _within(torch_run[0]["losses"], fp32["losses"], FP32_BAND)


@pytest.mark.distributed
def test_fp32_accumulation_matches_deepspeed_zero1_bf16_optimizer() -> None:
    """DeepSpeed accumulates pipeline gradients in fp32 only under ZeRO stage 1 (at stage 0 it
    raises NotImplementedError); its BF16 optimizer then matches the torch dialect's fp32
    accumulation bitwise, with the gradients rounded to bf16 by the one-replica reduction
    unless communication_data_type is fp32."""
    for comm in (None, "fp32"):
        kwargs = {"accum": "fp32", "comm": comm}
        torch_run = launch(workers.train, 2, "torch", "gpt", 2, 4, 2, 2, **kwargs, timeout=600)
        ds_run = launch(
            workers.train, 2, "deepspeed", "gpt", 2, 4, 2, 2, **kwargs, zero1=True, timeout=600
        )
        assert ds_run[0]["grad_acc_dtype"] == "torch.float32"
        assert torch_run[0]["losses"] == ds_run[0]["losses"]
        _assert_bitwise(_gather(torch_run), _gather(ds_run), f"torch vs deepspeed, comm {comm}")


@pytest.mark.distributed
@pytest.mark.parametrize(("stages", "schedule"), [(2, None), (4, "zbv_zero_bubble")])
def test_torch_bf16_without_a_cross_rank_tie_is_bitwise_local(
    stages: int, schedule: str | None
) -> None:
    """Also on a zero-bubble schedule, whose weight pass runs apart from the input pass: each
    pass hands its gradients to the buffers."""
    args = ("skip", stages, 4, 2, 2)
    torch_run = launch(workers.train, 2, "torch", *args, schedule=schedule, timeout=600)
    assert sorted(k for r in torch_run for k in r["stages"]) == list(range(stages))
    local = workers.train("local", *args)
    assert torch_run[0]["losses"] == local["losses"]
    _assert_bitwise(_gather(torch_run), local["params"], f"torch {schedule} vs local, skip")


# -- parameter groups on torch -----------------------------------------------------------------


@pytest.mark.distributed
def test_torch_param_groups_with_a_tied_weight_match_the_unsplit_model() -> None:
    """AdamW with decay 0.1, biases, norms and the tied embedding exempt: the tie is named
    ``wte.weight`` on both ranks (its group's first name), so it lands in the exempt group on
    both, once per rank."""
    args = ("torch", "gpt", 2, 4, 2, 2)
    runs = launch(
        workers.train, 2, *args, bf16=False, weight_decay=0.1, param_groups=True, timeout=600
    )
    ref = workers.reference_fp32("gpt", 4, 2, 2, weight_decay=0.1, param_groups=True)
    for r in runs:
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-6)
        assert [wd for _, wd in r["groups"]] == [0.1, 0.0]
    params = _gather(runs)
    for name, value in params.items():
        assert_tensor_close(value, ref["params"][name], name)
    # Without the groups, decay would have reached the tied weight: the groups mattered.
    plain = workers.reference_fp32("gpt", 4, 2, 2, weight_decay=0.1)
    assert not torch.allclose(plain["params"]["wte.weight"], ref["params"]["wte.weight"])


# -- the demo ----------------------------------------------------------------------------------


def test_demo_bf16_prints_the_bf16_curve_beside_fp32(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """``pipedialect demo --bf16`` as a user types it (the local dialect: one process)."""
    from pipedialect.cli import main
    from pipedialect.demo import BF16_BAND

    png = tmp_path / "curves.png"
    argv = ["demo", "--dialect", "local", "--steps", "4", "--bf16", "--output", str(png)]
    assert main(argv) == 0
    text = capfd.readouterr().out
    assert "bf16" in text and "fp32" in text and "relative" in text
    assert f"within the {BF16_BAND:.0%} band" in text
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit()]
    assert len([r for r in rows if len(r) == 4 and r[3].endswith("%")]) == 4
