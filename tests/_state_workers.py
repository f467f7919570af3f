"""Models with state and what each rank runs in the state-capture tests (importable by ranks).

The models are small and hold module state: BatchNorm running statistics and
``num_batches_tracked``, a buffer written by one stage and read by the next, a hand-written
running mean under ``torch.no_grad()`` in an ``if self.training:`` branch, non-persistent
buffers. The torch dialect's schedule set-up runs every stage once more on the first micro-batch
(fixed apart from capture), so the torch runs use the variants whose buffer
writes do not depend on earlier micro-batches (``last``: the latest batch mean): they check what
crosses a boundary, not that. :func:`reference` trains the unsplit model with a plain PyTorch
loop (plain Adam, the loss of each micro-batch divided by the accumulation steps) and evaluates
it in eval mode; it never runs pipedialect code. :func:`run` trains a plan on one dialect (the
local one in this process, deepspeed and torch on launched ranks) and returns what the tests
compare: losses, eval losses, and this rank's parameters and buffers by their original names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import pipedialect
import pipedialect.checkpoint as ckpt
from pipedialect.plan.partition import partition

DIM, VOCAB = 8, 16
MICRO, GAS, STEPS = 4, 2, 3
LR = 1e-2


class Block(nn.Module):
    """Linear, optionally BatchNorm1d, tanh (no bias before the norm: its gradient would be
    float noise, which Adam magnifies into differences that mean nothing)."""

    def __init__(self, bn: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM, bias=not bn)
        self.bn = nn.BatchNorm1d(DIM) if bn else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.bn(self.lin(x)))


class StateNet(nn.Module):
    """Split after ``b1``: stage 0 writes buffer ``last``, stage 1 reads it; BatchNorm in both.

    ``last`` is the batch mean of ``|b0|``'s output (a write that does not depend on earlier
    micro-batches); ``count`` (with ``counting``) counts forwards in place; ``table`` is a
    non-persistent constant.
    """

    def __init__(self, bn: bool = True, counting: bool = True, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.b0 = Block(bn)
            self.b1 = Block(bn)
            self.b2 = Block(bn)
            self.head = nn.Linear(DIM, DIM)
        self.register_buffer("last", torch.zeros(DIM))
        if counting:  # a buffer forward never uses would be in no stage
            self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("table", torch.linspace(0, 1, DIM), persistent=False)
        self.counting = counting

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b0(x + self.table)
        with torch.no_grad():
            self.last.copy_(h.abs().mean(0))
        if self.counting:
            self.count.add_(1)
        h = self.b1(h)
        return self.head(self.b2(h) + self.last)


class RunningMean(nn.Module):
    """A hand-written running mean (fp32 buffer) updated only in train mode; without ``ema``
    the latest batch mean."""

    def __init__(self, ema: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.register_buffer("mean", torch.zeros(DIM))
        self.ema = ema

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.lin(h)
        if self.training:
            with torch.no_grad():
                batch = h.float().reshape(-1, DIM).mean(0)
                if self.ema:
                    self.mean.mul_(0.9).add_(batch, alpha=0.1)
                else:
                    self.mean.copy_(batch)
        return h - self.mean.to(h.dtype)


class Bf16Net(nn.Module):
    """Token ids in, fp32 logits out; dtypes follow the parameters (``x.to(h.dtype)``), and the
    fp32 buffer ``stat.mean`` written by stage 0 is read by stage 1."""

    def __init__(self, ema: bool = True, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.emb = nn.Embedding(VOCAB, DIM)
            self.stat = RunningMean(ema)
            self.out = nn.Linear(DIM, VOCAB)
        self.register_buffer("pos", torch.linspace(-1, 1, 5)[:, None].expand(5, DIM).clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) + self.pos[: ids.shape[1]].to(self.emb.weight.dtype)
        h = self.stat(h)
        return self.out(torch.tanh(h) + self.stat.mean.to(h.dtype)).float()


def mse(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(outputs, labels)


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def state_batches(count: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(MICRO, DIM, generator=g), torch.randn(MICRO, DIM, generator=g))
        for _ in range(count)
    ]


def token_batches(count: int, seed: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, VOCAB, (MICRO, 5), generator=g),
            torch.randint(0, VOCAB, (MICRO, 5), generator=g),
        )
        for _ in range(count)
    ]


def config(*, bf16: bool = False, gas: int = GAS) -> dict[str, Any]:
    """Plain Adam, no clipping: DeepSpeed's exact-comparison settings."""
    out: dict[str, Any] = {
        "train_batch_size": MICRO * gas,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": LR, "torch_adam": True, "adam_w_mode": False},
        },
    }
    if bf16:
        out["bf16"] = {"enabled": True}
    return out


