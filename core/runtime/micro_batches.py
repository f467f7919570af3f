"""A step's micro-batches, read whole before anything is computed.

:func:`pull_micro_batches` reads every micro-batch of a step first, so a data iterator that runs
out stops the step before it changed anything (every rank learns of it through ``agreement``
[Note: rank agreement]); :func:`check_inputs` refuses a micro-batch with more inputs than the
model takes; :func:`kept_loss` is what a step keeps of a micro-batch's loss.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..errors import DataError, DataExhaustedError

__all__ = ["check_inputs", "kept_loss", "pull_micro_batches"]


def kept_loss(loss: torch.Tensor) -> torch.Tensor:
    """A micro-batch's loss as a step keeps it (for its mean and the finiteness check): detached,
    in storage of its own. On CPUs a loss may share the storage its reduction wrote (the scalar
    of ``F.mse_loss`` keeps a buffer of its input's size), which a list of the step's losses
    would otherwise hold until the step ends, once per micro-batch."""
    return loss.detach().clone()


def pull_micro_batches(
    data_iter: Iterator[Any], count: int, *, what: str = "train_batch", source: str | None = None
) -> list[Any]:
    """Read ``count`` items from ``data_iter`` before any of them is used.

    Raises:
        DataExhaustedError: the iterator ran out first; nothing was computed from what it gave.
    """
    source = source or "gradient_accumulation_steps"
    items: list[Any] = []
    for got in range(count):
        try:
            items.append(next(data_iter))
        except StopIteration:
            raise DataExhaustedError(
                f"{what} needs {count} micro-batches ({source}), the data iterator ran out "
                f"after {got}; nothing was computed and no gradient or parameter changed. Pass "
                f"an iterator with at least {count} more micro-batches (a repeating loader "
                "never runs out)",
                expected=count,
                got=got,
            ) from None
    return items


def check_inputs(inputs: Any, input_names: Sequence[str], index: int) -> None:
    """Refuse a tuple or list of more inputs than the model takes, explaining how it is read."""
    if isinstance(inputs, tuple | list) and len(inputs) > len(input_names):
        raise DataError(
            f"micro-batch {index}: its inputs are a {type(inputs).__name__} of {len(inputs)} "
            "values, and a tuple or list is passed as the model's positional inputs, one per "
            f"element (as DeepSpeed does), but the model takes {len(input_names)} "
            f"({list(input_names)}). Yield the input itself for a one-input model, or wrap a "
            "list-valued input in a 1-tuple: ((values,), labels)"
        )
