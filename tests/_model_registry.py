"""The models, micro-batch streams and configs the test suite shares, by name.

:func:`spec_for` finds a model: one of :mod:`pipedialect.models`, or one defined here for the
situations the example models do not reach (a tie with a skip connection across four stages,
pooling, an argmax, several sequence lengths, dropout on both stages, a no-grad float before the
activation). :func:`data_stream` gives a data-parallel rank its micro-batches (seeded
``DATA_SEED + rank``), :func:`ds_config` the DeepSpeed-style config every dialect reads,
:func:`local_params` a stage's parameters by the model's names, and
:func:`checkpoint_reference` the unsplit model's run that recomputation is compared with.
Module-level, so that spawned ranks import it; nothing here starts a runtime.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from _reference import call_model, steps_from, train_unsplit
from torch import nn

from pipedialect.models import (
    ModelSpec,
    ResidualMLP,
    cross_entropy_loss,
    get_model,
    mse_loss,
    seeded_init,
)
from pipedialect.runtime import ReferenceStreams

DATA_SEED = 100


class SkipTiedNet(nn.Module):
    """Embedding tied to the output projection, plus the embedding added back before the head.

    Split after blocks 0, 1 and 2 it has a tie between stages 0 and 3 and a skip connection that
    rides from stage 0 through stages 1 and 2 to stage 3.
    """

    def __init__(self, vocab: int = 16, dim: int = 16, seed: int = 0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(ResidualMLP(dim) for _ in range(4))
        self.out = nn.Linear(dim, vocab, bias=False)
        seeded_init(self, seed)
        self.out.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.embed(ids)
        h = e
        for block in self.blocks:
            h = block(h)
        return self.out(torch.tanh(h) + e)


def _skiptied_batch(gen: torch.Generator, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 16, (batch_size, 6), generator=gen)
    labels = torch.randint(0, 16, (batch_size, 6), generator=gen)
    return ids, labels


SKIPTIED = ModelSpec(
    name="skiptied",
    description="tie between stages 0 and 3 and a skip connection from stage 0 to stage 3",
    factory=SkipTiedNet,
    loss_fn=cross_entropy_loss,
    split_points={4: ("blocks.0", "blocks.1", "blocks.2"), 2: ("blocks.1",)},
    input_names=("ids",),
    _make_batch=_skiptied_batch,
)


class PoolTrapNet(nn.Module):
    """Three stages; the middle one receives a large bool mask and sends two floats.

    DeepSpeed 0.19 pools receive buffers by position only, so the middle stage's second gradient
    buffer would land in the slot the (larger) mask was received in, with the mask's dtype. The
    mask is also an expanded, non-contiguous view, which a send cannot take as it is.
    """

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 4)
        seeded_init(self, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = (x.unsqueeze(-1) > 0).expand(-1, -1, -1, 4)
        h = self.a(x)
        h1 = torch.tanh(self.b(h))
        gate = mask.float().mean(-1)
        return self.c((h1 + h) * gate)


def _pooltrap_batch(gen: torch.Generator, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 4, 8, generator=gen), torch.randn(
        batch_size, 4, 4, generator=gen
    )


POOLTRAP = ModelSpec(
    name="pooltrap",
    description="a middle stage that receives a big bool mask and sends two gradient floats",
    factory=PoolTrapNet,
    loss_fn=mse_loss,
    split_points={3: ("a", "b")},
    input_names=("x",),
    _make_batch=_pooltrap_batch,
)


class HiddenAndScores(nn.Module):
    """Returns a hidden state and scores derived from it; both need gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lin(x)
        return h, torch.tanh(h)


class ArgmaxNet(nn.Module):
    """The second stage uses the scores only through ``argmax``: no gradient reaches them."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.first = HiddenAndScores()
        self.head = nn.Linear(8, 4)
        seeded_init(self, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, scores = self.first(x)
        picked = scores.argmax(-1, keepdim=True).float()
        return self.head(h) + 0.01 * picked


ARGMAX = ModelSpec(
    name="argmax",
    description="a received value that needs a gradient but reaches no output differentiably",
    factory=ArgmaxNet,
    loss_fn=mse_loss,
    split_points={2: ("first",)},
    input_names=("x",),
    _make_batch=lambda gen, b: (torch.randn(b, 8, generator=gen), torch.randn(b, 4, generator=gen)),
)


def _varlen_batch(gen: torch.Generator, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    length = int(torch.randint(4, 9, (1,), generator=gen))
    ids = torch.randint(0, 32, (batch_size, length + 1), generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


GPT_VARLEN = ModelSpec(
    name="gptvarlen",
    description="the gpt model on micro-batches of different sequence lengths",
    factory=get_model("gpt").factory,
    loss_fn=cross_entropy_loss,
    split_points=dict(get_model("gpt").split_points),
    input_names=("input_ids",),
    _make_batch=_varlen_batch,
)


def spec_for(name: str) -> ModelSpec:
    extra = {"skiptied": SKIPTIED, "pooltrap": POOLTRAP, "argmax": ARGMAX, "gptvarlen": GPT_VARLEN}
    return extra.get(name) or get_model(name)


def ds_config(
    optimizer: str, *, gas: int, micro: int, dp: int, clip: float = 0.0
) -> dict[str, Any]:
    """A DeepSpeed config; ``optimizer`` is sgd, adam (plain Adam) or adamw (DeepSpeed's Adam)."""
    if optimizer == "sgd":
        opt = {"type": "SGD", "params": {"lr": 0.1}}
    elif optimizer == "adam":
        opt = {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True, "adam_w_mode": False}}
    elif optimizer == "adamw":
        opt = {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True, "weight_decay": 0.1}}
    else:
        raise ValueError(optimizer)
    return {
        "train_batch_size": micro * gas * dp,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "optimizer": opt,
        "gradient_clipping": clip,
        "steps_per_print": 10**9,
    }


