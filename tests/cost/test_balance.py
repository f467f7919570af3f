"""Automatic stage balancing: the exact solver, the cost model, and balanced plans that train.

- The solver is checked against brute force over every contiguous partition (random costs,
  stage weights, boundary charges, nesting and fixed cuts, via hypothesis), and DeepSpeed's
  parameter rule against DeepSpeed's own ``partition_balanced``.
- Costs are checked against values computed by hand for small models.
- Every candidate split point is one ``partition`` accepts, and balanced plans train on the
  local dialect to the losses and weights of the unsplit model trained by hand.
- Two fresh interpreters choose the same split points (``"time"`` too, through rank 0).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence
from typing import Any

import _balance_workers as workers
import pytest
import torch
from _compare import assert_tensor_close
from _reference import steps_from, train_unsplit
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import pipedialect
from pipedialect import ConfigError, PartitionError, SplitPointError, partition
from pipedialect.cost import predicted_bubble
from pipedialect.cost._solver import solve, spread_partition, uniform_partition
from pipedialect.cost.balance import choose_split_points, plan_costs, profile_model
from pipedialect.models import MODELS, ModelSpec, TinyGPT
from pipedialect.runtime.launch import launch

# -- the solver against brute force ------------------------------------------------------------


@st.composite
def _problems(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(0, 7))
    p = draw(st.integers(1, 5))
    num_channels = draw(st.integers(1, 2))
    channels = [draw(st.lists(st.integers(0, 20), min_size=n + 1, max_size=n + 1))]
    channels += [
        draw(st.lists(st.integers(0, 20), min_size=n + 1, max_size=n + 1))
        for _ in range(num_channels - 1)
    ]
    scales = [[draw(st.integers(1, 4)) for _ in range(num_channels)] for _ in range(p)]
    boundary = draw(st.none() | st.lists(st.integers(0, 6), min_size=n, max_size=n))
    # Properly nested calls: cut j may adopt the most recent subtrees as its descendants.
    roots: list[int] = []
    nested_from = []
    for j in range(n):
        adopt = draw(st.integers(0, len(roots)))
        start = roots[-adopt] if adopt else j
        del roots[len(roots) - adopt :]
        roots.append(start)
        nested_from.append(start)
    fixed = draw(st.sets(st.integers(0, n - 1), max_size=2)) if n else set()
    last_cut_below = draw(st.integers(0, n))
    overlaps = []
    if n:
        for _ in range(draw(st.integers(0, 3))):
            a = draw(st.integers(0, n - 1))
            b = draw(st.integers(a + 1, n))
            channel = draw(st.integers(0, num_channels - 1))
            overlaps.append((channel, a, b, draw(st.integers(0, 10))))
    return {
        "overlaps": overlaps,
        "channels": channels,
        "num_stages": p,
        "scales": scales,
        "boundary": boundary,
        "nested_from": nested_from,
        "fixed": fixed,
        "last_cut_below": last_cut_below,
    }


def _brute_force(
    problem: dict[str, Any],
) -> list[tuple[float, float, tuple[int, ...], float, float]]:
    """Every valid partition as (bottleneck, sum of squared stage costs, cuts, the bottleneck
    and the sum of squares of the stage costs without the boundary charges)."""
    channels = problem["channels"]
    n = len(channels[0]) - 1
    p = problem["num_stages"]
    boundary = problem["boundary"] or [0] * n
    nested_from = problem["nested_from"]
    found = []
    for cuts in itertools.combinations(range(n), p - 1):
        if not set(problem["fixed"]) <= set(cuts):
            continue
        if cuts and cuts[-1] >= problem["last_cut_below"]:
            continue
        # No chosen cut may lie inside the call another chosen cut ends (any pair).
        if any(nested_from[j] <= i < j for i in cuts for j in cuts):
            continue
        bounds = [-1, *cuts, n]
        costs = []
        compute = []
        for k in range(p):
            atoms = range(bounds[k] + 1, bounds[k + 1] + 1)
            totals = [sum(ch[a] for a in atoms) for ch in channels]
            for t, a, b, amount in problem["overlaps"]:
                if a in atoms and b in atoms:
                    totals[t] -= amount
            cost = sum(problem["scales"][k][t] * total for t, total in enumerate(totals))
            compute.append(cost)
            if k > 0:
                cost += boundary[bounds[k]]
            if k < p - 1:
                cost += boundary[bounds[k + 1]]
            costs.append(cost)
        found.append(
            (max(costs), sum(c * c for c in costs), cuts, max(compute), sum(c * c for c in compute))
        )
    return found


@settings(max_examples=300, deadline=None)
@given(_problems())
def test_solver_matches_brute_force(problem: dict[str, Any]) -> None:
    """The optimal bottleneck, then the smallest sum of squares among optimal partitions (with
    boundary charges: the smallest compute bottleneck, then compute sum of squares, ties broken
    by compute); a partition the solver returns satisfies every constraint brute force checks."""
    solution = solve(
        problem["channels"],
        problem["num_stages"],
        scales=problem["scales"],
        boundary=problem["boundary"],
        nested_from=problem["nested_from"],
        fixed=problem["fixed"],
        last_cut_below=problem["last_cut_below"],
        overlaps=problem["overlaps"],
    )
    every = _brute_force(problem)
    if not every:
        assert solution is None
        return
    assert solution is not None
    best = min(row[0] for row in every)
    assert solution.bottleneck == best
    ours = {row[2]: row for row in every}
    assert solution.cuts in ours, "the solver returned a partition that breaks a constraint"
    assert ours[solution.cuts][0] == best
    tied = [row for row in every if row[0] == best]
    if any(problem["boundary"] or []):
        least = min(row[3] for row in tied)
        assert ours[solution.cuts][3] == least
        assert ours[solution.cuts][4] == min(row[4] for row in tied if row[3] == least)
    else:
        assert ours[solution.cuts][1] == min(row[1] for row in tied)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 1000), min_size=1, max_size=12),
    st.integers(1, 6),
)
def test_spread_partition_is_deepspeeds_parameter_rule(weights: list[int], parts: int) -> None:
    """Our rewrite of DeepSpeed's ``partition_balanced`` gives DeepSpeed's own answer."""
    from deepspeed.runtime.utils import partition_balanced, partition_uniform

    assert spread_partition(weights, parts) == list(partition_balanced(weights, parts))
    assert uniform_partition(len(weights), parts) == list(partition_uniform(len(weights), parts))


def test_solver_scales_to_thousands_of_atoms() -> None:
    """n = 2000 atoms, 8 stages: exact, and the answer is the obvious even split."""
    costs = [1.0] * 2000
    solution = solve([costs], 8)
    assert solution is not None
    assert solution.bottleneck == 250.0
    assert solution.cuts == tuple(250 * k - 1 for k in range(1, 8))


def test_predicted_bubble() -> None:
    assert predicted_bubble(4, 8) == pytest.approx(3 / 11)
    assert predicted_bubble(1, 5) == 0.0
    with pytest.raises(ConfigError):
        predicted_bubble(2, 0)


# -- costs against hand-computed values --------------------------------------------------------


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_costs_of_a_small_mlp_by_hand() -> None:
    """Split after ``0`` (Linear 8->16) of Linear -> ReLU -> Linear 16->4, batch 2, fp32."""
    model = _mlp()
    costs = plan_costs(model, ["0"], example_inputs={"input": torch.randn(2, 8)}, micro_batches=4)
    first, second = costs.stages
    # Parameters: 8*16 + 16 and 16*4 + 4.
    assert (first.parameters, second.parameters) == (144, 68)
    assert (first.parameter_bytes, second.parameter_bytes) == (576, 272)
    # FLOPs, 2*b*in*out per product: fc1's forward, and its weight gradient only (its input
    # needs no gradient); fc2's forward, its weight gradient and its input gradient.
    assert first.flops == 2 * 2 * 8 * 16 * 2
    assert second.flops == 2 * 2 * 16 * 4 * 3
    # The boundary carries fc1's (2, 16) output.
    assert first.boundary_bytes == 2 * 16 * 4
    assert second.boundary_bytes == 0
    # Saved for backward: the input x for fc1's weight gradient; ReLU's output (which fc2
    # saves too, the same storage) for ReLU's and fc2's weight gradients.
    assert first.activation_bytes == 2 * 8 * 4
    assert second.activation_bytes == 2 * 16 * 4
    # 1F1B with p = 2, m = 4: stage 0 holds 2 micro-batches, stage 1 one.
    assert (first.in_flight, second.in_flight) == (2, 1)
    # Adam: weights, gradients and two states, 4 copies of each parameter byte.
    assert first.memory_bytes == 4 * 576 + 2 * 64
    assert second.memory_bytes == 4 * 272 + 1 * 128
    assert costs.bubble == pytest.approx(1 / 5)
    assert costs.imbalance("parameters") == pytest.approx(144 / ((144 + 68) / 2))
    assert "[Stage 0] 144 parameters" in costs.describe()


def test_parameters_without_example_inputs_use_an_fx_trace() -> None:
    profile = profile_model(_mlp())
    assert profile.candidates == ("0", "1", "2")
    assert profile.methods == ("parameters",)
    costs = profile.costs(["1"])
    assert [s.parameters for s in costs.stages] == [144, 68]
    assert costs.stages[0].flops is None and costs.stages[0].boundary_bytes is None
    assert profile.choose(2, "parameters") == ["0"]


def test_bandwidth_moves_the_cut_to_a_narrow_boundary() -> None:
    """Linear 8->8, 8->64, 64->8, 8->8, batch 2. In units u = 2*2*8*8 FLOPs the four layers
    cost 2u (no input gradient), 24u, 24u, 3u. Cutting after layer 1 (a 64-wide boundary,
    512 bytes) balances 26u | 27u; after layer 2 (8 wide, 64 bytes) gives 50u | 3u. A byte
    costs 2 * flops_per_second / bandwidth FLOPs (forward and backward): at 100 per byte the
    charge dominates, 27u + 51200 > 50u + 6400, so the narrow cut wins; with free boundaries
    (bandwidth=None) the balanced one does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 64), nn.Linear(64, 8), nn.Linear(8, 8))
    inputs = {"input": torch.randn(2, 8)}
    profile = profile_model(model, example_inputs=inputs)
    assert profile.choose(2, "flops", bandwidth=None) == ["1"]
    assert profile.choose(2, "flops", bandwidth=2e12, flops_per_second=1e14) == ["2"]
    assert profile.choose(2, "flops", bandwidth=1e20, flops_per_second=1e14) == ["1"]
    assert profile.choose(2, "parameters") == profile.choose(2, "parameters", bandwidth=None)
    with pytest.raises(ConfigError, match="bandwidth must be a positive number"):
        profile.choose(2, "flops", bandwidth=0)
    assert [s.boundary_bytes for s in profile.costs(["1"]).stages] == [512, 0]
    assert [s.boundary_bytes for s in profile.costs(["2"]).stages] == [64, 0]


