"""The simulator reproduces the published bubble and memory formulas on equal stage costs.

Every expected value here is the paper's formula written out by hand (docs/planning.rst cites
each): ``F`` a stage's forward, ``I`` its input-gradient pass, ``W`` its weight-gradient pass,
``B = I + W`` a full backward, ``p`` pipeline ranks, ``v`` stages per rank, ``m``
micro-batches. "In flight" counts the micro-batches a stage (or rank) holds activations for.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from pipedialect.cost import (
    Program,
    Simulation,
    StageTimes,
    deepspeed_program,
    simulate,
    torch_program,
    zb_h2_program,
)

COSTS = [(1.0, 1.0, 1.0), (1.0, 0.5, 1.5), (2.0, 1.0, 1.0), (1.0, 1.5, 0.5)]


def _run(program: Program, f: float, i: float, w: float, **kwargs: Any) -> Simulation:
    return simulate(program, [StageTimes(f, i, w)] * program.num_stages, **kwargs)


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12)


@pytest.mark.parametrize("f,i,w", COSTS)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("factor", [1, 2, 3])
@pytest.mark.parametrize("source", ["gpipe", "1f1b", "deepspeed"])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(
    source: str, p: int, factor: int, f: float, i: float, w: float
) -> None:
    """GPipe (Huang et al. 2019, section 2.3) and 1F1B (Narayanan et al. 2021, section 2.2.1):
    a step is ``(m + p - 1)(F + B)``, so the bubble is ``(p - 1) / (m + p - 1)``; 1F1B keeps
    ``min(p - k, m)`` micro-batches in flight on stage ``k``, GPipe all ``m``."""
    m = factor * p
    program = deepspeed_program(p, m) if source == "deepspeed" else torch_program(source, p, m)
    sim = _run(program, f, i, w)
    assert _close(sim.step_time, (m + p - 1) * (f + i + w))
    for bubble in sim.bubble:
        assert _close(bubble, (p - 1) / (m + p - 1))
    expected = [m] * p if source == "gpipe" else [min(p - k, m) for k in range(p)]
    assert list(sim.in_flight) == expected


@pytest.mark.parametrize("f,i,w", COSTS)
@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_interleaved_1f1b_divides_the_bubble_by_v(
    p: int, v: int, rounds: int, f: float, i: float, w: float
) -> None:
    """Interleaved 1F1B (Narayanan et al. 2021, section 2.2.2), each stage ``1/v`` of a rank's
    work: the bubble time is ``(p - 1)(F + B) / v`` of a rank's ``F + B``, the fraction
    ``(p - 1) / (v m + p - 1)``. The first rank holds ``p (1 + (p - 1) / (p v))`` full-stage
    micro-batches at its peak (Korthikanti et al. 2022, section 4.2.3), ``v p + p - 1`` stages'
    worth, when ``m`` is at least ``2p``; ``v m`` (all of them) below."""
    m = rounds * p
    chunk = (f / v, i / v, w / v)
    sim = _run(torch_program("interleaved_1f1b", p, m, v), *chunk)
    rank = f + i + w
    assert _close(sim.step_time, m * rank + (p - 1) * rank / v)
    for bubble in sim.bubble:
        assert _close(bubble, (p - 1) / (v * m + p - 1))
    first = sim.rank_in_flight[0]
    assert first == min(v * p + p - 1, v * m)
    if m >= 2 * p:
        assert _close(first / v, p * (1 + (p - 1) / (p * v)))


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("extra", [0, 1, 4])
def test_looped_bfs_has_the_interleaved_bubble_and_holds_every_micro_batch(
    p: int, v: int, extra: int
) -> None:
    """Breadth-first looping (Lamy-Poirier 2023) runs every forward of a stage before the next
    stage's: with ``m >= p`` the bubble of interleaving, ``(p - 1) / (v m + p - 1)``, with all
    ``v m`` stage-micro-batches of a rank in flight."""
    m = p + extra
    sim = _run(torch_program("looped_bfs", p, m, v), 1.0, 1.0, 1.0)
    assert _close(sim.step_time, v * m * 3 + (p - 1) * 3)
    assert list(sim.rank_in_flight) == [v * m] * p


@pytest.mark.parametrize(
    "f,i,w", [(1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (2.0, 1.0, 1.0), (1.0, 2.0, 1.0)]
)
@pytest.mark.parametrize("p", [2, 3, 4, 5])
@pytest.mark.parametrize("factor", [1, 2, 3])
def test_zb_h1_bubble_is_p_minus_1_times_f_plus_b_minus_2w(
    p: int, factor: int, f: float, i: float, w: float
) -> None:
    """ZB-H1 (Qi et al. 2024, section 2.1; torch's interleaved zero bubble with one stage per
    rank is its ZB1P): bubble ``(p - 1)(F + B - 2W)`` with ``B`` the full backward (the
    DualPipe README's form), for ``W <= I``; every stage holds ``p`` micro-batches, 1F1B's peak."""
    m = factor * p
    sim = _run(torch_program("interleaved_zero_bubble", p, m, 1), f, i, w)
    b = i + w
    assert _close(sim.step_time, m * (f + b) + (p - 1) * (f + b - 2 * w))
    assert list(sim.in_flight) == [min(p, m)] * p


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_interleaved_zero_bubble_divides_the_zb_h1_bubble_by_v(p: int, v: int, rounds: int) -> None:
    m = rounds * p
    f, i, w = 1.0 / v, 1.0 / v, 1.0 / v
    sim = _run(torch_program("interleaved_zero_bubble", p, m, v), f, i, w)
    assert _close(sim.step_time, m * 3.0 + (p - 1) * (f + i - w))


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("factor", [2, 3, 4])
def test_zb_h2_has_no_bubble_and_holds_2p_minus_1(p: int, factor: int) -> None:
    """ZB-H2 (Qi et al. 2024, section 2.2), with ``F = I = W``: a parallelogram, so step after
    step (the optimizer's synchronisation bypassed, as the paper does) a rank is never idle,
    and each holds ``2p - 1`` micro-batches; one synchronised step still has the stagger of
    ``(p - 1) F``."""
    m = factor * p
    program = zb_h2_program(p, m)
    steady = _run(program, 1.0, 1.0, 1.0, steps=4, barrier=False)
    assert _close(steady.step_time, 3.0 * m)
    one = _run(program, 1.0, 1.0, 1.0)
    assert _close(one.step_time, 3.0 * m + (p - 1))
    assert list(one.in_flight) == [2 * p - 1] * p


@pytest.mark.parametrize("p", [2, 3, 4, 5])
@pytest.mark.parametrize("factor", [2, 3, 4])
def test_zbv_has_no_bubble_and_the_memory_of_1f1b(p: int, factor: int) -> None:
    """ZB-V (Qi et al. 2024, section 6; torch's ZBV zero bubble), ``F = I = W`` and at least
    ``2p`` micro-batches: no bubble step after step, and each rank holds ``2p`` half-size
    stages' activations, the ``p`` full-stage micro-batches of 1F1B's first stage."""
    m = factor * p
    program = torch_program("zbv_zero_bubble", p, m, 2)
    steady = _run(program, 1.0, 1.0, 1.0, steps=4, barrier=False)
    assert _close(steady.step_time, 2 * m * 3.0)
    one = _run(program, 1.0, 1.0, 1.0)
    assert list(one.rank_in_flight) == [2 * p] * p


@pytest.mark.parametrize("f,w", [(1.0, 1.0), (1.0, 0.5), (2.0, 1.0), (2.0, 0.5)])
@pytest.mark.parametrize("p", [2, 3, 4, 5])
@pytest.mark.parametrize("factor", [2, 3])
def test_dualpipev_bubble_is_pp_half_minus_1_times_f_and_b_plus_b_minus_3w(
    p: int, factor: int, f: float, w: float
) -> None:
    """DualPipeV (DeepSeek-AI 2024, DualPipe README; torch's ScheduleDualPipeV) on ``PP = 2p``
    stages over ``p`` ranks: bubble ``(PP/2 - 1)(F&B + B - 3W)``, ``F&B`` the time of an
    overlapped forward and backward, here ``F + B`` (torch runs the pair one after the other),
    for ``F = I``; each rank holds ``PP + 1`` stages' activations."""
    m = factor * p
    i = f
    sim = _run(torch_program("dualpipev", p, m, 2), f, i, w)
    b = i + w
    pp = 2 * p
    bubble = (pp // 2 - 1) * ((f + b) + b - 3 * w)
    assert _close(sim.step_time, 2 * m * (f + b) + bubble)
    assert list(sim.rank_in_flight) == [pp + 1] * p
