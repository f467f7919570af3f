"""Small deterministic models for tests, the conformance suite and the demo.

Each :class:`ModelSpec` bundles a model factory, its loss function, recommended split points for
2 and 4 stages, and a deterministic micro-batch generator yielding ``(inputs, labels)`` pairs
(``inputs``: a tensor, or a tuple of tensors in the plan's ``input_names`` order). Every
parameter is initialised from a torch.Generator seeded per module (:func:`seeded_init`), so any
process that builds a model gets identical weights whatever its global RNG state: a pipeline
runtime that builds only its own stage, or several ranks, agree with a single-process reference.

The models (all tiny: they train in well under a second on 2 cores):

- ``gpt``: a GPT-like decoder whose blocks are custom modules, with the token embedding tied to
  the LM head (a tie between the first and the last stage).
- ``skip``: a value computed on stage 0 used again by the last stage (a skip connection over
  whole stages; two gradient-carrying tensors per boundary).
- ``mixed``: a boundary carrying a dict that holds a float tensor needing a gradient, a bool
  mask, an int tensor, a float tensor that needs no gradient, None and a Python number.
- ``encdec``: an encoder-decoder whose every decoder stage needs the encoder output (several
  gradient-carrying tensors per boundary).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ConfigError

__all__ = [
    "MODELS",
    "CausalSelfAttention",
    "CrossAttention",
    "DecoderLayer",
    "EncoderDecoder",
    "EncoderLayer",
    "GPTBlock",
    "MixedBoundaryNet",
    "ModelSpec",
    "Producer",
    "ResidualMLP",
    "SkipNet",
    "TinyGPT",
    "cross_entropy_loss",
    "get_model",
    "mse_loss",
    "seeded_init",
]

Inputs = torch.Tensor | tuple[torch.Tensor, ...]
Batch = tuple[Inputs, torch.Tensor]


def _seed_for(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def seeded_init(module: nn.Module, seed: int) -> None:
    """Initialise every parameter of ``module`` from a generator seeded by ``seed`` and its path.

    LayerNorm weights start at 1 and biases at 0; matrices are uniform in
    ``±1/sqrt(fan_in)``; other vectors uniform in ``±0.1``. The global RNG is not touched.
    """
    with torch.no_grad():
        for path, sub in module.named_modules():
            gen = torch.Generator().manual_seed(_seed_for(seed, path))
            for name, param in sub.named_parameters(recurse=False):
                if isinstance(sub, nn.LayerNorm):
                    param.fill_(1.0 if name == "weight" else 0.0)
                elif param.dim() >= 2:
                    bound = 1.0 / math.sqrt(param.shape[1])
                    param.uniform_(-bound, bound, generator=gen)
                else:
                    param.uniform_(-0.1, 0.1, generator=gen)


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Token-level cross entropy: ``logits`` ``(..., vocab)``, ``labels`` ``(...)``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def mse_loss(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean squared error."""
    return F.mse_loss(outputs, labels)


# -- gpt ---------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """Single-head causal self-attention."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim, bias=False)  # a key bias gets no gradient (softmax shift)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.scale = 1.0 / math.sqrt(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-2, -1) * self.scale
        allowed = torch.ones_like(scores, dtype=torch.bool).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
        out: torch.Tensor = self.proj(scores.softmax(dim=-1) @ self.v(x))
        return out


class _PreNormBlock(nn.Module):
    """The pre-norm transformer block of both GPT models, around the attention it is given."""

    def __init__(self, dim: int, attn: nn.Module) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = attn
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return out