def test_memory_weighs_activations_by_micro_batches_in_flight() -> None:
    """Eight equal Linear(32, 32) + Tanh pairs, batch 512: each pair holds 16,896 bytes of
    weights, gradients and Adam states and saves one 65,536-byte activation (Tanh's output, the
    next Linear's input). Equal parameters put four pairs on each of two stages, but stage 0
    keeps 2 micro-batches in flight and stage 1 one, so balanced memory moves the cut earlier,
    and the stage memory the solver minimised is the one the costs report."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(32, 32), nn.Tanh()]
    model = nn.Sequential(*layers)
    profile = profile_model(model, example_inputs={"input": torch.randn(512, 32)})
    by_params = profile.choose(2, "parameters")
    by_memory = profile.choose(2, "memory", micro_batches=8)
    order = profile.candidates
    assert [s.parameters for s in profile.costs(by_params).stages] == [4 * 1056, 4 * 1056]
    assert order.index(by_memory[0]) < order.index(by_params[0])
    memory = profile.costs(by_memory, micro_batches=8)
    assert [s.in_flight for s in memory.stages] == [2, 1]
    worst = max(s.memory_bytes or 0 for s in memory.stages)
    for point in order[:-1]:
        other = profile.costs([point], micro_batches=8)
        assert worst <= max(s.memory_bytes or 0 for s in other.stages), point


# -- candidates and choices --------------------------------------------------------------------


class _Shared(nn.Module):
    """Calls ``shared`` twice and keeps a torch.nn container module with children."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.shared = nn.Linear(8, 8)
        self.enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.shared(self.shared(self.inp(x)))
        out: torch.Tensor = self.out(self.enc(h))
        return out


