"""The torch.fx capture gives the model's function or refuses; plans are checked against models.

References: the unsplit model run eagerly (deep-copied before partitioning), trained by a plain
loop where losses are compared; hand-written expectations of what each message names.
"""

from __future__ import annotations

import copy
import math
import operator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _reference import steps_from, train_unsplit
from torch import fx, nn

import pipedialect
from pipedialect import (
    CaptureError,
    PartitionError,
    PlanMismatchError,
    partition,
)
from pipedialect.models import MODELS

VOCAB = 16
DIM = 8
GAS = 2
STEPS = 3


def _ids(seed: int, batch: int = 2, length: int = 5) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


# -- item 1: a dict with None and a Python float crosses the boundary --------------------------


class DictHead(nn.Module):
    """Returns a dict holding a tensor, ``None`` and a Python float."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.scale = 0.5

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        return {"h": torch.tanh(self.lin(x)), "aux": None, "scale": self.scale}


class Inspecting(nn.Module):
    """The code after the split point inspects the dict the way the issue describes."""

    def __init__(self, check: str = "is_none") -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.head = DictHead()
        self.out = nn.Linear(DIM, VOCAB)
        self.check = check
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            for p in self.parameters():
                nn.init.normal_(p, std=0.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.head(self.emb(ids))
        z = out["h"] * out["scale"]
        if self.check == "is_none":
            if out["aux"] is not None:
                z = z * 0
        elif self.check == "isinstance":
            if not isinstance(out["scale"], float):
                z = z * 0
        elif self.check == "len":
            z = z * len(out)
        elif self.check == "in":
            if "aux" in out and "missing" not in out:
                z = z + 1
        elif self.check == "get":
            if out.get("aux") is None and out.get("missing", 3) == 3:
                z = z - 1
        elif self.check == "arithmetic":
            z = z * math.sqrt(out["scale"] * 8)
        elif self.check == "items":
            for key, value in out.items():
                if key != "h" and value is not None:
                    z = z * value
        return self.out(z)


CHECKS = ["is_none", "isinstance", "len", "in", "get", "arithmetic", "items"]


@pytest.mark.parametrize("check", CHECKS)
def test_python_on_a_split_point_output_sees_the_real_values(check: str) -> None:
    model = Inspecting(check)
    reference = copy.deepcopy(model)
    plan = partition(model, ["head"])
    ids = _ids(1)
    expected = reference(ids)
    assert torch.equal(plan.graph(ids), expected)
    plan.verify(ids)
    # Stage 1 reads the output's tensor from what stage 0 sent; the constants are the model's.
    code = plan.stages[1].code
    assert "check_split_output" in code and "* 0.5" in code


def test_dict_none_float_boundary_trains_like_the_model() -> None:
    """The issue's model on the local dialect: the losses and parameters after a few steps are
    the unsplit model's (the old capture traced the branch as taken and zeroed the features)."""
    model = Inspecting("is_none")
    reference = copy.deepcopy(model)
    plan = partition(model, ["head"])
    config = {
        "train_batch_size": 2 * GAS,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "steps_per_print": 1000,
        "optimizer": {"type": "SGD", "params": {"lr": 0.2}},
    }
    dialect = pipedialect.get_dialect("local")
    engine = dialect.runtime_engine(
        dialect.pipe_engine(plan, config=config, loss_fn=_loss), config=config
    )
    batches = [(_ids(10 + i), _ids(100 + i)) for i in range(GAS * STEPS)]
    data = iter(batches)
    losses = [float(engine.train_batch(data)) for _ in range(STEPS)]

    optimizer = torch.optim.SGD(reference.parameters(), lr=0.2)
    steps = steps_from([iter(batches)], STEPS, GAS)
    expected = train_unsplit(reference, optimizer, steps, _loss).losses
    assert losses == pytest.approx(expected, rel=1e-6)
    assert losses[-1] < losses[0]  # it trained
    for name, param in reference.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[name], param, msg=name)


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


# -- the guard: what the trace assumed is checked on every micro-batch --------------------------


