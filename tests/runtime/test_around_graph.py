"""Equivalence around the graph: per-module train/eval modes, custom autograd Functions, hooks
and values the training loop sets, on every dialect and both capture paths.

The reference is the unsplit model trained by a plain PyTorch loop in one process on the same
micro-batches (``_state_runtime_workers.reference``, which puts the model in the same modes as
the user would: ``model.train()`` then the case's frozen modules). The local dialect runs in this
process; DeepSpeed and torch run every distributed case of the selected tests in one two-rank
launch per dialect.
"""

from __future__ import annotations

from typing import Any

import _state_runtime_workers as workers
import pytest
import torch
from _compare import ATOL, RTOL, assert_tensor_close

import pipedialect
from pipedialect.plan.partition import partition
from pipedialect.runtime.launch import launch

LAUNCH_TIMEOUT = 900.0


def _key(case: dict[str, Any]) -> str:
    return repr(sorted(case.items()))


def assert_like_reference(result: dict[str, Any], ref: dict[str, Any], what: str) -> None:
    """One rank's run against the unsplit model: losses, evaluation, parameters, buffers."""
    assert "error" not in result, f"{what}: {result.get('error')}"
    assert result["losses"] == pytest.approx(ref["losses"], rel=RTOL, abs=ATOL), what
    assert result["eval"] == pytest.approx(ref["eval"], rel=RTOL, abs=ATOL), what
    for name, value in result["params"].items():
        assert_tensor_close(value, ref["params"][name], f"{what}: {name}")
    for name, value in result["buffers"].items():
        expected = ref["buffers"][name]
        if value.is_floating_point():
            assert_tensor_close(value, expected, f"{what}: {name}")
        else:
            assert torch.equal(value, expected), f"{what}: {name}"


# -- the cases -------------------------------------------------------------------------------------

#: Cases that must train like the unsplit model, per test.
CASES: dict[str, list[dict[str, Any]]] = {
    "modes": [
        {"model": "frozen_bn"},
        {"model": "frozen_bn", "export": True},
        {"model": "norms_eval"},
        {"model": "norms_eval", "export": True},
        {"model": "frozen_bn", "stages": 4},
    ],
    "functions": [{"model": "reversal"}],
    "hooks": [
        {"model": "hooks"},
        {"model": "forward_hooks", "export": True},
        {"model": "leaf_hook_after"},
    ],
    "loop_values": [{"model": "anneal_buffer"}, {"model": "anneal_buffer", "export": True}],
}

#: Cases refused by name on every rank before any step: (case, exception name, words).
REFUSED: dict[str, list[tuple[dict[str, Any], str, str]]] = {
    "functions": [({"model": "reversal", "export": True}, "CaptureError", "GradScale")],
    "hooks": [
        ({"model": "hooks", "export": True}, "CaptureError", "['blocks.3'] have backward hooks"),
        ({"model": "hook_after"}, "ModelChangedError", "forward hook of 'blocks.2'"),
        ({"model": "hook_after", "export": True}, "ModelChangedError", "of 'blocks.2'"),
        ({"model": "leaf_hook_after", "export": True}, "ModelChangedError", "'blocks.2.lin'"),
    ],
    "loop_values": [
        ({"model": "anneal_float"}, "ModelChangedError", "blocks.2.gain is 0.5 now"),
        ({"model": "anneal_float", "export": True}, "ModelChangedError", "blocks.2.gain is 0.5"),
    ],
}

#: Which cases each distributed dialect runs (torch: 1F1B; four stages interleaved).
_TORCH_SCHEDULES = {2: "1f1b", 4: "interleaved_1f1b"}


def _for(dialect: str, case: dict[str, Any]) -> dict[str, Any]:
    if dialect == "torch":
        return {**case, "schedule": _TORCH_SCHEDULES[case.get("stages", 2)]}
    return dict(case)


