"""Where programs come from: torch's schedule classes, DeepSpeed's 1F1B, and the papers.

[Note: schedule sources]
- The torch schedules with several stages per rank (interleaved 1F1B, looped BFS, interleaved
  zero bubble, ZBV, DualPipeV) are read from torch at run time: the schedule class is built for
  the requested ranks and micro-batches on stand-in stages (objects with the attributes the
  constructor reads; nothing runs), and its ``pipeline_order_with_comms`` is exactly what
  ``_PipelineScheduleRuntime`` executes: torch's own lowering has already put in the sends and
  receives, the FSDP unshard/reshard prefetch (``max_active_stages=3``) and the gradient
  reductions. Torch's own checks (micro-batch counts a schedule cannot run) raise here as they
  would in the engine.
- GPipe and 1F1B (one stage per rank) run torch's hand-written ``_step_microbatches`` loops,
  not an action list; their order is encoded here from those loops: GPipe runs every forward,
  then every backward; 1F1B runs ``min(m, p - k)`` forwards on stage ``k``, then alternates one
  backward and one forward, then the remaining backwards. Sends go out right after the
  computation, receives are waited for right before it. The constructor still runs, for its
  checks. (Torch 2.13's ``Schedule1F1B.pipeline_order``, used only for drawing, starts the last
  rank at micro-batch 1 and ends it at micro-batch ``m``; the loop that runs does 0 to ``m - 1``,
  and this encoding follows the loop. ``tests/cost/test_schedules.py`` compares both.)
- DeepSpeed's ``TrainSchedule`` (``deepspeed_1f1b``), encoded here because the core never
  imports deepspeed: ``2 (m + p - 1)`` lock-step steps; at step ``t`` stage ``s`` computes a
  forward when ``t`` and ``s`` have the same parity, of micro-batch ``t // 2 - s // 2``, otherwise
  a backward of micro-batch ``t // 2 - p + s // 2 + 1`` (out-of-range micro-batches idle). A
  forward step first sends the gradient the previous step computed, then receives its input; a
  backward step first receives its gradient, then sends the activation the previous step
  computed. Sends and receives block and meet. The test suite compares this with deepspeed's own
  class, instruction by instruction.
- ZB-H2 (Qi et al. 2024, section 2.2), which no runtime here offers, for the simulator's
  formula tests only: rank ``i`` runs ``min(m, 2 (p - 1 - i) + 1)`` forwards, then repeats an
  input-gradient pass, a weight-gradient pass once ``2i`` of them are waiting (rank ``i``
  defers its weight passes by ``2i`` micro-batches, which turns the trapezoid into the paper's
  parallelogram), and a forward; every rank holds ``2p - 1`` micro-batches at its peak.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ._program import Action, ActionKind, Program, check_complete, lower_single, place

__all__ = [
    "TORCH_SCHEDULES",
    "TorchSchedule",
    "deepspeed_program",
    "torch_program",
    "zb_h2_program",
]

F, B, IN, W = (
    ActionKind.FORWARD,
    ActionKind.BACKWARD,
    ActionKind.BACKWARD_INPUT,
    ActionKind.BACKWARD_WEIGHT,
)


@dataclass(frozen=True)
class TorchSchedule:
    """One schedule of ``torch.distributed.pipelining`` under the torch dialect's name."""

    name: str
    torch_name: str
    #: ``"single"``, ``"loop"`` or ``"v"`` (see ``place``).
    placement: str
    #: Whether its backward is split into input- and weight-gradient passes.
    split_backward: bool

    def stages_per_rank_allowed(self, v: int) -> bool:
        """Whether this schedule runs ``v`` stages on each rank."""
        if self.placement == "single":
            return v == 1
        if self.placement == "v":
            return v == 2
        return v >= 1


