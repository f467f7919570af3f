"""DeepSpeed's learning-rate schedules, for the engines that do not run DeepSpeed.

A config's ``scheduler`` section (``{"type": "WarmupLR", "params": {...}}``) must give the same
learning rate at every step on every dialect, so the four schedules DeepSpeed 0.19.8 names in
``runtime/lr_schedules.py`` are written here from their documented behaviour:

- every schedule sets each parameter group's ``lr`` when it is built (iteration -1) and again at
  each :meth:`Schedule.step`, which the engine calls once after each optimizer step, as
  DeepSpeed's engine does (so the first optimizer step runs with the iteration -1 rate);
- ``WarmupLR``: from ``warmup_min_lr`` to ``warmup_max_lr`` (default: the optimizer's lr) over
  ``warmup_num_steps`` (at least 2) steps, ``log`` (default) or ``linear``, then constant;
- ``WarmupDecayLR``: the same warm-up (``warmup_max_lr`` defaults to 0.001), then linearly down
  to 0 at ``total_num_steps``;
- ``WarmupCosineLR``: a ratio of the optimizer's lr, from ``warmup_min_ratio`` to 1 over the
  warm-up, then a cosine down to ``cos_min_ratio`` at ``total_num_steps``; the rate at iteration
  -1 is 0;
- ``OneCycle``: from ``cycle_min_lr`` up to ``cycle_max_lr`` and back over two phases (optionally
  in stairs), then decayed by ``1 / (1 + decay_lr_rate * k / decay_step_size)``; when the
  optimizer has ``betas`` it also cycles ``betas[0]`` between ``cycle_max_mom`` and
  ``cycle_min_mom``, setting ``betas[1]`` to 0.99 as DeepSpeed does.

A scalar parameter applies to every parameter group; a list gives one value per group. Nothing
here imports a runtime.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..errors import ConfigError

__all__ = [
    "SCHEDULES",
    "OneCycle",
    "Schedule",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_schedule",
    "check_schedule_section",
    "current_lrs",
    "resolve_client_schedule",
]

logger = logging.getLogger(__name__)

_LOG = "log"
_LINEAR = "linear"


def current_lrs(optimizer: torch.optim.Optimizer) -> list[float]:
    """The learning rate of each parameter group, as DeepSpeed's ``engine.get_lr()`` lists it."""
    return [float(group.get("lr", 0.0)) for group in optimizer.param_groups]


def _per_group(optimizer: torch.optim.Optimizer, value: Any, name: str) -> list[float]:
    groups = len(optimizer.param_groups)
    if isinstance(value, list | tuple):
        if len(value) != groups:
            raise ConfigError(
                f"config['scheduler']['params'][{name!r}] has {len(value)} values for "
                f"{groups} parameter group(s); give one per group, or a single number"
            )
        return [float(v) for v in value]
    return [float(value)] * groups


def _warmup_steps(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(
            "config['scheduler']['params']['warmup_num_steps'] must be a positive integer, got "
            f"{value!r}"
        )
    return max(2, value)


def _warmup_type(value: Any) -> str:
    if value not in (_LOG, _LINEAR):
        logger.warning("unknown warmup_type %r: using 'log', as DeepSpeed does", value)
        return _LOG
    return str(value)


def _warmup_fraction(iteration: int, steps: int, kind: str) -> float:
    """How far the warm-up is at ``iteration`` (0 at the start, 1 at ``steps``)."""
    if kind == _LOG:
        return (1.0 / math.log(steps)) * math.log(iteration + 1)
    return iteration / steps


class Schedule:
    """A learning-rate schedule bound to one optimizer; :meth:`step` once per optimizer step."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        #: The index of the last step taken (-1 before the first).
        self.last_batch_iteration = -1
        self._last_lr: list[float] = []

    def lrs_at(self, iteration: int) -> list[float]:
        """Each group's learning rate after ``iteration`` steps (-1: none yet)."""
        raise NotImplementedError

    def _apply(self) -> None:
        lrs = self.lrs_at(self.last_batch_iteration)
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = current_lrs(self.optimizer)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one step (or to ``last_batch_iteration``) and set each group's rate."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply()

    def get_lr(self) -> list[float]:
        """Each group's learning rate at the current iteration."""
        return self.lrs_at(self.last_batch_iteration)

    def get_last_lr(self) -> list[float]:
        """The rates last written to the optimizer."""
        return list(self._last_lr)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the iteration, as DeepSpeed's schedules keep it."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at the saved iteration (the optimizer's rates come with its own state)."""
        self.last_batch_iteration = int(state["last_batch_iteration"])


class WarmupLR(Schedule):
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = _LOG,
    ) -> None:
        super().__init__(optimizer)
        if warmup_max_lr is None:
            warmup_max_lr = current_lrs(optimizer)
        self.steps = _warmup_steps(warmup_num_steps)
        self.kind = _warmup_type(warmup_type)
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self._apply()

    def _after_warmup(self, iteration: int) -> float:
        return 1.0

    def lrs_at(self, iteration: int) -> list[float]:
        """``min + (max - min) * gamma``: gamma is the warm-up fraction, then 1."""
        if iteration < 0:
            return list(self.min_lrs)
        if iteration < self.steps:
            gamma = _warmup_fraction(iteration, self.steps, self.kind)
        else:
            gamma = self._after_warmup(iteration)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """:class:`WarmupLR`, then linearly down to 0 at ``total_num_steps``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = _LOG,
    ) -> None:
        self.total_num_steps = int(total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)

    def _after_warmup(self, iteration: int) -> float:
        span = max(1.0, float(self.total_num_steps - self.steps))
        return max(0.0, float(self.total_num_steps - iteration) / span)


