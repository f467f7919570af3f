"""Schedule names, and where each schedule puts the stages.

[Note: stage placement]
``torch.distributed.pipelining`` fixes which rank runs which stage by the schedule's family, and
this dialect places the plan's stages the same way (then checks that the schedule agrees):

- single-stage schedules (GPipe, 1F1B): stage ``k`` on rank ``k``; one stage per rank;
- looped schedules (Interleaved 1F1B, Looped BFS, Interleaved Zero Bubble): stage ``k`` on rank
  ``k % W``, so rank ``r`` holds stages ``r, r + W, r + 2W, ...``;
- V-shaped schedules (ZBV Zero Bubble, DualPipeV): two stages per rank, rank ``r`` holding
  stages ``r`` and ``2W - 1 - r``, so the first and the last stage share rank 0.

``W`` is the number of pipeline ranks; the plan must have exactly ``W * stages_per_rank``
stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pipedialect import ConfigError, TopologyError

__all__ = [
    "ScheduleSpec",
    "available_schedules",
    "resolve_schedule",
    "sharded_schedules",
    "stage_to_rank",
]

Placement = Literal["single", "loop", "v"]


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule this dialect offers."""

    #: The name users pass (``"1f1b"``, ``"interleaved_1f1b"``, ...).
    name: str
    #: The class's name in ``torch.distributed.pipelining``.
    torch_name: str
    #: How stages are placed on ranks ([Note: stage placement]).
    placement: Placement
    #: Whether the schedule splits backward into input and weight passes (zero bubble).
    split_backward: bool = False
    #: What torch's class asks of the number of micro-batches: ``"stages"`` at least one per
    #: stage, ``"rounds"`` a multiple of its rounds (``max(1, n // ranks)``), or nothing.
    micro_batches: Literal["stages", "rounds"] | None = None

    def micro_batch_problem(self, count: int, num_stages: int, num_ranks: int) -> str | None:
        """Why torch's class refuses ``count`` micro-batches (its rule), or None."""
        if self.micro_batches == "stages" and count < num_stages:
            return f"needs at least one micro-batch per stage ({num_stages})"
        rounds = max(1, count // num_ranks)
        if self.micro_batches == "rounds" and count % rounds:
            return f"needs a multiple of its rounds ({rounds} = {count} // {num_ranks} ranks)"
        return None

    def torch_class(self) -> type[Any] | None:
        """The schedule class, or None when the installed torch does not have it."""
        from torch.distributed import pipelining

        cls = getattr(pipelining, self.torch_name, None)
        return cls if isinstance(cls, type) else None

    def default_stages_per_rank(self) -> int:
        """Stages per rank when the user does not say: 1 for single, 2 otherwise."""
        return 1 if self.placement == "single" else 2


_SPECS = (
    ScheduleSpec("gpipe", "ScheduleGPipe", "single"),
    ScheduleSpec("1f1b", "Schedule1F1B", "single", micro_batches="stages"),
    ScheduleSpec("interleaved_1f1b", "ScheduleInterleaved1F1B", "loop", micro_batches="rounds"),
    ScheduleSpec("looped_bfs", "ScheduleLoopedBFS", "loop"),
    ScheduleSpec(
        "interleaved_zero_bubble", "ScheduleInterleavedZeroBubble", "loop", True, "rounds"
    ),
    ScheduleSpec("zbv_zero_bubble", "ScheduleZBVZeroBubble", "v", True),
    ScheduleSpec("dualpipev", "ScheduleDualPipeV", "v", True, "stages"),
)

_ALIASES = {"zbv": "zbv_zero_bubble", "zero_bubble": "interleaved_zero_bubble"}


def _compact(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "").removeprefix("schedule")


_BY_COMPACT = {_compact(s.name): s for s in _SPECS}
_BY_COMPACT.update({_compact(s.torch_name): s for s in _SPECS})
_BY_COMPACT.update(
    {_compact(alias): _BY_COMPACT[_compact(name)] for alias, name in _ALIASES.items()}
)


def available_schedules() -> tuple[str, ...]:
    """The schedule names the installed torch supports, in this dialect's order."""
    return tuple(s.name for s in _SPECS if s.torch_class() is not None)


def sharded_schedules() -> tuple[str, ...]:
    """The schedule names ``data_parallel_mode="fsdp"`` runs with: those with one stage per
    rank (``_fsdp`` [Note: FSDP on torch]), of the installed torch's."""
    return tuple(s.name for s in _SPECS if s.placement == "single" and s.torch_class() is not None)


def resolve_schedule(name: object, *, installed: bool = True) -> ScheduleSpec:
    """Return the schedule called ``name`` (case, ``_`` and ``-`` do not matter).

    Torch's own class names (``"Interleaved1F1B"``, ``"ScheduleZBVZeroBubble"``) are accepted.
    With ``installed`` (the default) the installed torch must have the schedule; checking
    imports ``torch.distributed.pipelining``.

    Raises:
        ConfigError: the name is unknown, or the installed torch lacks that schedule.
    """
    if not isinstance(name, str):
        raise ConfigError(
            f"schedule must be a name such as '1f1b', got {type(name).__name__} {name!r}; "
            f"available: {', '.join(available_schedules())}"
        )
    spec = _BY_COMPACT.get(_compact(name))
    if spec is None:
        known = available_schedules() if installed else tuple(s.name for s in _SPECS)
        raise ConfigError(f"unknown pipeline schedule {name!r}; available: {', '.join(known)}")
    if installed and spec.torch_class() is None:
        import torch

        raise ConfigError(
            f"schedule {name!r} needs torch.distributed.pipelining.{spec.torch_name}, which "
            f"torch {torch.__version__} does not have; available: "
            f"{', '.join(available_schedules())}"
        )
    return spec


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def _stages(n: int) -> str:
    return f"{n} stage" if n == 1 else f"{n} stages"


def stage_to_rank(spec: ScheduleSpec, num_stages: int, num_ranks: int) -> dict[int, int]:
    """Map every stage id to its pipeline rank ([Note: stage placement]).

    Raises:
        TopologyError: ``num_stages`` does not fit ``num_ranks`` ranks under this schedule.
    """
    if num_ranks < 1:
        raise TopologyError(f"a pipeline needs at least one rank, got {num_ranks}")
    per_rank, rest = divmod(num_stages, num_ranks)
    if rest or per_rank < 1:
        raise TopologyError(
            f"schedule {spec.name!r} places the same number of stages on each of the "
            f"{num_ranks} pipeline ranks, but the plan has {_stages(num_stages)}; partition the "
            f"model into a multiple of {num_ranks} stages, or launch a number of ranks that "
            f"divides {num_stages}"
        )
    if spec.placement == "single":
        if per_rank != 1:
            raise TopologyError(
                f"schedule {spec.name!r} runs one stage per rank, but the plan has "
                f"{_stages(num_stages)} for {_ranks(num_ranks)}; launch {_ranks(num_stages)}, "
                "or use a looped schedule such as 'interleaved_1f1b' for several stages per rank"
            )
        return {k: k for k in range(num_stages)}
    if spec.placement == "loop":
        return {k: k % num_ranks for k in range(num_stages)}
    if per_rank != 2:
        raise TopologyError(
            f"schedule {spec.name!r} is V-shaped: exactly 2 stages per rank, but the plan has "
            f"{_stages(num_stages)} for {_ranks(num_ranks)}; partition the model into "
            f"{2 * num_ranks} stages, or launch {_ranks(num_stages // 2 or 1)}"
        )
    return {k: k if k < num_ranks else 2 * num_ranks - 1 - k for k in range(num_stages)}
