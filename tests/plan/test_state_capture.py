"""Models with state split without changing what they compute.

Grad-mode and autocast regions, train/eval behaviour, in-place buffer updates, buffers read by a
later stage, bf16 through torch.export, forward defaults and dataclass outputs. The reference is
always the unsplit model run by plain PyTorch in one process (:mod:`_state_workers`), never the
code's own output; the distributed tests run the same checks on real DeepSpeed and torch
engines over 2 ranks.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import _bf16_workers as bf
import _hf_workers as hf
import _state_workers as w
import pytest
import torch
import torch.nn.functional as F
from _compare import ATOL, RTOL, assert_tensor_close
from torch import nn

import pipedialect
import pipedialect.checkpoint as ckpt
from pipedialect import CaptureError, ConfigError, partition
from pipedialect.runtime.launch import launch

DIM = w.DIM
PATHS = ["fx", "export"]
LAUNCH_TIMEOUT = 900.0


def _x(seed: int = 0, batch: int = w.MICRO) -> torch.Tensor:
    return torch.randn(batch, DIM, generator=torch.Generator().manual_seed(seed))


def _partition(model: nn.Module, points: list[str], path: str, **kwargs: Any) -> Any:
    example = {"x": _x()} if path == "export" else None
    return partition(model, points, example_inputs=example, **kwargs)


def _train_local(plan: Any, loss_fn: Any, batches: list[Any], steps: int = w.STEPS) -> Any:
    """Train ``plan`` on the local dialect, evaluating after every step; seeds as
    :func:`_reference` sets them."""
    dialect = pipedialect.get_dialect("local")
    engine = dialect.runtime_engine(dialect.pipe_engine(plan, config=w.config(), loss_fn=loss_fn))
    losses, evals = [], []
    for step in range(steps):
        chunk = batches[step * w.GAS : (step + 1) * w.GAS]
        torch.manual_seed(100 + step)
        losses.append(float(engine.train_batch(iter(chunk))))
        evals.append(float(engine.eval_batch(iter(chunk))))
    return losses, evals, engine


def _reference(
    model: nn.Module,
    loss_fn: Any,
    batches: list[Any],
    steps: int = w.STEPS,
    split_points: list[str] | None = None,
) -> Any:
    """:func:`_state_workers.reference` with the same seed before each step as
    :func:`_train_local`; with ``split_points``, random numbers drawn as that plan's stages
    draw them (``ReferenceStreams``)."""
    from pipedialect.runtime import ReferenceStreams

    streams = ReferenceStreams(model, split_points or [])
    optimizer = torch.optim.Adam(model.parameters(), lr=w.LR)
    losses, evals = [], []
    for step in range(steps):
        chunk = batches[step * w.GAS : (step + 1) * w.GAS]
        torch.manual_seed(100 + step)
        model.train()
        total = 0.0
        for m, (x, y) in enumerate(chunk):
            with streams.micro_batch("train", step + 1, m) if split_points else nullcontext():
                loss = loss_fn(model(x), y)
            (loss / w.GAS).backward()
            total += loss.item() / w.GAS
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
        model.eval()
        with torch.no_grad():
            values = []
            for m, (x, y) in enumerate(chunk):
                with streams.micro_batch("eval", step + 1, m) if split_points else nullcontext():
                    values.append(loss_fn(model(x), y).item())
            evals.append(sum(values) / w.GAS)
    model.train()
    return losses, evals


def _assert_losses(got: list[float], expected: list[float], what: str) -> None:
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert abs(a - b) <= RTOL * abs(b) + ATOL, f"{what} {i}: {a} != {b}"


def _assert_state(got: nn.Module | dict[str, torch.Tensor], expected: nn.Module) -> None:
    """Every parameter and buffer (``got`` a module or a ``{name: tensor}``) as ``expected``'s."""
    reference = {
        **dict(expected.named_parameters(remove_duplicate=False)),
        **dict(expected.named_buffers()),
    }
    table = (
        {**dict(got.named_parameters(remove_duplicate=False)), **dict(got.named_buffers())}
        if isinstance(got, nn.Module)
        else got
    )
    assert table, "nothing to compare"
    for name, value in table.items():
        want = reference[name].detach()
        if want.is_floating_point():
            assert_tensor_close(value.detach().to(want.dtype), want, name)
        else:
            assert torch.equal(value, want), name


