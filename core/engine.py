"""What every DeepSpeed-style engine shares, for dialect authors: config, optimizer and data.

DeepSpeed's ``PipelineEngine`` is the model every engine follows: ``train_batch`` pulls
``gradient_accumulation_steps`` ``(inputs, labels)`` micro-batches, steps the optimizer once and
returns the mean micro-batch loss. :class:`DeepSpeedStyleEngine` holds what that needs besides
the schedule itself -- the parsed config, the optimizer (with parameter groups), the learning
rate schedule, the step counter and whole-step data reads -- so a dialect's engine adds only
how its stages run. The local and torch dialects' engines build on it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .agreement import first_nonfinite_grad, nonfinite_grad_error, pull_micro_batches
from .checkpoint_files import LATEST_FILE
from .config import TrainingConfig, build_optimizer
from .errors import CheckpointError, DataError, NonFiniteError
from .lr_schedules import build_schedule, current_lrs, resolve_client_schedule
from .param_groups import ParamGroupsFn, resolve_param_groups

__all__ = ["DeepSpeedStyleEngine", "read_checkpoint_file", "shape_mismatch", "stage_param_name"]


class DeepSpeedStyleEngine:
    """What every engine shares with DeepSpeed's ``PipelineEngine``: config, optimizer,
    accessors and the data iterator (the torch dialect's engine builds on it too)."""

    def __init__(
        self,
        module: nn.Module,
        config: TrainingConfig,
        *,
        check_finite: bool = False,
        lr_scheduler: Any = None,
        param_groups: ParamGroupsFn | None = None,
    ) -> None:
        self.module = module
        self.config = config
        #: Refuse a step whose loss or gradients are not finite (see :meth:`check_finite_grads`).
        self.check_finite = bool(check_finite)
        # parameters() yields a parameter shared by several local stages once: it is stepped,
        # and clipped, once.
        if param_groups is None:
            self.optimizer = build_optimizer(config, module.parameters())
        else:
            named = ((stage_param_name(n)[1], p) for n, p in module.named_parameters())
            self.optimizer = build_optimizer(config, resolve_param_groups(param_groups, named))
        #: Stepped after each optimizer step, as DeepSpeed's engine steps it: the client's
        #: ``lr_scheduler`` (an object, or a callable building one from the optimizer) wins
        #: over the config's ``scheduler`` section, as in ``deepspeed.initialize``.
        self.lr_scheduler: Any = None
        if lr_scheduler is not None:
            self.lr_scheduler = resolve_client_schedule(lr_scheduler, self.optimizer)
        elif config.scheduler is not None:
            self.lr_scheduler = build_schedule(config.scheduler, self.optimizer)
        self.global_steps = 0
        self.micro_batches = config.gradient_accumulation_steps
        self._data_iterator: Iterator[Any] | None = None

    def get_lr(self) -> list[float]:
        """The learning rate of each parameter group, as DeepSpeed's ``engine.get_lr()``."""
        return current_lrs(self.optimizer)

    def step_lr_scheduler(self) -> None:
        """Step the schedule once, after an optimizer step (DeepSpeed's ``_take_model_step``)."""
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    def scheduler_state(self) -> dict[str, Any] | None:
        """The schedule's state for a checkpoint (None without a schedule)."""
        if self.lr_scheduler is None or not hasattr(self.lr_scheduler, "state_dict"):
            return None
        state: dict[str, Any] = self.lr_scheduler.state_dict()
        return state

    def load_scheduler_state(self, state: Mapping[str, Any] | None) -> None:
        """Resume the schedule where a checkpoint left it, as DeepSpeed's ``load_checkpoint``."""
        if state is not None and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state)

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self.config.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        """Samples per optimizer step."""
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per micro-batch."""
        return self.config.micro_batch_size

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        """Set the iterator ``train_batch()`` uses when called without one."""
        self._data_iterator = iterator

    @staticmethod
    def next_pair(data_iter: Iterator[Any]) -> tuple[Any, Any]:
        """Pull one ``(inputs, labels)`` micro-batch, refusing anything else by name."""
        return DeepSpeedStyleEngine.check_pair(next(data_iter), 0)

    @staticmethod
    def check_pair(batch: Any, index: int) -> tuple[Any, Any]:
        """``batch`` as an ``(inputs, labels)`` pair; anything else is refused by name."""
        if not isinstance(batch, tuple | list) or len(batch) != 2:
            raise DataError(
                f"data_iter must yield (inputs, labels) pairs, one per micro-batch; micro-batch "
                f"{index} is {type(batch).__name__}"
                + (f" of length {len(batch)}" if isinstance(batch, tuple | list) else "")
            )
        return batch[0], batch[1]

    def pull_pairs(
        self, data_iter: Iterator[Any], count: int, *, what: str, source: str | None = None
    ) -> list[tuple[Any, Any]]:
        """Read a whole step's ``(inputs, labels)`` micro-batches before any is used.

        Raises:
            DataExhaustedError: ``data_iter`` ran out first (nothing was computed).
            DataError: an item is not an ``(inputs, labels)`` pair.
        """
        items = pull_micro_batches(data_iter, count, what=what, source=source)
        return [self.check_pair(batch, i) for i, batch in enumerate(items)]

    def check_finite_grads(
        self, stages: Iterable[tuple[int, nn.Module]], step: int
    ) -> NonFiniteError | None:
        """The error for the first stage (in order) with a non-finite gradient, or None."""
        for stage_id, stage in stages:
            found = first_nonfinite_grad(getattr(stage, "mod", stage).named_parameters())
            if found is not None:
                return nonfinite_grad_error(*found, step=step, stage=stage_id)
        return None


def shape_mismatch(
    saved: Mapping[str, Any], current: Mapping[str, Any]
) -> tuple[str, tuple[int, ...], tuple[int, ...]] | None:
    """The first entry (in ``current``'s order) whose saved tensor has another shape."""
    for name, value in current.items():
        old = saved.get(name)
        if not isinstance(old, torch.Tensor) or not isinstance(value, torch.Tensor):
            continue
        if old.shape != value.shape:
            return name, tuple(old.shape), tuple(value.shape)
    return None


def read_checkpoint_file(
    path: Path, tag: str, device: torch.device | str, *, from_latest: bool
) -> dict[str, Any]:
    """``torch.load`` one checkpoint file, refusing a missing, empty or unreadable one by name.

    ``from_latest``: the tag was read from the directory's ``latest`` file.
    """
    if not path.parent.is_dir():
        named = f" (named by {path.parent.parent / LATEST_FILE})" if from_latest else ""
        raise CheckpointError(
            f"no checkpoint tag {tag!r}{named} in {path.parent.parent}: {path.parent} does not "
            "exist; pass the tag of a checkpoint that was saved, or fix the latest file"
        )
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {path.parent} has no {path.name}; it was saved by another engine or "
            "number of ranks, or its save was interrupted"
        )
    try:
        state: dict[str, Any] = torch.load(path, map_location=device, weights_only=True)
    except (EOFError, RuntimeError, OSError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint {path} cannot be read ({type(exc).__name__}: {exc}); the file is empty "
            "or truncated, as an interrupted save leaves it. Load another tag"
        ) from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} holds {type(state).__name__}, not a state dict")
    return state


def stage_param_name(key: str) -> tuple[str, str]:
    """``stages.1.mod.blocks.2.weight`` as stage ``"1"`` and parameter ``"blocks.2.weight"``."""
    parts = key.split(".")
    if len(parts) > 2 and parts[0] == "stages" and parts[1].isdigit():
        rest = parts[3:] if parts[2] == "mod" else parts[2:]
        return parts[1], ".".join(rest)
    return "?", key
