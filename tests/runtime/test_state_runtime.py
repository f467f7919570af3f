"""Models with state on every dialect, at run time (bf16 buffers;
one error on every rank).

The reference is always the unsplit model trained by a plain PyTorch loop in one process on the
same micro-batches (``_state_runtime_workers.reference``): losses every step, the evaluation
loss, parameters and buffers after training (fp32: within 1e-6 relative; bf16: bitwise against
DeepSpeed's recipe written out by hand in ``_bf16_workers``). The pipelines run on the local
dialect in this process and on DeepSpeed and torch on two ranks; each distributed dialect runs
the cases of the selected tests in one launch (``_launched``), so selecting one test with ``-k``
launches only its cases.
"""

from __future__ import annotations

import copy
from typing import Any

import _state_runtime_workers as workers
import pytest
import torch
from _compare import ATOL, RTOL, assert_tensor_close
from torch import nn

import pipedialect
from pipedialect.runtime.launch import launch

#: Every rank must have raised within this many seconds of starting the failing phase (an
#: engine is built inside some of them); a hang runs into the launch's timeout instead.
SECONDS = 60.0
LAUNCH_TIMEOUT = 900.0


def _key(case: dict[str, Any]) -> str:
    return repr(sorted(case.items()))


def assert_like_reference(result: dict[str, Any], ref: dict[str, Any], what: str) -> None:
    """One rank's run against the unsplit model: losses, evaluation, parameters, buffers."""
    assert "error" not in result, f"{what}: {result.get('error')}"
    bitwise = bool(result["case"].get("bf16"))
    if bitwise:
        assert result["losses"] == ref["losses"], what
        assert result["eval"] == ref["eval"], what
    else:
        assert result["losses"] == pytest.approx(ref["losses"], rel=RTOL, abs=ATOL), what
        assert result["eval"] == pytest.approx(ref["eval"], rel=RTOL, abs=ATOL), what
    for name, value in result["params"].items():
        expected = ref["params"][name]
        if bitwise:
            assert torch.equal(value, expected), f"{what}: {name}"
        else:
            assert_tensor_close(value, expected, f"{what}: {name}")
    for name, value in result["buffers"].items():
        expected = ref["buffers"][name]
        assert value.dtype == expected.dtype, f"{what}: {name} is {value.dtype}"
        if bitwise or not value.is_floating_point():
            assert torch.equal(value, expected), f"{what}: {name}"
        else:
            assert_tensor_close(value, expected, f"{what}: {name}")
    assert all(result["frozen_unchanged"].values()), f"{what}: {result['frozen_unchanged']}"


# -- the cases -------------------------------------------------------------------------------------

_TORCH_2 = [("1f1b", 2), ("gpipe", 2)]
_TORCH_4 = [("interleaved_1f1b", 4), ("zbv_zero_bubble", 4)]


def _torch(model: str, schedules: list[tuple[str, int]], **extra: Any) -> list[dict[str, Any]]:
    return [{"model": model, "schedule": s, "stages": n, **extra} for s, n in schedules]


