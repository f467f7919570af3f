"""What each rank runs in the multi-process tie tests (module-level, so spawned ranks import it).

A model built on the meta device is partitioned on every rank, and each rank materialises only
the stage it runs, as a user at scale would: ``to_empty()`` (which gives every holder of a tied
weight its own Parameter) and then the values of the real model. The dialect must tie the copies
again before it trains them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import pipedialect
from pipedialect.models import ModelSpec, ResidualMLP, cross_entropy_loss, seeded_init
from pipedialect.plan.partition import partition

DATA_SEED = 100
GAS, MICRO = 4, 2


class DoubleTiedNet(nn.Module):
    """The embedding tied to two heads, both on the last stage when split after ``blocks.0``.

    One tie group then has two names on stage 1: materialising that stage gives them two
    Parameter objects on the rank that runs it.
    """

    def __init__(self, vocab: int = 16, dim: int = 16, seed: int = 0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(ResidualMLP(dim) for _ in range(2))
        self.out = nn.Linear(dim, vocab, bias=False)
        self.aux = nn.Linear(dim, vocab, bias=False)
        seeded_init(self, seed)
        self.out.weight = self.embed.weight
        self.aux.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.blocks[1](self.blocks[0](self.embed(ids)))
        return self.out(h) + self.aux(torch.tanh(h))


def _batch(gen: torch.Generator, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 16, (batch_size, 6), generator=gen)
    labels = torch.randint(0, 16, (batch_size, 6), generator=gen)
    return ids, labels


DOUBLE_TIED = ModelSpec(
    name="doubletied",
    description="embedding tied to two heads on the last stage",
    factory=DoubleTiedNet,
    loss_fn=cross_entropy_loss,
    split_points={2: ("blocks.0",)},
    input_names=("ids",),
    _make_batch=_batch,
)


def sgd_config() -> dict[str, Any]:
    """DeepSpeed's config for plain SGD (lr 0.1), one data-parallel replica."""
    return {
        "train_batch_size": GAS * MICRO,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }


def materialise(stage: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Allocate a meta stage's tensors on the CPU and load the real model's values into them."""
    stage.to_empty(device="cpu")
    root = getattr(stage, "mod", stage)
    root.load_state_dict({name: state[name] for name in root.state_dict()})


def deepspeed_meta_run(steps: int) -> dict[str, Any]:
    """Train the double-tied model on DeepSpeed, this rank's stage materialised by hand."""
    dialect = pipedialect.get_dialect("deepspeed")
    dialect.init_distributed()
    spec = DOUBLE_TIED
    with torch.device("meta"):
        plan = partition(spec.build(0), spec.split_points_for(2))
    topology = dialect.make_topology(2, 1)
    stage = int(topology.get_coord(dist.get_rank()).pipe)
    stages = list(dialect.wrap_stages(plan))
    materialise(stages[stage], spec.build(0).state_dict())
    heads_before = _heads_tied(plan, stage)
    config = sgd_config()
    module = dialect.pipe_engine(
        plan, stages, config=config, loss_fn=spec.loss_fn, topology=topology
    )
    engine = dialect.runtime_engine(module, config=config)
    data = iter(list(spec.micro_batches(steps * GAS, batch_size=MICRO, seed=DATA_SEED)))
    losses = [float(engine.train_batch(data_iter=data)) for _ in range(steps)]
    named = plan.stages[stage].named_parameters(remove_duplicate=False)
    return {
        "stage": stage,
        "losses": losses,
        "heads_tied_before": heads_before,
        "heads_tied_after": _heads_tied(plan, stage),
        "params": {n: p.detach().clone() for n, p in named},
    }


def _heads_tied(plan: Any, stage: int) -> bool | None:
    """On the last stage, whether both heads hold one Parameter; None on the first."""
    if stage == 0:
        return None
    module = plan.stages[stage]
    return bool(module.get_parameter("out.weight") is module.get_parameter("aux.weight"))
