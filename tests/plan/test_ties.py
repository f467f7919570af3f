"""Tie groups and their ranks, checked against hand-worked examples (research/slapo.md 4.6).

Re-tying: stages of a meta-built model materialised one by one (``to_empty()``) train like the
unsplit model on every dialect, in one process (local) and on two ranks (deepspeed, torch).
"""

from __future__ import annotations

import copy
import itertools
from collections import namedtuple
from collections.abc import Iterator
from typing import Any

import _tie_workers
import _torch_workers
import pytest
import torch
from _compare import ATOL, RTOL, assert_tensor_close
from _reference import steps_from, train_unsplit
from torch import nn

import pipedialect
from pipedialect import (
    DefaultTieAnalyzer,
    GridTopology,
    StageWrapper,
    TieError,
    TieGroup,
    TopologyError,
    analyze_tie_ranks,
    find_tie_groups,
    partition,
)
from pipedialect.dialects.local import LocalDialect
from pipedialect.models import MODELS
from pipedialect.plan.ties import check_tie_objects, retie_parameters
from pipedialect.runtime.launch import launch
from pipedialect.runtime.topology import check_topology


class FakeTopology:
    """A row-major process grid with named axes, as DeepSpeed's ProcessTopology lays it out."""

    def __init__(self, axes: list[str], dims: list[int]) -> None:
        self.axes = axes
        self.dims = dims
        self.coord = namedtuple("ProcessCoord", axes)  # type: ignore[misc]
        self.ranks = [self.coord(*c) for c in itertools.product(*(range(d) for d in dims))]

    def get_dim(self, axis: str) -> int:
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def world_size(self) -> int:
        return len(self.ranks)

    def get_coord(self, rank: int) -> Any:
        return self.ranks[rank]

    def filter_match(self, **kwargs: int) -> list[int]:
        return [
            r
            for r, c in enumerate(self.ranks)
            if all(getattr(c, k) == v for k, v in kwargs.items())
        ]


def test_gpt_embedding_and_lm_head_form_one_group() -> None:
    spec = MODELS["gpt"]
    for num_stages, last in ((2, 1), (4, 3)):
        plan = partition(spec.build(), spec.split_points_for(num_stages))
        assert [g.members for g in plan.tie_groups] == [
            (("wte.weight", 0), ("lm_head.weight", last))
        ]
        group = plan.tie_groups[0]
        assert group.key == "tie0_wte_weight"
        assert list(group) == [("wte.weight", 0), ("lm_head.weight", last)]
        assert group.stages == (0, last)
        nn.ModuleDict({group.key: nn.Identity()})  # a valid ModuleDict key