class WarmupCosineLR(Schedule):
    """A ratio of the optimizer's rate: warm up to 1, then a cosine down to ``cos_min_ratio``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = _LOG,
    ) -> None:
        super().__init__(optimizer)
        self.steps = _warmup_steps(warmup_num_steps)
        self.kind = _warmup_type(warmup_type)
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        self.base_lrs = current_lrs(optimizer)
        self._apply()

    def ratio_at(self, iteration: int) -> float:
        """The factor applied to each group's base rate after ``iteration`` steps."""
        if iteration < 0:
            return 0.0
        if iteration < self.steps:
            fraction = _warmup_fraction(iteration, self.steps, self.kind)
            return self.warmup_min_ratio + fraction * (1.0 - self.warmup_min_ratio)
        progress = (iteration - self.steps + 1) / max(1, self.total_num_steps - self.steps)
        cosine = (1.0 + math.cos(math.pi * min(1.0, progress))) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lrs_at(self, iteration: int) -> list[float]:
        """Each base rate times :meth:`ratio_at`."""
        ratio = self.ratio_at(iteration)
        return [lr * ratio for lr in self.base_lrs]


class OneCycle(Schedule):
    """Up from ``cycle_min_lr`` to ``cycle_max_lr`` and back, then a slow decay."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: float = 2000,
        cycle_second_step_size: float | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: float = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
    ) -> None:
        super().__init__(optimizer)
        first = float(cycle_first_step_size)
        second = first if cycle_second_step_size is None else float(cycle_second_step_size)
        if first <= 0 or second < 0:
            raise ConfigError(
                "config['scheduler']['params']: cycle_first_step_size must be > 0 and "
                f"cycle_second_step_size >= 0, got {first} and {second}"
            )
        self.first, self.second, self.total = first, second, first + second
        self.first_stairs = int(cycle_first_stair_count)
        self.second_stairs = (
            self.first_stairs if cycle_second_stair_count is None else int(cycle_second_stair_count)
        )
        self.decay_step_size = float(decay_step_size)
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = float(decay_lr_rate)
        self.decay_mom_rate = float(decay_mom_rate)
        no_decay = math.isclose(self.decay_step_size, 0)
        self.decay_lr = not (no_decay or math.isclose(self.decay_lr_rate, 0))
        self.decay_mom = not (no_decay or math.isclose(self.decay_mom_rate, 0))
        self.cycle_momentum = bool(cycle_momentum) and "betas" in optimizer.defaults
        if cycle_momentum and not self.cycle_momentum:
            logger.warning(
                "OneCycle: %s has no betas, so momentum is not cycled (as in DeepSpeed)",
                type(optimizer).__name__,
            )
        self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        for group, lr in zip(optimizer.param_groups, self.min_lrs, strict=True):
            group["lr"] = lr
        if self.cycle_momentum:
            for group, mom in zip(optimizer.param_groups, self.min_moms, strict=True):
                group["betas"] = (mom, 0.99)
        self._last_lr = current_lrs(optimizer)

    def _scale(self, iteration: int) -> float:
        """Where the cycle is at step ``iteration + 1``: 0 at the ends, 1 at the peak."""
        position = iteration + 1
        x = 1.0 + position / self.total - math.floor(1 + position / self.total)
        ratio = self.first / self.total
        if x <= ratio:
            scale, stairs = x / ratio, self.first_stairs
        else:
            scale, stairs = (x - 1) / (ratio - 1), self.second_stairs
        if stairs > 0:
            within = position % self.total
            if within <= self.first:
                level = within * stairs / self.first
            else:
                level = (self.total - within) * stairs / self.second
            scale = math.floor(level) / stairs
        return scale

    def lrs_at(self, iteration: int) -> list[float]:
        """The cycle's rate, then ``min / (1 + decay_lr_rate * k / decay_step_size)``."""
        if iteration < self.total:
            scale = self._scale(iteration)
            return [
                lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)
            ]
        if not self.decay_lr:
            return list(self.min_lrs)
        k = iteration - self.total + 1
        factor = 1.0 + self.decay_lr_rate * (k / self.decay_step_size)
        return [lo / factor for lo in self.min_lrs]

    def moms_at(self, iteration: int) -> list[float]:
        """``betas[0]`` of each group: the mirror image of the rate's cycle, then a decay."""
        if iteration < self.total:
            scale = self._scale(iteration)
            return [
                hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms, strict=True)
            ]
        if not self.decay_mom:
            return list(self.max_moms)
        k = iteration - self.total + 1
        factor = 1.0 + self.decay_mom_rate * (k / self.decay_step_size)
        return [hi * factor for hi in self.max_moms]

    def _apply(self) -> None:
        super()._apply()
        if self.cycle_momentum:
            moms = self.moms_at(self.last_batch_iteration)
            for group, mom in zip(self.optimizer.param_groups, moms, strict=True):
                group["betas"] = (mom, 0.99)


