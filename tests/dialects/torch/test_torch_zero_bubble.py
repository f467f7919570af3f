"""torch's zero-bubble schedules on stages their split backward used to get wrong.

One launch of two ranks trains each model of ``_zero_bubble_workers`` on every schedule that
splits backward into input and weight passes; the test process trains the unsplit model on the
same micro-batches with a plain PyTorch loop and compares every loss and every parameter.
"""

from __future__ import annotations

import _zero_bubble_workers as workers
import pytest
import torch
from _compare import ATOL, RTOL, assert_tensor_close
from _reference import steps_from, train_unsplit

from pipedialect.runtime.launch import launch

pytestmark = pytest.mark.distributed

MODELS = ("embed_only", "unused_split_point", "reused_output", "reused_layer")
SCHEDULES = ("zbv_zero_bubble", "interleaved_zero_bubble", "dualpipev")


def reference(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The unsplit model's mean loss per step and its parameters after ``STEPS`` SGD steps."""
    model = workers.build(name)
    opt = torch.optim.SGD(model.parameters(), lr=workers.LR)
    steps = steps_from([iter(workers.batches())], workers.STEPS, workers.GAS)
    losses = train_unsplit(model, opt, steps, workers.loss_fn).losses
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def test_split_backward_schedules_train_these_stages_like_the_unsplit_model() -> None:
    cases = [(m, s) for m in MODELS for s in SCHEDULES]
    launched = launch(workers.run_cases, 2, cases, timeout=600)
    refs = {m: reference(m) for m in MODELS}
    failures = []
    for i, (name, schedule) in enumerate(cases):
        ref_losses, ref_params = refs[name]
        seen: set[str] = set()
        for rank, results in enumerate(launched):
            losses, params = results[i]
            label = f"{name} on {schedule}, rank {rank}"
            if losses != pytest.approx(ref_losses, rel=RTOL, abs=ATOL):
                failures.append(f"{label}: losses {losses} != {ref_losses}")
            for n, value in params.items():
                try:
                    assert_tensor_close(value, ref_params[n], f"{label} {n}")
                except AssertionError as exc:
                    failures.append(str(exc))
            seen.update(params)
        assert seen == set(ref_params), f"{name} on {schedule}: untrained {set(ref_params) - seen}"
    assert not failures, "\n".join(failures)
