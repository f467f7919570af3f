"""The conformance suite's own models, next to the shared ones of :mod:`pipedialect.models`.

- ``plain``: an MLP over a sequence whose every boundary carries one float tensor: the model
  every dialect must train, whatever it declares. Its micro-batches can vary the sequence length
  (``plain-dynamic``), for the dynamic-shape checks.
- ``complex``: a boundary that carries a complex tensor needing a gradient, which no pipeline
  runtime can carry: the dialect must refuse it with a named error.
"""

from __future__ import annotations

import torch
from torch import nn

from ...models import MODELS, ModelSpec, ResidualMLP, mse_loss, seeded_init

__all__ = ["SUITE_MODELS", "ComplexBoundaryNet", "PlainNet", "ToComplex", "suite_model"]

Batch = tuple[torch.Tensor, torch.Tensor]


class PlainNet(nn.Module):
    """``head(blocks(stem(x)))`` over ``(batch, seq, 8)`` inputs: one tensor per boundary."""

    def __init__(self, in_dim: int = 8, dim: int = 16, out_dim: int = 4, seed: int = 0) -> None:
        super().__init__()
        self.stem = nn.Linear(in_dim, dim)
        self.blocks = nn.ModuleList(ResidualMLP(dim) for _ in range(4))
        self.head = nn.Linear(dim, out_dim)
        seeded_init(self, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        for block in self.blocks:
            h = block(h)
        out: torch.Tensor = self.head(h)
        return out


def _plain_batch(gen: torch.Generator, batch_size: int) -> Batch:
    return torch.randn(batch_size, 6, 8, generator=gen), torch.randn(
        batch_size, 6, 4, generator=gen
    )


def _plain_dynamic_batch(gen: torch.Generator, batch_size: int) -> Batch:
    """A sequence length of 3 to 7, drawn per micro-batch."""
    seq = int(torch.randint(3, 8, (1,), generator=gen))
    return (
        torch.randn(batch_size, seq, 8, generator=gen),
        torch.randn(batch_size, seq, 4, generator=gen),
    )


class ToComplex(nn.Module):
    """``complex(W x, tanh(W x))``: a complex output that needs a gradient."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return torch.complex(h, torch.tanh(h))


class ComplexBoundaryNet(nn.Module):
    """Stage 0 (``a``) hands stage 1 a complex tensor that needs a gradient."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.a = ToComplex(8)
        self.b = nn.Linear(8, 4)
        seeded_init(self, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.a(x)
        out: torch.Tensor = self.b(z.real * z.imag)
        return out


_PLAIN_SPLITS = {2: ("blocks.1",), 4: ("blocks.0", "blocks.1", "blocks.2")}

SUITE_MODELS: dict[str, ModelSpec] = {
    "plain": ModelSpec(
        name="plain",
        description="an MLP over a sequence; one float tensor per boundary",
        factory=PlainNet,
        loss_fn=mse_loss,
        split_points=_PLAIN_SPLITS,
        input_names=("x",),
        _make_batch=_plain_batch,
    ),
    "plain-dynamic": ModelSpec(
        name="plain-dynamic",
        description="the plain model on micro-batches whose sequence length varies",
        factory=PlainNet,
        loss_fn=mse_loss,
        split_points=_PLAIN_SPLITS,
        input_names=("x",),
        _make_batch=_plain_dynamic_batch,
    ),
    "complex": ModelSpec(
        name="complex",
        description="a complex tensor that needs a gradient crosses the boundary",
        factory=ComplexBoundaryNet,
        loss_fn=mse_loss,
        split_points={2: ("a",)},
        input_names=("x",),
        _make_batch=lambda gen, b: (
            torch.randn(b, 8, generator=gen),
            torch.randn(b, 4, generator=gen),
        ),
    ),
}


def suite_model(name: str) -> ModelSpec:
    """Return the suite model or shared test model called ``name``."""
    return SUITE_MODELS.get(name) or MODELS[name]