#: The ``scheduler.type`` names this module implements.
SCHEDULES: dict[str, type[Schedule]] = {
    "OneCycle": OneCycle,
    "WarmupCosineLR": WarmupCosineLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupLR": WarmupLR,
}


def check_schedule_section(section: Any) -> dict[str, Any] | None:
    """Validate a config's ``scheduler`` section; return it as a dict (None when absent).

    Raises:
        ConfigError: not a dict with a known ``type`` and a ``params`` dict.
    """
    if section is None:
        return None
    if not isinstance(section, Mapping) or not isinstance(section.get("type"), str):
        raise ConfigError(
            "config['scheduler'] must be a dict with a 'type' (WarmupLR, WarmupDecayLR, "
            "WarmupCosineLR or OneCycle) and optional 'params'"
        )
    name = section["type"]
    if name not in SCHEDULES:
        raise ConfigError(
            f"config['scheduler']['type'] is {name!r}; the engines outside DeepSpeed implement "
            f"{sorted(SCHEDULES)} (LRRangeTest and torch.optim.lr_scheduler names are not). "
            "Pass a scheduler object as lr_scheduler= instead"
        )
    params = section.get("params") or {}
    if not isinstance(params, Mapping):
        raise ConfigError("config['scheduler']['params'] must be a dict")
    return {"type": name, "params": dict(params)}


def build_schedule(section: Mapping[str, Any], optimizer: torch.optim.Optimizer) -> Schedule:
    """Build the schedule a checked ``scheduler`` section names, bound to ``optimizer``.

    Building it sets each group's rate for the first step, as DeepSpeed's classes do.

    Raises:
        ConfigError: the section's ``params`` do not fit the schedule.
    """
    checked = check_schedule_section(section)
    if checked is None:
        raise ConfigError("config['scheduler'] is empty")
    cls = SCHEDULES[checked["type"]]
    try:
        return cls(optimizer, **checked["params"])
    except TypeError as exc:
        raise ConfigError(
            f"config['scheduler'] (type {checked['type']!r}) rejects its params "
            f"{checked['params']}: {exc}"
        ) from exc


def resolve_client_schedule(lr_scheduler: Any, optimizer: torch.optim.Optimizer) -> Any:
    """A client ``lr_scheduler`` as DeepSpeed takes it: an object with ``step()``, or a
    callable that builds one from the optimizer.

    A schedule bound to an optimizer (torch's schedulers hold it as ``.optimizer``) must be
    bound to the engine's: one built over another optimizer would set rates nobody steps with.

    Raises:
        ConfigError: the result has no ``step()`` method, or drives another optimizer.
    """
    schedule = lr_scheduler
    if callable(lr_scheduler):
        factory: Callable[[torch.optim.Optimizer], Any] = lr_scheduler
        schedule = factory(optimizer)
    if not callable(getattr(schedule, "step", None)):
        raise ConfigError(
            f"lr_scheduler must have a step() method (or build one from the optimizer), got "
            f"{type(schedule).__name__}"
        )
    bound = getattr(schedule, "optimizer", None)
    if isinstance(bound, torch.optim.Optimizer) and bound is not optimizer:
        raise ConfigError(
            f"lr_scheduler {type(schedule).__name__} drives another optimizer than the engine's, "
            "so the engine's learning rate would never change; pass a callable that builds it "
            "from the engine's optimizer, lr_scheduler=lambda optimizer: ..."
        )
    return schedule
