"""Slapo's first pipeline test: its model, its data, and what each rank runs (module-level, so
spawned ranks can import it).

Slapo's own DeepSpeed pipeline test (its PR #105) builds 12 ``Linear(10, 10)`` layers cut after
``layers.5``, wraps the stages through the seed's API, evaluates one batch with ``eval_batch``
on a ``RepeatingLoader([(tuple(inputs), labels)])`` and compares the loss with the unsplit
model's. Here the layer at the cut is a block returning ``(h, [tanh(h), None], 3, 0.5)``: a
list, which the seed's path codec gives back as a tuple, a ``None`` the code after it tests,
and two Python numbers it computes with. The config is the one Slapo's ``get_ds_config`` writes
for that test, keys Slapo adds and DeepSpeed does not know included (``help``,
``pipeline.sequence_parallel``), given to the seed's ``deepspeed_pipe_engine`` and, as Slapo's
engine set-up does, to ``init_ds_engine``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import pipedialect
from pipedialect.dialects.deepspeed.pipeline import (
    DeepSpeedPipeStageWrapper,
    PathCodec,
    analyze_pipeline_module,
    deepspeed_pipe_engine,
)
from pipedialect.models import seeded_init
from pipedialect.plan.partition import PipelinePlan, partition

DIM = 10
BATCH = 4
SPLIT = "layers.5"
DATA_SEED = 105


def slapo_ds_config(batch_size: int, micro_batch_size_per_gpu: int) -> dict[str, Any]:
    """What Slapo's ``get_ds_config(batch_size, micro_batch_size_per_gpu, fp16=False)`` returns
    (``slapo.framework_dialect.deepspeed.pipeline`` on the branch of its pipeline tests), with
    one change: torch's AdamW (``torch_adam``), the same maths as DeepSpeed's FusedAdam, which a
    CPU would first compile for minutes."""
    return {
        "help": "",
        "steps_per_print": 10,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.0001, "torch_adam": True}},
        "fp16": {"enabled": False, "initial_scale_power": 12},
        "bf16": {"enabled": False},
        "gradient_clipping": 1.0,
        "train_batch_size": batch_size,
        "train_micro_batch_size_per_gpu": micro_batch_size_per_gpu,
        "pipeline": {"sequence_parallel": False},
        "wall_clock_breakdown": False,
    }


#: Slapo's test evaluates one batch: one micro-batch of the whole batch.
CONFIG = slapo_ds_config(BATCH, BATCH)


class SplitBlock(nn.Module):
    """The layer at the cut: a Linear whose output comes with a list, None and two numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> tuple[Any, ...]:
        h = self.linear(x)
        return h, [torch.tanh(h), None], 3, 0.5


class TwelveLinears(nn.Module):
    """Twelve Linear(10, 10) layers in a ModuleList, the sixth inside :class:`SplitBlock`."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            SplitBlock() if i == 5 else nn.Linear(DIM, DIM) for i in range(12)
        )
        seeded_init(self, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i != 5:
                x = layer(x)
                continue
            h, (t, missing), k, scale = layer(x)
            x = h * scale + t * k if missing is None else h
        return x


def loss_fn(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean squared error."""
    return nn.functional.mse_loss(outputs, labels)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Slapo's one batch: ``(inputs, labels)``."""
    gen = torch.Generator().manual_seed(DATA_SEED)
    return torch.randn(BATCH, DIM, generator=gen), torch.randn(BATCH, DIM, generator=gen)


def seed_stages(plan: PipelinePlan) -> list[DeepSpeedPipeStageWrapper]:
    """Every stage wrapped as Slapo wraps them: the seed's constructor and path codec."""
    stage_id_2_arg_names, stage_id_2_name, liveness = analyze_pipeline_module(plan)
    return [
        DeepSpeedPipeStageWrapper(
            mod,
            stage_id,
            stage_id_2_name[stage_id],
            plan.num_stages,
            liveness,
            stage_id_2_arg_names,
            codec=PathCodec(),
        )
        for stage_id, mod in enumerate(plan.stages)
    ]


def seed_api_eval() -> dict[str, Any]:
    """Build the pipeline through the seed's API on the real DeepSpeed engine; evaluate."""
    import torch.distributed as dist
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    from deepspeed.utils import RepeatingLoader

    from pipedialect.dialects.deepspeed.engine import init_ds_engine

    dialect = pipedialect.get_dialect("deepspeed")
    dialect.init_distributed()
    plan = partition(TwelveLinears(), [SPLIT])
    stages = seed_stages(plan)
    topology = PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=1)
    model = deepspeed_pipe_engine(plan, stages, config=CONFIG, loss_fn=loss_fn, topology=topology)
    engine = init_ds_engine(model, config=CONFIG)
    inputs, labels = batch()
    loss = engine.eval_batch(RepeatingLoader([((inputs,), labels)]))
    stage = int(engine.stage_id)
    return {
        "rank": dist.get_rank(),
        "stage": stage,
        "codec": type(stages[stage].codec).__name__,
        "loss": float(loss),
    }