#: For each distributed test, the cases each dialect runs.
CASES: dict[str, dict[str, list[dict[str, Any]]]] = {
    # Item 4: recomputation leaves running statistics as one forward would.
    "test_recomputation_never_changes_state_on_deepspeed_and_torch": {
        "deepspeed": [
            {"model": "bn", "interval": 1},
            {"model": "bn", "recompute": "blocks.*"},
            {"model": "scale", "interval": 1},
        ],
        "torch": _torch("bn", [("1f1b", 2)], recompute="blocks.*")
        + _torch("scale", [("interleaved_1f1b", 4)], recompute="blocks.*"),
    },
    # Item 5: the torch dialect's set-up run leaves every buffer as it was.
    "test_torch_setup_leaves_module_state_as_it_was": {
        "torch": _torch("bn", [("1f1b", 2), ("interleaved_1f1b", 4)]),
    },
    # Item 7: an in-place buffer update saved for backward, several forwards in flight.
    "test_in_place_buffer_updates_saved_for_backward_train_on_every_schedule": {
        "deepspeed": [{"model": "scale"}],
        "torch": _torch("scale", [*_TORCH_2, ("zbv_zero_bubble", 4)]),
    },
    # Item 8: in-place operations on the tensors a stage received.
    "test_in_place_operations_on_received_tensors_train_on_every_schedule": {
        "deepspeed": [{"model": "inplace"}],
        "torch": _torch("inplace", _TORCH_2 + _TORCH_4),
    },
    # Item 9: frozen and parameterless stages; a frozen tie with decay groups and clipping.
    "test_stages_with_nothing_to_train_run_and_frozen_parameters_stay_put": {
        "deepspeed": [
            {"model": "frozen_first"},
            {"model": "param_free_last"},
            {"model": "frozen_tie", "optimizer": "adamw", "groups": True, "clip": 1.0},
            {"model": "frozen_gpt_first", "bf16": True},
        ],
        "torch": _torch("frozen_first", [("1f1b", 2), ("interleaved_1f1b", 4)])
        + _torch("param_free_last", [("1f1b", 2)])
        + _torch("frozen_tie", [("1f1b", 2)], optimizer="adamw", groups=True, clip=1.0)
        + _torch("frozen_gpt_first", [("1f1b", 2)], bf16=True),
    },
    # bf16: floating buffers stay fp32 and update like DeepSpeed's recipe on the unsplit model.
    "test_bf16_batchnorm_buffers_stay_fp32_and_equal_the_recipe": {
        "deepspeed": [{"model": "bn_plain", "bf16": True}],
        "torch": _torch("bn_plain", [("1f1b", 2), ("interleaved_1f1b", 4)], bf16=True),
    },
}

_LAUNCHED: dict[str, dict[str, list[dict[str, Any]]]] = {}


def _launched(request: pytest.FixtureRequest, dialect: str) -> dict[str, list[dict[str, Any]]]:
    """Every rank's result for each case of ``dialect`` the selected tests need: one launch."""
    if dialect not in _LAUNCHED:
        selected = {getattr(item, "originalname", item.name) for item in request.session.items}
        cases = [
            case
            for test, per_dialect in CASES.items()
            if test in selected
            for case in per_dialect.get(dialect, [])
        ]
        runs = launch(workers.run, 2, dialect, cases, timeout=LAUNCH_TIMEOUT)
        _LAUNCHED[dialect] = {
            _key(case): [ranks[i] for ranks in runs] for i, case in enumerate(cases)
        }
    return _LAUNCHED[dialect]


def _check_distributed(request: pytest.FixtureRequest, test: str) -> None:
    for dialect, cases in CASES[test].items():
        results = _launched(request, dialect)
        for case in cases:
            ref = workers.reference(case)
            ranks = results[_key(case)]
            stages = sorted(k for r in ranks for k in r.get("stages", []))
            assert stages == list(range(case.get("stages", 2))), (dialect, case, ranks)
            for r in ranks:
                assert_like_reference(r, ref, f"{dialect} {case} stages {r.get('stages')}")
            # Between them the ranks hold every parameter and buffer of the model.
            assert {n for r in ranks for n in r["params"]} == set(ref["params"]), (dialect, case)
            assert {n for r in ranks for n in r["buffers"]} == set(ref["buffers"]), (dialect, case)


# -- item 4: recomputation -------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["bn", "scale"])
def test_local_recomputation_counts_each_batch_once(model: str) -> None:
    """``partition(recompute=...)`` on BatchNorm blocks and on a block that updates a buffer in
    place and divides by it: the buffers after training (``num_batches_tracked`` 12, not 24),
    the evaluation and the weights are the unsplit model's."""
    case = {"model": model, "recompute": "blocks.*"}
    result = workers.run_case("local", case)
    ref = workers.reference(case)
    assert set(result["params"]) == set(ref["params"])
    assert set(result["buffers"]) == set(ref["buffers"])
    tracked = {n: int(b) for n, b in result["buffers"].items() if "num_batches" in n}
    assert set(tracked.values()) <= {12}
    assert_like_reference(result, ref, f"local {case}")