class ModeHead(nn.Module):
    """``aux`` is ``None`` in training mode and a tensor in eval mode."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        h = self.lin(x)
        return {"h": h, "aux": None if self.training else h.mean()}


class ModeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.head = ModeHead()
        self.out = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.head(self.emb(ids))
        z = out["h"]
        if out["aux"] is not None:
            z = z + out["aux"]
        return self.out(z)


def test_a_constant_that_changes_at_run_time_is_refused_by_the_stage_that_uses_it() -> None:
    model = ModeNet().train()
    reference = copy.deepcopy(model)
    plan = partition(model, ["head"])
    ids = _ids(2)
    assert torch.equal(plan.graph(ids), reference(ids))
    model.eval()  # the split point now returns a tensor where the trace saw None
    with pytest.raises(CaptureError) as info:
        plan.stages[1](model.head(model.emb(ids)))
    message = str(info.value)
    assert message.startswith("[Stage 1] the output of split point 'head' at ['aux'] is a Tensor")
    assert "recorded None" in message and "example_inputs=" in message

    scaled = Inspecting("is_none")
    plan = partition(scaled, ["head"])
    scaled.head.scale = 0.25  # a Python attribute the trace read as 0.5
    with pytest.raises(CaptureError, match=r"at \['scale'\] is 0\.25.*recorded 0\.5"):
        plan.graph(ids)


class Wrapped(nn.Module):
    """A split point that returns a list where the caller indexes a tuple-typed structure."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return (self.lin(x), None)


class TupleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.block = Wrapped()
        self.out = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h, extra = self.block(self.emb(ids))
        return self.out(h if extra is None else h * 0)


@pytest.mark.parametrize(
    ("received", "fragment"),
    [
        ([torch.ones(2, 5, DIM), None], "is a list, but the torch.fx capture recorded a tuple"),
        ((torch.ones(2, 5, DIM),), "has 1 items, but the torch.fx capture recorded 2"),
        ((None, None), "at [0] is None, but the torch.fx capture treated it as a tensor"),
        ((torch.ones(2, 5, DIM), 1.0), "at [1] is 1.0, but the torch.fx capture recorded None"),
    ],
)
def test_guard_names_the_split_point_and_the_path(received: Any, fragment: str) -> None:
    model = TupleNet()
    reference = copy.deepcopy(model)
    plan = partition(model, ["block"])
    ids = _ids(3)
    assert torch.equal(plan.graph(ids), reference(ids))
    with pytest.raises(CaptureError) as info:
        plan.stages[1](received)
    assert "[Stage 1] the output of split point 'block'" in str(info.value)
    assert fragment in str(info.value)


# -- split points whose code fx cannot trace: an opaque output, refused where inspected ---------