#: The torch dialect's schedule names (``pipedialect.dialects.torch.available_schedules``).
TORCH_SCHEDULES: Mapping[str, TorchSchedule] = {
    s.name: s
    for s in (
        TorchSchedule("gpipe", "ScheduleGPipe", "single", False),
        TorchSchedule("1f1b", "Schedule1F1B", "single", False),
        TorchSchedule("interleaved_1f1b", "ScheduleInterleaved1F1B", "loop", False),
        TorchSchedule("looped_bfs", "ScheduleLoopedBFS", "loop", False),
        TorchSchedule("interleaved_zero_bubble", "ScheduleInterleavedZeroBubble", "loop", True),
        TorchSchedule("zbv_zero_bubble", "ScheduleZBVZeroBubble", "v", True),
        TorchSchedule("dualpipev", "ScheduleDualPipeV", "v", True),
    )
}


class _StandInStage:
    """What a torch schedule's constructor reads from its stages, and nothing else."""

    def __init__(self, group_rank: int, group_size: int, num_stages: int, stage_index: int):
        self.group_rank = group_rank
        self.group_size = group_size
        self.num_stages = num_stages
        self.stage_index = stage_index
        self.submod = None
        self.stage_index_to_group_rank: dict[int, int] = {}


_TORCH_KINDS = {
    "F": ActionKind.FORWARD,
    "B": ActionKind.BACKWARD,
    "I": ActionKind.BACKWARD_INPUT,
    "W": ActionKind.BACKWARD_WEIGHT,
    "OVERLAP_F_B": ActionKind.OVERLAP,
    "SEND_F": ActionKind.SEND_F,
    "RECV_F": ActionKind.RECV_F,
    "SEND_B": ActionKind.SEND_B,
    "RECV_B": ActionKind.RECV_B,
    "UNSHARD": ActionKind.ALL_GATHER,
    "RESHARD": ActionKind.RESHARD,
    "REDUCE_GRAD": ActionKind.REDUCE_GRAD,
}


def _from_torch(action: Any) -> Action:
    kind = _TORCH_KINDS.get(str(action.computation_type.value))
    if kind is None:
        raise ConfigError(
            f"torch's schedule holds an action this simulator does not know: {action}"
        )
    if kind == ActionKind.OVERLAP:
        return Action(kind, -1, None, tuple(_from_torch(a) for a in action.sub_actions or ()))
    return Action(kind, int(action.stage_index), action.microbatch_index)


def _build_torch(spec: TorchSchedule, num_ranks: int, micro_batches: int, v: int) -> Any:
    from torch.distributed import pipelining

    cls = getattr(pipelining, spec.torch_name, None)
    if not isinstance(cls, type):
        import torch

        raise ConfigError(
            f"schedule {spec.name!r} needs torch.distributed.pipelining.{spec.torch_name}, which "
            f"torch {torch.__version__} does not have"
        )
    num_stages = num_ranks * v
    local = [k for k, r in enumerate(place(num_stages, num_ranks, spec.placement)) if r == 0]
    stages = [_StandInStage(0, num_ranks, num_stages, k) for k in local]
    target: Any = stages[0] if spec.placement == "single" else stages
    try:
        return cls(target, n_microbatches=micro_batches)
    except (ValueError, AssertionError) as exc:
        raise ConfigError(
            f"schedule {spec.name!r} cannot run {micro_batches} micro-batches over {num_stages} "
            f"stages on {num_ranks} ranks: {exc}"
        ) from exc


def _gpipe_orders(p: int, m: int) -> list[list[Action]]:
    return [
        [Action(F, r, i) for i in range(m)] + [Action(B, r, i) for i in range(m)] for r in range(p)
    ]


def _one_f_one_b_orders(p: int, m: int) -> list[list[Action]]:
    orders = []
    for r in range(p):
        warmup = min(m, p - r)
        order = [Action(F, r, i) for i in range(warmup)]
        forward, backward = warmup, 0
        while backward < m:
            order.append(Action(B, r, backward))
            backward += 1
            if forward < m:
                order.append(Action(F, r, forward))
                forward += 1
        orders.append(order)
    return orders


