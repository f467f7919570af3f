"""What a dialect offers the planner, read from the dialect itself.

[Note: what a dialect offers]
The planner proposes only layouts the target dialect runs, and reads them from what the
dialect declares, so that a layout appears as soon as a dialect declares it:

- schedules: a dialect whose ``options`` declare ``schedule`` runs the names its package's
  ``available_schedules()`` returns (the torch dialect's, for the installed torch; a subclass
  inherits its base class's); a dialect
  without that option runs one schedule: DeepSpeed's ``TrainSchedule`` for ``deepspeed``
  (``deepspeed_1f1b``). The planner can only simulate schedules it has a program for
  (:data:`~pipedialect.planner.TORCH_SCHEDULES` and ``deepspeed_1f1b``); others are listed as not
  modelled;
- stages per rank: the torch dialect's placement ([Note: stage placement] there): one for
  GPipe and 1F1B, two for the V-shaped schedules, any number for the looped ones, when its
  options declare ``stages_per_rank``;
- data parallelism: the ``data-parallel`` capability (DDP-style replicas);
- sharded data parallelism (FSDP): the ``sharded-data-parallel`` capability and a
  ``data_parallel_mode`` option; the schedules it runs with are its package's
  ``sharded_schedules()`` when it has one (the torch dialect: one stage per rank), else all;
- tensor parallelism: the ``tensor-parallel`` capability and a ``tensor_parallel`` option;
- several processes at all: ``multi-process`` (without it every stage runs in one process and
  there is no layout to plan).

A mode the dialect does not declare is listed as "not offered by this dialect".
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..contracts import Capability
from ..cost import TORCH_SCHEDULES
from ..errors import ConfigError

__all__ = ["DEEPSPEED_SCHEDULE", "Offer", "offer_of"]

#: The name of DeepSpeed's 1F1B (its ``TrainSchedule``) among the planner's schedules.
DEEPSPEED_SCHEDULE = "deepspeed_1f1b"


@dataclass(frozen=True)
class Offer:
    """The layouts one dialect runs ([Note: what a dialect offers])."""

    dialect: str
    #: Schedules the planner may choose (simulated ones only).
    schedules: tuple[str, ...]
    data_parallel: bool
    fsdp: bool
    tensor_parallel: bool
    #: Whether ``pipe_engine`` takes ``schedule=`` and ``stages_per_rank=``.
    schedule_option: bool
    stages_per_rank_option: bool
    #: False when the dialect runs the first stage's backward whole (torch: its inputs need no
    #: gradient, so its split backward would lose weight gradients).
    split_first_stage: bool
    #: Lines saying what the planner leaves out, and why.
    not_offered: tuple[str, ...] = ()
    #: The schedules FSDP runs with (None: every schedule).
    fsdp_schedules: tuple[str, ...] | None = None

    def runs(self, mode: str, schedule: str) -> bool:
        """Whether the dialect runs data-parallel ``mode`` under ``schedule``."""
        return mode != "fsdp" or self.fsdp_schedules is None or schedule in self.fsdp_schedules

    def stages_per_rank(self, schedule: str, most: int) -> tuple[int, ...]:
        """The stages-per-rank values ``schedule`` runs, up to ``most``."""
        if schedule == DEEPSPEED_SCHEDULE:
            return (1,)
        spec = TORCH_SCHEDULES[schedule]
        if not self.stages_per_rank_option:
            return (1,) if spec.placement == "single" else (2,)
        return tuple(v for v in range(1, most + 1) if spec.stages_per_rank_allowed(v))

    def data_modes(self, data: int) -> tuple[str, ...]:
        """The data-parallel modes for ``data`` replicas."""
        if data == 1:
            return ("ddp",)
        modes = []
        if self.data_parallel:
            modes.append("ddp")
        if self.fsdp:
            modes.append("fsdp")
        return tuple(modes)

    def engine_options(
        self, schedule: str, stages_per_rank: int, mode: str, tensor: int, tensor_plan: Any
    ) -> tuple[tuple[str, Any], ...]:
        """The dialect's own ``pipe_engine`` options for a layout."""
        options: list[tuple[str, Any]] = []
        if self.schedule_option:
            options.append(("schedule", schedule))
        if self.stages_per_rank_option:
            options.append(("stages_per_rank", stages_per_rank))
        if mode == "fsdp":
            options.append(("data_parallel_mode", "fsdp"))
        if tensor > 1:
            options.append(("tensor_parallel", dict(tensor_plan or {})))
        return tuple(options)


