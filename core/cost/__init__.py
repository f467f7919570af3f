"""What a partition costs: one measurement of the model, one cost and memory model, one bubble.

- :mod:`pipedialect.cost.balance` measures a model once (:func:`profile_model`: forward and
  backward on fake tensors, or timed for real) and chooses split points with the exact
  contiguous-partition solver (:func:`choose_split_points`); ``partition(balance=)`` uses it.
- A :class:`Chain` is a model as the planner sees it (:func:`model_chains` measures one); a
  :class:`Program` is what each rank of a schedule runs (torch's schedules, DeepSpeed's 1F1B,
  the papers'); :func:`simulate` replays a program with per-stage costs (step time, bubble,
  micro-batches in flight, memory per rank); :func:`predict` prices a :class:`Layout` of a
  chain on a :class:`Cluster` and simulates it. :mod:`pipedialect.planner` searches layouts with
  it; :mod:`pipedialect.trace` measures the bubble with its formula.

Imports :mod:`pipedialect.runtime` and the root leaves, never a room above it.
:mod:`pipedialect.cost.module_paths` (module paths of a model, shared with the capture) is used
through its module name.
"""

from __future__ import annotations

from ._bubble import idle_fractions, predicted_bubble, step_window
from ._chain import Atom, Chain, StageProfile
from ._model import checkpoint_label, model_chains
from ._predict import (
    Cluster,
    Layout,
    Prediction,
    lower_bounds,
    predict,
    ring_all_reduce,
    ring_gather,
    stage_weights,
)
from ._program import Action, ActionKind, Program, place
from ._schedules import (
    TORCH_SCHEDULES,
    TorchSchedule,
    deepspeed_program,
    torch_program,
    zb_h2_program,
)
from ._simulate import SimulatedSpan, Simulation, StageMemory, StageTimes, simulate
from .balance import (
    DEFAULT_BANDWIDTH,
    DEFAULT_FLOPS_PER_SECOND,
    BalanceMethod,
    BalanceOptions,
    ModelProfile,
    PlanCosts,
    StageCosts,
    balanced_split_points,
    choose_split_points,
    plan_costs,
    profile_model,
    timing_threads,
)

__all__ = [
    "DEFAULT_BANDWIDTH",
    "DEFAULT_FLOPS_PER_SECOND",
    "TORCH_SCHEDULES",
    "Action",
    "ActionKind",
    "Atom",
    "BalanceMethod",
    "BalanceOptions",
    "Chain",
    "Cluster",
    "Layout",
    "ModelProfile",
    "PlanCosts",
    "Prediction",
    "Program",
    "SimulatedSpan",
    "Simulation",
    "StageCosts",
    "StageMemory",
    "StageProfile",
    "StageTimes",
    "TorchSchedule",
    "balanced_split_points",
    "checkpoint_label",
    "choose_split_points",
    "deepspeed_program",
    "idle_fractions",
    "lower_bounds",
    "model_chains",
    "place",
    "plan_costs",
    "predict",
    "predicted_bubble",
    "profile_model",
    "ring_all_reduce",
    "ring_gather",
    "simulate",
    "stage_weights",
    "step_window",
    "timing_threads",
    "torch_program",
    "zb_h2_program",
]