class SharedWeights(nn.Module):
    """``a``/``b``/``c`` share one weight over stages 0 and 1; ``d``/``e`` share one in stage 1."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3, bias=False)
        self.b = nn.Linear(3, 3, bias=False)
        self.cut = nn.Linear(3, 3)
        self.c = nn.Linear(3, 3, bias=False)
        self.d = nn.Linear(3, 3, bias=False)
        self.e = nn.Linear(3, 3, bias=False)
        self.b.weight = self.a.weight
        self.c.weight = self.a.weight
        self.e.weight = self.d.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.cut(self.b(self.a(x)))
        return self.e(self.d(self.c(h)))


def test_same_stage_members_are_listed_and_single_stage_ties_stay_intact() -> None:
    model = SharedWeights()
    reference = copy.deepcopy(model)
    plan = partition(model, ["cut"])
    assert [g.members for g in plan.tie_groups] == [
        (("a.weight", 0), ("b.weight", 0), ("c.weight", 1))
    ]
    assert plan.tie_groups[0].names_on(0) == ("a.weight", "b.weight")
    stage1 = plan.stages[1]
    assert stage1.get_parameter("d.weight") is stage1.get_parameter("e.weight")
    assert plan.stages[0].get_parameter("a.weight") is stage1.get_parameter("c.weight")
    x = torch.randn(2, 3)
    assert torch.equal(plan.graph(x), reference(x))


def test_wrappers_are_looked_through_and_keys_stay_unique() -> None:
    class Collide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.x = nn.ModuleDict({"b_c": nn.Linear(2, 2), "b": nn.ModuleDict()})
            self.x["b"]["c"] = nn.Linear(2, 2)
            self.cut = nn.Linear(2, 2)
            self.y = nn.Linear(2, 2)
            self.z = nn.Linear(2, 2)
            self.y.weight = self.x["b_c"].weight
            self.z.weight = self.x["b"]["c"].weight

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            h = self.cut(self.x["b"]["c"](self.x["b_c"](h)))
            return self.z(self.y(h))

    plan = partition(Collide(), ["cut"])
    keys = [g.key for g in plan.tie_groups]
    assert len(set(keys)) == 2 and all("." not in k for k in keys)
    assert find_tie_groups(pipedialect.get_dialect("local").wrap_stages(plan)) == plan.tie_groups


def test_one_pass_over_the_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = MODELS["gpt"]
    plan = partition(spec.build(), spec.split_points_for(4))
    calls: list[bool] = []
    original = nn.Module.named_parameters

    def counting(self: nn.Module, *args: Any, **kwargs: Any) -> Iterator[Any]:
        calls.append(bool(kwargs.get("remove_duplicate", True)))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "named_parameters", counting)
    groups = find_tie_groups(plan.stages)
    assert calls == [False] * 4  # one call per stage, duplicates included
    assert len(groups) == 1


# -- ranks ---------------------------------------------------------------------------------


def test_slapo_pp4_tp2_example() -> None:
    topology = FakeTopology(["pipe", "model"], [4, 2])
    groups = [[("wte.weight", 0), ("lm_head.weight", 3)], [("a", 2), ("b", 1)]]
    tie_ranks, tie_stages = analyze_tie_ranks(groups, topology)
    assert tie_ranks == [[[0, 6], [1, 7]], [[2, 4], [3, 5]]]
    assert tie_stages == [[0, 3], [1, 2]]


def test_three_way_tie_pp4_dp2() -> None:
    group = TieGroup("tie0_w", (("w", 0), ("w2", 1), ("w3", 3)))
    for topology in (FakeTopology(["pipe", "data"], [4, 2]), GridTopology(pipe=4, data=2)):
        assert analyze_tie_ranks([group], topology) == ([[[0, 2, 6], [1, 3, 7]]], [[0, 1, 3]])


def test_ranks_pair_by_coordinate_when_pipe_is_not_outermost() -> None:
    topology = FakeTopology(["data", "pipe"], [2, 4])  # rank = 4 * data + pipe
    tie_ranks, tie_stages = analyze_tie_ranks([[("e", 0), ("h", 3)]], topology)
    assert tie_ranks == [[[0, 3], [4, 7]]]
    assert tie_stages == [[0, 3]]


def test_deepspeed_topology_satisfies_the_protocol() -> None:
    topology_mod = pytest.importorskip("deepspeed.runtime.pipe.topology")
    topology = topology_mod.PipeModelDataParallelTopology(num_pp=4, num_mp=2, num_dp=1)
    groups = [[("wte.weight", 0), ("lm_head.weight", 3)], [("a", 2), ("b", 1)]]
    assert analyze_tie_ranks(groups, topology) == (
        [[[0, 6], [1, 7]], [[2, 4], [3, 5]]],
        [[0, 3], [1, 2]],
    )


def test_stage_outside_the_pipe_axis_is_an_error() -> None:
    with pytest.raises(TopologyError, match=r"'lm_head\.weight' is on stage 3"):
        analyze_tie_ranks([[("wte.weight", 0), ("lm_head.weight", 3)]], GridTopology(pipe=2))


def test_plan_and_topology_stage_counts_must_agree() -> None:
    spec = MODELS["gpt"]
    plan = partition(spec.build(), spec.split_points_for(4))
    check_topology(GridTopology(pipe=4, data=2), plan.num_stages)
    with pytest.raises(TopologyError, match="pipe axis has 3 coordinates but the plan has 4"):
        check_topology(GridTopology(pipe=3), plan.num_stages)


def test_default_tie_analyzer() -> None:
    spec = MODELS["gpt"]
    plan = partition(spec.build(), spec.split_points_for(4))
    analyzer = pipedialect.get_dialect("local").tie_analyzer
    assert isinstance(analyzer, DefaultTieAnalyzer)
    groups = analyzer.find_groups(plan.stages)
    assert groups == plan.tie_groups
    assert analyzer.analyze_ranks(groups, GridTopology(pipe=4, data=2)) == (
        [[[0, 6], [1, 7]]],
        [[0, 3]],
    )


def test_stage_modules_holding_copies_of_a_tie_are_refused() -> None:
    spec = MODELS["gpt"]
    plan = partition(spec.build(), spec.split_points_for(4))
    stages = pipedialect.get_dialect("local").wrap_stages(plan)
    check_tie_objects(plan.tie_groups, stages)
    stages[3] = copy.deepcopy(stages[3])
    with pytest.raises(TieError, match=r"tie0_wte_weight .*wte\.weight@0, lm_head\.weight@3"):
        check_tie_objects(plan.tie_groups, stages)
    with pytest.raises(TieError, match=r"no parameter 'lm_head\.weight'"):
        check_tie_objects(plan.tie_groups, [*stages[:3], nn.Linear(1, 1)])


# -- topology objects ------------------------------------------------------------------------


class _NoCoord:
    """A topology of another library: it has no ``get_coord``."""

    def get_dim(self, axis: str) -> int:
        return 2 if axis == "pipe" else 1

    def filter_match(self, **kwargs: int) -> list[int]:
        return [kwargs.get("pipe", 0)]

    def world_size(self) -> int:
        return 2


class _NoneDims(_NoCoord):
    def get_dim(self, axis: str) -> Any:
        return None

    def get_coord(self, rank: int) -> Any:
        return (rank,)


GPT_TIE = [[("wte.weight", 0), ("lm_head.weight", 1)]]


@pytest.mark.parametrize(
    ("topology", "message"),
    [
        (_NoCoord(), r"_NoCoord\) has no get_coord\(\) method; a topology needs get_dim"),
        (object(), r"has no get_dim\(\), filter_match\(\), get_coord\(\) method"),
        (GridTopology, r"got the class GridTopology; create one first"),
        (_NoneDims(), r"get_dim\('pipe'\) returned None; it must return the number of"),
    ],
    ids=["no-get_coord", "not-a-topology", "a-class", "no-pipe-size"],
)
def test_a_wrong_topology_object_is_a_topology_error(topology: Any, message: str) -> None:
    with pytest.raises(TopologyError, match=message):
        analyze_tie_ranks(GPT_TIE, topology)


def test_check_topology_names_what_the_object_lacks() -> None:
    spec = MODELS["gpt"]
    plan = partition(spec.build(), spec.split_points_for(2))
    with pytest.raises(TopologyError, match=r"\(object\) has no get_dim\(\) method"):
        check_topology(object(), plan.num_stages)
    with pytest.raises(TopologyError, match="got the class GridTopology"):
        check_topology(GridTopology, plan.num_stages)
    with pytest.raises(TopologyError, match=r"get_dim\('pipe'\) returned None"):
        check_topology(_NoneDims(), plan.num_stages)


# -- re-tying stages in one process ---------------------------------------------------------

SGD = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
GAS, STEPS = 4, 3
LOCAL_CONFIG = {
    "train_batch_size": 2 * GAS,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_clipping": 0.0,
    "steps_per_print": 1000,
    "optimizer": SGD,
}


def _root(stage: nn.Module) -> nn.Module:
    return stage.mod if isinstance(stage, StageWrapper) else stage


def materialise(stage: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """What a user does with one stage of a model built on the meta device: allocate its
    tensors (``to_empty``, which gives every holder of a tied weight its own Parameter),
    then load its values."""
    stage.to_empty(device="cpu")
    root = _root(stage)
    root.load_state_dict({name: state[name] for name in root.state_dict()})


def unsplit_run(
    spec: Any, batches: list[Any], momentum: float = 0.9
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference: the unsplit model (real tensors, one tied Parameter) trained by hand
    with SGD (lr 0.1), ``GAS`` micro-batches a step."""
    model = spec.build(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    steps = steps_from([iter(batches)], STEPS, GAS)
    losses = train_unsplit(model, optimizer, steps, spec.loss_fn).losses
    return losses, {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("given", [False, True], ids=["plan-stages", "stage-modules"])
def test_meta_built_stages_materialised_one_by_one_train_tied_on_local(given: bool) -> None:
    """The plan's tie holds after ``to_empty()`` per stage, with or without ``stage_modules``:
    losses and parameters equal the unsplit model's (two copies would train apart)."""
    spec = MODELS["gpt"]
    with torch.device("meta"):
        plan = partition(spec.build(0), spec.split_points_for(4))
    state = spec.build(0).state_dict()
    dialect = LocalDialect()
    stages: list[nn.Module] = list(dialect.wrap_stages(plan)) if given else list(plan.stages)
    for stage in stages:
        materialise(stage, state)
    head, wte = (
        plan.stages[3].get_parameter("lm_head.weight"),
        plan.stages[0].get_parameter("wte.weight"),
    )
    assert head is not wte and torch.equal(head, wte)  # what to_empty() did to the tie
    module = dialect.pipe_engine(
        plan, stages if given else None, config=LOCAL_CONFIG, loss_fn=spec.loss_fn
    )
    engine = dialect.runtime_engine(module, config=LOCAL_CONFIG)
    batches = list(spec.micro_batches(GAS * STEPS))
    data = iter(batches)
    losses = [float(engine.train_batch(data)) for _ in range(STEPS)]
    ref_losses, ref_params = unsplit_run(spec, batches)
    assert losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-8)
    for k, stage in enumerate(plan.stages):
        for name, param in stage.named_parameters(remove_duplicate=False):
            torch.testing.assert_close(param, ref_params[name], rtol=1e-6, atol=1e-8, msg=name)
        assert k < 3 or stage.get_parameter("lm_head.weight") is wte


def test_copies_that_differ_take_the_lowest_stages_value() -> None:
    """As the multi-process dialects broadcast the lowest stage's copy, so re-tying keeps it;
    a copy still on the meta device never becomes the parameter."""
    model = SharedWeights()
    plan = partition(model, ["cut"])
    original = model.a.weight.detach().clone()
    stages = [copy.deepcopy(s) for s in pipedialect.get_dialect("local").wrap_stages(plan)]
    with torch.no_grad():
        _root(stages[0]).get_parameter("b.weight").add_(0)  # still one object with a.weight
        _root(stages[1]).get_parameter("c.weight").add_(1.0)
    assert retie_parameters(plan.tie_groups, stages) == 1
    a, b = _root(stages[0]).a.weight, _root(stages[0]).b.weight
    assert a is b is _root(stages[1]).c.weight and torch.equal(a, original)

    meta = [copy.deepcopy(s) for s in pipedialect.get_dialect("local").wrap_stages(plan)]
    meta[0].to("meta")  # to("meta") gives every holder its own copy, on stage 0 too
    assert retie_parameters(plan.tie_groups, meta) == 2
    kept = _root(meta[1]).c.weight
    assert kept.device.type == "cpu" and _root(meta[0]).a.weight is kept
    assert _root(meta[0]).b.weight is kept
    assert retie_parameters(plan.tie_groups, meta) == 0  # nothing left to do


def test_copies_that_cannot_be_one_parameter_are_refused() -> None:
    spec = MODELS["gpt"]
    plan = partition(spec.build(), spec.split_points_for(2))
    stages = pipedialect.get_dialect("local").wrap_stages(plan)
    stages[1] = copy.deepcopy(stages[1])
    head = _root(stages[1]).lm_head
    head.weight.requires_grad_(False)
    with pytest.raises(
        TieError,
        match=r"\[Stage 1\] tied parameter 'lm_head\.weight' \(tie "
        r"group tie0_wte_weight\) has requires_grad=False instead of True of "
        r"wte\.weight@0",
    ):
        retie_parameters(plan.tie_groups, stages)
    head.weight = nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(TieError, match=r"has shape \(3, 3\) instead of \(\d+, \d+\)"):
        retie_parameters(plan.tie_groups, stages)
    head.weight = nn.Parameter(head.weight.new_zeros(_root(stages[0]).wte.weight.shape).double())
    with pytest.raises(TieError, match=r"dtype torch\.float64 instead of torch\.float32"):
        retie_parameters(plan.tie_groups, stages)
    with pytest.raises(TieError, match=r"\[Stage 1\] has no parameter 'lm_head\.weight'"):
        retie_parameters(plan.tie_groups, [stages[0], nn.Linear(1, 1)])
    with pytest.raises(TieError, match="names stage 1, but there are 1 stage modules"):
        retie_parameters(plan.tie_groups, stages[:1])


@pytest.mark.distributed
def test_meta_built_stages_stay_tied_on_deepspeed() -> None:
    """Two names of one tie on the stage a rank materialises: DeepSpeed trains them as one."""
    spec = _tie_workers.DOUBLE_TIED
    results = launch(_tie_workers.deepspeed_meta_run, 2, STEPS, timeout=300)
    batches = list(spec.micro_batches(STEPS * GAS, batch_size=2, seed=_tie_workers.DATA_SEED))
    ref_losses, ref_params = unsplit_run(spec, batches, momentum=0.0)
    assert [r["stage"] for r in results] == [0, 1]
    assert [(r["heads_tied_before"], r["heads_tied_after"]) for r in results] == [
        (None, None),
        (False, True),
    ]
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, rel=RTOL, abs=ATOL), r["stage"]
        for name, value in r["params"].items():
            assert_tensor_close(value, ref_params[name], f"stage {r['stage']} {name}")
    assert set().union(*(r["params"] for r in results)) == set(ref_params)


@pytest.mark.distributed
def test_meta_built_stages_stay_tied_on_torch() -> None:
    """A V-shaped schedule puts both ends of the GPT tie on rank 0: one Parameter there."""
    case = {"model": "gpt", "stages": 4, "schedule": "zbv_zero_bubble", "optimizer": "sgd"}
    launched = launch(_torch_workers.run_cases, 2, [{**case, "meta": True}], timeout=300)
    spec = MODELS["gpt"]
    batches = list(spec.micro_batches(STEPS * GAS, batch_size=2, seed=_torch_workers.DATA_SEED))
    ref_losses, ref_params = unsplit_run(spec, batches, momentum=0.0)
    per_rank = [r["results"][0] for r in launched]
    assert [sorted(r["stages"]) for r in per_rank] == [[0, 3], [1, 2]]
    for r in per_rank:
        assert r["losses"] == pytest.approx(ref_losses, rel=RTOL, abs=ATOL), r["rank"]
        for name, value in r["params"].items():
            assert_tensor_close(value, ref_params[name], f"rank {r['rank']} {name}")
    assert set().union(*(r["params"] for r in per_rank)) == set(ref_params)