def _cases(dialect: str, groups: set[str]) -> list[dict[str, Any]]:
    out = [_for(dialect, c) for g in sorted(groups) for c in CASES.get(g, [])]
    out += [_for(dialect, c) for g in sorted(groups) for c, _, _ in REFUSED.get(g, [])]
    return [c for c in out if dialect == "torch" or c.get("stages", 2) == 2]


_LAUNCHED: dict[str, dict[str, list[dict[str, Any]]]] = {}
_GROUP_OF_TEST = {
    "test_per_module_modes_on_deepspeed_and_torch": "modes",
    "test_custom_autograd_functions_on_deepspeed_and_torch": "functions",
    "test_hooks_on_deepspeed_and_torch": "hooks",
    "test_values_the_loop_sets_on_deepspeed_and_torch": "loop_values",
}


def _launched(request: pytest.FixtureRequest, dialect: str) -> dict[str, list[dict[str, Any]]]:
    """Every rank's result for each case of the selected tests on ``dialect``: one launch."""
    if dialect not in _LAUNCHED:
        selected = {getattr(item, "originalname", item.name) for item in request.session.items}
        groups = {g for test, g in _GROUP_OF_TEST.items() if test in selected}
        cases = _cases(dialect, groups)
        runs = launch(workers.run, 2, dialect, cases, timeout=LAUNCH_TIMEOUT)
        _LAUNCHED[dialect] = {
            _key(case): [ranks[i] for ranks in runs] for i, case in enumerate(cases)
        }
    return _LAUNCHED[dialect]


def _check_distributed(request: pytest.FixtureRequest, group: str) -> None:
    for dialect in ("deepspeed", "torch"):
        results = _launched(request, dialect)
        for case in CASES.get(group, []):
            if dialect != "torch" and case.get("stages", 2) != 2:
                continue
            run_case = _for(dialect, case)
            ref = workers.reference(case)
            ranks = results[_key(run_case)]
            for r in ranks:
                assert_like_reference(r, ref, f"{dialect} {run_case} stages {r.get('stages')}")
            assert {n for r in ranks for n in r["params"]} == set(ref["params"]), run_case
        for case, error, words in REFUSED.get(group, []):
            ranks = results[_key(_for(dialect, case))]
            for r in ranks:
                assert r.get("error", "").startswith(error), (dialect, case, r.get("error"))
                assert words in r["error"], (dialect, case, r["error"])


# -- item: per-module train/eval modes -------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    [c for c in CASES["modes"] if c.get("stages", 2) == 2],
    ids=lambda c: f"{c['model']}{'-export' if c.get('export') else ''}",
)
def test_local_per_module_modes_train_like_the_unsplit_model(case: dict[str, Any]) -> None:
    """A BatchNorm frozen with ``bn.eval()`` after ``model.train()``, and a ``train()`` override
    that keeps every norm in eval: losses, evaluation, weights and running statistics (the
    frozen ones untouched) are the unsplit model's, on both capture paths."""
    result = workers.run_case("local", case)
    ref = workers.reference(case)
    assert_like_reference(result, ref, f"local {case}")
    frozen = workers.spec_of(case).modes
    if case["model"] == "frozen_bn":
        assert frozen is not None
        initial = torch.zeros(8)
        for path in ("blocks.0.bn", "blocks.2.bn"):
            assert torch.equal(result["buffers"][f"{path}.running_mean"], initial), path
            # The export path's stages hold no buffer a frozen norm never reads.
            count = result["buffers"].get(f"{path}.num_batches_tracked", torch.tensor(0))
            assert int(count) == 0, path