def reference(
    model: nn.Module, loss_fn: Any, batches: list[Any], steps: int = STEPS, gas: int = GAS
) -> dict[str, Any]:
    """The unsplit model trained by a plain loop, then evaluated on the same micro-batches."""
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses, evals = [], []
    for step in range(steps):
        model.train()
        total = 0.0
        for inputs, labels in batches[step * gas : (step + 1) * gas]:
            loss = loss_fn(model(inputs), labels)
            (loss / gas).backward()
            total += loss.item() / gas
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
        model.eval()
        with torch.no_grad():
            chunk = batches[step * gas : (step + 1) * gas]
            evals.append(sum(float(loss_fn(model(x), y)) for x, y in chunk) / gas)
    model.train()
    return {"losses": losses, "evals": evals, "state": _state(model)}


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers()]
    return {n: t.detach().to("cpu").clone() for n, t in named}


MODELS = ("state", "state-last", "bf16", "bf16-last")


def build(model_name: str) -> tuple[nn.Module, Any, list[Any], list[str]]:
    """One of :data:`MODELS`: the model, its loss, the run's micro-batches, its split point.

    "state": :class:`StateNet` with BatchNorm and the counter; "state-last": without either;
    "bf16": :class:`Bf16Net`; "bf16-last": its running mean as the latest batch mean.
    """
    if model_name.startswith("bf16"):
        return Bf16Net(ema=model_name == "bf16"), token_loss, token_batches(STEPS * GAS), ["stat"]
    full = model_name == "state"
    return StateNet(bn=full, counting=full), mse, state_batches(STEPS * GAS), ["b1"]


def run(
    dialect_name: str,
    model_name: str,
    *,
    bf16: bool = False,
    export: bool = False,
    save_dir: str | None = None,
) -> dict[str, Any]:
    """Train :func:`build` ``(model_name)`` split in two on a dialect.

    Returns the train and eval losses, this rank's stages' parameters and buffers (fp32, by
    their original names), the plan's buffer table, and the path of a portable checkpoint
    saved after training when ``save_dir`` is given.
    """
    model, loss_fn, batches, points = build(model_name)
    example = {("ids" if isinstance(model, Bf16Net) else "x"): batches[0][0]} if export else None
    precision = {"dtype": torch.bfloat16} if bf16 and export else {}
    plan = partition(model, points, example_inputs=example, **precision)
    dialect = pipedialect.get_dialect(dialect_name)
    dialect.init_distributed()
    kwargs: dict[str, Any] = {"config": config(bf16=bf16), "loss_fn": loss_fn}
    if dialect_name != "local":
        kwargs["topology"] = dialect.make_topology(2, 1)
    engine = dialect.runtime_engine(dialect.pipe_engine(plan, **kwargs))
    losses, evals = [], []
    for step in range(STEPS):
        chunk = batches[step * GAS : (step + 1) * GAS]
        losses.append(float(engine.train_batch(iter(chunk))))
        evals.append(float(engine.eval_batch(iter(chunk))))
    stages = list(dialect.local_stages(engine))
    state = {
        n: t.detach().to("cpu", torch.float32 if t.is_floating_point() else t.dtype).clone()
        for k in stages
        for n, t in [
            *plan.stages[k].named_parameters(remove_duplicate=False),
            *plan.stages[k].named_buffers(),
        ]
    }
    dtypes = {n: str(b.dtype) for k in stages for n, b in plan.stages[k].named_buffers()}
    path = None
    if save_dir is not None:
        path = str(ckpt.save(engine, Path(save_dir)))
    return {
        "losses": losses,
        "evals": evals,
        "stages": stages,
        "state": state,
        "buffer_dtypes": dtypes,
        "buffers": [(b.name, b.owner, b.readers) for b in getattr(plan, "buffers", ())],
        "checkpoint": path,
    }


def deepspeed_checks(save_dir: str) -> dict[str, Any]:
    """One deepspeed launch: the BatchNorm model (fx) with a portable checkpoint, and the bf16
    model captured with torch.export."""
    return {
        "state": run("deepspeed", "state", save_dir=save_dir),
        "bf16": run("deepspeed", "bf16", bf16=True, export=True),
    }


def torch_checks(save_dir: str) -> dict[str, Any]:
    """One torch launch: the cross-stage buffer model (fx) with a portable checkpoint, and the
    bf16 model captured with torch.export."""
    return {
        "state": run("torch", "state-last", save_dir=save_dir),
        "bf16": run("torch", "bf16-last", bf16=True, export=True),
    }