def test_recomputation_starts_from_the_state_the_forward_saw() -> None:
    """A recomputed module that updates a buffer in place and divides by it: its gradients
    use the value the forward used (not the one the forward left), and the buffer is updated
    once per call."""
    from pipedialect.plan.capture._recompute import recomputed  # what the stage graphs call

    block = workers.ScaleBlock(4)
    seeded = copy.deepcopy(block)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(2, 4, generator=gen)
        recomputed(block, x).sum().backward()
        seeded(x).sum().backward()
    assert torch.equal(block.scale.scale, seeded.scale.scale)
    assert torch.allclose(block.scale.scale, torch.full((4,), 0.9**3))
    for (name, p), q in zip(block.named_parameters(), seeded.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


@pytest.mark.distributed
def test_recomputation_never_changes_state_on_deepspeed_and_torch(
    request: pytest.FixtureRequest,
) -> None:
    """DeepSpeed's ``activation_checkpoint_interval`` and ``partition(recompute=...)`` on
    DeepSpeed and torch (1F1B, interleaved 1F1B): the unsplit model's buffers."""
    _check_distributed(request, "test_recomputation_never_changes_state_on_deepspeed_and_torch")


# -- item 5: the torch dialect's set-up run --------------------------------------------------------


@pytest.mark.distributed
def test_torch_setup_leaves_module_state_as_it_was(request: pytest.FixtureRequest) -> None:
    """The run that learns the boundary shapes updates no running statistic: after training,
    every BatchNorm buffer is the unsplit model's (``num_batches_tracked`` 12, not 13)."""
    _check_distributed(request, "test_torch_setup_leaves_module_state_as_it_was")


# -- item 7: in-place buffer updates saved for backward --------------------------------------------


def _wrapped(case: dict[str, Any]) -> tuple[nn.Module, Any, list[Any]]:
    model, plan = workers.build(case)
    reference = copy.deepcopy(model)
    return reference, plan, pipedialect.get_dialect("local").wrap_stages(plan)


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def test_a_second_forward_before_the_first_backward_keeps_the_saved_buffer() -> None:
    """Stage 0 runs micro-batch 2's forward before micro-batch 1's backward, as 1F1B and GPipe
    do: the in-place update of ``scale`` does not touch what micro-batch 1 saved, and the
    gradients and buffers are the unsplit model's (which runs forward, backward, forward,
    backward)."""
    case = {"model": "scale"}
    reference, plan, (first, last) = _wrapped(case)
    (x1, y1), (x2, y2) = workers.batches(case, 2)
    wire1 = first(x1)
    loss1 = workers.mse_loss(last(*wire1), y1)
    wire2 = first(x2)  # the next forward is in flight before the first backward
    loss1.backward()
    workers.mse_loss(last(*wire2), y2).backward()
    for x, y in ((x1, y1), (x2, y2)):
        workers.mse_loss(reference(x), y).backward()
    theirs = _grads(reference)
    ours = {n: g for stage in plan.stages for n, g in _grads(stage).items()}
    assert ours.keys() == theirs.keys()
    for name, grad in ours.items():
        torch.testing.assert_close(grad, theirs[name], rtol=0, atol=0, msg=name)
    buffers = dict(reference.named_buffers())
    for stage in plan.stages:
        for name, buf in stage.named_buffers():
            assert torch.equal(buf, buffers[name]), name


@pytest.mark.distributed
def test_in_place_buffer_updates_saved_for_backward_train_on_every_schedule(
    request: pytest.FixtureRequest,
) -> None:
    """``self.scale.mul_(0.9); return h / self.scale`` on DeepSpeed (1F1B) and torch (1F1B,
    GPipe, ZBV zero bubble): the unsplit model's losses, weights, buffers."""
    _check_distributed(
        request, "test_in_place_buffer_updates_saved_for_backward_train_on_every_schedule"
    )


# -- item 8: in-place operations on received tensors -----------------------------------------------


def test_in_place_operations_on_tensors_received_as_leaves() -> None:
    """A runtime that hands the next stage its inputs as leaves needing a gradient (torch's
    pipelining does): ``h.add_(0.1)`` and ``nn.ReLU(inplace=True)`` on them run, and the
    gradients that reach the previous stage are the unsplit model's."""
    case = {"model": "inplace"}
    reference, plan, (first, last) = _wrapped(case)
    ((x, y),) = workers.batches(case, 1)
    wire = first(x)
    received = [t.detach().requires_grad_(t.requires_grad) for t in wire]
    workers.mse_loss(last(*received), y).backward()
    sent = [(t, r.grad) for t, r in zip(wire, received, strict=True) if t.requires_grad]
    assert sent
    torch.autograd.backward([t for t, _ in sent], [g for _, g in sent])
    workers.mse_loss(reference(x), y).backward()
    theirs = _grads(reference)
    ours = {n: g for stage in plan.stages for n, g in _grads(stage).items()}
    assert ours.keys() == theirs.keys()
    for name, grad in ours.items():
        torch.testing.assert_close(grad, theirs[name], rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.distributed
def test_in_place_operations_on_received_tensors_train_on_every_schedule(
    request: pytest.FixtureRequest,
) -> None:
    """In-place operations right after each split point, and on a value that crosses every
    boundary, on DeepSpeed and on torch's 1F1B, GPipe, interleaved and ZBV schedules."""
    _check_distributed(
        request, "test_in_place_operations_on_received_tensors_train_on_every_schedule"
    )


# -- item 9: nothing to train ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    [
        {"model": "frozen_first"},
        {"model": "param_free_last"},
        {"model": "frozen_tie", "optimizer": "adamw", "groups": True, "clip": 1.0},
        {"model": "frozen_gpt_first", "bf16": True},
    ],
    ids=["frozen_first", "param_free_last", "frozen_tie", "frozen_gpt_first_bf16"],
)
def test_local_frozen_and_parameterless_stages(case: dict[str, Any]) -> None:
    result = workers.run_case("local", case)
    assert_like_reference(result, workers.reference(case), f"local {case}")