@pytest.mark.parametrize("export", [False, True])
def test_plan_records_and_stages_apply_each_modules_mode(export: bool) -> None:
    """The plan records the frozen norm's flag in both patterns; a stage wrapper's ``train()``
    puts it back in eval while everything else trains, and ``eval()`` evaluates everything."""
    case = {"model": "frozen_bn", "export": export}
    model, plan = workers.build(case)
    assert plan.module_modes["blocks.0.bn"] == (False, False)
    assert plan.module_modes["blocks.2.bn"] == (False, False)
    assert "blocks.1.bn" not in plan.module_modes
    module = pipedialect.get_dialect("local").pipe_engine(
        plan, config=workers.config(case), loss_fn=workers.mse_loss
    )
    module.train()
    if not export:  # the fx stages call the model's BatchNorm modules themselves
        assert not model.blocks[0].bn.training and not model.blocks[2].bn.training
        assert model.blocks[1].bn.training and model.blocks[3].bn.training
    module.eval()
    if not export:
        assert not any(m.training for m in model.modules() if isinstance(m, torch.nn.BatchNorm1d))
    assert not any(s.training for s in plan.stages)
    module.train()
    assert all(s.training for s in plan.stages)


def test_a_model_partitioned_in_eval_mode_trains_with_its_own_train_patterns() -> None:
    """A model partitioned in eval mode: its training pattern is what its ``train()`` gives
    (the override keeps the norms in eval)."""
    model = workers.NormsEvalNet(seed=0)
    model.eval()
    plan = partition(model, ["blocks.1"])
    assert all(plan.module_modes[f"blocks.{i}.bn"] == (False, False) for i in range(4)), (
        plan.module_modes
    )
    assert not model.training  # left as it was


@pytest.mark.distributed
def test_per_module_modes_on_deepspeed_and_torch(request: pytest.FixtureRequest) -> None:
    """Frozen norms and a ``train()`` override on DeepSpeed and torch (1F1B; interleaved with
    four stages), both capture paths: the unsplit model's losses, weights and statistics."""
    _check_distributed(request, "modes")


# -- item: custom autograd Functions ---------------------------------------------------------------


def test_local_custom_autograd_function_keeps_its_backward() -> None:
    """A gradient-scaling ``torch.autograd.Function`` in every block (fx capture): the stage
    graph calls ``apply``, so its backward runs and training equals the unsplit model's."""
    case = {"model": "reversal"}
    _, plan = workers.build(case)
    code = "\n".join(stage.code for stage in plan.stages)
    assert "GradScale_apply" in code and "view_as" not in code
    assert_like_reference(workers.run_case("local", case), workers.reference(case), "local")


def test_export_refuses_custom_autograd_function_by_name() -> None:
    """torch.export drops a Function's backward: the capture refuses it, naming the Function
    and the capture that keeps it."""
    with pytest.raises(pipedialect.CaptureError, match=r"GradScale.*without example_inputs"):
        workers.build({"model": "reversal", "export": True})


def test_verify_checks_gradients_so_a_dropped_backward_never_passes() -> None:
    """A stage whose Function call is replaced by its forward (what a capture that loses the
    backward produces) computes the model's forward exactly; ``plan.verify`` still refuses it,
    naming the stage and a parameter whose gradient differs."""
    from pipedialect.plan.capture._functions import function_call

    _, plan = workers.build({"model": "reversal"})
    x = workers.batches({"model": "reversal"}, 1)[0][0]
    plan.verify(x)  # the plan as captured: forward and gradients agree
    target = function_call(workers.GradScale)
    for stage in plan.stages:
        for node in stage.graph.nodes:
            if node.op == "call_function" and node.target is target:
                node.target = torch.Tensor.view_as
                node.args = (node.args[0], node.args[0])
        stage.recompile()
    with pytest.raises(pipedialect.PlanMismatchError, match=r"\[Stage \d\] parameter '.*' has a"):
        plan.verify(x)


@pytest.mark.distributed
def test_custom_autograd_functions_on_deepspeed_and_torch(request: pytest.FixtureRequest) -> None:
    """The Function's backward runs on DeepSpeed and torch as in the unsplit model; the
    torch.export capture is refused on every rank with a ``CaptureError`` naming it."""
    _check_distributed(request, "functions")


# -- item: hooks -----------------------------------------------------------------------------------


