"""What a state-correct recomputation holds between a micro-batch's forward and its backward."""

from __future__ import annotations

import gc

import torch
from torch import nn

from pipedialect.runtime.module_state import recompute_with_state

BIG = 1 << 16


class _Reads(nn.Module):
    """A module that reads a large buffer and never changes it, beside a small running count
    it updates every call (so the recomputation has state to replay)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("table", torch.ones(BIG))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.linear(x) * self.table[:8]


def _tables() -> int:
    """Live tensors of the buffer's size (the buffer and any copy of it)."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.numel() == BIG)


def test_recomputation_keeps_no_copy_of_a_buffer_its_forward_leaves_alone() -> None:
    """The first recomputed call learns which buffers its forward changes; the large one it
    only reads must not be held twice until the backward. The recomputation still replays the
    count it changes: after the backward it is counted once per forward, as unsplit."""
    module = _Reads()
    before = _tables()
    outputs = []
    for _ in range(3):  # the first call learns, the others use what it learned
        x = torch.randn(4, 8, requires_grad=True)
        outputs.append(recompute_with_state(module, (module,), x))
        assert _tables() == before, "a copy of the unchanged buffer outlives the forward"
    for out in outputs:
        out.sum().backward()
    assert module.calls.item() == 3
    assert _tables() == before