def torch_program(
    schedule: str, num_ranks: int, micro_batches: int, stages_per_rank: int | None = None
) -> Program:
    """The program torch runs for ``schedule`` ([Note: schedule sources]).

    Raises:
        ConfigError: an unknown schedule, a number of stages per rank it does not run, or a
            micro-batch count torch refuses.
    """
    spec = TORCH_SCHEDULES.get(schedule)
    if spec is None:
        raise ConfigError(
            f"unknown torch schedule {schedule!r}; known: {', '.join(TORCH_SCHEDULES)}"
        )
    if num_ranks < 1 or micro_batches < 1:
        raise ConfigError(
            f"a program needs at least one rank and one micro-batch, got {num_ranks} and "
            f"{micro_batches}"
        )
    v = stages_per_rank or (1 if spec.placement == "single" else 2)
    if not spec.stages_per_rank_allowed(v):
        raise ConfigError(f"schedule {schedule!r} does not run {v} stages per rank")
    built = _build_torch(spec, num_ranks, micro_batches, v)
    num_stages = num_ranks * v
    if spec.placement == "single":
        orders = (_gpipe_orders if schedule == "gpipe" else _one_f_one_b_orders)(
            num_ranks, micro_batches
        )
        return lower_single(schedule, orders, place(num_stages, num_ranks, "single"), micro_batches)
    mapping = dict(built.stage_index_to_group_rank)
    placement = tuple(int(mapping[k]) for k in range(num_stages))
    ranks = []
    for r in range(num_ranks):
        actions = [_from_torch(a) for a in built.pipeline_order_with_comms[r] if a is not None]
        actions += [Action(ActionKind.ALL_REDUCE, -1), Action(ActionKind.OPTIMIZER, -1)]
        ranks.append(tuple(actions))
    program = Program(schedule, num_stages, micro_batches, placement, tuple(ranks))
    check_complete(program)
    return program


def deepspeed_program(num_stages: int, micro_batches: int) -> Program:
    """DeepSpeed's ``TrainSchedule`` as a program ([Note: schedule sources])."""
    p, m = num_stages, micro_batches
    if p < 1 or m < 1:
        raise ConfigError(f"DeepSpeed's 1F1B needs stages and micro-batches, got {p} and {m}")
    ranks = []
    for s in range(p):
        actions: list[Action] = []
        previous = -1
        for t in range(2 * (m + p - 1)):
            forward = t % 2 == s % 2
            mb = t // 2 - s // 2 if forward else t // 2 - p + s // 2 + 1
            valid, had = 0 <= mb < m, 0 <= previous < m
            if forward:
                if had and s > 0:
                    actions.append(Action(ActionKind.SEND_B, s, previous))
                if valid and s > 0:
                    actions.append(Action(ActionKind.RECV_F, s, mb))
                if valid:
                    actions.append(Action(F, s, mb))
            else:
                if valid and s < p - 1:
                    actions.append(Action(ActionKind.RECV_B, s, mb))
                if had and s < p - 1:
                    actions.append(Action(ActionKind.SEND_F, s, previous))
                if valid:
                    actions.append(Action(B, s, mb))
            previous = mb
        actions += [Action(ActionKind.ALL_REDUCE, -1), Action(ActionKind.OPTIMIZER, -1)]
        ranks.append(tuple(actions))
    program = Program(
        "deepspeed_1f1b",
        p,
        m,
        tuple(range(p)),
        tuple(ranks),
        blocking_p2p=True,
        receive_buffer_per_micro_batch=False,
        packs_gradients_alone=True,
    )
    check_complete(program)
    return program


def zb_h2_program(num_ranks: int, micro_batches: int) -> Program:
    """ZB-H2 of Qi et al. 2024, section 2.2 ([Note: schedule sources])."""
    p, m = num_ranks, micro_batches
    orders = []
    for i in range(p):
        warmup = min(m, 2 * (p - 1 - i) + 1)
        order = [Action(F, i, k) for k in range(warmup)]
        forward, backward, weight = warmup, 0, 0
        while weight < m:
            if backward < m:
                order.append(Action(IN, i, backward))
                backward += 1
            if backward - weight > 2 * i or backward == m:
                order.append(Action(W, i, weight))
                weight += 1
            if forward < m:
                order.append(Action(F, i, forward))
                forward += 1
        orders.append(order)
    return lower_single("zb_h2", orders, place(p, p, "single"), m)