class GPTBlock(_PreNormBlock):
    """Pre-norm transformer block (a custom module: fx traces through it unless it is a leaf)."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim, CausalSelfAttention(dim))


class _TiedDecoder(nn.Module):
    """The decoder of both GPT models: embeddings, the given blocks, a final norm and an LM head
    tied to the token embedding; every parameter seeded by :func:`seeded_init`."""

    def __init__(
        self, vocab: int, dim: int, max_len: int, blocks: Iterable[nn.Module], seed: int
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Parameter(torch.zeros(max_len, dim))
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        seeded_init(self, seed)
        self.lm_head.weight = self.wte.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(input_ids) + self.wpe[: input_ids.size(1)]
        for block in self.blocks:
            h = block(h)
        out: torch.Tensor = self.lm_head(self.ln_f(h))
        return out


class TinyGPT(_TiedDecoder):
    """A GPT-like decoder with its token embedding tied to the LM head."""

    def __init__(
        self,
        vocab: int = 32,
        dim: int = 16,
        max_len: int = 8,
        num_blocks: int = 4,
        seed: int = 0,
    ) -> None:
        super().__init__(vocab, dim, max_len, (GPTBlock(dim) for _ in range(num_blocks)), seed)


class MultiHeadAttention(nn.Module):
    """Causal self-attention over ``heads`` heads, written for tensor parallelism: it reshapes
    with ``-1`` heads of ``head_dim`` features, so a rank holding some of the heads (``q``,
    ``k``, ``v`` sharded by output feature) computes exactly those heads."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        q = self.q(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        allowed = torch.ones_like(scores, dtype=torch.bool).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
        out = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, s, -1)
        result: torch.Tensor = self.o(out)
        return result


class MultiHeadBlock(_PreNormBlock):
    """Pre-norm transformer block with :class:`MultiHeadAttention`."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__(dim, MultiHeadAttention(dim, heads))


class MultiHeadGPT(_TiedDecoder):
    """A GPT-like decoder with multi-head attention and its token embedding tied to the LM
    head; :data:`MHGPT_TENSOR_PLAN` shards it over a tensor axis."""

    def __init__(
        self,
        vocab: int = 32,
        dim: int = 16,
        heads: int = 4,
        max_len: int = 8,
        num_blocks: int = 4,
        seed: int = 0,
    ) -> None:
        blocks = (MultiHeadBlock(dim, heads) for _ in range(num_blocks))
        super().__init__(vocab, dim, max_len, blocks, seed)


#: :class:`MultiHeadGPT`'s tensor-parallel plan: the heads and the MLP's hidden features split
#: over the axis, the vocabulary too (the embedding rowwise and its tied LM head colwise).
MHGPT_TENSOR_PLAN: Mapping[str, str] = {
    "wte": "rowwise",
    "blocks.*.attn.q": "colwise",
    "blocks.*.attn.k": "colwise",
    "blocks.*.attn.v": "colwise",
    "blocks.*.attn.o": "rowwise",
    "blocks.*.fc1": "colwise",
    "blocks.*.fc2": "rowwise",
    "lm_head": "colwise",
}


def _gpt_batch(gen: torch.Generator, batch_size: int) -> Batch:
    ids = torch.randint(0, 32, (batch_size, 9), generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


# -- skip --------------------------------------------------------------------------------------


class ResidualMLP(nn.Module):
    """``x + W2 tanh(W1 x)``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, dim)
        self.fc2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.fc2(torch.tanh(self.fc1(x)))
        return out