def test_candidates_exclude_modules_that_cannot_end_a_stage() -> None:
    model = _Shared()
    profile = profile_model(model, example_inputs={"x": torch.randn(2, 3, 4)})
    assert profile.candidates == ("inp", "enc", "out")
    assert "calls it 2 times" in str(profile.why_not("shared"))
    assert "inside 'enc'" in str(profile.why_not("enc.linear1"))
    assert "whole model" in str(profile.why_not(""))
    with pytest.raises(SplitPointError, match="'shared' cannot end a pipeline stage"):
        profile.choose(3, "flops", split_points=["shared"])
    with pytest.raises(SplitPointError, match="not a module"):
        profile.choose(3, "flops", split_points=["nope"])
    with pytest.raises(PartitionError, match="cannot be cut into 4 stages"):
        profile.choose(4, "flops")  # 'out' is the last computation: only 2 usable cuts


def test_bad_requests_are_refused_by_name() -> None:
    model = TinyGPT()
    with pytest.raises(ConfigError, match="example_inputs"):
        choose_split_points(model, 2, "flops")
    with pytest.raises(ConfigError, match="balance must be one of"):
        choose_split_points(model, 2, "speed")  # type: ignore[arg-type]
    profile = profile_model(
        model, example_inputs={"input_ids": torch.zeros(2, 8, dtype=torch.long)}
    )
    with pytest.raises(ConfigError, match="measure_time"):
        profile.choose(2, "time")
    with pytest.raises(SplitPointError, match=r"inside 'blocks\.1'"):
        profile.choose(4, "flops", split_points=["blocks.1.fc1", "blocks.1"])
    with pytest.raises(SplitPointError, match="more than num_stages"):
        profile.choose(2, "flops", split_points=["blocks.0", "blocks.2"])
    with pytest.raises(SplitPointError, match="out of execution order"):
        profile.costs(["blocks.2", "blocks.0"])
    meta = copy.deepcopy(model).to("meta")
    with pytest.raises(ConfigError, match="meta device"):
        profile_model(
            meta,
            example_inputs={"input_ids": torch.zeros(2, 8, dtype=torch.long)},
            measure_time=True,
        )