# -- item 1: grad-mode and autocast regions ----------------------------------------------------


class Regions(nn.Module):
    """``no_grad``, ``set_grad_enabled(False)`` and an autocast region inside forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(DIM, DIM)
        self.gate = nn.Linear(DIM, DIM)
        self.mid = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            n = self.lin.weight.norm()
        h = self.lin(x) / n
        with torch.set_grad_enabled(False):
            scale = self.gate(h).abs().mean() + 1
        h = torch.tanh(self.gate(h)) * scale
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.mid(h)
        return self.out(torch.tanh(h.float()))


@pytest.mark.parametrize("path", PATHS)
def test_grad_mode_and_autocast_regions_are_kept(path: str) -> None:
    """Gradients do not flow through ``n`` or ``scale``, ``mid`` runs in bf16: as in the model
    (the regions end right after ``mid``, the split point, so they close in stage 0)."""
    model, reference = Regions(), Regions()
    plan = _partition(model, ["mid"], path)
    batches = w.state_batches(w.STEPS * w.GAS)
    losses, evals, engine = _train_local(plan, w.mse, batches)
    expected, expected_evals = _reference(reference, w.mse, batches)
    _assert_losses(losses, expected, "loss")
    _assert_losses(evals, expected_evals, "eval loss")
    _assert_state(model, reference)
    _, logits = engine.eval_batch(iter(batches[:1]), return_logits=True, num_micro_batches=1)
    assert not logits.requires_grad  # the regions restored eval_batch's no_grad
    assert torch.is_grad_enabled()


def test_regions_survive_pickling() -> None:
    """Unpickling re-traces a stage's code: the region helpers record themselves then."""
    plan = partition(Regions(), ["mid"])
    copied = pickle.loads(pickle.dumps(plan.stages[0]))
    x = _x(4)
    out = copied(x)
    assert out.dtype == torch.bfloat16  # the autocast region is still there
    torch.testing.assert_close(out, plan.stages[0](x))
    assert torch.is_grad_enabled()


class RegionAcross(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)
        self.c = nn.Linear(DIM, DIM)
        self.d = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.no_grad():
            h = self.b(h)
            h = self.c(h)
        return self.d(h)


@pytest.mark.parametrize("path", PATHS)
def test_a_region_around_a_split_point_is_refused_by_name(path: str) -> None:
    with pytest.raises(CaptureError) as info:
        _partition(RegionAcross(), ["b"], path)
    message = str(info.value)
    assert "split point 'b'" in message and "no_grad()" in message, message
    assert "Choose a split point outside the region" in message
    model = RegionAcross()
    plan = _partition(model, ["c"], path)  # the region ends after 'c': closed in stage 0
    x = _x(1).requires_grad_()
    out = plan.graph(x)
    torch.testing.assert_close(out, model(x))
    out.sum().backward()
    assert model.b.weight.grad is None and model.d.weight.grad is not None


# -- item 2: stages follow the engine's mode ---------------------------------------------------


