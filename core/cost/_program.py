"""What a schedule asks each rank to do: actions, in the order the runtime runs them.

[Note: programs]
A :class:`Program` holds, for each pipeline rank, the list of actions the runtime executes on
that rank in one training step: computation (forward ``F``, full backward ``B``, the input-gradient
pass ``I`` and the weight-gradient pass ``W`` of a split backward, and ``OVERLAP`` for the fused
forward + backward pairs DualPipeV runs one after the other), point-to-point communication
(``SEND_F``/``RECV_F`` for activations, ``SEND_B``/``RECV_B`` for gradients; a send is labelled with
the sending stage, a receive with the receiving one, as torch labels them), the collectives of
sharded data parallelism (``ALL_GATHER`` before a stage computes, ``RESHARD`` to free the gathered
parameters, ``REDUCE_GRAD`` after a stage's last backward) and the end of the step
(``ALL_REDUCE`` of the data-parallel gradients, ``OPTIMIZER``). One program describes one
pipeline replica; data-parallel replicas run the same program.

``placement[k]`` is the pipeline rank of stage ``k``; ``blocking_p2p`` says whether a send and its
receive meet (DeepSpeed's blocking ``send``/``recv``) or the send is fire-and-forget and only the
consumer waits (torch's ``isend``/``irecv``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from ..errors import ConfigError

__all__ = ["Action", "ActionKind", "Program"]


class ActionKind(enum.StrEnum):
    """The kinds of action a program holds ([Note: programs])."""

    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    OVERLAP = "OVERLAP"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    ALL_GATHER = "ALL_GATHER"
    RESHARD = "RESHARD"
    REDUCE_GRAD = "REDUCE_GRAD"
    ALL_REDUCE = "ALL_REDUCE"
    OPTIMIZER = "OPTIMIZER"


COMPUTE = frozenset(
    {
        ActionKind.FORWARD,
        ActionKind.BACKWARD,
        ActionKind.BACKWARD_INPUT,
        ActionKind.BACKWARD_WEIGHT,
    }
)
P2P = frozenset({ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B})


@dataclass(frozen=True)
class Action:
    """One step of a rank's program: ``Action(FORWARD, 2, 0)`` is ``2F0``."""

    kind: ActionKind
    #: The stage (-1 for a rank-wide action: ``OVERLAP``, ``ALL_REDUCE``, ``OPTIMIZER``).
    stage: int
    #: The micro-batch, for computation and point-to-point communication.
    micro_batch: int | None = None
    #: The actions an ``OVERLAP`` runs, in order.
    parts: tuple[Action, ...] = field(default=(), compare=True)

    def __str__(self) -> str:
        if self.parts:
            return f"({';'.join(str(p) for p in self.parts)}){self.kind.value}"
        if self.stage < 0:
            return self.kind.value
        mb = "" if self.micro_batch is None else str(self.micro_batch)
        return f"{self.stage}{self.kind.value}{mb}"

    def leaves(self) -> tuple[Action, ...]:
        """The action itself, or the parts of an ``OVERLAP``."""
        return self.parts if self.parts else (self,)


@dataclass(frozen=True)
class Program:
    """Every pipeline rank's actions for one training step ([Note: programs])."""

    #: The schedule's name (``"1f1b"``, ``"zbv_zero_bubble"``, ``"deepspeed_1f1b"``, ...).
    schedule: str
    num_stages: int
    micro_batches: int
    #: ``placement[k]``: the pipeline rank that runs stage ``k``.
    placement: tuple[int, ...]
    #: ``ranks[r]``: the actions of pipeline rank ``r``, in order.
    ranks: tuple[tuple[Action, ...], ...]
    #: Whether a send waits for its receive (True) or only the receiver waits (False).
    blocking_p2p: bool = False
    #: Whether a stage keeps a receive buffer for every micro-batch of the step (torch's
    #: ``PipelineStage``) or one it reuses, copying each received activation out of it
    #: (DeepSpeed's engine): [Note: boundary buffers] in ``cost._predict``.
    receive_buffer_per_micro_batch: bool = True
    #: Whether the runtime packs the rank's gradients into one flat tensor at the end of every
    #: step even without data-parallel replicas (DeepSpeed's engine all-reduces over its data
    #: group of one): [Note: packing the gradients] in ``cost._predict``.
    packs_gradients_alone: bool = False

    def __post_init__(self) -> None:
        if len(self.placement) != self.num_stages:
            raise ConfigError(
                f"a program of {self.num_stages} stages needs a placement for each, got "
                f"{len(self.placement)}"
            )
        if sorted(set(self.placement)) != list(range(len(self.ranks))):
            raise ConfigError(
                f"the placement {self.placement} does not use exactly the {len(self.ranks)} "
                "ranks of the program"
            )

    @property
    def num_ranks(self) -> int:
        """Pipeline ranks."""
        return len(self.ranks)

    @property
    def stages_per_rank(self) -> int:
        """Stages on each rank."""
        return self.num_stages // self.num_ranks

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages rank ``rank`` runs, in stage order."""
        return tuple(k for k, r in enumerate(self.placement) if r == rank)

    def compute(self, rank: int) -> Iterator[Action]:
        """Rank ``rank``'s computations in order (the parts of an ``OVERLAP`` one by one)."""
        for action in self.ranks[rank]:
            for leaf in action.leaves():
                if leaf.kind in COMPUTE:
                    yield leaf

    def splits_backward(self) -> bool:
        """Whether some rank runs a separate weight-gradient pass (``W``)."""
        return any(
            a.kind == ActionKind.BACKWARD_WEIGHT
            for r in range(self.num_ranks)
            for a in self.compute(r)
        )

    def table(self) -> str:
        """The program as text: one line per rank, actions separated by spaces."""
        return "\n".join(
            f"rank {r}: " + " ".join(str(a) for a in actions)
            for r, actions in enumerate(self.ranks)
        )