def test_partition_chooses_what_choose_split_points_chooses_and_describes_the_costs() -> None:
    """partition(num_stages=, balance=) keeps fixed split points, agrees with
    choose_split_points, and its describe() prints every stage's costs and the bubble
    (p - 1) / (m + p - 1) = 3 / 11 for p = 4, m = 8."""
    model = TinyGPT()
    ids = {"input_ids": torch.zeros(2, 8, dtype=torch.long)}
    expected = choose_split_points(model, 4, "flops", example_inputs=ids, micro_batches=8)
    plan = partition(model, num_stages=4, balance="flops", balance_inputs=ids, micro_batches=8)
    assert list(plan.split_points) == expected
    fixed = partition(model, ["blocks.0"], num_stages=4, balance="flops", balance_inputs=ids)
    assert "blocks.0" in fixed.split_points and fixed.num_stages == 4
    assert plan.costs is not None
    text = plan.describe()
    assert "predicted bubble 27.3% (m=8)" in text
    for stage in plan.costs.stages:
        assert stage.flops is not None and stage.flops > 0
        line = next(
            line
            for line in text.splitlines()
            if line.startswith(f"[Stage {stage.stage}] {stage.parameters:,} parameters")
        )
        assert f"{stage.flops:,.0f} FLOPs" in line and "in flight" in line
        assert ("sends" in line) == (stage.stage < 3)
    # Without a measurement: parameters only, the default method, m = num_stages.
    by_params = partition(model, num_stages=2)
    assert by_params.costs is not None and by_params.costs.micro_batches == 2
    assert "FLOPs" not in by_params.describe() and "predicted bubble 33.3%" in by_params.describe()
    assert partition(model, ["blocks.1"]).costs is None


