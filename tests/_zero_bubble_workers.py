"""Models and the rank function of the torch zero-bubble regression tests (importable by ranks).

Each model has a stage that torch's split backward (an input-gradient pass, then a weight pass)
got wrong before the dialect's fixes ([Note: split backward without a gradient-carrying input]
and [Note: wire tensors for torch] in ``pipedialect.dialects.torch._stage``):

- ``embed_only``: stage 1 sends ``embed(ids)``, whose only input is the integer tensor ``ids``:
  ``embed.weight`` silently got no gradient (found by the fuzzer, torch seed 94);
- ``unused_split_point``: stage 2 sends ``h2`` and ends with the split point ``b4(h2)``, whose
  output nothing uses: the weight pass read ``h2`` after it was detached in place and torch
  raised (fuzzer seeds 91, 93, 138, 185, 186);
- ``reused_output``: the same stage, with ``b4(h2)`` used by the last stage: the same failure
  with every output used;
- ``reused_layer``: stage 2 applies ``a``, then ``b``, then ``a`` again: the weight pass of
  ``a`` freed the graph of ``b`` before ``b``'s own and torch raised (fuzzer seed 91, a tie).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import pipedialect

GAS, STEPS, MICRO = 4, 2, 3
LR = 0.1


def _init(model: nn.Module) -> None:
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.5, 0.5, generator=gen)


class EmbedOnly(nn.Module):
    """``head(tanh(block(tanh(stem(x)) + embed(ids))))``."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.embed = nn.Embedding(5, 4)
        self.block = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4)
        _init(self)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x)) + self.embed(ids)
        return self.head(torch.tanh(self.block(h)))


class UnusedSplitPoint(nn.Module):
    """A stage that sends ``h2`` and ends with ``b4(h2)``; with ``use_b4`` the head uses it."""

    def __init__(self, use_b4: bool = False) -> None:
        super().__init__()
        self.use_b4 = use_b4
        self.stem = nn.Linear(4, 4)
        self.b1 = nn.Linear(4, 4)
        self.b2 = nn.Linear(4, 4)
        self.b3 = nn.Linear(4, 4)
        self.b4 = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4)
        _init(self)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        del ids
        h = torch.tanh(self.b1(torch.tanh(self.stem(x))))
        h2 = torch.tanh(self.b2(h))
        torch.tanh(self.b3(h2))  # unused
        out = self.b4(h2)
        return self.head(h2) + out if self.use_b4 else self.head(h2)


class ReusedLayer(nn.Module):
    """``head(c(tanh(a(tanh(b(tanh(a(tanh(s1(tanh(stem(x))))))))))))``: ``a`` used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.s1 = nn.Linear(4, 4)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4)
        _init(self)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        del ids
        h = torch.tanh(self.s1(torch.tanh(self.stem(x))))
        h = torch.tanh(self.a(torch.tanh(self.b(torch.tanh(self.a(h))))))
        return self.head(self.c(h))


#: Where each model is split (4 stages: two per rank on two ranks).
SPLIT_POINTS = {
    "embed_only": ["stem", "embed", "block"],
    "unused_split_point": ["stem", "b1", "b4"],
    "reused_output": ["stem", "b1", "b4"],
    "reused_layer": ["stem", "s1", "c"],
}


def build(name: str) -> nn.Module:
    """A fresh model by name (the same weights every time)."""
    if name == "embed_only":
        return EmbedOnly()
    if name == "unused_split_point":
        return UnusedSplitPoint()
    if name == "reused_output":
        return UnusedSplitPoint(use_b4=True)
    if name == "reused_layer":
        return ReusedLayer()
    raise ValueError(name)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


def batches() -> list[tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """``GAS * STEPS`` micro-batches ``((x, ids), y)``."""
    gen = torch.Generator().manual_seed(1)
    return [
        (
            (torch.randn(MICRO, 4, generator=gen), torch.randint(0, 5, (MICRO,), generator=gen)),
            torch.randn(MICRO, 4, generator=gen),
        )
        for _ in range(GAS * STEPS)
    ]


def config() -> dict[str, Any]:
    return {
        "train_batch_size": MICRO * GAS,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
    }


def run_cases(cases: list[tuple[str, str]]) -> list[tuple[list[float], dict[str, torch.Tensor]]]:
    """Train each ``(model, schedule)`` for ``STEPS`` steps; return the losses and this rank's
    parameters by their original names."""
    dialect = pipedialect.get_dialect("torch")
    dialect.init_distributed()
    results = []
    for name, schedule in cases:
        plan = pipedialect.partition(build(name), SPLIT_POINTS[name])
        module = dialect.pipe_engine(plan, config=config(), loss_fn=loss_fn, schedule=schedule)
        engine = dialect.runtime_engine(module, config=config())
        data = batches()
        losses = [
            float(engine.train_batch(iter(data[k * GAS : (k + 1) * GAS]))) for k in range(STEPS)
        ]
        params = {
            n: p.detach().clone()
            for k in dialect.local_stages(engine)
            for n, p in plan.stages[k].named_parameters()
        }
        results.append((losses, params))
    return results