class ModeNet(nn.Module):
    """``self.training`` read in traced code, a hand-written running mean, BatchNorm and
    dropout modules."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(DIM, DIM)
        self.stat = w.RunningMean()
        self.bn = nn.BatchNorm1d(DIM)
        self.drop = nn.Dropout(0.2)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(torch.tanh(self.a(x)), 0.3, training=self.training)
        h = self.stat(h)
        return self.out(self.drop(torch.tanh(self.bn(h))))


@pytest.mark.parametrize("path", PATHS)
def test_stages_follow_train_and_eval_mode(path: str) -> None:
    """train_batch runs the train-mode code (dropout, batch statistics, the running-mean
    update) and eval_batch the eval-mode code, whatever mode the model was partitioned in."""
    for made_in in (True, False):
        model, reference = ModeNet().train(made_in), ModeNet()
        plan = _partition(model, ["stat"], path)
        batches = w.state_batches(w.STEPS * w.GAS)
        losses, evals, _ = _train_local(plan, w.mse, batches)
        expected, expected_evals = _reference(reference, w.mse, batches, split_points=["stat"])
        _assert_losses(losses, expected, f"loss (partitioned in train={made_in})")
        _assert_losses(evals, expected_evals, f"eval loss (partitioned in train={made_in})")
        _assert_state(model, reference)


class ModeBoundary(nn.Module):
    """Stage 0 computes ``extra`` only in train mode, and stage 1 uses it only then."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.aux = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)
        self.c = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        extra = self.aux(h) if self.training else None
        out = self.c(self.b(h))
        if extra is not None:
            out = out + extra
        return out


@pytest.mark.parametrize("path", PATHS)
def test_a_boundary_that_differs_between_modes_is_refused_by_name(path: str) -> None:
    with pytest.raises(CaptureError, match=r"^\[Stage 0\] sends .* in train mode but .* in eval"):
        _partition(ModeBoundary(), ["b"], path)


def test_a_mode_switching_stage_survives_deepcopy_and_pickle() -> None:
    model = ModeNet()
    plan = _partition(model, ["stat"], "export")
    stage = plan.stages[1]
    assert isinstance(stage, pipedialect.plan.capture._modal.ModalGraphModule)
    h = _x(3)
    for make in (copy.deepcopy, lambda s: pickle.loads(pickle.dumps(s))):
        copied, reference = make(stage), copy.deepcopy(model)
        for training in (False, True, False):
            copied.train(training)
            reference.train(training)
            torch.manual_seed(5)
            got = copied(h)
            torch.manual_seed(5)
            expected = reference.out(reference.drop(torch.tanh(reference.bn(h))))
            torch.testing.assert_close(got, expected)


# -- item 3: partition() has no side effects; in-place buffer updates run in training ---------


def _module_state(model: nn.Module) -> list[Any]:
    """Everything of every module that partition could change, as comparable values."""
    out: list[Any] = []
    for name, module in model.named_modules():
        tables = {t: dict(getattr(module, t)) for t in ("_parameters", "_buffers", "_modules")}
        plain = {k: v for k, v in module.__dict__.items() if k not in tables}
        out.append((name, module.training, plain, tables))
    return out


def _assert_unchanged(model: nn.Module, before: list[Any], values: dict[str, torch.Tensor]) -> None:
    for (name, training, plain, tables), (name2, training2, plain2, tables2) in zip(
        before, _module_state(model), strict=True
    ):
        assert name == name2 and training == training2, name
        assert plain.keys() == plain2.keys(), (name, set(plain) ^ set(plain2))
        for key, value in plain.items():
            assert plain2[key] is value or plain2[key] == value, (name, key)
        for table, entries in tables.items():
            assert entries.keys() == tables2[table].keys(), (name, table)
            assert all(entries[k] is tables2[table][k] for k in entries), (name, table)
    now = model.state_dict()
    assert now.keys() == values.keys()
    for key, value in values.items():
        assert now[key].dtype == value.dtype and torch.equal(now[key], value), key


@pytest.mark.parametrize("path", PATHS)
def test_partition_leaves_the_model_bitwise_unchanged(path: str) -> None:
    model = w.StateNet()
    model.extra = {"kept": [1, 2]}  # a Python attribute forward does not touch
    before = _module_state(model)
    values = {k: v.clone() for k, v in model.state_dict().items()}
    _partition(model, ["b1"], path)
    _assert_unchanged(model, before, values)
    model.eval()
    before = _module_state(model)
    _partition(model, ["b1"], path)
    _assert_unchanged(model, before, values)


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.lin(x))


class CountingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = Counting()
        self.mid = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.enc(x))))


@pytest.mark.parametrize("path", PATHS)
def test_an_attribute_update_in_forward_is_refused_by_name(path: str) -> None:
    model = CountingNet()
    before = _module_state(model)
    values = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CaptureError) as info:
        _partition(model, ["mid"], path)
    message = str(info.value)
    assert "'enc' (Counting) changes 'calls' from 0 to 1" in message, message
    assert "leaf_modules=['enc']" in message
    _assert_unchanged(model, before, values)  # also when capture raises
    assert model.enc.calls == 0


def test_a_leaf_module_keeps_its_attribute_updates() -> None:
    """The fix the message names: a leaf module's real forward runs at every call."""
    model, reference = CountingNet(), CountingNet()
    plan = partition(model, ["mid"], leaf_modules=["enc"])
    assert model.enc.calls == 0
    batches = w.state_batches(w.STEPS * w.GAS)
    losses, _, _ = _train_local(plan, w.mse, batches)
    expected, _ = _reference(reference, w.mse, batches)
    _assert_losses(losses, expected, "loss")
    assert model.enc.calls == reference.enc.calls == 2 * w.STEPS * w.GAS  # train and eval


@pytest.mark.parametrize("path", PATHS)
def test_buffers_after_training_equal_the_unsplit_model(path: str) -> None:
    """In-place updates (``last.copy_``, ``count.add_``, BatchNorm's running statistics and
    ``num_batches_tracked``) run in every training micro-batch, in the stage that owns them."""
    got = w.run("local", "state", export=path == "export")
    expected = w.reference(w.StateNet(), w.mse, w.state_batches(w.STEPS * w.GAS))
    _assert_losses(got["losses"], expected["losses"], "loss")
    _assert_losses(got["evals"], expected["evals"], "eval loss")
    assert got["state"].keys() == expected["state"].keys()
    for name, value in got["state"].items():
        assert torch.equal(value, expected["state"][name]) or torch.allclose(
            value.double(), expected["state"][name].double(), rtol=RTOL, atol=ATOL
        ), name
    assert int(got["state"]["count"]) == 2 * w.STEPS * w.GAS  # train and eval forwards


# -- item 6: buffers in the plan ---------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_the_plan_records_which_stage_owns_each_buffer(path: str) -> None:
    plan = _partition(w.StateNet(), ["b1"], path)
    table = {b.name: b for b in plan.buffers}
    last = table["last"]
    assert (last.owner, last.readers, last.persistent) == (0, (1,), True)
    assert last.value in plan.liveness[1] and last.value in plan.stage_arg_names[1]
    assert (table["count"].owner, table["count"].readers) == (0, ())
    assert (table["b2.bn.running_mean"].owner, table["b2.bn.num_batches_tracked"].owner) == (1, 1)
    assert (table["table"].owner, table["table"].readers, table["table"].persistent) == (
        None,
        (0,),
        False,
    )
    text = plan.describe()
    assert "Buffers:" in text
    assert f"last: written by stage 0, read by stages [1], sent as {last.value!r}" in text
    assert "table: no stage writes it, read by stages [0] (not persistent)" in text
    assert plan.fingerprint() != dataclasses.replace(plan, buffers=plan.buffers[1:]).fingerprint()
    # The reader holds no copy of its own (it would be stale on another rank).
    assert "last" not in dict(plan.stages[1].named_buffers())
    assert "table" not in plan.stages[0].state_dict()  # not persistent in the model either