def _ids(case: dict[str, Any]) -> str:
    return f"{case['model']}{'-export' if case.get('export') else ''}"


@pytest.mark.parametrize("case", CASES["hooks"], ids=_ids)
def test_local_hooks_behave_as_in_the_unsplit_model(case: dict[str, Any]) -> None:
    """A forward hook and a pre-forward hook on captured blocks, a full backward hook (torch.fx:
    the block becomes one call), a parameter's tensor hook, all registered before partition;
    and a forward hook added to a leaf after partition (the fx stages call that very module):
    training equals the unsplit model's with the same hooks."""
    assert_like_reference(workers.run_case("local", case), workers.reference(case), "local")


@pytest.mark.parametrize(("case", "error", "words"), REFUSED["hooks"], ids=lambda v: str(v))
def test_local_hooks_the_stages_cannot_run_are_refused_by_name(
    case: dict[str, Any], error: str, words: str
) -> None:
    """A backward hook under torch.export (at partition), and a hook added after partition to a
    module whose code the stages hold (at the next step, before it runs)."""
    with pytest.raises(getattr(pipedialect, error)) as info:
        workers.run_case("local", case)
    assert words in str(info.value)


@pytest.mark.distributed
def test_hooks_on_deepspeed_and_torch(request: pytest.FixtureRequest) -> None:
    """The hooks cases on DeepSpeed and torch: equal to the unsplit model, or refused by name on
    every rank."""
    _check_distributed(request, "hooks")


# -- item: values the loop sets --------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES["loop_values"], ids=_ids)
def test_local_buffers_the_loop_sets_reach_the_stages(case: dict[str, Any]) -> None:
    """``model.blocks[i].temp = torch.tensor(1 / (1 + step))`` (a buffer re-assigned) and
    ``temp.fill_(...)`` (in place) before every step: the stages compute with the new values,
    as the unsplit model does, on both capture paths."""
    assert_like_reference(workers.run_case("local", case), workers.reference(case), "local")


@pytest.mark.parametrize(("case", "error", "words"), REFUSED["loop_values"], ids=lambda v: str(v))
def test_local_python_values_the_loop_sets_are_refused_by_name(
    case: dict[str, Any], error: str, words: str
) -> None:
    """``model.blocks[2].gain = 1 / (1 + step)``: a plain float the capture wrote into the
    graph; the second step refuses it, naming the attribute, both values and the fix."""
    with pytest.raises(getattr(pipedialect, error)) as info:
        workers.run_case("local", case)
    assert words in str(info.value) and "register_buffer" in str(info.value)
    assert info.value.path == "blocks.2.gain"


@pytest.mark.parametrize("export", [False, True])
def test_dropout_probability_changed_by_the_loop(export: bool) -> None:
    """``nn.Dropout.p`` changed after partition: the torch.fx stages call the Dropout module,
    which reads ``p`` at every call (followed); torch.export wrote ``p`` into the graph
    (refused by name before the next step)."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.drop = torch.nn.Dropout(0.0)
            self.b = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.b(self.drop(self.a(x)))
            return out

    model = Net()
    kwargs = {"example_inputs": (torch.randn(2, 4),)} if export else {}
    plan = partition(model, ["a"], **kwargs)
    before_step = plan.stage_spec(1).before_step
    assert before_step is not None
    model.drop.p = 1.0
    if export:
        with pytest.raises(pipedialect.ModelChangedError, match=r"drop\.p is 1\.0 now"):
            before_step(True)
    else:
        before_step(True)
        out = plan.stages[1](torch.ones(2, 4))
        assert torch.equal(out, model.b(torch.zeros(2, 4)))  # p = 1 drops everything


@pytest.mark.distributed
def test_values_the_loop_sets_on_deepspeed_and_torch(request: pytest.FixtureRequest) -> None:
    """Re-assigned and in-place buffers reach every rank's stages; a plain float the capture
    wrote into the graph is refused by name on every rank at the next step."""
    _check_distributed(request, "loop_values")
