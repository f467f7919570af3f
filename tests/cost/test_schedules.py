"""The planner's programs against the runtimes' own schedules.

Each program must be what the runtime executes: torch's multi-stage schedules through torch's
own visualiser (which lowers them its own way), GPipe and 1F1B against torch's ``pipeline_order``
tables, DeepSpeed's 1F1B against deepspeed's ``TrainSchedule`` instruction by instruction.
"""

from __future__ import annotations

import re

import pytest

from pipedialect import ConfigError
from pipedialect.cost import TORCH_SCHEDULES, ActionKind, Program, deepspeed_program, torch_program
from pipedialect.planner import DEEPSPEED_SCHEDULE, offer_of

GRID = [(p, m) for p in (2, 3, 4) for m in (p, 2 * p, 3 * p)]


def _compute_strings(program: Program, rank: int) -> list[str]:
    out = []
    for action in program.ranks[rank]:
        if action.kind == ActionKind.OVERLAP:
            out.append("(" + ";".join(str(a) for a in action.parts) + ")OVERLAP_F_B")
        elif action.kind in (
            ActionKind.FORWARD,
            ActionKind.BACKWARD,
            ActionKind.BACKWARD_INPUT,
            ActionKind.BACKWARD_WEIGHT,
        ):
            out.append(str(action))
    return out


_TORCH_NAMES = {"ALL_GATHER": "UNSHARD", "OVERLAP": "OVERLAP_F_B"}


def _torch_strings(program: Program, rank: int) -> list[str]:
    """The rank's actions spelt as torch spells them, without the end of the step."""
    out = []
    for a in program.ranks[rank]:
        if a.kind in (ActionKind.ALL_REDUCE, ActionKind.OPTIMIZER):
            continue
        if a.kind == ActionKind.OVERLAP:
            out.append("(" + ";".join(str(p) for p in a.parts) + ")OVERLAP_F_B")
        else:
            text = str(a)
            for ours, theirs in _TORCH_NAMES.items():
                text = text.replace(ours, theirs)
            out.append(text)
    return out


MULTI = [
    ("interleaved_1f1b", 2),
    ("interleaved_1f1b", 3),
    ("looped_bfs", 2),
    ("looped_bfs", 3),
    ("interleaved_zero_bubble", 2),
    ("interleaved_zero_bubble", 3),
    ("zbv_zero_bubble", 2),
    ("dualpipev", 2),
]


@pytest.mark.parametrize("schedule,v", MULTI)
@pytest.mark.parametrize("p,m", GRID)
def test_multi_stage_programs_are_what_torchs_lowering_produces(
    schedule: str, v: int, p: int, m: int
) -> None:
    """Torch's visualiser builds the schedule and lowers it with its own runtime instance."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    name = TORCH_SCHEDULES[schedule].torch_name.removeprefix("Schedule")
    try:
        expected = get_schedule_ops(name, p, m, v, with_comms=True)
    except ValueError:
        with pytest.raises(ConfigError, match="cannot run"):
            torch_program(schedule, p, m, v)
        return
    program = torch_program(schedule, p, m, v)
    for rank in range(p):
        assert _torch_strings(program, rank) == [str(a) for a in expected[rank] if a is not None]


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble"])
@pytest.mark.parametrize("p,m", GRID)
def test_looped_programs_with_one_stage_per_rank_follow_torchs_pipeline_order(
    schedule: str, p: int, m: int
) -> None:
    """Torch's visualiser draws looped schedules with two stages per rank or more; with one,
    the program's computations are the class's own ``pipeline_order``."""
    from torch.distributed import pipelining

    from pipedialect.cost._schedules import _StandInStage

    cls = getattr(pipelining, TORCH_SCHEDULES[schedule].torch_name)
    try:
        built = cls([_StandInStage(0, p, p, 0)], n_microbatches=m)
    except ValueError:
        with pytest.raises(ConfigError, match="cannot run"):
            torch_program(schedule, p, m, 1)
        return
    program = torch_program(schedule, p, m, 1)
    for rank in range(p):
        assert _compute_strings(program, rank) == [
            str(a) for a in built.pipeline_order[rank] if a is not None
        ]


def _torch_ir(schedule: str, p: int, m: int) -> dict[int, list[str]]:
    from torch.distributed import pipelining

    from pipedialect.cost._schedules import _StandInStage

    cls = getattr(pipelining, TORCH_SCHEDULES[schedule].torch_name)
    built = cls(_StandInStage(0, p, p, 0), n_microbatches=m)
    return {
        r: [str(a) for a in actions if a is not None and "REDUCE_GRAD" not in str(a)]
        for r, actions in built.pipeline_order.items()
    }


@pytest.mark.parametrize("p,m", GRID)
def test_gpipe_program_is_torchs_pipeline_order(p: int, m: int) -> None:
    program = torch_program("gpipe", p, m)
    ir = _torch_ir("gpipe", p, m)
    for rank in range(p):
        assert _compute_strings(program, rank) == ir[rank]


@pytest.mark.parametrize("p,m", GRID)
def test_one_f_one_b_program_is_torchs_order_but_for_its_last_rank_drawing(p: int, m: int) -> None:
    """Torch 2.13's ``Schedule1F1B.pipeline_order`` numbers the last rank's micro-batches from
    1 (its ``_step_microbatches``, which runs, goes from 0): every other rank agrees exactly,
    and the last one agrees once torch's numbers are shifted down by one."""
    program = torch_program("1f1b", p, m)
    ir = _torch_ir("1f1b", p, m)
    for rank in range(p - 1):
        assert _compute_strings(program, rank) == ir[rank]
    last = p - 1
    shifted = []
    for action in ir[last]:
        stage, kind, mb = re.fullmatch(r"(\d+)([FB])(\d+)", action).groups()  # type: ignore[union-attr]
        shifted.append(f"{stage}{kind}{int(mb) - 1 if kind == 'F' else int(mb)}")
    assert _compute_strings(program, last) == shifted