def test_a_later_stage_reads_what_its_writer_stage_wrote() -> None:
    """Each stage with buffers of its own, as on separate ranks: stage 1 still sees ``last`` as
    the model does, because stage 0 sends it."""
    model = w.StateNet()
    reference = copy.deepcopy(model)
    plan = partition(model, ["b1"])
    separate = [copy.deepcopy(stage) for stage in plan.stages]  # each with its own buffers
    for seed in range(3):
        values: dict[str, Any] = {"x": _x(seed)}
        for k, stage in enumerate(separate):
            out = stage(*(values[n] for n in plan.stage_arg_names[k]))
            if isinstance(out, tuple):
                values.update((f"submod_{k}.{i}", v) for i, v in enumerate(out))
            values[f"submod_{k}"] = out
        torch.testing.assert_close(out, reference(values["x"]))


class SharedNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)
        self.norm = nn.BatchNorm1d(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(self.norm(self.a(x)))
        return self.norm(h)


class ReadBeforeWrite(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)
        self.register_buffer("seen", torch.zeros(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x + self.seen)
        h = self.b(h)
        with torch.no_grad():
            self.seen.copy_(h.mean(0))
        return h * 2


@pytest.mark.parametrize("path", PATHS)
def test_buffers_the_plan_cannot_keep_are_refused_by_name(path: str) -> None:
    with pytest.raises(CaptureError, match=r"buffer 'norm\.\w+' is written by stages \[0, 1\]"):
        _partition(SharedNorm(), ["b"], path)
    with pytest.raises(CaptureError) as info:
        _partition(ReadBeforeWrite(), ["a"], path)
    assert "buffer 'seen' is read by stage 0 and written by the later stage 1" in str(info.value)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(DIM))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.scale


class ModuleRead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.m = Scaled()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.m.scale.copy_(x.mean(0))
        return self.m(self.a(x))


def test_a_module_called_as_one_op_may_write_its_buffers() -> None:
    """A leaf module's code is not in the graph: it counts as writing the buffers it holds."""
    with pytest.raises(CaptureError) as info:
        partition(ModuleRead(), ["a"], leaf_modules=["m"])
    message = str(info.value)
    assert "buffer 'm.scale' is written by stages [0, 1]" in message
    assert "modules called as one op that hold it: 'm' in stage 1" in message
    plan = partition(ModuleRead(), ["a"])  # traced through: stage 1 is sent the value
    assert [b.readers for b in plan.buffers] == [(1,)]


class Table(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.linspace(0.5, 1.5, DIM))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.table


class SharedTableBlock(nn.Module):
    def __init__(self, table: Table) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.table = table

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(self.table(h)))


class SharedTableNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        table = Table()
        self.blocks = nn.ModuleList(SharedTableBlock(table) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_a_constant_buffer_shared_by_split_points_is_held_by_each() -> None:
    """Split points run as one call, but their code is traced by itself too: a block that
    only reads a buffer it shares with the other blocks does not own it."""
    model = SharedTableNet()
    plan = partition(model, ["blocks.0", "blocks.1"])
    (table,) = plan.buffers
    assert (table.name, table.owner, table.readers) == ("blocks.0.table.table", None, (0, 1, 2))
    plan.verify(_x())


def test_consolidate_after_training_equals_the_unsplit_state_dict(tmp_path: Path) -> None:
    got = w.run("local", "state", save_dir=str(tmp_path))
    expected = w.reference(w.StateNet(), w.mse, w.state_batches(w.STEPS * w.GAS))["state"]
    state = ckpt.consolidate(got["checkpoint"])
    assert state.keys() == w.StateNet().state_dict().keys()
    for name, value in state.items():
        assert torch.equal(value, expected[name]), name


# -- item 10: bf16 through torch.export --------------------------------------------------------


def test_bf16_on_a_plan_exported_in_fp32_is_refused_by_name() -> None:
    ids = w.token_batches(1)[0][0]
    plan = partition(w.Bf16Net(), ["stat"], example_inputs={"ids": ids})
    assert plan.param_dtype == torch.float32
    dialect = pipedialect.get_dialect("local")
    with pytest.raises(ConfigError) as info:
        engine = dialect.runtime_engine(
            dialect.pipe_engine(plan, config=w.config(bf16=True), loss_fn=w.token_loss)
        )
        engine.train_batch(iter(w.token_batches(w.GAS)))
    message = str(info.value)
    assert "captured by torch.export" in message and "dtype=torch.bfloat16" in message
    bf16 = partition(w.Bf16Net(), ["stat"], example_inputs={"ids": ids}, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="keeps the parameters' dtype"):
        dialect.pipe_engine(bf16, config=w.config(), loss_fn=w.token_loss)


def _bf16_reference(ema: bool = True) -> tuple[dict[str, Any], nn.Module]:
    net = w.Bf16Net(ema=ema).train()
    data = iter(w.token_batches(w.STEPS * w.GAS))
    return bf.reference_bf16(net, w.token_loss, data, w.STEPS, w.GAS, lr=w.LR), net


def test_bf16_export_plan_trains_as_the_bf16_recipe() -> None:
    """Captured with bf16 parameters, the stages compute as the bf16 model: the same losses
    and weights as DeepSpeed's recipe written out by hand; the buffers stay fp32."""
    got = w.run("local", "bf16", bf16=True, export=True)
    expected, net = _bf16_reference()
    assert got["losses"] == expected["losses"]
    for name, value in got["state"].items():
        want = expected["params"].get(name, dict(net.named_buffers()).get(name))
        assert want is not None, name
        assert torch.equal(value, want.float()), name
    assert got["buffer_dtypes"] == {"pos": "torch.float32", "stat.mean": "torch.float32"}
    assert ("stat.mean", 0, (1,)) in got["buffers"]


class _Named(nn.Module):
    """A transformers model called by its input names, for the hand-written bf16 recipe."""

    def __init__(self, case: hf.HFCase, model: nn.Module) -> None:
        super().__init__()
        self.case = case
        self.model = model

    def forward(self, *inputs: torch.Tensor) -> Any:
        return self.case.forward(self.model, inputs)


@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_transformers_models_train_in_bf16_through_export(name: str) -> None:
    """The route transformers models take: captured with bf16 parameters, a plan trains
    bitwise as the unsplit bf16 model; captured in fp32 it is refused under bf16 (it crashed)."""
    case = hf.CASES[name]
    config = dict(w.config(bf16=True), train_micro_batch_size_per_gpu=2, train_batch_size=4)
    dialect = pipedialect.get_dialect("local")
    fp32 = case.partition(case.build(0), 2)
    with pytest.raises(ConfigError, match=r"dtype=torch\.bfloat16"):
        dialect.pipe_engine(fp32, config=config, loss_fn=case.loss_fn)
    model, reference = case.build(0), case.build(0)
    plan = partition(
        model,
        case.split_points[2],
        example_inputs=case.example_inputs(),
        concrete_args=case.fixed,
        dtype=torch.bfloat16,
    )
    assert all(p.dtype == torch.float32 for p in model.parameters())  # as it was
    engine = dialect.runtime_engine(dialect.pipe_engine(plan, config=config, loss_fn=case.loss_fn))
    batches = list(case.micro_batches(w.STEPS * w.GAS))
    losses = [
        float(engine.train_batch(iter(batches[s * w.GAS : (s + 1) * w.GAS])))
        for s in range(w.STEPS)
    ]
    expected = bf.reference_bf16(
        _Named(case, reference), case.loss_fn, iter(batches), w.STEPS, w.GAS, lr=w.LR
    )
    assert losses == expected["losses"]
    for param_name, param in model.named_parameters():
        assert torch.equal(param.float(), expected["params"][f"model.{param_name}"]), param_name


# -- item 11: forward defaults; dataclass outputs ---------------------------------------------


@dataclasses.dataclass
class HeadOut:
    h: torch.Tensor
    aux: torch.Tensor


class DataclassHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> HeadOut:
        h = self.lin(x)
        return HeadOut(torch.relu(h), h.sum(-1))


class DataclassNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = DataclassHead()
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        o = self.head(x)
        return self.out(o.h) * scale + o.aux[:, None]


def test_a_split_point_returning_a_dataclass_verifies_under_example_inputs() -> None:
    model = DataclassNet()
    plan = partition(model, ["head"], example_inputs={"x": _x()})  # verified on them
    torch.testing.assert_close(plan.graph(_x(2)), model(_x(2)))


class Defaults(DataclassNet):
    def forward(  # type: ignore[override]
        self, x: torch.Tensor, scale: float = 2.0, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = super().forward(x, scale)
        if bias is not None:  # traced as a value: the plan adds it
            out = out + bias
        return out


def test_forward_defaults_are_recorded_for_the_inputs_that_have_them() -> None:
    """A number default can stand in for an omitted input; a None default cannot (the trace
    took the input as a value), so it is not offered."""
    plan = partition(Defaults(), ["head"])
    assert plan.input_names == ("x", "scale", "bias")
    assert dict(plan.input_defaults) == {"scale": 2.0}
    exported = partition(DataclassNet(), ["head"], example_inputs={"x": _x()})
    assert exported.input_names == ("x",) and dict(exported.input_defaults) == {}


# -- items 6 and 10 on deepspeed and torch ----------------------------------------------------


def _check_launch(results: list[dict[str, Any]], state_model: str, bf16_model: str) -> None:
    model, loss_fn, batches, _ = w.build(state_model)
    expected = w.reference(model, loss_fn, batches)
    local_bf16 = w.run("local", bf16_model, bf16=True, export=True)
    bf16_reference, net = _bf16_reference(ema=bf16_model == "bf16")
    held: set[str] = set()
    for rank in results:
        got = rank["state"]
        _assert_losses(got["losses"], expected["losses"], f"rank {got['stages']} loss")
        _assert_losses(got["evals"], expected["evals"], f"rank {got['stages']} eval loss")
        for name, value in got["state"].items():
            assert_tensor_close(value.double(), expected["state"][name].double(), name)
        held.update(got["state"])
        assert rank["bf16"]["losses"] == local_bf16["losses"]
        for name, value in rank["bf16"]["state"].items():
            assert torch.equal(value, local_bf16["state"][name]), name
        _assert_losses(rank["bf16"]["losses"], bf16_reference["losses"], "bf16 loss")
    assert {n for n, _ in model.named_parameters()} <= held
    state = ckpt.consolidate(results[0]["state"]["checkpoint"])
    assert state.keys() == model.state_dict().keys()
    for name, value in state.items():
        assert_tensor_close(value.double(), expected["state"][name].double(), f"saved {name}")
    assert float(net.stat.mean.abs().sum()) > 0


@pytest.mark.distributed
def test_deepspeed_trains_stateful_plans_as_the_unsplit_model(tmp_path: Path) -> None:
    """DeepSpeed PP=2: BatchNorm in both stages, ``last`` written by stage 0 and read by stage
    1, losses, eval losses, every parameter and buffer and the consolidated checkpoint as the
    unsplit model's; the bf16 export plan as the local dialect's bitwise."""
    results = launch(w.deepspeed_checks, 2, str(tmp_path), timeout=LAUNCH_TIMEOUT)
    _check_launch(results, "state", "bf16")


@pytest.mark.distributed
def test_torch_trains_stateful_plans_as_the_unsplit_model(tmp_path: Path) -> None:
    """torch PP=2: the buffer stage 0 writes is what stage 1 reads; the rest as on DeepSpeed."""
    results = launch(w.torch_checks, 2, str(tmp_path), timeout=LAUNCH_TIMEOUT)
    _check_launch(results, "state-last", "bf16-last")
