"""Plan before you run: simulate schedules, predict step time and memory, choose a layout.

:func:`simulate` replays a :class:`Program` (what each rank of a schedule runs, read from
torch's schedule classes, DeepSpeed's 1F1B or the papers) with per-stage costs: step time,
bubble, micro-batches in flight and memory per rank.
"""

from ._program import Action, ActionKind, Program
from ._schedules import (
    TORCH_SCHEDULES,
    TorchSchedule,
    deepspeed_program,
    torch_program,
    zb_h2_program,
)
from ._simulate import SimulatedSpan, Simulation, StageMemory, StageTimes, simulate

__all__ = [
    "TORCH_SCHEDULES",
    "Action",
    "ActionKind",
    "Program",
    "SimulatedSpan",
    "Simulation",
    "StageMemory",
    "StageTimes",
    "TorchSchedule",
    "deepspeed_program",
    "simulate",
    "torch_program",
    "zb_h2_program",
]