def _package_schedules(
    dialect: Any, function: str = "available_schedules"
) -> tuple[str, ...] | None:
    """``available_schedules()`` (or ``function``) of the package of the dialect's class, or of
    the nearest base class whose package has one (a subclass of the torch dialect runs its
    schedules)."""
    for cls in type(dialect).__mro__:
        package = cls.__module__.rpartition(".")[0] or cls.__module__
        try:
            found = getattr(importlib.import_module(package), function, None)
        except ImportError:
            continue
        if callable(found):
            return tuple(str(s) for s in found())
    return None


def _is_torch(dialect: Any) -> bool:
    """Whether the dialect is (or derives from) the built-in torch dialect, whose first stage
    runs its backward whole ([Note: split backward without a gradient-carrying input] there)."""
    return any(
        cls.__module__.startswith("pipedialect.dialects.torch.") for cls in type(dialect).__mro__
    )


def offer_of(dialect: Any, schedules: Sequence[str] | None = None) -> Offer:
    """What ``dialect`` (a :class:`~pipedialect.Dialect`) offers ([Note: what a dialect offers]).

    ``schedules`` restricts the schedules considered (names the dialect runs).

    Raises:
        ConfigError: the dialect runs every stage in one process, or the planner cannot tell
            which schedule it runs, or ``schedules`` names one it does not run.
    """
    name = str(getattr(dialect, "name", type(dialect).__name__))
    capabilities = {str(c) for c in getattr(dialect, "capabilities", ())}
    options_cls = getattr(dialect, "options", None)
    options = (
        {f.name for f in dataclasses.fields(options_cls)}
        if options_cls is not None and dataclasses.is_dataclass(options_cls)
        else set()
    )
    if str(Capability.MULTI_PROCESS) not in capabilities:
        raise ConfigError(
            f"the {name} dialect runs every stage in one process (it does not declare "
            "multi-process): there is no layout to plan; plan for a multi-process dialect such "
            "as 'torch' or 'deepspeed'"
        )
    notes: list[str] = []
    schedule_option = "schedule" in options
    if schedule_option:
        offered = _package_schedules(dialect)
        if offered is None:
            raise ConfigError(
                f"the {name} dialect takes schedule= but its package has no "
                "available_schedules(); pass schedules=[...] to the planner"
            )
    elif name == "deepspeed":
        offered = (DEEPSPEED_SCHEDULE,)
    else:
        raise ConfigError(
            f"the planner does not know which schedule the {name} dialect runs (it declares no "
            "schedule option); pass schedules=[...] naming one the planner simulates: "
            f"{', '.join([*TORCH_SCHEDULES, DEEPSPEED_SCHEDULE])}"
        )
    modelled = tuple(s for s in offered if s in TORCH_SCHEDULES or s == DEEPSPEED_SCHEDULE)
    for s in offered:
        if s not in modelled:
            notes.append(f"schedule {s}: not modelled by the planner")
    if schedules is not None:
        unknown = [s for s in schedules if s not in modelled]
        if unknown:
            raise ConfigError(
                f"the {name} dialect does not run (or the planner does not model) "
                f"{', '.join(map(repr, unknown))}; it runs {', '.join(modelled)}"
            )
        modelled = tuple(s for s in modelled if s in schedules)
    data_parallel = str(Capability.DATA_PARALLEL) in capabilities
    fsdp = str(Capability.SHARDED_DATA_PARALLEL) in capabilities and "data_parallel_mode" in options
    tensor = str(Capability.TENSOR_PARALLEL) in capabilities and "tensor_parallel" in options
    if not data_parallel:
        notes.append("data parallelism (DDP): not offered by this dialect")
    if not fsdp:
        notes.append("sharded data parallelism (FSDP): not offered by this dialect")
    if not tensor:
        notes.append("tensor parallelism: not offered by this dialect")
    return Offer(
        dialect=name,
        schedules=modelled,
        data_parallel=data_parallel,
        fsdp=fsdp,
        tensor_parallel=tensor,
        schedule_option=schedule_option,
        stages_per_rank_option="stages_per_rank" in options,
        split_first_stage=not _is_torch(dialect),
        not_offered=tuple(notes),
        fsdp_schedules=_package_schedules(dialect, "sharded_schedules") if fsdp else None,
    )
