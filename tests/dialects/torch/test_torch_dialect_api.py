"""The torch dialect in one process: registration, schedule names, placement, argument errors.

Everything here is checked before any process group is needed, so no ranks are launched; the
distributed behaviour is in test_torch_dialect.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import pipedialect
from pipedialect import ConfigError, GridTopology, TopologyError
from pipedialect.dialects.torch import TorchDialect, available_schedules
from pipedialect.dialects.torch._schedules import resolve_schedule, stage_to_rank
from pipedialect.dialects.torch._stage import normalize_wire
from pipedialect.models import get_model


@pytest.fixture(scope="module")
def gpt_plan() -> Any:
    spec = get_model("gpt")
    return pipedialect.partition(spec.build(0), spec.split_points_for(2))


def _config() -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "gradient_clipping": 0.0,
    }


def test_found_through_its_entry_point_with_honest_capabilities() -> None:
    dialect = pipedialect.get_dialect("torch")
    assert isinstance(dialect, TorchDialect)
    (info,) = [i for i in pipedialect.list_dialects() if i.name == "torch"]
    assert info.status == "ok"
    assert info.distribution == "pipedialect"
    caps = pipedialect.Capability
    assert {
        caps.TIED_WEIGHTS,
        caps.NON_FLOAT_TENSORS,
        caps.MULTI_GRAD_BOUNDARY,
    } <= info.capabilities
    # torch fixes boundary shapes; pipelines are replicated over a data axis
    assert caps.DYNAMIC_SHAPES not in info.capabilities
    assert caps.DATA_PARALLEL in info.capabilities


def test_schedule_names_and_aliases() -> None:
    names = available_schedules()
    assert names[:3] == ("gpipe", "1f1b", "interleaved_1f1b")
    assert "interleaved_zero_bubble" in names and "zbv_zero_bubble" in names
    assert resolve_schedule("Interleaved1F1B").name == "interleaved_1f1b"
    assert resolve_schedule("ScheduleZBVZeroBubble").name == "zbv_zero_bubble"
    assert resolve_schedule("ZBV").name == "zbv_zero_bubble"
    assert resolve_schedule("interleaved-1f1b").name == "interleaved_1f1b"
    assert resolve_schedule("GPipe").torch_class() is torch.distributed.pipelining.ScheduleGPipe


@pytest.mark.parametrize("bad", ["1F1B_fast", "pipedream", ""])
def test_unknown_schedule_names_are_refused_with_the_choices(bad: str) -> None:
    with pytest.raises(ConfigError, match="unknown pipeline schedule") as info:
        TorchDialect(schedule=bad)
    assert "interleaved_1f1b" in str(info.value)


def test_unknown_schedule_name_in_pipe_engine(gpt_plan: Any) -> None:
    with pytest.raises(ConfigError, match=r"'fast'.*available: gpipe, 1f1b"):
        TorchDialect().pipe_engine(
            gpt_plan, config=_config(), loss_fn=get_model("gpt").loss_fn, schedule="fast"
        )


def test_placement_matches_torch_for_looped_and_v_schedules() -> None:
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    looped = resolve_schedule("interleaved_1f1b")
    v = resolve_schedule("zbv_zero_bubble")
    assert stage_to_rank(looped, 6, 3) == {0: 0, 1: 1, 2: 2, 3: 0, 4: 1, 5: 2}
    assert stage_to_rank(v, 4, 2) == {0: 0, 1: 1, 2: 1, 3: 0}
    assert stage_to_rank(v, 6, 3) == {0: 0, 1: 1, 2: 2, 3: 2, 4: 1, 5: 0}
    for ranks in (1, 2, 4):
        assert stage_to_rank(v, 2 * ranks, ranks) == generate_stage_to_rank_mapping(
            ranks, 2 * ranks, style="v"
        )
        assert stage_to_rank(looped, 3 * ranks, ranks) == generate_stage_to_rank_mapping(
            ranks, 3 * ranks, style="loop"
        )
    assert stage_to_rank(resolve_schedule("1f1b"), 3, 3) == {0: 0, 1: 1, 2: 2}


@pytest.mark.parametrize(
    ("schedule", "stages", "ranks", "message"),
    [
        ("1f1b", 4, 2, "runs one stage per rank"),
        ("gpipe", 1, 2, "has 1 stage;"),
        ("interleaved_1f1b", 3, 2, "has 3 stages"),
        ("zbv_zero_bubble", 6, 2, "exactly 2 stages per rank"),
        ("dualpipev", 2, 2, "exactly 2 stages per rank"),
    ],
)
def test_stages_that_do_not_fit_the_ranks(
    schedule: str, stages: int, ranks: int, message: str
) -> None:
    with pytest.raises(TopologyError, match=message):
        stage_to_rank(resolve_schedule(schedule), stages, ranks)


def _engine_error(plan: Any, **kwargs: Any) -> str:
    args: dict[str, Any] = {"config": _config(), "loss_fn": get_model("gpt").loss_fn}
    args.update(kwargs)
    with pytest.raises(pipedialect.PipeDialectError) as info:
        TorchDialect().pipe_engine(plan, **args)
    return f"{type(info.value).__name__}: {info.value}"


def test_argument_errors_come_before_any_collective(gpt_plan: Any) -> None:
    import torch.distributed as dist

    assert not dist.is_initialized()  # each error below is raised without a process group
    assert _engine_error(gpt_plan, pipeline_size=2).startswith("ConfigError: unknown argument")
    assert "config" in _engine_error(gpt_plan, config=None)
    assert "loss_fn" in _engine_error(gpt_plan, loss_fn="cross-entropy")
    assert "dynamic_shapes" in _engine_error(gpt_plan, dynamic_shapes=True)
    assert "optimizer" in _engine_error(gpt_plan, config={**_config(), "optimizer": None})
    # A config whose batch triple counts one replica, on a topology of two.
    one_replica = {**_config(), "train_batch_size": 8}
    data = _engine_error(gpt_plan, config=one_replica, topology=GridTopology(pipe=2, data=2))
    assert data.startswith("ConfigError") and "data-parallel size (2)" in data
    fsdp = _engine_error(gpt_plan, data_parallel_mode="fsdp", schedule="interleaved_1f1b")
    assert fsdp.startswith("ConfigError") and "pytorch#164756" in fsdp
    bf16 = {
        **_config(),
        "bf16": {"enabled": True},
        "data_types": {"grad_accum_dtype": "fp32"},
    }
    comm = _engine_error(gpt_plan, config=bf16, data_parallel_mode="fsdp")
    assert comm.startswith("ConfigError") and "communication_data_type" in comm
    mode = _engine_error(gpt_plan, data_parallel_mode="zero3")
    assert mode.startswith("ConfigError") and "'ddp', 'fsdp'" in mode
    fits = _engine_error(gpt_plan, topology=GridTopology(pipe=4))
    assert fits.startswith("TopologyError") and "2 stages" in fits
    v_two = _engine_error(gpt_plan, topology=GridTopology(pipe=2), schedule="zbv")
    assert v_two.startswith("TopologyError") and "exactly 2 stages per rank" in v_two
    spr = _engine_error(gpt_plan, topology=GridTopology(pipe=2), stages_per_rank=2)
    assert spr.startswith("TopologyError") and "stages_per_rank=2" in spr
    unset = _engine_error(gpt_plan, topology=GridTopology(pipe=2))
    assert unset.startswith("ConfigError") and "init_distributed" in unset


@pytest.mark.parametrize("schedule", ["interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"])
def test_zero_bubble_schedules_refuse_a_stage_with_nothing_to_train(schedule: str) -> None:
    spec = get_model("gpt")
    model = spec.build(0)
    plan = pipedialect.partition(model, spec.split_points_for(4))
    for param in plan.stages[1].parameters():
        param.requires_grad_(False)
    try:
        error = _engine_error(plan, topology=GridTopology(pipe=2), schedule=schedule)
    finally:
        model.requires_grad_(True)
    assert error.startswith("ConfigError") and "stage 1 has nothing to train" in error, error
    # Without split backward the same frozen stage gets past this check (to the process group).
    other = _engine_error(plan, topology=GridTopology(pipe=2), schedule="interleaved_1f1b")
    assert "nothing to train" not in other and "init_distributed" in other, other


def test_make_topology_counts_ranks_not_stages() -> None:
    assert TorchDialect().make_topology(4).get_dim("pipe") == 4
    assert TorchDialect("interleaved_1f1b").make_topology(4).get_dim("pipe") == 2
    assert TorchDialect("looped_bfs", stages_per_rank=3).make_topology(6).get_dim("pipe") == 2
    assert TorchDialect("zbv").make_topology(6).world_size() == 3
    grid = TorchDialect("interleaved_1f1b").make_topology(4, data_parallel=2)
    assert (grid.get_dim("pipe"), grid.get_dim("data"), grid.world_size()) == (2, 2, 4)
    # DeepSpeed's layout: the pipe axis outermost, the data axis varies fastest
    assert [tuple(grid.get_coord(r))[:2] for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    with pytest.raises(TopologyError, match="data_parallel must be a positive integer"):
        TorchDialect().make_topology(2, data_parallel=0)
    with pytest.raises(TopologyError, match="tensor_parallel must be a positive integer"):
        TorchDialect().make_topology(2, tensor_parallel=0)
    with pytest.raises(TopologyError, match="5 stages"):
        TorchDialect("dualpipev").make_topology(5)
    with pytest.raises(ConfigError, match="stages_per_rank"):
        TorchDialect(stages_per_rank=0)


def test_runtime_engine_and_local_stages_refuse_foreign_objects() -> None:
    dialect = TorchDialect()
    with pytest.raises(ConfigError, match=r"TorchDialect\.pipe_engine"):
        dialect.runtime_engine(torch.nn.Linear(2, 2), config=_config())
    with pytest.raises(
        ConfigError, match=r"unknown argument 'optimiser' for the torch dialect's runtime_engine"
    ):
        dialect.runtime_engine(torch.nn.Linear(2, 2), optimiser=None)
    with pytest.raises(ConfigError, match="not a torch engine"):
        dialect.local_stages(object())  # type: ignore[arg-type]


def test_wire_tensors_become_plain_tensors_torch_can_send_and_detach() -> None:
    base = torch.randn(4, 6, requires_grad=True)
    h = base * 2
    ids = torch.arange(12).reshape(3, 4)
    wire = (h[:, :3], h.t(), ids[1:], ids.t(), torch.ones(3))
    out = normalize_wire(wire, "[Stage 0]")
    assert all(t.is_contiguous() and not t._is_view() for t in out)
    assert out[0].requires_grad and out[1].requires_grad  # the graph is kept
    assert torch.equal(out[0], h[:, :3]) and torch.equal(out[1], h.t())
    assert out[2].data_ptr() == ids[1:].data_ptr()  # a contiguous no-grad view: no copy
    assert out[4] is wire[4]
    for t in out:
        t.detach_()  # what the zero-bubble schedules do to stage outputs
    with pytest.raises(ConfigError, match=r"\[Stage 3\] a stage module must return"):
        normalize_wire({"h": h}, "[Stage 3]")


def test_the_micro_batch_rule_each_schedule_declares_is_torchs() -> None:
    """The rule the engine checks when it is built (never at the first step) is the
    one torch's own schedule classes apply, over a grid of ranks and micro-batch counts."""
    from pipedialect.cost._schedules import torch_program

    for name in available_schedules():
        spec = resolve_schedule(name)
        for ranks in (2, 3, 4):
            stages = ranks * spec.default_stages_per_rank()
            for count in range(1, 10):
                try:
                    torch_program(name, ranks, count)
                    refused = False
                except ConfigError as exc:
                    refused = "micro-batches" in str(exc)
                ours = spec.micro_batch_problem(count, stages, ranks)
                assert (ours is not None) == refused, (name, ranks, count, ours)
