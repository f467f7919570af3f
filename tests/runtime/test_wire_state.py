"""The wire's state machine: training and evaluation in any order, and resets of its shapes.

What a boundary sends depends on the grad mode (under ``no_grad`` every float looks alike), on
whether the layout is frozen (static shapes) and on resets (``reset_activation_shape``). Each
test runs a sequence of training and evaluation batches on the local dialect, which chains the
same stage wrappers as a distributed run, and compares every loss with the unsplit model trained
by hand on the same micro-batches.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _model_registry import NoGradFloatFirst, float_batches, gpt16, token_batches
from _reference import train_unsplit
from torch import nn

import pipedialect
from pipedialect import StructureChangedError, partition
from pipedialect.models import cross_entropy_loss, mse_loss
from pipedialect.runtime.codec import SchemaCodec
from pipedialect.runtime.wire import WireDecoder, WireEncoder

GAS = 2
RTOL = 1e-6
LR = 0.1

Batch = tuple[torch.Tensor, torch.Tensor]


def _config() -> dict[str, Any]:
    return {
        "train_batch_size": 2 * GAS,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
    }


def _local_engine(model: nn.Module, split: str, loss_fn: Any, *, dynamic: bool) -> Any:
    dialect = pipedialect.get_dialect("local")
    plan = partition(model, [split])
    module = dialect.pipe_engine(plan, config=_config(), loss_fn=loss_fn, dynamic_shapes=dynamic)
    return dialect.runtime_engine(module, config=_config())


class Reference:
    """The unsplit model, trained and evaluated by hand as the engines do."""

    def __init__(self, model: nn.Module, loss_fn: Any) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def train(self, batches: list[Batch]) -> float:
        self.model.train()
        return train_unsplit(self.model, self.optimizer, [batches], self.loss_fn).losses[0]

    def eval(self, batches: list[Batch]) -> float:
        self.model.eval()
        with torch.no_grad():
            return sum(float(self.loss_fn(self.model(x), y)) for x, y in batches) / len(batches)


def _run(engine: Any, ref: Reference, steps: str, data: Iterator[list[Batch]]) -> None:
    """Run ``steps`` ("t" train, "e" eval) on both; every loss must match the reference."""
    for i, step in enumerate(steps):
        batches = next(data)
        if step == "t":
            ours, theirs = float(engine.train_batch(iter(batches))), ref.train(batches)
        else:
            ours, theirs = float(engine.eval_batch(iter(batches))), ref.eval(batches)
        assert ours == pytest.approx(theirs, rel=RTOL), f"step {i} ({step}) of {steps}"


@pytest.mark.parametrize("steps", ["tete", "etet"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_training_and_evaluation_in_any_order_match_the_unsplit_model(
    dynamic: bool, steps: str
) -> None:
    model = NoGradFloatFirst()
    ref = Reference(copy.deepcopy(model), mse_loss)
    engine = _local_engine(model, "emit", mse_loss, dynamic=dynamic)
    batches = float_batches(GAS * len(steps), seed=0)
    chunks = iter([batches[i * GAS : (i + 1) * GAS] for i in range(len(steps))])
    _run(engine, ref, steps, chunks)
    for (name, p), q in zip(model.named_parameters(), ref.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=1e-8, msg=name)


def _boundary() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h = torch.randn(2, 3, requires_grad=True) * 1.0
    return torch.rand(2, 1), h, torch.tensor([True, False])


def test_the_metadata_tensor_always_describes_the_layout_it_travels_with() -> None:
    sender = WireEncoder(SchemaCodec(), prefix="[Stage 0]", frozen=False)
    receiver = WireDecoder(SchemaCodec(), prefix="[Stage 1]", frozen=False)
    value = list(_boundary())
    for grad in (True, False, True):
        with torch.set_grad_enabled(grad):
            wire = sender.encode(value, None)
            decoded = receiver.decode(wire)
        assert receiver.layout is None  # a layout that is not final is never kept
        for got, sent in zip(decoded, value, strict=True):
            assert got.dtype == sent.dtype and torch.equal(got.detach(), sent.detach())


def test_a_frozen_receiver_keeps_only_the_senders_final_layout() -> None:
    """A layout worked out under no_grad before training is read, used once and forgotten."""
    sender = WireEncoder(SchemaCodec(), prefix="[Stage 0]")
    receiver = WireDecoder(SchemaCodec(), prefix="[Stage 1]")
    value = list(_boundary())
    with torch.no_grad():
        receiver.decode(sender.encode(value, None))
    assert sender.layout is None  # nothing is frozen under no_grad
    kept = []
    for _ in range(2):
        decoded = receiver.decode(sender.encode(value, None))
        assert sender.layout is not None and receiver.layout == sender.layout
        kept.append(receiver.layout)
        assert decoded[1].requires_grad and not decoded[0].requires_grad
        for got, sent in zip(decoded, value, strict=True):
            assert got.dtype == sent.dtype and torch.equal(got.detach(), sent.detach())
    assert kept[0] is kept[1]  # read once, then kept


def test_reset_activation_shape_accepts_a_new_sequence_length() -> None:
    model = gpt16()
    ref = Reference(copy.deepcopy(model), cross_entropy_loss)
    engine = _local_engine(model, "blocks.1", cross_entropy_loss, dynamic=False)
    long = token_batches(3 * GAS, 16, seed=1)
    short = token_batches(4 * GAS, 8, seed=2)
    _run(engine, ref, "tte", iter([long[i * GAS : (i + 1) * GAS] for i in range(3)]))
    with pytest.raises(StructureChangedError, match=r"\[Stage 0\].*reset_activation_shape"):
        engine.train_batch(iter(short[:GAS]))
    # The failed batch stopped in its first forward: nothing was stepped.
    engine.reset_activation_shape()
    _run(engine, ref, "ette", iter([short[i * GAS : (i + 1) * GAS] for i in range(4)]))
    for (name, p), q in zip(model.named_parameters(), ref.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=1e-8, msg=name)


@pytest.mark.distributed
def test_torch_engine_reset_activation_shape_accepts_a_new_sequence_length() -> None:
    """The torch engine offers DeepSpeed's method too: its stages are built again."""
    import _ds_workers as workers

    from pipedialect.runtime.launch import launch

    results = launch(workers.wire_state_run, 2, "torch", ("static", "reset"), timeout=600)
    workers.assert_wire_state_matches(results, ("static", "reset"))