def test_bad_partition_balance_requests_are_refused_by_name() -> None:
    model = TinyGPT()
    with pytest.raises(SplitPointError, match="num_stages"):
        partition(model)
    with pytest.raises(ConfigError, match="num_stages"):
        partition(model, ["blocks.1"], balance="flops")
    with pytest.raises(ConfigError, match="num_stages"):
        partition(model, ["blocks.1"], micro_batches=4)
    with pytest.raises(ConfigError, match="balance_inputs"):
        partition(model, num_stages=2, balance="flops")
    with pytest.raises(SplitPointError, match="more than num_stages"):
        partition(model, ["blocks.0", "blocks.2"], num_stages=2)
    with pytest.raises(ConfigError, match="num_stages must be a positive int"):
        partition(model, num_stages=0)


def test_fixed_split_points_are_kept_and_the_rest_solved_around_them() -> None:
    model = TinyGPT()
    ids = torch.zeros(2, 8, dtype=torch.long)
    profile = profile_model(model, example_inputs={"input_ids": ids})
    every = {"candidates": profile.candidates, "bandwidth": None}  # any module, free boundaries
    free = profile.choose(4, "flops", **every)
    fixed = profile.choose(4, "flops", split_points=["blocks.0"], **every)
    assert "blocks.0" in fixed and len(fixed) == 3
    assert "blocks.0" not in free
    assert fixed == sorted(fixed, key=profile.candidates.index)
    # Restricting the candidates to whole blocks, as a hand-written LayerSpec pipeline would.
    layers = ["wte", *(f"blocks.{i}" for i in range(4)), "ln_f"]
    coarse = profile.choose(3, "flops", candidates=layers, bandwidth=None)
    assert set(coarse) <= set(layers)
    fine_max = max(s.flops or 0 for s in profile.costs(profile.choose(3, "flops", **every)).stages)
    assert max(s.flops or 0 for s in profile.costs(coarse).stages) >= fine_max