def reference_optimizer(optimizer: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The torch optimizer the unsplit reference steps for :func:`ds_config`'s ``optimizer``."""
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    if optimizer == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def data_stream(spec: ModelSpec, count: int, micro: int, dp_rank: int) -> Iterator[Any]:
    return iter(list(spec.micro_batches(count, batch_size=micro, seed=DATA_SEED + dp_rank)))


def local_params(plan: Any, stage: int) -> dict[str, torch.Tensor]:
    return {
        n: p.detach().cpu().clone()
        for n, p in plan.stages[stage].named_parameters(remove_duplicate=False)
    }


# -- the wire-state models: a no-grad float before the activation; token ids -------------------


class Emit(nn.Module):
    """A float that needs no gradient first, then the activation, then a bool mask."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scale = torch.sigmoid(x.mean(-1, keepdim=True))
        return scale, self.lin(x), x.sum(-1) > 0


class NoGradFloatFirst(nn.Module):
    """Split after ``emit``, stage 1 receives ``(scale, h, mask)``: the float that needs no
    gradient comes before the activation, and no reordering of the two goes unnoticed."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.emit = Emit()
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        seeded_init(self, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale, h, mask = self.emit(x)
        h = torch.tanh(self.mid(h)) - 3.0 * scale
        out: torch.Tensor = self.head(h).masked_fill(~mask.unsqueeze(-1), 0.0)
        return out


def float_batches(count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(2, 3, 8, generator=gen), torch.randn(2, 3, 4, generator=gen))
        for _ in range(count)
    ]


def token_batches(count: int, length: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, 32, (2, length + 1), generator=gen)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def gpt16(seed: int = 0) -> nn.Module:
    """The gpt test model with room for 16 positions."""
    from pipedialect.models import TinyGPT

    return TinyGPT(max_len=16, seed=seed)


# -- activation recomputation ------------------------------------------------------------------


class DropNet(nn.Module):
    """Token ids into stage 0; dropout on both stages (split after ``block0``)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.drop0 = nn.Dropout(0.25)
        self.block0 = ResidualMLP(16)
        self.drop1 = nn.Dropout(0.25)
        self.head = nn.Linear(16, 32)
        seeded_init(self, seed)

    def stage0(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.block0(self.drop0(self.embed(ids)))
        return out

    def stage1(self, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.drop1(torch.tanh(h)))
        return out

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.stage1(self.stage0(ids))


DROPNET = ModelSpec(
    name="dropnet",
    description="token ids into stage 0 and dropout on both stages",
    factory=DropNet,
    loss_fn=cross_entropy_loss,
    split_points={2: ("block0",)},
    input_names=("ids",),
    _make_batch=lambda gen, b: _skiptied_batch(gen, b),
)

#: Each rank seeds its own RNG with this plus its stage right before training: the stages'
#: dropout streams must not depend on it ([Note: random streams]).
DROPOUT_SEED = 1000


#: ``partition(recompute=...)`` on DropNet: the split point itself, both dropouts (by glob)
#: and the head are recomputed in backward.
MODULE_RECOMPUTE = ["block0", "drop*", "head"]


def count_module_calls(stage: nn.Module, path: str) -> list[int]:
    calls = [0]

    def count(*_: Any) -> None:
        calls[0] += 1

    stage.get_submodule(path).register_forward_pre_hook(count)
    return calls


def checkpoint_reference(model_name: str, steps: int = 3, gas: int = 2) -> dict[str, Any]:
    """The unsplit model on the cases' micro-batches: losses and the gradients of each step.

    On ``dropnet`` the unsplit model runs under ``ReferenceStreams`` of the plan's split point
    and the engines' default seed: each stage's part draws the masks the pipeline's stage draws
    for that step and micro-batch ([Note: random streams]).
    """
    spec = DROPNET if model_name == "dropnet" else spec_for(model_name)
    model = spec.build(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    streams = ReferenceStreams(model, ["block0"] if model_name == "dropnet" else [])
    count = [0]

    def forward(model: Any, inputs: Any) -> Any:
        if model_name != "dropnet":
            return call_model(model, inputs)
        step, micro_batch = divmod(count[0], gas)
        count[0] += 1
        with streams.micro_batch("train", step + 1, micro_batch):
            return call_model(model, inputs)

    grads: list[dict[str, torch.Tensor]] = []

    def keep_grads() -> None:
        grads.append({n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)})

    data = data_stream(spec, steps * gas, 2, 0)
    losses = train_unsplit(
        model,
        opt,
        steps_from([data], steps, gas),
        spec.loss_fn,
        forward=forward,
        before_step=keep_grads,
    ).losses
    params = dict(model.named_parameters(remove_duplicate=False))
    return {"losses": losses, "grads": grads, "params": params}