def test_one_f_one_b_order_is_the_warmup_then_alternation_torchs_loop_runs() -> None:
    """Hand-written: stage 0 of 3 with 5 micro-batches runs 3 forwards (``min(m, p - k)``), then
    backward-forward pairs, then the remaining backwards."""
    program = torch_program("1f1b", 3, 5)
    assert _compute_strings(program, 0) == [
        "0F0", "0F1", "0F2", "0B0", "0F3", "0B1", "0F4", "0B2", "0B3", "0B4",
    ]  # fmt: skip
    assert _compute_strings(program, 2) == [
        "2F0", "2B0", "2F1", "2B1", "2F2", "2B2", "2F3", "2B3", "2F4", "2B4",
    ]  # fmt: skip


def test_torch_refuses_what_its_schedules_refuse() -> None:
    with pytest.raises(ConfigError, match="cannot run 2 micro-batches"):
        torch_program("1f1b", 4, 2)
    with pytest.raises(ConfigError, match="cannot run 3 micro-batches"):
        torch_program("dualpipev", 2, 3)
    with pytest.raises(ConfigError, match="does not run 3 stages per rank"):
        torch_program("zbv_zero_bubble", 2, 4, 3)


_DS = {
    "SendGrad": "SEND_B",
    "RecvActivation": "RECV_F",
    "ForwardPass": "F",
    "RecvGrad": "RECV_B",
    "SendActivation": "SEND_F",
    "BackwardPass": "B",
}


@pytest.mark.parametrize("p,m", [*GRID, (2, 1), (4, 1), (3, 7)])
def test_deepspeed_program_is_deepspeeds_train_schedule(p: int, m: int) -> None:
    schedule_module = pytest.importorskip("deepspeed.runtime.pipe.schedule")
    program = deepspeed_program(p, m)
    assert program.blocking_p2p
    for stage in range(p):
        sched = schedule_module.TrainSchedule(micro_batches=m, stages=p, stage_id=stage)
        buffers = sched.num_pipe_buffers()
        theirs = []
        for cmds in sched:
            for cmd in cmds:
                name = type(cmd).__name__
                if name in _DS:
                    theirs.append((_DS[name], cmd.buffer_id))
                elif name in ("ReduceTiedGrads", "ReduceGrads"):
                    if not theirs or theirs[-1] != ("ALL_REDUCE", None):
                        theirs.append(("ALL_REDUCE", None))
                elif name == "OptimizerStep":
                    theirs.append(("OPTIMIZER", None))
        ours = [
            (a.kind.value, None if a.micro_batch is None else a.micro_batch % buffers)
            for a in program.ranks[stage]
        ]
        assert ours == theirs


def test_torch_schedule_names_and_placements_are_the_torch_dialects() -> None:
    from pipedialect.dialects.torch import _schedules as dialect_schedules

    specs = {s.name: s for s in dialect_schedules._SPECS}
    assert set(specs) == set(TORCH_SCHEDULES)
    for name, spec in TORCH_SCHEDULES.items():
        theirs = specs[name]
        assert (spec.torch_name, spec.placement, spec.split_backward) == (
            theirs.torch_name,
            theirs.placement,
            theirs.split_backward,
        )
        for v in (1, 2, 3):
            if spec.stages_per_rank_allowed(v):
                program = torch_program(name, 2, 4, v)
                assert list(program.placement) == [
                    dialect_schedules.stage_to_rank(theirs, 2 * v, 2)[k] for k in range(2 * v)
                ]


def test_offer_reads_the_schedules_and_modes_the_dialect_declares() -> None:
    import pipedialect
    from pipedialect.dialects.torch import available_schedules

    torch_offer = offer_of(pipedialect.get_dialect("torch"))
    assert torch_offer.schedules == available_schedules()
    assert torch_offer.data_parallel and torch_offer.fsdp
    assert torch_offer.fsdp_schedules == ("gpipe", "1f1b")
    assert torch_offer.runs("fsdp", "1f1b") and not torch_offer.runs("fsdp", "interleaved_1f1b")
    assert torch_offer.tensor_parallel  # the capability and the tensor_parallel option
    assert not any("tensor parallelism: not offered" in n for n in torch_offer.not_offered)
    ds_offer = offer_of(pipedialect.get_dialect("deepspeed"))
    assert ds_offer.schedules == (DEEPSPEED_SCHEDULE,)
    with pytest.raises(ConfigError, match="one process"):
        offer_of(pipedialect.get_dialect("local"))