class Untraceable(nn.Module):
    """Data-dependent control flow: tracing this module by itself fails."""

    def __init__(self, aux: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.aux = aux

    def forward(self, x: torch.Tensor) -> Any:
        h = self.lin(x)
        if h.sum() > 0:
            h = -h
        return {"h": h, "aux": None} if self.aux else h


class OpaqueNet(nn.Module):
    def __init__(self, use: str) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.gate = Untraceable(aux=use != "tensor")
        self.out = nn.Linear(DIM, VOCAB)
        self.use = use

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.gate(self.emb(ids))
        if self.use == "tensor":
            return self.out(out)
        z = out["h"]
        if self.use == "is_none":
            if out["aux"] is not None:
                z = z * 0
        elif self.use == "len":
            z = z * len(out)
        elif self.use == "in":
            z = z * ("aux" in out)
        elif self.use == "bool":
            z = z if out else -z
        elif self.use == "iter":
            z = z * sum(1 for _ in out)
        return self.out(z)


def test_untraceable_split_point_returning_a_tensor_still_partitions() -> None:
    model = OpaqueNet("tensor")
    reference = copy.deepcopy(model)
    plan = partition(model, ["gate"])
    for seed in range(3):
        ids = _ids(seed)
        assert torch.equal(plan.graph(ids), reference(ids))
    plan.verify(_ids(4))


def test_unknown_structure_tested_for_none_is_refused_at_run_time() -> None:
    """Today the trace took ``out["aux"] is not None`` as true and zeroed every logit."""
    model = OpaqueNet("is_none")
    plan = partition(model, ["gate"])
    with pytest.raises(CaptureError) as info:
        plan.graph(_ids(5))
    message = str(info.value)
    assert "[Stage 1] the output of split point 'gate' at ['aux'] is None" in message
    assert "tracing 'gate' by itself failed" in message and "example_inputs=" in message
    with pytest.raises(CaptureError, match=r"split point 'gate' at \['aux'\] is None"):
        plan.verify(_ids(5))


@pytest.mark.parametrize(
    ("use", "fragment"),
    [
        ("len", "takes the len() of the output of split point 'gate'"),
        ("in", "tests 'aux' in the output of split point 'gate'"),
        ("bool", "tests the truth (if/and/or/not) of the output of split point 'gate'"),
        ("iter", "iterates over the output of split point 'gate'"),
    ],
)
def test_unknown_structure_inspected_by_python_is_refused_at_capture(
    use: str, fragment: str
) -> None:
    model = OpaqueNet(use)
    attrs = set(vars(model))
    with pytest.raises(CaptureError) as info:
        partition(model, ["gate"])
    message = str(info.value)
    assert fragment in message, message
    assert "whose structure the torch.fx capture cannot know" in message
    assert "example_inputs=" in message
    assert set(vars(model)) == attrs


# -- verify: the plan against the model ---------------------------------------------------------


class Chain(nn.Module):
    """Three blocks, a dropout and a BatchNorm: verify must leave RNG and buffers alone."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(3))
            self.norm = nn.BatchNorm1d(DIM)
            self.drop = nn.Dropout(0.3)
            self.head = nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(self.drop(self.norm(x)))


def _x(seed: int = 0, batch: int = 4) -> torch.Tensor:
    return torch.randn(batch, DIM, generator=torch.Generator().manual_seed(seed))


def _corrupt(stage: fx.GraphModule, first: Any) -> None:
    """Scale the input of stage's first ``first`` node by 1.5: a wrong stage that runs."""
    node = next(n for n in stage.graph.nodes if n.target is first or n.op == first)
    with stage.graph.inserting_before(node):
        scaled = stage.graph.call_function(operator.mul, (node.args[0], 1.5))
    node.args = (scaled, *node.args[1:])
    stage.recompile()


@pytest.mark.parametrize("k", [0, 1, 2])
def test_verify_names_the_first_stage_that_differs(k: int) -> None:
    plan = partition(Chain(), ["blocks.0", "blocks.1"])
    plan.verify(_x())
    _corrupt(plan.stages[k], "call_module" if k == 0 else torch.relu)
    with pytest.raises(PlanMismatchError) as info:
        plan.verify(_x())
    assert info.value.stage == k
    if k < 2:
        assert info.value.path == f"blocks.{k}"
        assert str(info.value).startswith(
            f"[Stage {k}] the output of split point 'blocks.{k}' differs from the model's: "
            "tensors differ by up to"
        )
    else:
        assert str(info.value).startswith("[Stage 2] the plan's output differs from the model's")


def test_verify_reports_a_stage_that_raises() -> None:
    plan = partition(Chain(), ["blocks.0"])
    stage = plan.stages[1]
    node = next(n for n in stage.graph.nodes if n.op == "call_module")
    node.args = (node.args[0], node.args[0])
    stage.recompile()
    with pytest.raises(PlanMismatchError, match=r"^\[Stage 1\] raised TypeError") as info:
        plan.verify(_x())
    assert info.value.stage == 1


def test_verify_leaves_no_trace_on_the_model() -> None:
    model = Chain().train()
    plan = partition(model, ["blocks.1"])
    buffers = {n: (id(b), b.clone()) for n, b in model.named_buffers()}
    torch.manual_seed(7)
    rng = torch.get_rng_state()
    plan.verify(_x())  # in train mode: dropout and batch statistics, identical in both runs
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training and all(m.training for m in model.modules())
    for name, buffer in model.named_buffers():
        assert id(buffer) == buffers[name][0] and torch.equal(buffer, buffers[name][1]), name
    assert all(not m._forward_hooks for m in model.modules())


def test_verify_on_the_meta_device_checks_structure() -> None:
    with torch.device("meta"):
        model = Chain().eval()
    plan = partition(model, ["blocks.0", "blocks.1"])
    x = torch.empty(4, DIM, device="meta")
    plan.verify(x)
    stage = plan.stages[1]
    node = next(n for n in stage.graph.nodes if n.target is torch.relu)
    with stage.graph.inserting_after(node):
        wider = stage.graph.call_function(torch.cat, ([node, node], -1))
    for user in list(node.users):
        if user is not wider:
            user.replace_input_with(node, wider)
    stage.recompile()
    with pytest.raises(PlanMismatchError, match=r"^\[Stage 1\] (raised|the output)") as info:
        plan.verify(x)
    assert info.value.stage == 1
    exported = partition(model, ["blocks.0", "blocks.1"], example_inputs={"x": x})
    assert exported.num_stages == 3  # checked on meta tensors before it was returned


def test_verify_input_errors() -> None:
    plan = partition(Chain(), ["blocks.0"])
    with pytest.raises(PartitionError, match=r"'y', which is not an input of the plan.*\['x'\]"):
        plan.verify(y=_x())
    with pytest.raises(PartitionError, match="needs a value for the plan input 'x'"):
        plan.verify()
    with pytest.raises(PartitionError, match="2 positional values"):
        plan.verify(_x(), _x())


# -- partition(..., example_inputs=...) checks the plan before returning ------------------------


class PythonState(nn.Module):
    """forward reads Python state: torch.export bakes the branch it took while capturing."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)
        self.calls = _Calls()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.count += 1
        h = self.a(x)
        if self.calls.count > 1:
            h = h * 2
        return self.b(h)


class _Calls:
    """A counter object outside the module's own state (export restores that)."""

    def __init__(self) -> None:
        self.count = 0


def test_partition_with_example_inputs_refuses_a_plan_that_differs() -> None:
    with pytest.raises(PlanMismatchError, match=r"^\[Stage 1\] the plan's output differs"):
        partition(PythonState(), ["a"], example_inputs={"x": _x()})
    plan = partition(PythonState(), ["a"], example_inputs={"x": _x()}, verify=False)
    assert plan.num_stages == 2


def test_partition_with_example_inputs_names_a_wrong_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage corrupted while the plan is built: the check names it, on the export path."""
    from pipedialect.plan.capture import _split

    build = _split._build_stage

    def corrupting(*args: Any, **kwargs: Any) -> fx.GraphModule:
        stage = build(*args, **kwargs)
        if args[1] == 0:
            _corrupt(stage, torch.ops.aten.linear.default)
        return stage

    monkeypatch.setattr(_split, "_build_stage", corrupting)
    with pytest.raises(PlanMismatchError) as info:
        partition(Chain().eval(), ["blocks.0", "blocks.1"], example_inputs={"x": _x()})
    assert info.value.stage == 0 and info.value.path == "blocks.0"
    assert "split point 'blocks.0'" in str(info.value)


def test_example_inputs_as_a_tuple() -> None:
    model = Chain().eval()
    reference = copy.deepcopy(model)
    plan = partition(model, ["blocks.1"], example_inputs=(_x(),))
    assert plan.input_names == ("x",)
    torch.testing.assert_close(plan.graph(_x(1)), reference(_x(1)))
    with pytest.raises(CaptureError, match=r"example_inputs is a Tensor.*\(x,\)"):
        partition(model, ["blocks.1"], example_inputs=_x())  # type: ignore[arg-type]
    with pytest.raises(CaptureError, match=r"holds 2 values.*takes 1 positional"):
        partition(model, ["blocks.1"], example_inputs=(_x(), _x()))


def test_fx_capture_error_suggests_example_inputs() -> None:
    class Shapes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(DIM, DIM)
            self.b = nn.Linear(DIM, DIM)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            if h.shape[0] > 2:  # control flow on a shape: fx sees a Proxy
                h = h * 2
            return self.b(h)

    with pytest.raises(CaptureError, match=r"example_inputs=\{parameter name: tensor"):
        partition(Shapes(), ["a"])
    model = Shapes()
    plan = partition(model, ["a"], example_inputs={"x": _x()})
    torch.testing.assert_close(plan.graph(_x(1)), model(_x(1)))


def test_getitem_reads_stay_at_their_use() -> None:
    """A leaf of a split-point output is read where it is used: the output itself rides to the
    later stage, as it does when the model indexes it there."""
    plan = partition(MODELS["mixed"].build(), ["producer", "block1"])
    assert plan.stage_arg_names[2] == ("submod_1", "submod_0")
    received = [n for n in plan.stages[2].graph.nodes if n.op == "placeholder"][1]
    reads = [n.args[1] for n in received.users if n.target is operator.getitem]
    assert sorted(reads) == ["h", "ids", "scale"]  # "factor" and "extra" are the constants


def test_stages_with_checks_survive_pickling() -> None:
    """Unpickling a GraphModule re-traces its code: the checks must record themselves then,
    and still check afterwards."""
    import pickle

    model = Inspecting("is_none")
    stage = pickle.loads(pickle.dumps(partition(model, ["head"]).stages[1]))
    out = model.head(model.emb(_ids(1)))
    assert torch.equal(stage(out), model.out(out["h"] * 0.5))
    with pytest.raises(CaptureError, match=r"at \['aux'\] is 1, but"):
        stage({**out, "aux": 1})
    first = pickle.loads(
        pickle.dumps(partition(Chain().eval(), ["blocks.0"], example_inputs=(_x(),)).stages[0])
    )
    with pytest.raises(pipedialect.StructureChangedError, match=r"input 'x' has shape \[3, 8\]"):
        first(_x(batch=3))


class _NoOpCastBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.lin(h) + x.float()  # float32 already: returns x itself


class _NoOpCastModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _NoOpCastBlock()
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x, x)) + x


def test_export_verification_accepts_a_value_the_split_point_was_called_with() -> None:
    # Found by the fuzzer: export records later uses of x as the no-op cast inside the split
    # point; stage 0 sends that node, which is x itself, and the plan is right.
    torch.manual_seed(0)
    model = _NoOpCastModel()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    plan = pipedialect.partition(model, ["block"], example_inputs={"x": x})
    torch.testing.assert_close(plan.graph(x), reference(x), rtol=0, atol=0)