def check_complete(program: Program) -> None:
    """Check that every stage runs every micro-batch's forward and backward exactly once, on its
    own rank; a program built wrongly is refused here rather than simulated into nonsense."""
    seen: dict[tuple[int, str, int], int] = {}
    for rank in range(program.num_ranks):
        for a in program.compute(rank):
            if a.micro_batch is None or not 0 <= a.stage < program.num_stages:
                raise ConfigError(f"rank {rank} of {program.schedule!r} holds a malformed {a}")
            if program.placement[a.stage] != rank:
                raise ConfigError(
                    f"[Stage {a.stage}] {program.schedule!r} runs {a} on rank {rank}, but the "
                    f"stage is placed on rank {program.placement[a.stage]}"
                )
            kinds = ("I", "W") if a.kind == ActionKind.BACKWARD else (a.kind.value,)
            for kind in kinds:
                key = (a.stage, kind, a.micro_batch)
                seen[key] = seen.get(key, 0) + 1
    for stage in range(program.num_stages):
        for mb in range(program.micro_batches):
            for kind in ("F", "I", "W"):
                count = seen.get((stage, kind, mb), 0)
                if count != 1:
                    name = {"F": "forward", "I": "backward", "W": "weight pass"}[kind]
                    raise ConfigError(
                        f"[Stage {stage}] {program.schedule!r} runs the {name} of micro-batch "
                        f"{mb} {count} times, not once"
                    )


def place(num_stages: int, num_ranks: int, style: str) -> tuple[int, ...]:
    """Stage-to-rank placement: ``"single"`` (one stage each), ``"loop"`` (stage ``k`` on rank
    ``k % W``) or ``"v"`` (rank ``r`` holds stages ``r`` and ``2W - 1 - r``)."""
    if style == "single":
        return tuple(range(num_stages))
    if style == "loop":
        return tuple(k % num_ranks for k in range(num_stages))
    return tuple(k if k < num_ranks else 2 * num_ranks - 1 - k for k in range(num_stages))


def lower_single(
    schedule: str,
    orders: Sequence[Sequence[Action]],
    placement: Sequence[int],
    micro_batches: int,
    *,
    blocking_p2p: bool = False,
) -> Program:
    """A :class:`Program` from compute-only orders, each send right after the computation that
    produces it and each receive right before the one that consumes it, plus the collectives
    torch's lowering adds (a gather before the first computation, a gradient reduction after each
    stage's last backward) and the end of the step."""
    num_stages = len(placement)
    ranks = []
    for rank, order in enumerate(orders):
        actions: list[Action] = []
        local = [k for k, r in enumerate(placement) if r == rank]
        actions += [Action(ActionKind.ALL_GATHER, k) for k in local]
        backwards: dict[int, int] = {}
        for a in order:
            for leaf in a.leaves():
                s = leaf.stage
                if leaf.kind == ActionKind.FORWARD and s > 0 and placement[s - 1] != rank:
                    actions.append(Action(ActionKind.RECV_F, s, leaf.micro_batch))
                elif (
                    leaf.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT)
                    and s < num_stages - 1
                    and placement[s + 1] != rank
                ):
                    actions.append(Action(ActionKind.RECV_B, s, leaf.micro_batch))
            actions.append(a)
            for leaf in a.leaves():
                s = leaf.stage
                if (
                    leaf.kind == ActionKind.FORWARD
                    and s < num_stages - 1
                    and placement[s + 1] != rank
                ):
                    actions.append(Action(ActionKind.SEND_F, s, leaf.micro_batch))
                elif (
                    leaf.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT)
                    and s > 0
                    and placement[s - 1] != rank
                ):
                    actions.append(Action(ActionKind.SEND_B, s, leaf.micro_batch))
                if leaf.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
                    backwards[leaf.stage] = backwards.get(leaf.stage, 0) + 1
                    if backwards[leaf.stage] == micro_batches:
                        actions.append(Action(ActionKind.REDUCE_GRAD, leaf.stage))
        actions += [Action(ActionKind.RESHARD, k) for k in local]
        actions += [Action(ActionKind.ALL_REDUCE, -1), Action(ActionKind.OPTIMIZER, -1)]
        ranks.append(tuple(actions))
    program = Program(
        schedule=schedule,
        num_stages=num_stages,
        micro_batches=micro_batches,
        placement=tuple(placement),
        ranks=tuple(ranks),
        blocking_p2p=blocking_p2p,
    )
    check_complete(program)
    return program