def test_measuring_leaves_the_model_as_it_was() -> None:
    """Fake and timed runs change no parameter, gradient, buffer (BatchNorm statistics) or
    random state, though the model trains with dropout and batch statistics."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 2)
    ).train()
    example = {"input": torch.randn(16, 4)}
    before = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    profile = profile_model(model, example_inputs=example, measure_time=True)
    assert profile.methods == ("parameters", "flops", "memory", "time")
    assert all(p.grad is None for p in model.parameters())
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert torch.equal(torch.get_rng_state(), rng)
    times = [s.time for s in profile.costs(["1"]).stages]
    assert all(t is not None and t > 0 for t in times)


def test_a_meta_model_gets_the_same_split_points() -> None:
    """Fake tensors never read the weights: a model on the meta device chooses alike."""
    ids = torch.zeros(2, 8, dtype=torch.long)
    real = TinyGPT()
    with torch.device("meta"):
        meta = TinyGPT()
    for method in ("parameters", "flops", "memory"):
        assert choose_split_points(meta, 3, method, example_inputs={"input_ids": ids}) == (
            choose_split_points(real, 3, method, example_inputs={"input_ids": ids})
        )


def _example(spec: ModelSpec) -> dict[str, torch.Tensor]:
    inputs, _ = next(spec.micro_batches(1))
    values = inputs if isinstance(inputs, tuple) else (inputs,)
    return dict(zip(spec.input_names, values, strict=True))


@pytest.mark.parametrize(
    ("name", "capture"),
    [("gpt", "fx"), ("skip", "fx"), ("skip", "export"), ("mixed", "fx"), ("mixed", "export")],
)
def test_every_candidate_is_a_split_point_partition_accepts(name: str, capture: str) -> None:
    """Each candidate alone, captured with torch.fx or torch.export: the plan computes what
    the unsplit model computes."""
    spec = MODELS[name]
    model = spec.build()
    example = _example(spec)
    profile = profile_model(model, example_inputs=example)
    expected = model(*example.values())
    usable = []
    for point in profile.candidates:
        try:
            profile.costs([point])
        except SplitPointError as exc:  # only a module whose call is forward's last work
            assert "last computation" in str(exc)
            continue
        usable.append(point)
    assert len(usable) >= len(profile.candidates) - 1
    for point in usable:
        plan = partition(model, [point], example_inputs=example if capture == "export" else None)
        torch.testing.assert_close(plan.graph(*example.values()), expected, rtol=0, atol=0)


# -- balanced plans train like the unsplit model -----------------------------------------------

GAS = 4
STEPS = 3


def _train_reference(spec: ModelSpec, model: nn.Module, batches: Sequence[Any]) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    steps = steps_from([iter(batches)], STEPS, GAS)
    return train_unsplit(model, optimizer, steps, spec.loss_fn).losses


@pytest.mark.parametrize(
    ("name", "balance", "stages", "via"),
    [
        ("gpt", "flops", 4, "choose"),
        ("skip", "memory", 3, "choose"),
        ("mixed", "flops", 3, "choose"),
        ("encdec", "parameters", 3, "choose"),
        ("skip", "memory", 3, "partition"),
        ("encdec", "parameters", 3, "partition"),
        ("gpt", "flops", 3, "partition-export"),
    ],
)
def test_balanced_plan_trains_like_the_unsplit_model(
    name: str, balance: str, stages: int, via: str
) -> None:
    """Split points from choose_split_points, or chosen by partition(num_stages=, balance=)
    itself (torch.fx with balance_inputs, or torch.export with example_inputs)."""
    spec = MODELS[name]
    model = spec.build()
    reference = copy.deepcopy(model)
    if via == "choose":
        points = choose_split_points(
            model,
            stages,
            balance,  # type: ignore[arg-type]
            example_inputs=_example(spec),
            micro_batches=GAS,
        )
        assert len(points) == stages - 1
        plan = partition(model, points)
    else:
        inputs = {"balance_inputs" if via == "partition" else "example_inputs": _example(spec)}
        plan = partition(
            model,
            num_stages=stages,
            balance=balance,  # type: ignore[arg-type]
            micro_batches=GAS,
            **inputs,  # type: ignore[arg-type]
        )
        assert plan.num_stages == stages
        assert plan.costs is not None and list(plan.costs.split_points) == list(plan.split_points)
    config = {
        "train_batch_size": 2 * GAS,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "steps_per_print": 1000,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
    }
    dialect = pipedialect.get_dialect("local")
    engine = dialect.runtime_engine(
        dialect.pipe_engine(plan, config=config, loss_fn=spec.loss_fn), config=config
    )
    batches = list(spec.micro_batches(GAS * STEPS))
    data = iter(batches)
    losses = [float(engine.train_batch(data)) for _ in range(STEPS)]
    expected = _train_reference(spec, reference, batches)
    assert_tensor_close(torch.tensor(losses), torch.tensor(expected), "losses")
    ours = dict(model.named_parameters())
    for pname, param in reference.named_parameters():
        assert_tensor_close(ours[pname].detach(), param.detach(), pname)


# -- the same answer in every process ----------------------------------------------------------


@pytest.mark.distributed
def test_two_fresh_interpreters_choose_the_same_split_points() -> None:
    """Two spawned ranks (different hash seeds): the same points for every method, "time"
    included (measured on both, rank 0's times win), and all accepted by partition."""
    results = launch(workers.choose_everything, 2, timeout=240)
    assert results[0] == results[1]
    assert set(results[0]) == {"parameters", "flops", "memory", "time", "fx-parameters"}


class _Unequal(nn.Module):
    """Blocks of unequal width on one boundary size: every cut carries the same bytes."""

    def __init__(self, dim: int, widths: Sequence[int]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, w, bias=False), nn.ReLU(), nn.Linear(w, dim, bias=False))
            for w in widths
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_flops_balances_flops_when_every_cut_carries_the_same_bytes() -> None:
    """At the default device speed a cut's transfer outweighs these blocks' compute; every cut
    carries the same bytes, so no split can avoid them and balance="flops" balances the FLOPs
    themselves: its largest stage is the least over the block boundaries (brute force, FLOPs by
    hand: two products of b x dim x width, forward twice, backward four times), not the end
    stages' five blocks around one block in each middle stage."""
    dim, batch, widths = 64, 4, [48, 32, 32, 32, 32, 32, 32, 32, 32, 32, 32, 40]
    model = _Unequal(dim, widths)
    points = choose_split_points(model, 4, "flops", example_inputs={"x": torch.randn(batch, dim)})
    block_flops = [12 * batch * dim * w for w in widths]
    block_flops[0] -= 2 * batch * dim * widths[0]  # the model's input needs no gradient
    n = len(widths)
    largest = {}
    for cuts in itertools.combinations(range(n - 1), 3):
        bounds = [-1, *cuts, n - 1]
        largest[cuts] = max(sum(block_flops[bounds[k] + 1 : bounds[k + 1] + 1]) for k in range(4))
    chosen = tuple(int(p.split(".")[1]) for p in points)
    assert largest[chosen] == min(largest.values()), (points, largest[chosen])


