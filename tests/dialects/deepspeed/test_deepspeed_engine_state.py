"""What the DeepSpeed dialect's ``engine_state`` says a ``PipelineEngine`` trains (one process).

A hand-written ``PipelineModule`` holds the user's own layers, not stage wrappers: each layer is
its own root (``stage_root``), whatever its attributes are called: taking a submodule that
happens to be named ``mod`` (the stage wrapper's attribute) for the root would leave the layer's
other parameters out of a portable checkpoint without a word.
"""

from __future__ import annotations

from types import SimpleNamespace

from torch import nn

from pipedialect.dialects.deepspeed._engine_state import deepspeed_engine_state


class Block(nn.Module):
    """A user's layer whose submodule happens to be called ``mod``."""

    def __init__(self) -> None:
        super().__init__()
        self.mod = nn.Linear(3, 3)
        self.norm = nn.LayerNorm(3)


def _engine(*layers: nn.Module) -> SimpleNamespace:
    """The members of a DeepSpeed ``PipelineEngine`` that ``engine_state`` reads."""
    return SimpleNamespace(
        module=SimpleNamespace(forward_funcs=list(layers)),
        stage_id=0,
        num_stages=1,
        optimizer=None,
        lr_scheduler=None,
        gradient_accumulation_steps=lambda: 1,
        train_batch_size=lambda: 1,
    )


def test_a_plain_layer_is_its_own_root_even_with_a_submodule_named_mod() -> None:
    block = Block()
    (held,) = deepspeed_engine_state(_engine(block)).stages
    assert held.module is block
    assert {name for name, _ in held.module.named_parameters()} == {
        "mod.weight",
        "mod.bias",
        "norm.weight",
        "norm.bias",
    }
