"""DeepSpeed's wire rules, checked in one process on the stage that builds the payload.

A payload DeepSpeed's PipelineEngine cannot carry must be refused here with an error naming the
value, before it reaches the engine (where it would crash or hang).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipedialect import ConfigError, StageWrapper, StructureChangedError, WireError
from pipedialect.dialects.deepspeed import DeepSpeedDialect
from pipedialect.plan.partition import partition


class Fanout(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.lin(x)
        return tuple(h * (i + 1) for i in range(self.n))


class ManyValues(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.fan = Fanout(n)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = self.fan(x)
        total = outs[0]
        for i in range(1, self.fan.n):
            total = total + outs[i]
        return self.out(total)


class Emit(nn.Module):
    """Returns whatever extra value the test asks for next to a hidden state."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.extra: object = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, object]:
        h = self.lin(x)
        extra = self.extra(h) if callable(self.extra) else self.extra
        return h, extra


class Carry(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emit = Emit()
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, object]:
        h, extra = self.emit(x)
        return self.out(h), extra


def first_stage(model: nn.Module, split: str) -> StageWrapper:
    plan = partition(model, [split])
    return DeepSpeedDialect().wrap_stages(plan)[0]


def test_too_many_tensors_for_deepspeeds_meta_buffer() -> None:
    ok = first_stage(ManyValues(60), "fan")  # 2 + 60 * (2 + 2) + metadata = 248 entries
    ok(torch.randn(3, 4))
    stage = first_stage(ManyValues(70), "fan")
    with pytest.raises(WireError, match=r"\[Stage 0\].*256") as info:
        stage(torch.randn(3, 4))
    assert "int32 entries" in str(info.value)


def test_dtype_deepspeed_cannot_send_is_named() -> None:
    model = Carry()
    model.emit.extra = torch.zeros(4, dtype=torch.uint16)
    stage = first_stage(model, "emit")
    with pytest.raises(WireError, match=r"\[Stage 0\].*uint16") as info:
        stage(torch.randn(3, 4))
    assert "[1]" in str(info.value)  # the path of the offending value


def test_complex_tensor_needing_a_gradient_is_refused() -> None:
    model = Carry()
    model.emit.extra = lambda h: torch.complex(h, h)
    stage = first_stage(model, "emit")
    with pytest.raises(WireError, match="complex64 tensor that needs a gradient"):
        stage(torch.randn(3, 4))


def test_structure_change_after_the_first_micro_batch_names_the_path() -> None:
    model = Carry()
    model.emit.extra = {"scale": 0.5, "mask": torch.ones(3, dtype=torch.bool)}
    stage = first_stage(model, "emit")
    stage(torch.randn(3, 4))
    model.emit.extra = {"scale": 0.5, "mask": None}
    with pytest.raises(StructureChangedError, match=r"\[Stage 0\].*'mask'"):
        stage(torch.randn(3, 4))


def test_shape_change_is_refused_unless_shapes_are_dynamic() -> None:
    stage = first_stage(Carry(), "emit")
    stage(torch.randn(3, 4))
    with pytest.raises(StructureChangedError, match=r"changed shape from \(3, 4\) to \(5, 4\)"):
        stage(torch.randn(5, 4))
    plan = partition(Carry(), ["emit"])
    dynamic = DeepSpeedDialect().wrap_stages(plan, dynamic_shapes=True)
    dynamic[0](torch.randn(3, 4))
    dynamic[1](dynamic[0](torch.randn(5, 4)))


def test_gradient_need_change_is_refused() -> None:
    model = Carry()
    model.emit.extra = torch.randn(3, 4, requires_grad=True)
    stage = first_stage(model, "emit")
    stage(torch.randn(3, 4))
    model.emit.extra = torch.randn(3, 4)
    with pytest.raises(WireError, match="needed a gradient in the first training micro-batch"):
        stage(torch.randn(3, 4))


def test_wire_puts_gradient_floats_first_and_disguises_the_rest() -> None:
    model = Carry()
    model.emit.extra = {
        "mask": torch.tensor([True, False]),
        "nograd": torch.tensor([1.5, -2.0]),
        "ids": torch.tensor([3, 4]),
        "grad": None,
    }
    plan = partition(model, ["emit"])
    stages = DeepSpeedDialect().wrap_stages(plan)
    x = torch.randn(3, 4)
    wire = stages[0](x)
    assert [t.dtype for t in wire] == [
        torch.float32,  # the hidden state: the only float that needs a gradient, first
        torch.int32,  # the float that needs none, bit-cast
        torch.bool,
        torch.int64,
        torch.uint8,  # the metadata, last
    ]
    assert wire[0].requires_grad and not any(t.requires_grad for t in wire[1:])
    out, extra = stages[1](wire)
    ref_out, ref_extra = model(x)
    torch.testing.assert_close(out, ref_out)
    assert extra.keys() == ref_extra.keys()
    assert torch.equal(extra["nograd"], torch.tensor([1.5, -2.0]))
    assert extra["nograd"].dtype == torch.float32 and extra["grad"] is None


def test_reset_wire_state_accepts_a_new_shape_and_checks_deepspeeds_rules_again() -> None:
    stage = first_stage(ManyValues(60), "fan")  # 2-D tensors: 248 entries of tensor meta
    stage(torch.randn(3, 4))
    with pytest.raises(StructureChangedError, match="reset_activation_shape"):
        stage(torch.randn(2, 3, 4))
    stage.reset_wire_state()
    # The new shape is accepted, and checked again: 3-D tensors overflow DeepSpeed's buffer.
    with pytest.raises(WireError, match=r"\[Stage 0\].*256"):
        stage(torch.randn(2, 3, 4))


def _pipe_engine_error(**kwargs: object) -> str:
    plan = partition(Carry(), ["emit"])
    config: dict[str, object] = {"train_batch_size": 2, **kwargs.pop("config_extra", {})}  # type: ignore[dict-item]
    with pytest.raises(ConfigError) as info:
        DeepSpeedDialect().pipe_engine(
            plan,
            config=config,
            loss_fn=lambda out, labels: out[0].sum(),
            **kwargs,
        )
    return str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"activation_checkpoint_func": print}, "activation_checkpoint_func cannot be passed"),
        ({"checkpointable_layers": ["GPTBlock"]}, "checkpointable_layers cannot be passed"),
        ({"activation_checkpoint_interval": -1}, "activation_checkpoint_interval must be"),
        ({"activation_checkpoint_interval": True}, "activation_checkpoint_interval must be"),
        (
            {"config_extra": {"pipeline": {"activation_checkpoint_interval": 1.5}}},
            "pipeline.activation_checkpoint_interval must be",
        ),
        (
            {
                "activation_checkpoint_interval": 0,
                "config_extra": {"pipeline": {"activation_checkpoint_interval": 2}},
            },
            "set one of them",
        ),
    ],
    ids=["func", "layers", "negative", "bool", "config-float", "disagree"],
)
def test_activation_checkpoint_settings_that_cannot_be_honoured_are_refused_by_name(
    kwargs: dict[str, object], expected: str
) -> None:
    assert expected in _pipe_engine_error(**kwargs)
