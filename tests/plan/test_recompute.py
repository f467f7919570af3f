"""``partition(..., recompute=...)``: modules recomputed in backward, inside the stage graphs.

References: the unsplit model run by hand from the same RNG state (dropout included), and the
same plan built without ``recompute=``. Recomputation is observed, not assumed: a forward
hook on each recomputed module counts two calls per training micro-batch.
"""

from __future__ import annotations

import copy
from typing import Any

import _ds_workers as ds_workers
import _model_registry
import _torch_workers as torch_workers
import pytest
import torch
from _compare import ATOL, RTOL, assert_tensor_close
from _reference import steps_from, train_unsplit
from torch import nn

import pipedialect
from pipedialect import RecomputeError, partition
from pipedialect.models import TinyGPT, cross_entropy_loss, seeded_init
from pipedialect.runtime.launch import launch


class DropBlock(nn.Module):
    """A residual MLP block with dropout inside, so recomputation must replay the mask."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.fc2(self.drop(torch.relu(self.fc1(x))))
        return out


class DropStack(nn.Module):
    def __init__(self, dim: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(4, dim)
        self.blocks = nn.ModuleList(DropBlock(dim) for _ in range(depth))
        self.out = nn.Linear(dim, 3)
        seeded_init(self, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        out: torch.Tensor = self.out(h)
        return out


def _counters(root: nn.Module, paths: list[str]) -> dict[str, list[int]]:
    counts: dict[str, list[int]] = {}
    for path in paths:
        counts[path] = [0]
        # A pre-hook: non-reentrant recomputation stops as soon as backward has what it needs.
        root.get_submodule(path).register_forward_pre_hook(
            lambda *_, c=counts[path]: c.__setitem__(0, c[0] + 1)
        )
    return counts


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_step(
    plan: Any, model: nn.Module, reference: nn.Module, x: torch.Tensor, target: torch.Tensor
) -> None:
    """The plan's output and ``model``'s gradients equal the unsplit ``reference``'s, exactly,
    from the same RNG state (every dropout mask the same)."""
    torch.manual_seed(7)
    expected = reference(x)
    torch.nn.functional.mse_loss(expected, target).backward()
    torch.manual_seed(7)
    ours = plan.graph(x)
    torch.nn.functional.mse_loss(ours, target).backward()
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    theirs = _grads(reference)
    assert _grads(model).keys() == theirs.keys()
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, theirs[name], rtol=0, atol=0, msg=name)


def test_checkpointed_plan_equals_the_unsplit_model_with_dropout_and_recomputes() -> None:
    """Outputs and gradients equal the unsplit model's from the same RNG state (the dropout
    masks replayed in recomputation); each recomputed block ran twice, the rest once."""
    model = DropStack()
    reference = copy.deepcopy(model)
    plan = partition(model, ["blocks.1"], recompute="blocks.*")
    assert plan.recomputed == ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
    assert dict(plan.stages[0].named_parameters()).keys() == {
        n
        for n, _ in reference.named_parameters()
        if n.startswith(("inp.", "blocks.0.", "blocks.1."))
    }
    counts = _counters(plan.stages[1], ["blocks.2", "blocks.3", "out"])
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    target = torch.randn(5, 3, generator=torch.Generator().manual_seed(2))
    _assert_same_step(plan, model, reference, x, target)
    assert {p: c[0] for p, c in counts.items()} == {"blocks.2": 2, "blocks.3": 2, "out": 1}
    with torch.no_grad():
        plan.graph(x)
    assert counts["blocks.2"][0] == 3  # no recomputation without a backward


def _train_local(plan: Any, batches: list[Any], seed: int) -> list[float]:
    config = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1000,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
    }
    dialect = pipedialect.get_dialect("local")
    loss_fn = torch.nn.functional.mse_loss
    engine = dialect.runtime_engine(
        dialect.pipe_engine(plan, config=config, loss_fn=loss_fn), config=config
    )
    torch.manual_seed(seed)
    data = iter(batches)
    return [float(engine.train_batch(data)) for _ in range(3)]


def test_local_training_with_checkpoint_equals_training_without() -> None:
    """Three SGD steps on the local dialect, with dropout: identical losses and weights."""
    gen = torch.Generator().manual_seed(3)
    batches = [
        (torch.randn(2, 4, generator=gen), torch.randn(2, 3, generator=gen)) for _ in range(12)
    ]
    plain_model, ckpt_model = DropStack(), DropStack()
    plain = partition(plain_model, ["blocks.0", "blocks.2"])
    ckpt = partition(ckpt_model, ["blocks.0", "blocks.2"], recompute=["blocks.*", "out"])
    assert ckpt.fingerprint() != plain.fingerprint()
    assert ckpt.tie_groups == plain.tie_groups
    counts = _counters(ckpt.stages[2], ["blocks.3"])
    assert _train_local(ckpt, batches, 11) == _train_local(plain, batches, 11)
    assert counts["blocks.3"][0] == 2 * 4 * 3
    theirs = dict(plain_model.named_parameters())
    for name, param in ckpt_model.named_parameters():
        torch.testing.assert_close(param, theirs[name], rtol=0, atol=0, msg=name)


def test_checkpoint_keeps_ties_names_and_a_deterministic_fingerprint() -> None:
    """A tied GPT: the same tie groups and parameter names as without checkpointing, and two
    partitions of the same model give the same fingerprint."""
    model = TinyGPT()
    plain = partition(model, ["blocks.1"])
    first = partition(model, ["blocks.1"], recompute=["blocks.*", "lm_head"])
    second = partition(model, ["blocks.1"], recompute=["blocks.*", "lm_head"])
    assert first.fingerprint() == second.fingerprint()
    assert first.tie_groups == plain.tie_groups and first.tie_groups
    for a, b in zip(first.stages, plain.stages, strict=True):
        assert list(dict(a.named_parameters()).items()) == list(dict(b.named_parameters()).items())
    assert "Recomputed in backward" in first.describe()


def test_checkpoint_composes_with_balance() -> None:
    """num_stages + balance="memory" with recomputed blocks: no split point is chosen inside
    a recomputed block, and the plan trains like the unsplit model on the local dialect."""
    model = TinyGPT()
    reference = copy.deepcopy(model)
    ids = torch.zeros(2, 8, dtype=torch.long)
    plan = partition(
        model,
        num_stages=3,
        balance="memory",
        balance_inputs={"input_ids": ids},
        recompute="blocks.*",
        micro_batches=4,
    )
    for point in plan.split_points:
        assert not any(point.startswith(c + ".") for c in plan.recomputed), point
    gen = torch.Generator().manual_seed(5)
    batches = [
        (torch.randint(0, 32, (2, 8), generator=gen), torch.randint(0, 32, (2, 8), generator=gen))
        for _ in range(12)
    ]
    config = _model_registry.ds_config("sgd", gas=4, micro=2, dp=1)
    dialect = pipedialect.get_dialect("local")
    engine = dialect.runtime_engine(
        dialect.pipe_engine(plan, config=config, loss_fn=cross_entropy_loss), config=config
    )
    data = iter(batches)
    losses = [float(engine.train_batch(data)) for _ in range(3)]
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    steps = steps_from([iter(batches)], 3, 4)
    expected = train_unsplit(reference, opt, steps, cross_entropy_loss).losses
    assert_tensor_close(torch.tensor(losses), torch.tensor(expected), "losses")


def test_export_capture_recomputes_regions_with_the_unsplit_models_numbers() -> None:
    """With example_inputs (torch.export: no module calls), each recomputed block's nodes run
    as one region through the checkpoint: outputs and gradients equal the unsplit model's
    from the same RNG state (dropout replayed), the parameter names are the plan's without
    recomputation, and each region runs twice per backward, once without one."""
    model, reference = DropStack(), DropStack()
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    plain = partition(DropStack(), ["blocks.1"], example_inputs=(x,))
    plan = partition(model, ["blocks.1"], recompute="blocks.*", example_inputs=(x,))
    assert plan.recomputed == ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
    for ours, theirs in zip(plan.stages, plain.stages, strict=True):
        assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    regions = [m for s in plan.stages for n, m in s.named_children() if n.startswith("recomputed")]
    assert len(regions) == 4
    counts = [0]
    for region in regions:
        region.register_forward_pre_hook(lambda *_: counts.__setitem__(0, counts[0] + 1))
    target = torch.randn(5, 3, generator=torch.Generator().manual_seed(2))
    model.train()
    reference.train()
    _assert_same_step(plan, model, reference, x, target)
    assert counts[0] == 2 * 4
    with torch.no_grad():
        plan.graph(x)
    assert counts[0] == 2 * 4 + 4


def test_bad_checkpoint_requests_are_refused_by_name() -> None:
    model = TinyGPT()
    with pytest.raises(RecomputeError, match=r"'blokcs\.\*' matches no module.*blocks"):
        partition(model, ["blocks.1"], recompute="blokcs.*")
    with pytest.raises(RecomputeError, match=r"'blocks\.1\.attn' is inside .*'blocks\.1'"):
        partition(model, ["blocks.1.attn"], recompute="blocks.1")
    normed = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    with pytest.raises(RecomputeError, match=r"'1' writes '1\.num_batches_tracked' in place"):
        partition(normed, ["0"], recompute="1", example_inputs=(torch.randn(3, 4),))
    encoder = nn.Sequential(nn.Linear(4, 4), nn.TransformerEncoderLayer(4, 1, 8))
    with pytest.raises(RecomputeError, match=r"'1\.linear1'.*inside '1'"):
        partition(encoder, ["0"], recompute="1.linear1")
    with pytest.raises(RecomputeError, match="not a module path"):
        partition(model, ["blocks.1"], recompute=[""])


@pytest.mark.distributed
def test_deepspeed_and_torch_checkpoint_train_like_the_unsplit_model() -> None:
    """DropNet on 2 ranks with ``recompute=["block0", "drop*", "head"]``, on DeepSpeed's
    PipelineEngine and on torch.distributed.pipelining: the losses, gradients (DeepSpeed) and
    weights of the unsplit model drawing the same dropout masks, and each recomputed module
    ran twice per training micro-batch."""
    ref = _model_registry.checkpoint_reference("dropnet")
    runs = {
        "deepspeed": launch(ds_workers.module_checkpoint_run, 2, timeout=300),
        "torch": launch(torch_workers.module_checkpoint_run, 2, timeout=300),
    }
    for dialect, results in runs.items():
        assert sorted(r["stage"] for r in results) == [0, 1], dialect
        for r in results:
            where = f"{dialect} stage {r['stage']}"
            assert r["losses"] == pytest.approx(ref["losses"], rel=RTOL, abs=ATOL), where
            for n, value in r["params"].items():
                assert_tensor_close(value, ref["params"][n].detach(), f"{where}: {n}")
            # Two calls per training micro-batch (forward, recomputation); the torch dialect's
            # first step also runs one forward to learn the boundary shapes.
            steps = [b - a for a, b in zip([0, *r["calls"]], r["calls"], strict=False)]
            assert steps[1:] == [2 * 2, 2 * 2], (where, r["calls"])
            if dialect == "deepspeed":
                assert steps[0] == 2 * 2, (where, r["calls"])
            for step, grads in enumerate(r.get("grads", [])):
                for n, g in grads.items():
                    assert_tensor_close(g, ref["grads"][step][n], f"{where} step {step}: {n}")
    assert "recomputed" in runs["deepspeed"][0]["code"]
