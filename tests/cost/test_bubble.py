"""One bubble and one step time for a schedule, wherever the package states them.

The trace measures the bubble on recorded spans, the simulator predicts it on replayed ones,
``partition(balance=)``'s costs state its closed form and a 1F1B step time: the same schedule
gives the same numbers in all of them, checked against values worked out by hand.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipedialect.cost import (
    Atom,
    Chain,
    Cluster,
    Layout,
    PlanCosts,
    Prediction,
    StageCosts,
    StageTimes,
    deepspeed_program,
    predict,
    predicted_bubble,
    simulate,
    torch_program,
)
from pipedialect.planner import predicted_timeline

MS = 1e-3


def _layout(schedule: str, p: int, v: int, d: int, m: int) -> Layout:
    return Layout(
        dialect="deepspeed" if schedule == "deepspeed_1f1b" else "torch",
        schedule=schedule,
        pipeline=p,
        stages_per_rank=v,
        data_parallel=d,
        data_parallel_mode="ddp",
        tensor_parallel=1,
        micro_batches=m,
        micro_batch_size=1,
        recompute=None,
    )


def test_a_prediction_states_the_bubble_its_trace_shows() -> None:
    """DeepSpeed's 1F1B, p = 2, m = 4, each stage F = 1 ms and B = 2 ms, free messages, two
    replicas whose 1 MiB of gradients all-reduce after the last backward, then the optimizer.
    By hand: the computation spans ``(m + p - 1)(F + B)`` = 15 ms and each rank computes 12 ms,
    a bubble of 1/5 ((p - 1) / (m + p - 1)); the all-reduce and the optimizer come after the
    last backward, where no schedule can put work. The prediction states that bubble, and
    :func:`pipedialect.trace`'s measure of the predicted spans reads the same."""
    atoms = tuple(
        Atom(forward=1 * MS, backward=2 * MS, parameters={name: 1 << 20}) for name in "ab"
    )
    chain = Chain(atoms, cuts=("a",), boundary=(0,), batch=1)
    cluster = Cluster(
        world_size=4,
        memory_per_rank=1 << 30,
        bandwidth=float("inf"),
        collective_bandwidth=1e9,
        optimizer_seconds_per_byte=1e-9,
    )
    layout = replace(_layout("deepspeed_1f1b", 2, 1, 2, 4), split_points=("a",), cuts=(0,))
    prediction = predict(chain, layout, cluster, deepspeed_program(2, 4))
    assert prediction.step_time > 15 * MS + 1e-4  # the all-reduce and the optimizer take time
    assert prediction.simulation.bubble == pytest.approx((1 / 5, 1 / 5))
    assert prediction.bubble == pytest.approx(1 / 5)
    measured = predicted_timeline(prediction).bubble()
    assert sum(measured.values()) / len(measured) == pytest.approx(prediction.bubble)


@pytest.mark.parametrize(("p", "v", "m"), [(2, 1, 4), (4, 1, 8), (2, 2, 4), (4, 2, 8)])
def test_the_trace_the_simulator_and_the_closed_form_agree_on_equal_stages(
    p: int, v: int, m: int
) -> None:
    """torch's 1F1B (v = 1) and interleaved 1F1B (v = 2) on equal stages and free messages:
    ``(p - 1) / (v m + p - 1)`` from the closed form, the simulator and the trace of its spans."""
    schedule = "1f1b" if v == 1 else "interleaved_1f1b"
    program = torch_program(schedule, p, m, v)
    sim = simulate(program, [StageTimes(1.0, 1.0, 1.0, split=False)] * (p * v))
    expected = (p - 1) / (v * m + p - 1)
    assert predicted_bubble(p, m, v) == pytest.approx(expected)
    assert sim.bubble == pytest.approx((expected,) * p)
    layout = _layout(schedule, p, v, 1, m)
    timeline = predicted_timeline(Prediction(layout, sim.step_time, (0.0,) * p, True, sim))
    assert timeline.theoretical_bubble() == pytest.approx(expected)
    assert list(timeline.bubble().values()) == pytest.approx([expected] * p)


def _stage(k: int, forward: float, time: float) -> StageCosts:
    return StageCosts(
        stage=k,
        ends_after=None,
        parameters=0,
        parameter_bytes=0,
        state_bytes=0,
        flops=None,
        activation_bytes=None,
        in_flight=1,
        memory_bytes=None,
        boundary_bytes=None,
        time=time,
        forward_time=forward,
    )


def test_partitions_step_time_is_the_simulated_1f1b_step() -> None:
    """Two stages of 1 and 3 seconds (a third of each the forward), m = 4. By hand: the second
    stage starts after the first's first forward (1/3 s), then runs its four forwards and
    backwards back to back (12 s), and the first stage's last backward (2/3 s) ends the step:
    13 s, not ``(m + p - 1)`` times the slowest stage (15 s)."""
    costs = PlanCosts(("a",), (_stage(0, 1 / 3, 1.0), _stage(1, 1.0, 3.0)), micro_batches=4)
    assert costs.step_time == pytest.approx(13.0)
    assert costs.bubble == pytest.approx(predicted_bubble(2, 4))
    assert "predicted step 13000.000 ms" in costs.describe()


def test_an_unknown_balancing_option_is_refused_by_name() -> None:
    """The balancing options are keyword arguments checked by name: a misspelt one is an error,
    never silently ignored."""
    from torch import nn

    from pipedialect.cost import choose_split_points
    from pipedialect.errors import ConfigError

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ConfigError, match=r"unknown balancing option\(s\) \['micro_batch'\]"):
        choose_split_points(model, 2, "parameters", micro_batch=4)  # type: ignore[call-arg]
