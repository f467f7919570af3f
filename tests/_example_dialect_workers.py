"""What each rank runs to trace the example third-party dialect (importable by spawned ranks).

The example dialect (examples/pipedialect-sendrecv) must be installed where the ranks find it.
Each rank trains the suite's GPT twice from the same weights on the same micro-batches, untraced
and inside :func:`pipedialect.trace`, and returns both runs' losses and the traced run's
communication spans: the dialect's ``instrument`` hook times its sends and receives.
"""

from __future__ import annotations

from typing import Any

import torch

import pipedialect
from pipedialect.testing._harness._models import suite_model

GAS, STEPS = 4, 2
CONFIG = {
    "train_batch_size": 2 * GAS,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": GAS,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
    "gradient_clipping": 0.0,
}


def _losses(traced: bool) -> tuple[list[float], list[tuple[str, str, int | None]]]:
    spec = suite_model("gpt")
    plan = pipedialect.partition(spec.build(0), spec.split_points_for(2))
    dialect = pipedialect.get_dialect("sendrecv")
    engine = dialect.runtime_engine(
        dialect.pipe_engine(plan, config=CONFIG, loss_fn=spec.loss_fn), config=CONFIG
    )
    data = iter(list(spec.micro_batches(GAS * STEPS, batch_size=2, seed=11)))
    if not traced:
        return [float(engine.train_batch(data)) for _ in range(STEPS)], []
    with pipedialect.trace(engine, png=False) as recorded:
        losses = [float(engine.train_batch(data)) for _ in range(STEPS)]
    assert recorded.timeline is not None
    rank = torch.distributed.get_rank()
    mine = [
        (s.kind, str(s.detail), s.micro_batch)
        for s in recorded.timeline.spans
        if s.rank == rank and s.kind in ("send", "recv") and s.step == 0
    ]
    return losses, mine


def traced_and_untraced() -> dict[str, Any]:
    """Both runs' losses and this rank's communication spans of the first traced step."""
    pipedialect.get_dialect("sendrecv").init_distributed()
    torch.set_num_threads(1)
    untraced, _ = _losses(traced=False)
    traced, spans = _losses(traced=True)
    return {
        "rank": torch.distributed.get_rank(),
        "untraced": untraced,
        "traced": traced,
        "spans": spans,
    }
