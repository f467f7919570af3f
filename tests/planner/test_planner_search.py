"""The planner's search against brute force, and its cost model against hand-worked numbers.

The brute force here enumerates the search space itself (every tensor, pipeline and data
degree, data mode, schedule, stages per rank, micro-batch count and recomputation option, split
points from the exact solver) and predicts every layout; the planner, which stops early and
skips layouts that cannot fit, must choose the same one.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import pytest
from _layouts import one_stage_layout
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipedialect import ConfigError
from pipedialect.cost import TORCH_SCHEDULES, Atom, Chain, Cluster, Layout, predict
from pipedialect.cost._predict import stage_weights
from pipedialect.cost._solver import solve
from pipedialect.planner import DEEPSPEED_SCHEDULE, Offer, build_program, search

TORCH_LIKE = Offer(
    dialect="torch",
    schedules=tuple(TORCH_SCHEDULES),
    data_parallel=True,
    fsdp=True,
    tensor_parallel=True,
    schedule_option=True,
    stages_per_rank_option=True,
    split_first_stage=False,
)
DEEPSPEED_LIKE = Offer(
    dialect="deepspeed",
    schedules=(DEEPSPEED_SCHEDULE,),
    data_parallel=True,
    fsdp=False,
    tensor_parallel=False,
    schedule_option=False,
    stages_per_rank_option=False,
    split_first_stage=True,
)
TP_PLAN = {"*.mlp": "colwise"}
MAX_V = 2


@st.composite
def _chains(draw: st.DrawFn) -> dict[str, Chain]:
    n = draw(st.integers(1, 5))
    atoms = []
    recomputed = []
    for a in range(n):
        forward = draw(st.integers(1, 8)) / 4
        backward = forward * draw(st.sampled_from([1.0, 2.0, 3.0]))
        params = {f"p{a}": draw(st.integers(0, 64))}
        saved = {a: draw(st.integers(0, 32))}
        tensor = draw(st.floats(0.0, 1.0))
        tp_params = frozenset(params) if draw(st.booleans()) else frozenset()
        common: dict[str, Any] = {
            "parameters": params,
            "state": {f"s{a}": draw(st.integers(0, 8))},
            "tensor_forward": forward * tensor,
            "tensor_backward": backward * tensor,
            "tensor_parameters": tp_params,
            "tensor_saved": frozenset(saved) if tensor else frozenset(),
            "tensor_forward_bytes": draw(st.integers(0, 16)),
            "tensor_backward_bytes": draw(st.integers(0, 16)),
        }
        atoms.append(Atom(forward=forward, backward=backward, saved=saved, **common))
        recomputed.append(
            Atom(
                forward=forward,
                backward=backward,
                saved={("recompute", a): saved[a] // 4},
                recompute=forward,
                **common,
            )
        )
    cuts = tuple(f"layers.{a}" for a in range(n - 1))
    boundary = tuple(draw(st.integers(0, 16)) for _ in range(n - 1))
    batch = draw(st.sampled_from([1, 2]))
    fraction = draw(st.sampled_from([0.0, 0.5, 0.75]))
    return {
        "": Chain(tuple(atoms), cuts, boundary, batch=batch, weight_fraction=fraction),
        "layers.*": Chain(tuple(recomputed), cuts, boundary, batch=batch, weight_fraction=fraction),
    }


@st.composite
def _clusters(draw: st.DrawFn) -> Cluster:
    return Cluster(
        world_size=draw(st.integers(1, 4)),
        memory_per_rank=draw(st.sampled_from([60.0, 150.0, 400.0, 1e9])),
        bandwidth=draw(st.sampled_from([4.0, 64.0, 1e6])),
        latency=draw(st.sampled_from([0.0, 0.05])),
        optimizer_states=draw(st.integers(0, 2)),
        action_overhead=draw(st.sampled_from([0.0, 0.1])),
    )


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _brute_force(
    chains: dict[str, Chain], cluster: Cluster, offer: Offer, batch: int
) -> list[tuple[tuple[Any, ...], Layout, float]]:
    """Every layout of the space that runs and fits, with its sort key."""
    found = []
    world = cluster.world_size
    tensors = _divisors(world) if offer.tensor_parallel else [1]
    for t in tensors:
        for p in _divisors(world // t):
            d = world // (p * t)
            if batch % d:
                continue
            modes = ["ddp"] if d == 1 else (["ddp"] if offer.data_parallel else [])
            modes += ["fsdp"] if d > 1 and offer.fsdp else []
            for mode, schedule in itertools.product(modes, offer.schedules):
                if schedule == DEEPSPEED_SCHEDULE:
                    vs = [1]
                else:
                    spec = TORCH_SCHEDULES[schedule]
                    vs = [v for v in range(1, MAX_V + 1) if spec.stages_per_rank_allowed(v)]
                for v in vs:
                    n = p * v
                    for m in _divisors(batch // d):
                        if m > 4 * n:
                            continue
                        try:
                            program = build_program(schedule, p, m, v)
                        except ConfigError:
                            continue
                        for label, chain in chains.items():
                            if n > len(chain.atoms):
                                continue
                            layout = Layout(
                                dialect=offer.dialect,
                                schedule=schedule,
                                pipeline=p,
                                stages_per_rank=v,
                                data_parallel=d,
                                data_parallel_mode=mode,
                                tensor_parallel=t,
                                micro_batches=m,
                                micro_batch_size=batch // (d * m),
                                recompute=label or None,
                            )
                            cuts: tuple[int, ...] = ()
                            if n > 1:
                                weights = stage_weights(chain, layout, cluster)
                                solution = solve([weights], n)
                                assert solution is not None
                                cuts = solution.cuts
                            layout = Layout(
                                **{
                                    **{f: getattr(layout, f) for f in _FIELDS},
                                    "cuts": cuts,
                                    "split_points": chain.split_points(cuts),
                                }
                            )
                            pred = predict(
                                chain,
                                layout,
                                cluster,
                                program,
                                split_first_stage=offer.split_first_stage,
                            )
                            if pred.fits:
                                key = (pred.step_time, max(pred.peak_memory), layout.key())
                                found.append((key, layout, pred.step_time))
    return found


_FIELDS = (
    "dialect",
    "schedule",
    "pipeline",
    "stages_per_rank",
    "data_parallel",
    "data_parallel_mode",
    "tensor_parallel",
    "micro_batches",
    "micro_batch_size",
    "recompute",
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    chains=_chains(),
    cluster=_clusters(),
    offer=st.sampled_from([TORCH_LIKE, DEEPSPEED_LIKE]),
    batch=st.sampled_from([2, 4, 6, 8]),
)
def test_search_chooses_what_brute_force_chooses(
    chains: dict[str, Chain], cluster: Cluster, offer: Offer, batch: int
) -> None:
    every = _brute_force(chains, cluster, offer, batch)
    kwargs: dict[str, Any] = {
        "tensor_plan": TP_PLAN if offer.tensor_parallel else None,
        "max_stages_per_rank": MAX_V,
        "refine": 0,
    }
    if not every:
        with pytest.raises(ConfigError, match="no layout"):
            search(chains, cluster, offer, batch, **kwargs)
        return
    plan = search(chains, cluster, offer, batch, **kwargs)
    _, layout, step = min(every, key=lambda e: e[0])
    assert plan.best.layout.key() == layout.key()
    assert plan.best.step_time == step
    exhaustive = search(chains, cluster, offer, batch, exhaustive=True, **kwargs)
    assert exhaustive.best.layout.key() == layout.key()
    assert plan.simulated <= exhaustive.simulated


@settings(max_examples=40, deadline=None)
@given(chains=_chains(), batch=st.sampled_from([4, 8]))
def test_refined_split_points_are_never_slower(chains: dict[str, Chain], batch: int) -> None:
    cluster = Cluster(world_size=4, memory_per_rank=1e9, bandwidth=64.0, latency=0.05)
    if len(chains[""].atoms) < 4:
        return
    solver = search(chains, cluster, DEEPSPEED_LIKE, batch, refine=0)
    refined = search(chains, cluster, DEEPSPEED_LIKE, batch, refine=3)
    assert refined.best.step_time <= solver.best.step_time


def test_refinement_finds_the_faster_split_the_solver_misses() -> None:
    """1F1B, 4 stages, 4 micro-batches, forwards 4 9 8 8 9 5 1 (backward twice as long): the
    solver's split gives a 267 step; cutting after atoms 1, 3 and 4 gives 244, the best of
    every split (brute force)."""
    forwards = [4, 9, 8, 8, 9, 5, 1]
    chain = Chain(
        tuple(Atom(forward=f, backward=2 * f) for f in forwards),
        tuple(f"c{i}" for i in range(6)),
        (0,) * 6,
    )
    cluster = Cluster(world_size=4, memory_per_rank=1e9, bandwidth=1e18)
    offer = Offer(
        dialect="torch",
        schedules=("1f1b",),
        data_parallel=False,
        fsdp=False,
        tensor_parallel=False,
        schedule_option=True,
        stages_per_rank_option=False,
        split_first_stage=True,
    )
    kwargs: dict[str, Any] = {"micro_batches": [4]}
    solver = search({"": chain}, cluster, offer, 4, refine=0, **kwargs).best
    refined = search({"": chain}, cluster, offer, 4, **kwargs).best
    program = build_program("1f1b", 4, 4, 1)
    layout = one_stage_layout(schedule="1f1b", pipeline=4, micro_batches=4)
    steps = {
        cuts: predict(chain, dataclasses.replace(layout, cuts=cuts), cluster, program).step_time
        for cuts in itertools.combinations(range(6), 3)
    }
    assert solver.step_time == 267.0
    assert refined.step_time == min(steps.values()) == 244.0


def _two_atoms() -> Chain:
    atom = Atom(forward=1.0, backward=2.0, parameters={"w": 100}, state={"b": 10}, saved={0: 8})
    other = dataclasses.replace(atom, parameters={"v": 100}, state={"c": 10}, saved={1: 8})
    return Chain((atom, other), ("a",), (4,))


def test_state_per_rank_under_ddp_and_fsdp() -> None:
    """Two atoms of 100 trainable bytes and 10 frozen each, Adam (2 states): one stage holds
    (100 + 100) * (1 + 1 + 2) + 20 = 820 bytes and 16 of activations per micro-batch. Over two
    replicas, FSDP keeps 800 / 2 + 20 = 420 always, and the whole 200 of gathered parameters
    and the whole 200 of unsharded gradients beside the shards while the stage computes: 836 at
    the peak, with one micro-batch. DDP's gradient sum packs the 200 bytes of gradients into a
    flat tensor of their own while it all-reduces them: 820 + 200 at its peak, above the 836
    of the backward."""
    chain = _two_atoms()
    cluster = Cluster(world_size=2, memory_per_rank=1e9, bandwidth=100.0)
    program = build_program("gpipe", 1, 1, 1)
    ddp = predict(chain, one_stage_layout(data_parallel=2), cluster, program)
    assert ddp.peak_memory == (820.0 + 200.0,)
    # One replica sums nothing: no packed copy.
    alone = predict(chain, one_stage_layout(), cluster, program)
    assert alone.peak_memory == (820.0 + 16.0,)
    fsdp = predict(
        chain, one_stage_layout(data_parallel=2, data_parallel_mode="fsdp"), cluster, program
    )
    assert fsdp.peak_memory == (420.0 + 200.0 + 200.0 + 16.0,)
    # DDP all-reduces 200 bytes over 2 ranks at 100 B/s: 2 (1/2) 200 / 100 = 2 s after the
    # 6 s of compute (two atoms of 1 + 2); FSDP gathers (1 s) before and reduce-scatters
    # (1 s) after.
    assert math.isclose(ddp.step_time, 6.0 + 2.0)
    assert math.isclose(fsdp.step_time, 1.0 + 6.0 + 1.0)


def test_tensor_parallelism_divides_the_sharded_part_and_adds_its_all_reduce() -> None:
    """Half of each atom's work and its parameters sharded over 2 ranks; 8 bytes all-reduced in
    the forward and in the backward of each atom at 8 B/s (2 (1/2) 8 / 8 = 1 s each)."""
    atom = Atom(
        forward=2.0,
        backward=4.0,
        parameters={"w": 100},
        tensor_forward=1.0,
        tensor_backward=2.0,
        tensor_parameters=frozenset({"w"}),
        tensor_forward_bytes=8,
        tensor_backward_bytes=8,
    )
    chain = Chain((atom,), (), ())
    cluster = Cluster(world_size=2, memory_per_rank=1e9, bandwidth=8.0, optimizer_states=0)
    pred = predict(
        chain, one_stage_layout(tensor_parallel=2), cluster, build_program("gpipe", 1, 1, 1)
    )
    assert math.isclose(pred.step_time, (1.0 + 0.5 + 1.0) + (2.0 + 1.0 + 1.0))
    assert pred.peak_memory == (100.0,)


def test_recomputation_runs_the_forward_again_and_keeps_less() -> None:
    atom = Atom(forward=1.0, backward=2.0, saved={("recompute", "x"): 2}, recompute=1.0)
    plain = Atom(forward=1.0, backward=2.0, saved={0: 10})
    cluster = Cluster(world_size=1, memory_per_rank=1e9, bandwidth=1.0)
    program = build_program("gpipe", 1, 4, 1)
    kept = predict(Chain((plain,), (), ()), one_stage_layout(micro_batches=4), cluster, program)
    redone = predict(Chain((atom,), (), ()), one_stage_layout(micro_batches=4), cluster, program)
    assert kept.step_time == 4 * 3.0 and redone.step_time == 4 * 4.0
    assert kept.peak_memory == (40.0,) and redone.peak_memory == (8.0,)


def test_nothing_fits_names_the_closest_layout() -> None:
    cluster = Cluster(world_size=2, memory_per_rank=10.0, bandwidth=1.0)
    with pytest.raises(ConfigError, match=r"no layout of the torch dialect fits.*closest"):
        search({"": _two_atoms()}, cluster, TORCH_LIKE, 4)


def test_fsdp_gathers_and_reductions_run_at_the_measured_gather_bandwidth() -> None:
    """Gloo's all-gather and reduce-scatter are no faster than its all-reduce of the same
    tensor, so the calibration measures their bandwidth apart. With 200 trainable bytes over
    2 replicas, a gather bandwidth of 25 B/s makes each of them (1/2) 200 / 25 = 4 s (at the
    all-reduce's 100 B/s: 1 s), before and after the 6 s of compute."""
    chain = _two_atoms()
    cluster = Cluster(world_size=2, memory_per_rank=1e9, bandwidth=100.0, shard_bandwidth=25.0)
    program = build_program("gpipe", 1, 1, 1)
    fsdp = predict(
        chain, one_stage_layout(data_parallel=2, data_parallel_mode="fsdp"), cluster, program
    )
    assert math.isclose(fsdp.step_time, 4.0 + 6.0 + 4.0)
    ddp = predict(chain, one_stage_layout(data_parallel=2), cluster, program)
    assert math.isclose(ddp.step_time, 6.0 + 2.0)
