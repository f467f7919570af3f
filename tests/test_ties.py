"""Tie groups and their ranks, checked against hand-worked examples (research/slapo.md 4.6)."""

from __future__ import annotations

import copy
import itertools
from collections import namedtuple
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import pipedialect
from pipedialect import (
    DefaultTieAnalyzer,
    GridTopology,
    TieError,
    TieGroup,
    TopologyError,
    analyze_tie_ranks,
    find_tie_groups,
    partition,
)
from pipedialect.testing.models import MODELS
from pipedialect.ties import check_tie_objects, check_topology


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
    assert find_tie_groups(plan.wrap()) == plan.tie_groups


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
    check_topology(plan, GridTopology(pipe=4, data=2))
    with pytest.raises(TopologyError, match="pipe axis has 3 coordinates but the plan has 4"):
        check_topology(plan, GridTopology(pipe=3))


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
    stages = plan.wrap()
    check_tie_objects(plan.tie_groups, stages)
    stages[3] = copy.deepcopy(stages[3])
    with pytest.raises(TieError, match=r"tie0_wte_weight .*wte\.weight@0, lm_head\.weight@3"):
        check_tie_objects(plan.tie_groups, stages)
    with pytest.raises(TieError, match=r"no parameter 'lm_head\.weight'"):
        check_tie_objects(plan.tie_groups, [*stages[:3], nn.Linear(1, 1)])