class _CountsThreads(nn.Module):
    """Records the intra-op threads torch runs it with."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(torch.get_num_threads())
        for block in self.blocks:
            x = block(x)
        return x


def test_measure_time_pins_its_threads_and_reports_runs_and_spread() -> None:
    """Timed with this process's share of the cores whatever torch was set to, and put back
    after; at least ``repeats`` runs; the report says how many threads, runs and what spread."""
    import os

    from pipedialect.cost._profile import timing_threads

    model = _CountsThreads()
    previous = torch.get_num_threads()
    odd = 3 if timing_threads() != 3 else 2
    torch.set_num_threads(odd)
    try:
        profile = profile_model(
            model, example_inputs={"x": torch.randn(4, 8)}, measure_time=True, repeats=4
        )
        assert torch.get_num_threads() == odd
    finally:
        torch.set_num_threads(previous)
    cores = len(os.sched_getaffinity(0))
    timing = profile.timing
    assert timing is not None
    assert timing.threads == cores  # one process: all of its cores
    timed = model.seen[-timing.runs :]
    assert timed == [cores] * timing.runs
    assert 4 <= timing.runs <= 20
    assert timing.spread >= 0.0
    assert f"{timing.threads} thread(s)" in timing.describe()


class _Scale(torch.autograd.Function):
    """Doubles its input; a custom Function, whose node Python code owns."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


class _KeepsWeakRefs(nn.Module):
    """Blocks of 1 MiB activations through a custom autograd Function; remembers a weak
    reference to the autograd node of every real block output."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(256, 256) for _ in range(4))
        self.outputs: list[Any] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import weakref

        for block in self.blocks:
            x = _Scale.apply(torch.tanh(block(x)))
            if type(x) is torch.Tensor:  # a timed run's, not the fake-tensor trace's
                self.outputs.append(weakref.ref(x.grad_fn))
        return x


def test_measure_time_frees_every_timed_run_before_the_next() -> None:
    """What one timed forward kept for its backward is freed when the run ends, not held
    across the runs (nor after ``measure_time`` returns), without the garbage collector.

    A run that kept its activations alive made every following run's forward allocate fresh
    memory (page faults on every page), several times slower than the same forward in a
    pipeline's steady state ([Note: timing on warm memory])."""
    import gc

    model = _KeepsWeakRefs()
    enabled = gc.isenabled()
    gc.disable()
    try:
        profile = profile_model(
            model, example_inputs={"x": torch.randn(1024, 256)}, measure_time=True, repeats=3
        )
        assert profile.timing is not None
        alive = [r for r in model.outputs if r() is not None]
        # The warm-ups too, and the runs at half the micro-batch ([Note: seconds that do not
        # scale with the micro-batch]).
        timing = profile.timing
        assert timing.half_batch == 512
        assert len(model.outputs) == 4 * (timing.runs + 1 + timing.half_runs + 1)
    finally:
        if enabled:
            gc.enable()
    assert alive == [], f"{len(alive)} autograd nodes of the timed runs are still alive"
