"""Non-finite losses and gradients: finding the first one and the error ``check_finite`` raises.

Each finder costs one synchronisation; :func:`root_nonfinite` picks, among every rank's errors,
the one every rank raises (a ``choose`` for ``agreement``'s
:func:`~pipedialect.runtime.agreement.agree_on_error`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from ..errors import NonFiniteError, PipeDialectError
from .sharded import local_part

__all__ = [
    "first_nonfinite_grad",
    "first_nonfinite_loss",
    "nonfinite_grad_error",
    "nonfinite_loss_error",
    "root_nonfinite",
]


def root_nonfinite(errors: Sequence[PipeDialectError | None]) -> int:
    """The rank whose :class:`~pipedialect.NonFiniteError` came first: a loss, else the
    earliest stage (a ``choose`` for :func:`agree_on_error`)."""

    def order(rank: int) -> tuple[int, int, int]:
        error = errors[rank]
        if not isinstance(error, NonFiniteError):
            return (2, 0, rank)
        return (0 if error.micro_batch is not None else 1, error.stage, rank)

    return min((r for r, e in enumerate(errors) if e is not None), key=order)


def first_nonfinite_loss(losses: Sequence[torch.Tensor]) -> int | None:
    """The index of the first loss with a NaN or infinite element, or None (one sync)."""
    if not losses:
        return None
    flags = torch.stack([torch.isfinite(loss.detach()).all() for loss in losses])
    if bool(flags.all()):
        return None
    return int((~flags).nonzero()[0, 0])


def first_nonfinite_grad(
    named: Iterable[tuple[str, nn.Parameter]],
) -> tuple[str, torch.Tensor] | None:
    """The first ``(name, gradient)`` with a NaN or infinite element, or None (one sync).

    A sharded gradient is checked on this rank's part (``sharded`` [Note: sharded tensors]).
    """
    grads = [(name, local_part(p.grad)) for name, p in named if p.grad is not None]
    if not grads:
        return None
    flags = torch.stack([torch.isfinite(g).all().to(grads[0][1].device) for _, g in grads])
    if bool(flags.all()):
        return None
    return grads[int((~flags).nonzero()[0, 0])]


def _kind(value: torch.Tensor) -> str:
    return "NaN" if bool(torch.isnan(value).any()) else "infinite"


def nonfinite_loss_error(
    loss: torch.Tensor, *, step: int, stage: int, micro_batch: int
) -> NonFiniteError:
    """The error ``check_finite`` raises for a non-finite loss."""
    return NonFiniteError(
        f"[Stage {stage}] step {step}, micro-batch {micro_batch}: the loss is {_kind(loss)}; the "
        "optimizer did not step and the step's gradients were dropped. Check that "
        "micro-batch's data, lower the learning rate, or pass check_finite=False to train on",
        step=step,
        stage=stage,
        micro_batch=micro_batch,
    )


def nonfinite_grad_error(name: str, grad: torch.Tensor, *, step: int, stage: int) -> NonFiniteError:
    """The error ``check_finite`` raises for a non-finite gradient."""
    return NonFiniteError(
        f"[Stage {stage}] step {step}: the gradient of parameter {name!r} is {_kind(grad)} "
        "(every micro-batch loss was finite); the optimizer did not step and the step's "
        "gradients were dropped. Lower the learning rate, enable gradient_clipping, or pass "
        "check_finite=False to train on",
        step=step,
        stage=stage,
        parameter=name,
    )
