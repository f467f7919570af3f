"""The bubble of a pipeline step: one definition for predictions, simulations and traces.

[Note: the bubble]
A rank's bubble in one training step is ``1 - busy / window``: ``busy`` is the rank's
computation (forward and backward passes), ``window`` runs from the step's first computation to
its last, on any rank. Communication the computation waits for, and the idle time the schedule
leaves, count as bubble; what runs after the last backward (the data-parallel all-reduce, the
optimizer) is outside the window, since no schedule can fill it. Over several steps, the
windows and the busy times add up.

Three places ask for it, and all three call this module: :func:`pipedialect.trace` measures it
on recorded spans, the simulator (:func:`pipedialect.cost.simulate`) predicts it on the spans it
replays, so a predicted trace shows the bubble the prediction states, and
:func:`predicted_bubble` gives its closed form for ``p`` pipeline ranks of ``v`` equal stages each
and ``m`` micro-batches, ``(p - 1) / (v m + p - 1)`` (GPipe, 1F1B and interleaved 1F1B with no
communication: ``tests/cost/test_formulas.py`` checks that the simulator reproduces it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypeVar

from ..errors import ConfigError

__all__ = ["idle_fractions", "predicted_bubble", "step_window"]

N = TypeVar("N", int, float)


def predicted_bubble(pipeline: int, micro_batches: int, stages_per_rank: int = 1) -> float:
    """``(p - 1) / (v m + p - 1)``: the bubble of GPipe, 1F1B (``v = 1``) and interleaved 1F1B
    with equal stages and free communication ([Note: the bubble])."""
    if pipeline < 1 or micro_batches < 1 or stages_per_rank < 1:
        raise ConfigError(
            f"the bubble needs at least one pipeline rank, one micro-batch and one stage per "
            f"rank, got p={pipeline}, m={micro_batches}, v={stages_per_rank}"
        )
    return (pipeline - 1) / (stages_per_rank * micro_batches + pipeline - 1)


def step_window(
    computations: Iterable[tuple[int, N, N]], ranks: Iterable[int] = ()
) -> tuple[N, dict[int, N]]:
    """``(window, busy by rank)`` of one step's computations, each ``(rank, start, end)``
    ([Note: the bubble]); ``ranks`` that computed nothing count with nothing busy."""
    spans = list(computations)
    if not spans:
        return 0, dict.fromkeys(ranks, 0)
    zero = spans[0][1] - spans[0][1]
    busy: dict[int, N] = dict.fromkeys(ranks, zero)
    for rank, start, end in spans:
        busy[rank] = busy.get(rank, zero) + (end - start)
    window = max(end for _, _, end in spans) - min(start for _, start, _ in spans)
    return window, busy


def idle_fractions(busy: Mapping[int, float], window: float) -> dict[int, float]:
    """``1 - busy / window`` for each rank, in rank order ([Note: the bubble]); every rank idle
    (0.0 busy) counts as 1.0, and an empty window gives 0.0."""
    return {r: (1.0 - b / window if window else 0.0) for r, b in sorted(busy.items())}