class SkipNet(nn.Module):
    """An MLP whose stem output is added back just before the head (a long skip connection)."""

    def __init__(self, in_dim: int = 8, dim: int = 16, out_dim: int = 4, seed: int = 0) -> None:
        super().__init__()
        self.stem = nn.Linear(in_dim, dim)
        self.blocks = nn.ModuleList(ResidualMLP(dim) for _ in range(4))
        self.head = nn.Linear(dim, out_dim)
        seeded_init(self, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = torch.tanh(self.stem(x))
        h = skip
        for block in self.blocks:
            h = block(h)
        out: torch.Tensor = self.head(h + skip)
        return out


def _skip_batch(gen: torch.Generator, batch_size: int) -> Batch:
    x = torch.randn(batch_size, 8, generator=gen)
    y = torch.randn(batch_size, 4, generator=gen)
    return x, y


# -- mixed -------------------------------------------------------------------------------------


class Producer(nn.Module):
    """Returns a dict of every kind of value a boundary may carry."""

    def __init__(self, in_dim: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_dim, dim)
        self.factor = 0.5

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> dict[str, Any]:
        return {
            "h": self.proj(x),
            "mask": ids % 3 != 0,
            "ids": ids + 1,
            "scale": torch.sigmoid(x.mean(-1)),
            "extra": None,
            "factor": self.factor,
        }


class MixedBoundaryNet(nn.Module):
    """The producer's dict crosses every boundary; the last stage uses each of its entries."""

    def __init__(
        self, in_dim: int = 8, dim: int = 16, out_dim: int = 4, num_ids: int = 9, seed: int = 0
    ) -> None:
        super().__init__()
        self.producer = Producer(in_dim, dim)
        self.block1 = ResidualMLP(dim)
        self.block2 = ResidualMLP(dim)
        self.id_emb = nn.Embedding(num_ids + 1, dim)
        self.norm_weight = nn.Parameter(torch.ones(dim))
        self.head = nn.Linear(dim, out_dim)
        seeded_init(self, seed)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        state = self.producer(x, ids)
        h = state["h"] * state["factor"] * state["mask"].unsqueeze(-1)
        h = self.block1(h)
        h = self.block2(h)
        h = h * state["scale"].unsqueeze(-1) + self.id_emb(state["ids"]) + state["h"]
        h = F.layer_norm(h, (h.shape[-1],), self.norm_weight, state["extra"])
        out: torch.Tensor = self.head(h)
        return out


def _mixed_batch(gen: torch.Generator, batch_size: int) -> Batch:
    x = torch.randn(batch_size, 6, 8, generator=gen)
    ids = torch.randint(0, 9, (batch_size, 6), generator=gen)
    y = torch.randn(batch_size, 6, 4, generator=gen)
    return (x, ids), y


# -- encdec ------------------------------------------------------------------------------------


class EncoderLayer(nn.Module):
    """Pre-norm residual MLP over the source sequence."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.ln(x))))
        return out


class CrossAttention(nn.Module):
    """Single-head attention from the target sequence to the encoder output."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim, bias=False)  # a key bias gets no gradient (softmax shift)
        self.v = nn.Linear(dim, dim)
        self.scale = 1.0 / math.sqrt(dim)

    def forward(self, y: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        scores = self.q(y) @ self.k(memory).transpose(-2, -1) * self.scale
        out: torch.Tensor = scores.softmax(dim=-1) @ self.v(memory)
        return out


class DecoderLayer(nn.Module):
    """Cross-attention to the encoder output, then an MLP; both residual."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.cross = CrossAttention(dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, y: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        y = y + self.cross(self.ln1(y), memory)
        out: torch.Tensor = y + self.fc2(F.gelu(self.fc1(self.ln2(y))))
        return out


class Encoder(nn.Module):
    """Linear embedding of float source features, residual layers, final norm."""

    def __init__(self, in_dim: int, dim: int, num_layers: int) -> None:
        super().__init__()
        self.embed = nn.Linear(in_dim, dim)
        self.layers = nn.ModuleList(EncoderLayer(dim) for _ in range(num_layers))
        self.norm = nn.LayerNorm(dim)

    def forward(self, src: torch.Tensor) -> torch.Tensor:
        h = self.embed(src)
        for layer in self.layers:
            h = layer(h)
        out: torch.Tensor = self.norm(h)
        return out


class Decoder(nn.Module):
    """Token embedding, decoder layers that all read the encoder output, final norm."""

    def __init__(self, vocab: int, dim: int, num_layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(DecoderLayer(dim) for _ in range(num_layers))
        self.norm = nn.LayerNorm(dim)

    def forward(self, tgt: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        y = self.embed(tgt)
        for layer in self.layers:
            y = layer(y, memory)
        out: torch.Tensor = self.norm(y)
        return out


class EncoderDecoder(nn.Module):
    """An encoder-decoder: ``head(decoder(tgt, encoder(src)))``."""

    def __init__(self, in_dim: int = 8, vocab: int = 16, dim: int = 16, seed: int = 0) -> None:
        super().__init__()
        self.encoder = Encoder(in_dim, dim, num_layers=2)
        self.decoder = Decoder(vocab, dim, num_layers=3)
        self.head = nn.Linear(dim, vocab)
        seeded_init(self, seed)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.decoder(tgt, self.encoder(src)))
        return out


def _encdec_batch(gen: torch.Generator, batch_size: int) -> Batch:
    src = torch.randn(batch_size, 6, 8, generator=gen)
    tgt = torch.randint(0, 16, (batch_size, 5), generator=gen)
    labels = torch.randint(0, 16, (batch_size, 5), generator=gen)
    return (src, tgt), labels


# -- the registry ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """A test model with everything needed to train it on any dialect."""

    #: The key in :data:`MODELS`.
    name: str
    #: What the model exercises.
    description: str
    #: Builds the model; identical weights for identical ``seed`` in every process.
    factory: Callable[..., nn.Module]
    #: ``loss_fn(outputs, labels)``.
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    #: Recommended split points by number of stages.
    split_points: Mapping[int, tuple[str, ...]]
    #: The model's inputs, in the order ``inputs`` holds them.
    input_names: tuple[str, ...]
    _make_batch: Callable[[torch.Generator, int], Batch] = field(repr=False)
    #: A tensor-parallel plan (``tensor_parallel=`` of the torch dialect), if the model has one.
    tensor_plan: Mapping[str, str] | None = None

    def build(self, seed: int = 0) -> nn.Module:
        """Return a freshly initialised model (weights depend only on ``seed``)."""
        return self.factory(seed=seed)

    def split_points_for(self, num_stages: int) -> tuple[str, ...]:
        """The recommended split points for ``num_stages`` stages."""
        try:
            return self.split_points[num_stages]
        except KeyError:
            raise ConfigError(
                f"model {self.name!r} has split points for {sorted(self.split_points)} stages, "
                f"not {num_stages}"
            ) from None

    def micro_batches(self, count: int, *, batch_size: int = 2, seed: int = 0) -> Iterator[Batch]:
        """Yield ``count`` ``(inputs, labels)`` micro-batches, the same for the same arguments."""
        gen = torch.Generator().manual_seed(_seed_for(seed, self.name))
        for _ in range(count):
            yield self._make_batch(gen, batch_size)


MODELS: Mapping[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="gpt",
            description="GPT-like decoder, custom blocks, embedding tied to the LM head",
            factory=TinyGPT,
            loss_fn=cross_entropy_loss,
            split_points={2: ("blocks.1",), 4: ("blocks.0", "blocks.1", "blocks.2")},
            input_names=("input_ids",),
            _make_batch=_gpt_batch,
        ),
        ModelSpec(
            name="mhgpt",
            description="GPT-like decoder with 4 attention heads and a tensor-parallel plan",
            factory=MultiHeadGPT,
            loss_fn=cross_entropy_loss,
            split_points={2: ("blocks.1",), 4: ("blocks.0", "blocks.1", "blocks.2")},
            input_names=("input_ids",),
            _make_batch=_gpt_batch,
            tensor_plan=MHGPT_TENSOR_PLAN,
        ),
        ModelSpec(
            name="skip",
            description="a value from stage 0 used again by the last stage",
            factory=SkipNet,
            loss_fn=mse_loss,
            split_points={2: ("blocks.1",), 4: ("blocks.0", "blocks.1", "blocks.2")},
            input_names=("x",),
            _make_batch=_skip_batch,
        ),
        ModelSpec(
            name="mixed",
            description="a dict with a bool mask, int and no-grad float tensors, None, a number",
            factory=MixedBoundaryNet,
            loss_fn=mse_loss,
            split_points={2: ("producer",), 4: ("producer", "block1", "block2")},
            input_names=("x", "ids"),
            _make_batch=_mixed_batch,
        ),
        ModelSpec(
            name="encdec",
            description="encoder-decoder; every decoder stage needs the encoder output",
            factory=EncoderDecoder,
            loss_fn=cross_entropy_loss,
            split_points={
                2: ("decoder.layers.0",),
                4: ("encoder.layers.1", "decoder.layers.0", "decoder.layers.1"),
            },
            input_names=("src", "tgt"),
            _make_batch=_encdec_batch,
        ),
    )
}


def get_model(name: str) -> ModelSpec:
    """Return the :class:`ModelSpec` called ``name`` (one of :data:`MODELS`)."""
    try:
        return MODELS[name]
    except KeyError:
        raise ConfigError(f"no test model {name!r}; choose one of {sorted(MODELS)}") from None
