"""Plan before you run: simulate schedules, predict step time and memory, choose a layout.

- :func:`plan_layout` measures a model once and returns the fastest layout that fits (pipeline,
  data and tensor degrees, schedule, stages per rank, micro-batches, recomputation, split
  points) as the arguments of ``partition`` and ``pipe_engine``, with a table of the others and
  why they lose; ``pipedialect plan`` is its command line.
- :func:`simulate` replays a :class:`Program` (what each rank of a schedule runs, read from
  torch's schedule classes, DeepSpeed's 1F1B or the papers) with per-stage costs: step time,
  bubble, micro-batches in flight and memory per rank.
- :func:`calibrate` measures what the dialect's runtime itself costs on this machine (per
  computation, per step, per message with every link busy, per all-reduce) and stores it;
  ``plan_layout`` uses the stored calibration for what it is not told.
- :func:`write_chrome_trace` writes a prediction in the format :func:`pipedialect.trace`
  writes, to load beside the measured one.

``docs/planning.rst`` describes the model and cites the formulas the simulator reproduces.
"""

from ._api import parse_bytes, parse_rate, plan_layout
from ._calibrate import Calibration, calibrate, calibration_path, load_calibration
from ._chain import Atom, Chain, StageProfile
from ._costs import Cluster, Layout, Prediction, predict
from ._model import model_chains
from ._offer import DEEPSPEED_SCHEDULE, Offer, offer_of
from ._program import Action, ActionKind, Program
from ._schedules import (
    TORCH_SCHEDULES,
    TorchSchedule,
    deepspeed_program,
    torch_program,
    zb_h2_program,
)
from ._search import LayoutPlan, Row, build_program, search
from ._simulate import SimulatedSpan, Simulation, StageMemory, StageTimes, simulate
from ._trace import chrome_trace, predicted_timeline, write_chrome_trace

__all__ = [
    "DEEPSPEED_SCHEDULE",
    "TORCH_SCHEDULES",
    "Action",
    "ActionKind",
    "Atom",
    "Calibration",
    "Chain",
    "Cluster",
    "Layout",
    "LayoutPlan",
    "Offer",
    "Prediction",
    "Program",
    "Row",
    "SimulatedSpan",
    "Simulation",
    "StageMemory",
    "StageProfile",
    "StageTimes",
    "TorchSchedule",
    "build_program",
    "calibrate",
    "calibration_path",
    "chrome_trace",
    "deepspeed_program",
    "load_calibration",
    "model_chains",
    "offer_of",
    "parse_bytes",
    "parse_rate",
    "plan_layout",
    "predict",
    "predicted_timeline",
    "search",
    "simulate",
    "torch_program",
    "write_chrome_trace",
    "zb_h2_program",
]