def test_an_engine_with_nothing_to_train_builds_and_evaluates() -> None:
    """Every parameter frozen: the engine builds (its optimizer, the config's, holds nothing)
    and evaluates like the unsplit model; a training step is refused by name, since the loss
    needs no gradient (the unsplit model's backward would fail too), and changes nothing."""
    from pipedialect import ConfigError

    case = {"model": "bn"}
    model, plan = workers.build(case)
    for param in model.parameters():
        param.requires_grad_(False)
    reference = copy.deepcopy(model)
    cfg = workers.config(case)
    dialect = pipedialect.get_dialect("local")
    engine = dialect.runtime_engine(
        dialect.pipe_engine(plan, config=cfg, loss_fn=workers.mse_loss), config=cfg
    )
    assert type(engine.optimizer).__name__ == "Adam"
    assert [p for g in engine.optimizer.param_groups for p in g["params"]] == []
    data = workers.batches(case, 4)
    reference.eval()
    with torch.no_grad():
        expected = sum(float(workers.mse_loss(reference(x), y)) for x, y in data) / 4
    assert float(engine.eval_batch(iter(data))) == pytest.approx(expected, rel=RTOL)
    with pytest.raises(ConfigError, match="nothing to train"):
        engine.train_batch(iter(data))
    for (name, param), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(param, theirs), name


@pytest.mark.distributed
def test_stages_with_nothing_to_train_run_and_frozen_parameters_stay_put(
    request: pytest.FixtureRequest,
) -> None:
    """A frozen first stage (LoRA-like; also under bf16, against DeepSpeed's recipe bitwise), a
    parameterless last stage, and a frozen tied embedding with AdamW decay groups and clipping,
    on DeepSpeed and torch: frozen parameters bitwise unchanged (under bf16: as cast), the others
    as the unsplit model trained with the same frozen set."""
    _check_distributed(
        request, "test_stages_with_nothing_to_train_run_and_frozen_parameters_stay_put"
    )


# -- bf16 ------------------------------------------------------------------------------------------


def test_bf16_casts_parameters_as_deepspeed_does_and_keeps_buffers() -> None:
    """DeepSpeed 0.19.8 casts fp16/bf16/fp32/fp64 parameters (frozen ones too) and no buffer."""
    from pipedialect.engine.precision import cast_parameters

    module = nn.Module()
    module.w = nn.Parameter(torch.ones(2, dtype=torch.float64))
    module.frozen = nn.Parameter(torch.ones(2), requires_grad=False)
    module.register_buffer("stats", torch.ones(2))
    module.register_buffer("wide", torch.ones(2, dtype=torch.float64))
    module.register_buffer("count", torch.zeros((), dtype=torch.long))
    cast_parameters(module, torch.bfloat16)
    assert (module.w.dtype, module.frozen.dtype) == (torch.bfloat16, torch.bfloat16)
    assert (module.stats.dtype, module.wide.dtype, module.count.dtype) == (
        torch.float32,
        torch.float64,
        torch.long,
    )


