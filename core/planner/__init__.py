"""Plan before you run: search the layouts a dialect offers and choose the fastest that fits.

- :func:`plan_layout` measures a model once and returns the fastest layout that fits (pipeline,
  data and tensor degrees, schedule, stages per rank, micro-batches, recomputation, split
  points) as the arguments of ``partition`` and ``pipe_engine``, with a table of the others and
  why they lose; ``pipedialect plan`` is its command line. What each layout costs (the
  measurement, the schedule programs, the simulator, the cost and memory model) is
  :mod:`pipedialect.cost`'s.
- :func:`calibrate` measures what the dialect's runtime itself costs on this machine (per
  computation, per step, per message with every link busy, per all-reduce) and stores it;
  ``plan_layout`` uses the stored calibration for what it is not told.
- :func:`write_chrome_trace` writes a prediction in the format :func:`pipedialect.trace`
  writes, to load beside the measured one.

``docs/planning.rst`` describes the model and cites the formulas the simulator reproduces.
"""

from ._api import parse_bytes, parse_rate, plan_layout
from ._calibrate import Calibration, calibrate, calibration_path, load_calibration
from ._offer import DEEPSPEED_SCHEDULE, Offer, offer_of
from ._search import LayoutPlan, Row, build_program, search
from ._trace import chrome_trace, predicted_timeline, write_chrome_trace

__all__ = [
    "DEEPSPEED_SCHEDULE",
    "Calibration",
    "LayoutPlan",
    "Offer",
    "Row",
    "build_program",
    "calibrate",
    "calibration_path",
    "chrome_trace",
    "load_calibration",
    "offer_of",
    "parse_bytes",
    "parse_rate",
    "plan_layout",
    "predicted_timeline",
    "search",
    "write_chrome_trace",
]
