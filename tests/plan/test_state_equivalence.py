"""Module state the differential fuzzer found wrong or refused .

Buffer reassignment (``self.running = 0.9 * self.running + ...``) in traced code, on both
capture paths (torch.export dropped it silently: fuzz seed 82); a value computed from buffers
only, which must follow the buffer after training; ``partition(recompute=)`` on a block that
changes its input in place (fuzz seeds 137, 186); balancing a model with
``BatchNorm(momentum=None)``, counters and in-place buffer updates; forward defaults of model
inputs. The reference is always the unsplit model run by a plain loop.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _compare import ATOL, RTOL, assert_tensor_close
from torch import fx, nn

import pipedialect
from pipedialect import CaptureError, WireError, partition

DIM = 4
GAS = 2
STEPS = 3
PATHS = ("fx", "export")


def _batches(count: int = STEPS * GAS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        (torch.randn(3, DIM, generator=gen), torch.randn(3, DIM, generator=gen))
        for _ in range(count)
    ]


def _partition(model: nn.Module, points: list[str], path: str, **kwargs: Any) -> Any:
    example = {"x": _batches(1)[0][0]} if path == "export" else None
    return partition(model, points, example_inputs=example, **kwargs)


def _train_both(plan: Any, model: nn.Module, batches: list[Any] | None = None) -> None:
    """Train and evaluate ``plan`` on the local dialect and ``model`` by a plain loop, step by
    step; every loss, parameter and buffer must agree."""
    batches = _batches() if batches is None else batches
    config = {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "gradient_clipping": 0.0,
    }
    dialect = pipedialect.get_dialect("local")
    engine = dialect.runtime_engine(
        dialect.pipe_engine(plan, config=config, loss_fn=F.mse_loss), config=config
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        chunk = batches[step * GAS : (step + 1) * GAS]
        got = float(engine.train_batch(iter(chunk)))
        model.train()
        total = 0.0
        for x, y in chunk:
            loss = F.mse_loss(model(x), y)
            (loss / GAS).backward()
            total += float(loss) / GAS
        optimizer.step()
        optimizer.zero_grad()
        assert abs(got - total) <= RTOL * abs(total) + ATOL, f"train {step}: {got} != {total}"
        got = float(engine.eval_batch(iter(chunk)))
        model.eval()
        with torch.no_grad():
            want = sum(float(F.mse_loss(model(x), y)) for x, y in chunk) / GAS
        assert abs(got - want) <= RTOL * abs(want) + ATOL, f"eval {step}: {got} != {want}"
    expected = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    held = {}
    for stage in plan.stages:
        held.update(dict(stage.named_parameters()))
        held.update(dict(stage.named_buffers()))
    for name, want in expected.items():
        assert name in held, name
        assert_tensor_close(held[name].detach().to(want.dtype), want.detach(), name)


def _no_proxies(model: nn.Module) -> None:
    for module in model.modules():
        for value in [*module.__dict__.values(), *module._buffers.values()]:
            assert not isinstance(value, fx.Proxy)
            assert not isinstance(value, torch._subclasses.FakeTensor)


# -- buffer reassignment -------------------------------------------------------------------


class Assigning(nn.Module):
    """Running statistics kept by reassigning the buffers; a later stage reads one, and an
    earlier read (saved for backward) precedes the assignment."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)
        self.register_buffer("running", torch.zeros(DIM))
        self.register_buffer("gain", torch.ones(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) * self.gain  # saves the old gain for backward
        if self.training:
            self.gain = self.gain * 0.9 + 0.05
            self.running = 0.9 * self.running + 0.1 * h.mean(0).detach()
            h = h - h.mean(0)
        else:
            h = h - self.running
        return self.b(h + self.running)  # in stage 1: the value stage 0 assigned


@pytest.mark.parametrize("path", PATHS)
def test_a_buffer_assignment_trains_as_the_unsplit_model(path: str) -> None:
    model = Assigning()
    before = {n: b.clone() for n, b in model.named_buffers()}
    held = dict(model.named_buffers())
    plan = _partition(model, ["a"], path)
    _no_proxies(model)
    for name, buffer in model.named_buffers():  # the same tensors, the same values
        assert buffer is held[name] and torch.equal(buffer, before[name]), name
    assert {b.name: b.owner for b in plan.buffers} == {"gain": 1, "running": 1}
    _train_both(plan, Assigning())


@pytest.mark.parametrize("path", PATHS)
def test_partition_refuses_an_assignment_alike_on_every_call(path: str) -> None:
    """A buffer held under two names cannot be reassigned; the refusal is the same on every
    call (and rank) and leaves no traced value on the model."""
    model = Assigning()
    model.a.register_buffer("shared", model.running)
    messages = []
    for _ in range(2):
        with pytest.raises(CaptureError, match="also holds") as caught:
            _partition(model, ["a"], path)
        messages.append(str(caught.value))
        _no_proxies(model)
    assert messages[0] == messages[1]
    assert "'a.shared'" in messages[0] and "'running'" in messages[0]


class Reshaping(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.register_buffer("last", torch.zeros(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last = x.detach()  # (batch, DIM): another shape than the buffer's
        return self.a(x) + self.last.sum()


def test_an_assignment_of_another_shape_is_refused_by_name() -> None:
    with pytest.raises(
        CaptureError, match=r"assigns buffer 'last' a torch.float32 tensor of shape"
    ):
        _partition(Reshaping(), ["a"], "export")
    plan = _partition(Reshaping(), ["a"], "fx")  # fx knows shapes at run time only
    stage = plan.stages[0]
    with pytest.raises(CaptureError, match=r"assigns buffer 'last'.*shape \(3, 4\)"):
        stage(_batches(1)[0][0])


# -- A: a value computed from buffers only ----------------------------------------------------


class BufferOnly(nn.Module):
    """``sqrt(running_var + 1)`` reads buffers only: it must follow the buffer, updated in
    place in training in stage 0 and read in stage 1."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)
        self.register_buffer("running_var", torch.ones(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.training:
            self.running_var.mul_(0.5).add_(h.var(0).detach())
        return self.b(h / torch.sqrt(self.running_var + 1.0))


@pytest.mark.parametrize("path", PATHS)
def test_a_value_computed_from_buffers_only_follows_the_buffer(path: str) -> None:
    _train_both(_partition(BufferOnly(), ["a"], path), BufferOnly())


# -- C: recomputation, balance ----------------------------------------------------------------


class InPlaceBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.first = nn.Linear(DIM, DIM)
        self.block = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(DIM, DIM))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        return self.head(self.block(h) + h)  # h is read after the in-place ReLU, as changed


def test_a_checkpointed_block_changing_its_input_in_place_trains_as_the_model() -> None:
    model = InPlaceBlocks()
    plan = partition(copy.deepcopy(model), ["first"], recompute=["block"])
    _train_both(plan, model)


class Counted(nn.Module):
    """A counter in a leaf, an in-place buffer update in traced code, cumulative BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(3))
        self.norm = nn.BatchNorm1d(DIM, momentum=None)
        self.counter = CountingLinear()
        self.register_buffer("scale", torch.ones(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.blocks[0](x))
        if self.training:
            self.scale.mul_(0.9)
        h = self.blocks[1](h / self.scale)
        return self.blocks[2](self.counter(h))


class CountingLinear(nn.Linear):
    def __init__(self) -> None:
        super().__init__(DIM, DIM)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x) * (1 + 0.1 * (self.calls % 3))


@pytest.mark.parametrize("balance", ["parameters", "flops", "memory"])
def test_balance_leaves_state_alone_and_measures_cumulative_batchnorm(balance: str) -> None:
    model = Counted()
    kwargs: dict[str, Any] = (
        {"balance_inputs": {"x": _batches(1)[0][0]}} if balance != "parameters" else {}
    )
    before = {n: b.clone() for n, b in model.named_buffers()}
    plan = partition(
        model,
        num_stages=2,
        balance=balance,
        candidates=["blocks.0", "blocks.1"],
        leaf_modules=["counter"],
        **kwargs,
    )
    assert model.counter.calls == 0
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, before[name]), name
    _train_both(plan, Counted())


# -- forward defaults of model inputs --------------------------------------------------------


class WithDefault(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, scale: float = 0.5, shift: Any = None) -> torch.Tensor:
        h = self.a(x) * scale
        return self.b(h if shift is None else h + shift)


@pytest.mark.parametrize("dialect", ["local"])
def test_a_forward_default_is_taken_when_the_data_omits_the_input(dialect: str) -> None:
    plan = partition(WithDefault(), ["a"], concrete_args={"shift": None})
    assert plan.input_names == ("x", "scale") and dict(plan.input_defaults) == {"scale": 0.5}
    _train_both(plan, WithDefault())


def test_a_missing_input_without_a_default_names_concrete_args() -> None:
    plan = partition(WithDefault(), ["a"])  # shift: traced as a value, a required input
    wrapper = pipedialect.StageWrapper(plan.stages[0], plan.stage_spec(0))
    with pytest.raises(WireError, match=r"missing model input 'shift'.*concrete_args=\{'shift'"):
        wrapper.receive((_batches(1)[0][0],), {})
