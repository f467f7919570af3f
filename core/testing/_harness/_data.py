"""What every run of a case is fed: its DeepSpeed-style config and its micro-batches.

The ranks of a launch and the unsplit reference in the test process call the same functions, so
they see the same numbers. Replica ``d`` of a data-parallel run trains on the stream seeded
``DATA_SEED + d``; the unsplit model trains on all replicas' micro-batches each step.
"""

from __future__ import annotations

from typing import Any

import torch

from ._cases import DATA_SEED, EVAL_SEED, Case
from ._models import suite_model

__all__ = ["Batch", "eval_stream", "suite_config", "train_stream"]

Batch = tuple[Any, torch.Tensor]

#: The learning rate of every case (plain Adam, torch's defaults otherwise).
LR = 1e-2


def suite_config(case: Case) -> dict[str, Any]:
    """The DeepSpeed config of ``case``: plain Adam (``torch_adam``, no decoupled decay)."""
    return {
        "train_batch_size": case.micro * case.gas * case.data_parallel,
        "train_micro_batch_size_per_gpu": case.micro,
        "gradient_accumulation_steps": case.gas,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": LR, "torch_adam": True, "adam_w_mode": False},
        },
        "gradient_clipping": case.clip,
        "steps_per_print": 10**9,
    }


def train_stream(case: Case, replica: int, count: int | None = None) -> list[Batch]:
    """The training micro-batches of ``replica``: ``steps * gas`` of them unless ``count``."""
    spec = suite_model(case.model)
    n = case.steps * case.gas if count is None else count
    if case.mistake == "new-shape":
        # Sequence length 6, then 4: a dialect with static shapes must refuse the second.
        batches = spec.micro_batches(n, batch_size=case.micro, seed=DATA_SEED + replica)
        return [(_shorter(x), _shorter(y)) if i % 2 else (x, y) for i, (x, y) in enumerate(batches)]
    return list(spec.micro_batches(n, batch_size=case.micro, seed=DATA_SEED + replica))


def _shorter(t: Any) -> torch.Tensor:
    """``t`` cut to a sequence length of 4 (dimension 1)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a tensor, got {type(t).__name__}")
    return t[:, :4]


def eval_stream(case: Case, replica: int) -> list[Batch]:
    """The ``gas`` evaluation micro-batches of ``replica``."""
    spec = suite_model(case.model)
    return list(spec.micro_batches(case.gas, batch_size=case.micro, seed=EVAL_SEED + replica))
