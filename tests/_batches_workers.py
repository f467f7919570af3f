"""A two-input model trained on micro-batches by position and by name (module-level, so spawned
ranks can import it): see tests/plan/test_batches.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

import pipedialect
from pipedialect import DataError
from pipedialect.models import ResidualMLP, cross_entropy_loss, seeded_init

VOCAB, DIM, SEQ, MICRO, GAS = 16, 16, 6, 2, 2
LR = 1e-2
SPLIT = ("blocks.0",)


class Tagger(nn.Module):
    """``forward(ids, mask)``: masked token embeddings through two blocks to per-token logits.

    The mask is used again by the head, so it crosses the stage boundary too.
    """

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(ResidualMLP(DIM) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)
        seeded_init(self, seed)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) * mask.unsqueeze(-1)
        for block in self.blocks:
            h = block(h)
        out: torch.Tensor = self.head(h) * mask.unsqueeze(-1)
        return out


def config() -> dict[str, Any]:
    """Plain Adam (torch's), no clipping: what the reference loop does by hand."""
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": LR, "torch_adam": True, "adam_w_mode": False},
        },
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }


def micro_batches(count: int, seed: int = 0) -> list[tuple[tuple[torch.Tensor, ...], Any]]:
    """``((ids, mask), labels)`` pairs, in ``forward``'s order."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen)
        mask = (torch.rand(MICRO, SEQ, generator=gen) > 0.3).float()
        labels = torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen)
        out.append(((ids, mask), labels))
    return out


def as_dicts(batches: list[tuple[tuple[torch.Tensor, ...], Any]]) -> list[dict[str, Any]]:
    """The same micro-batches as a Hugging Face collator gives them: by name, in another order."""
    return [{"labels": labels, "mask": mask, "ids": ids} for (ids, mask), labels in batches]


def reference(steps: int, seed: int = 0) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The unsplit model trained by a plain loop on the same micro-batches."""
    model = Tagger()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    data = iter(micro_batches(steps * GAS, seed))
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        total = 0.0
        for _ in range(GAS):
            (ids, mask), labels = next(data)
            loss = cross_entropy_loss(model(ids, mask), labels)
            (loss / GAS).backward()
            total += loss.item() / GAS
        optimizer.step()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _engine(dialect: Any) -> tuple[Any, Any]:
    plan = pipedialect.partition(Tagger(), split_points=list(SPLIT))
    extra = {"topology": dialect.make_topology(2)} if dialect.name != "local" else {}
    module = dialect.pipe_engine(plan, config=config(), loss_fn=cross_entropy_loss, **extra)
    return plan, dialect.runtime_engine(module, config=config())


def _params(plan: Any, dialect: Any, engine: Any) -> dict[str, torch.Tensor]:
    return {
        n: p.detach().cpu().clone()
        for stage in dialect.local_stages(engine)
        for n, p in plan.stages[stage].named_parameters()
    }


def run(dialect_name: str, steps: int) -> dict[str, Any]:
    """Train the same model twice, on tuples and on dicts; then feed a dict that lacks a key."""
    dialect = pipedialect.get_dialect(dialect_name)
    dialect.init_distributed()
    results: dict[str, Any] = {}
    for kind in ("tuples", "dicts"):
        torch.manual_seed(0)
        plan, engine = _engine(dialect)
        batches: list[Any] = micro_batches(steps * GAS)
        if kind == "dicts":
            batches = as_dicts(batches)
        data: Iterator[Any] = iter(batches)
        results[kind] = {
            "losses": [float(engine.train_batch(data)) for _ in range(steps)],
            "eval": float(engine.eval_batch(iter(batches[:GAS]))),
            "params": _params(plan, dialect, engine),
        }
    before = _params(plan, dialect, engine)
    bad = [{k: v for k, v in b.items() if k != "mask"} for b in as_dicts(micro_batches(GAS))]
    try:
        engine.train_batch(iter(bad))
    except DataError as exc:
        results["error"] = str(exc)
    after = _params(plan, dialect, engine)
    results["unchanged"] = all(torch.equal(before[n], after[n]) for n in before)
    return results
