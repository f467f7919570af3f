"""Predictions as Chrome traces, in the format :func:`pipedialect.trace` writes.

[Note: predicted traces]
A predicted step becomes the :class:`~pipedialect.trace.Span` records a measured one has: the
same kinds (``forward``, ``backward``, ``send``, ``reduce``, ``optimizer``), labels (``F3``,
``B3``; a split backward's passes are ``backward`` spans labelled ``I3`` and ``W3``, with detail
``input`` and ``weight``), ``pid`` the global rank (replica 0, in DeepSpeed's pipe-data-model
order) and ``tid`` the stage; so :class:`~pipedialect.trace.Timeline` writes it, bubbles and all,
and ``otherData`` says it is a prediction and of which layout. Load it beside the measured trace
(chrome://tracing, https://ui.perfetto.dev) to see where they differ.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..cost import Prediction
from ..trace import Span, Timeline

__all__ = ["chrome_trace", "predicted_timeline", "write_chrome_trace"]

_KINDS = {
    "forward": ("forward", None),
    "backward": ("backward", None),
    "backward_input": ("backward", "input"),
    "backward_weight": ("backward", "weight"),
    "send": ("send", "activations"),
    "all_gather": ("reduce", "all-gather"),
    "reduce_grad": ("reduce", "reduce-grad"),
    "all_reduce": ("reduce", "all-reduce"),
    "optimizer": ("optimizer", None),
}


def predicted_timeline(prediction: Prediction) -> Timeline:
    """The predicted step as a :class:`~pipedialect.trace.Timeline` ([Note: predicted traces])."""
    layout = prediction.layout
    per_pipe = layout.data_parallel * layout.tensor_parallel
    spans = []
    for s in prediction.simulation.spans:
        kind, detail = _KINDS[s.kind]
        if s.kind == "send":
            detail = "grads" if s.name.startswith("send B") else "activations"
        if s.end <= s.start and kind != "forward":
            continue
        spans.append(
            Span(
                kind=kind,
                name=s.name,
                rank=s.rank * per_pipe,
                stage=s.stage,
                step=s.step,
                micro_batch=s.micro_batch,
                start_ns=round(s.start * 1e9),
                end_ns=round(s.end * 1e9),
                detail=detail,
            )
        )
    return Timeline(spans=spans, num_stages=layout.num_stages)


def chrome_trace(prediction: Prediction) -> dict[str, Any]:
    """The Chrome trace of :func:`predicted_timeline`, with the prediction in ``otherData``."""
    trace = predicted_timeline(prediction).chrome_trace()
    layout = prediction.layout
    trace["otherData"]["predicted"] = {
        "layout": layout.describe(),
        "step_ms": prediction.step_time * 1e3,
        "bubble": prediction.bubble,
        "peak_memory_bytes": list(prediction.peak_memory),
        "in_flight": list(prediction.simulation.in_flight),
        "split_points": list(layout.split_points),
    }
    return trace


def write_chrome_trace(prediction: Prediction, path: str | Path) -> Path:
    """Write :func:`chrome_trace` to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(prediction)))
    return path
