"""The independent reference of the equivalence tests: the unsplit model trained by a plain loop.

Every test that says "trains like the unsplit model" compares a pipeline with this loop (in the
test process, or on a rank where the test needs the reference there): one optimizer step per
element of ``steps``, which holds that step's micro-batches ``(inputs, labels)``. Each
micro-batch's loss, divided by the number of micro-batches of the step, is back-propagated (so
the gradient is the mean over the step, as a pipeline accumulates it), the gradients are
clipped to a global norm if asked, the optimizer steps and the gradients are cleared. Nothing of
pipedialect runs here: the loop is torch alone, so it cannot share a bug with the code it checks.

- :func:`train_unsplit` runs the loop and returns each step's mean loss (and the pre-clip norms).
- :func:`steps_from` cuts data-parallel streams into steps: ``gas`` micro-batches from each
  replica's stream in turn, as ``dp`` replicas of ``gas`` micro-batches make one global step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = ["Trained", "call_model", "steps_from", "train_unsplit"]

#: ``(inputs, labels)``; ``inputs`` a tensor, or a tuple of the forward's positional arguments.
MicroBatch = tuple[Any, Any]


class Trained(NamedTuple):
    """What the reference loop saw."""

    #: Each step's loss: the mean over its micro-batches.
    losses: list[float]
    #: Each step's global gradient norm before clipping (empty without ``clip``).
    norms: list[float]


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model(*inputs)`` for a tuple of inputs, else ``model(inputs)``."""
    return model(*inputs) if isinstance(inputs, tuple) else model(inputs)


def steps_from(
    streams: Sequence[Iterator[MicroBatch]], steps: int, gas: int
) -> Iterator[list[MicroBatch]]:
    """``steps`` global steps of ``gas`` micro-batches from each of ``streams`` in turn."""
    for _ in range(steps):
        yield [next(stream) for stream in streams for _ in range(gas)]


def train_unsplit(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: Iterable[Sequence[MicroBatch]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    clip: float = 0.0,
    clip_params: Iterable[torch.Tensor] | None = None,
    forward: Callable[[nn.Module, Any], Any] = call_model,
    before_step: Callable[[], None] | None = None,
    after_step: Callable[[], None] | None = None,
) -> Trained:
    """Train ``model`` one optimizer step per element of ``steps``; see the module docstring.

    ``clip``: clip the gradients' global norm to it before each step (over ``clip_params``,
    default the model's parameters, a tied weight once). ``forward(model, inputs)``: how the
    model is called (default :func:`call_model`). ``before_step`` runs after the backward passes
    (the step's gradients are there), ``after_step`` after the optimizer step (an LR schedule's
    step, say).
    """
    params = list(clip_params) if clip_params is not None else list(model.parameters())
    losses: list[float] = []
    norms: list[float] = []
    for batches in steps:
        optimizer.zero_grad()
        total = 0.0
        for inputs, labels in batches:
            loss = loss_fn(forward(model, inputs), labels)
            (loss / len(batches)).backward()
            total += loss.item() / len(batches)
        if before_step is not None:
            before_step()
        if clip > 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
        optimizer.step()
        if after_step is not None:
            after_step()
        losses.append(total)
    return Trained(losses, norms)