def test_local_bf16_batchnorm_buffers_stay_fp32_and_equal_the_recipe() -> None:
    case = {"model": "bn_plain", "bf16": True}
    result = workers.run_case("local", case)
    assert {b.dtype for n, b in result["buffers"].items() if "running" in n} == {torch.float32}
    assert_like_reference(result, workers.reference(case), "local bf16")


@pytest.mark.distributed
def test_bf16_batchnorm_buffers_stay_fp32_and_equal_the_recipe(
    request: pytest.FixtureRequest,
) -> None:
    """BatchNorm (running statistics only) under ``"bf16": {"enabled": true}`` on DeepSpeed and
    torch: fp32 buffers, bitwise the recipe's losses, weights, buffers and evaluation."""
    _check_distributed(request, "test_bf16_batchnorm_buffers_stay_fp32_and_equal_the_recipe")


# -- one error, every rank -------------------------------------------------------------------------


def test_agreed_without_a_process_group_runs_the_block() -> None:
    from pipedialect.runtime.agreement import agreed

    with pytest.raises(ValueError, match="plain"), agreed("a phase"):
        raise ValueError("plain")
    with agreed("a phase"):
        pass


def _assert_every_rank_raised(
    runs: list[dict[str, Any]], name: str, error: str, words: list[str], rank: int | None
) -> None:
    for r in runs:
        record = r[name]
        where = f"rank {r['rank']} {name}"
        assert record["error"] == error, (where, record)
        assert "PipeDialectError" in record["bases"], where
        for word in words:
            assert word in record["message"], (where, record["message"])
        if rank is not None:
            assert record["attrs"]["rank"] == rank, (where, record)
        assert record["seconds"] < SECONDS, (where, record["seconds"])


@pytest.mark.distributed
@pytest.mark.parametrize("dialect", ["deepspeed", "torch"])
def test_an_error_on_one_rank_is_raised_on_every_rank(dialect: str) -> None:
    """A loss that raises on the last stage mid-step, a data iterator that raises on one rank,
    a checkpoint save that fails on one rank, an engine build that fails on one rank, a loss
    that raises in ``eval_batch`` and a tied weight frozen on one rank only: every rank raises
    the same named error with the original message and the rank it came from, within seconds;
    no bare "Connection closed", no hang."""
    runs = launch(workers.failures, 2, dialect, timeout=LAUNCH_TIMEOUT)
    _assert_every_rank_raised(
        runs, "loss", "RankFailedError", ["train_batch (step 2)", "injected loss failure"], 1
    )
    # Once the process group is shut down, the next step says so at once.
    _assert_every_rank_raised(runs, "after_loss", "RankFailedError", ["Restart the run"], 1)
    _assert_every_rank_raised(runs, "data", "DataError", ["injected data failure"], None)
    for r in runs:
        assert r["after_data"] == {"error": None, "seconds": r["after_data"]["seconds"]}
    save_error = "RankFailedError" if dialect == "deepspeed" else "CheckpointError"
    _assert_every_rank_raised(runs, "save", save_error, ["injected save failure"], None)
    _assert_every_rank_raised(
        runs, "build", "RankFailedError", ["runtime_engine", "injected build failure"], 0
    )
    _assert_every_rank_raised(
        runs, "eval", "RankFailedError", ["eval_batch", "injected eval failure"], 1
    )
    # A tied weight frozen on one rank only: refused by name on both, before any step.
    _assert_every_rank_raised(
        runs, "tie", "TieError", ["'wte.weight'", "frozen", "every rank"], None
    )
    for r in runs:
        assert not r["shut_down"]["data"], "an error agreed at the step's start keeps the group"
        assert r["shut_down"]["loss"] and r["shut_down"]["eval"]
