"""Replaying a program with costs: step time, bubble, micro-batches in flight, memory.

[Note: simulation]
Every rank runs its actions in program order, one computation at a time. An action starts when
the rank has finished the one before and its inputs are there:

- a forward needs the previous stage's output: at once if that stage is on the same rank, else
  when its message arrives; a backward (``B``, or the input pass ``I``) needs its own forward
  and the next stage's input gradient, alike; a weight pass ``W`` needs its ``I``;
- a send without ``blocking_p2p`` costs the sender's computation nothing, but a rank's messages
  share its link and the cores that move them: they leave one after another, each taking
  ``boundary`` seconds (latency plus bytes over the link) from when the previous one has gone,
  so transfers that would overlap queue instead of all arriving ``boundary`` after their send
  (what the calibration's bandwidth, measured with every link busy at once, holds for: one
  message per link at a time); with ``blocking_p2p`` a send and its receive wait for each other
  and both ranks are busy for the transfer;
- ``ALL_GATHER`` and ``REDUCE_GRAD`` run on the rank's communication channel, one after another
  and beside its computation; a stage computes only once its gather is done, and the step ends
  only once its reductions are; ``ALL_REDUCE`` blocks the rank; ``OPTIMIZER`` takes its time;
- data-parallel replicas run the same program in step, so a collective among them has no one
  to wait for: it costs its own time;
- with ``barrier`` (what both dialects do: the loss is broadcast at the end of every step), no
  rank starts step ``k + 1`` before every rank has ended step ``k``; without it, steps follow
  each other on each rank as the dependencies allow.

The step time is the makespan of one step (from the first action to the last, every rank
starting at 0), or, over several steps, the steady period: the time between the ends of the last
two steps. A rank's bubble is the one the trace measures ([Note: the bubble] in ``_bubble``):
``1 - busy / window``, ``busy`` being its computation and ``window`` the step's from its first
computation to its last (over several steps, the steady period).

A micro-batch is *in flight* on a stage from the start of its forward until its last backward
piece ends (``B``; ``W`` when the backward is split; ``I`` on a stage whose backward the dialect
runs in one piece, ``split=False``). Those counts follow from each rank's order alone, so they
are exact whatever the costs; memory is the rank's base bytes plus, during every action of its
order, each stage's in-flight count times its activation bytes, the gathered parameters between
``ALL_GATHER`` and ``RESHARD``, and unsharded gradients from a stage's first backward to its
``REDUCE_GRAD`` (a backward holds its micro-batch's activations and the gradients it makes at
once), plus what one action holds only while it runs: a forward's ``forward_copy`` bytes, a
backward's ``transient`` bytes, the
``weight_gradient`` bytes of the action that makes a stage's weight gradients (``B``, or ``W``
of a split backward; ``I`` where the dialect runs the backward in one piece), an
``ALL_REDUCE``'s packed gradients.

[Note: gradient accumulation]
The model's backward is timed with ``torch.autograd.grad``, which returns the weight gradients
without adding them anywhere ([Note: timing a model] in ``cost._profile``). A runtime's
backward of every micro-batch but a stage's first in the step adds its weight gradient into
the one the step accumulates (both dialects set the gradients to None after the optimizer step,
so the first micro-batch's gradient becomes the accumulated one without a copy): a
read-modify-write of the stage's trainable bytes that the timing never saw. On the planner
benchmark's ``dp`` workload (64 MiB of weights per rank, 8 micro-batches) that is 28 additions
of 16 MiB per step, each about 1 ms on a 2-core machine. So the pass that writes a stage's
weight gradient (``W``, or the whole backward where it is not split) costs ``accumulate``
seconds more, except the stage's first in each step; :func:`~pipedialect.planner.calibrate`
measures the seconds per byte of such an addition on the machine, every rank adding at once.

[Note: ranks sharing cores]
A measured forward or backward is the time it took with the measuring process's threads to
itself; ranks on one host that compute at once share its ``cores``, and more computing threads
than cores slow every one of them down. Only CPU work competes: a computation that waits (sleeps,
I/O) leaves the cores to others. So each stage has a ``cpu_share`` (what ``measure_time``
measures: the process's CPU seconds over its wall seconds times its threads; the measured
seconds themselves leave out those its thread waited for a core another process held, so they
are the computation's with the cores to itself), and a computation
demands ``cpu_share * threads * processes_per_rank`` cores while it runs (its data- and
tensor-parallel peers compute in step with it). The cores are shared as processor sharing: while
the computations running at an instant demand ``L`` cores, their CPU part advances at
``min(1, cores / L)`` and the rest at full speed, so a computation of ``c`` seconds alone moves
at ``1 / (cpu_share / rate + 1 - cpu_share)`` of its pace, and the rate changes whenever any
computation starts or ends. Two ranks each computing 10 ms of CPU on one core from the same
instant both end at 20 ms; a computation that sleeps is not stretched; one rank alone, or
ranks demanding no more than the cores, are unchanged.

The replay runs each rank as far as it can go before the next, so when a computation starts
the others' are not all placed yet; the simulation replays the program again, each computation
paced against the other ranks' computations as the previous replay placed them, until no
computation moves (at most :data:`SHARING_PASSES` replays; the first replay has no sharing).
That fixed point is the processor-sharing schedule. What it leaves out: the runtime's own cost
per computation (``action_overhead``, calibrated under the runtime's own load) and communication
are not stretched, though moving bytes and the runtime's bookkeeping use the cores too; the
CPU share is one number for the whole model (a model whose blocks differ, some waiting and some
computing, gets their average); and the data-parallel peers are taken to compute exactly in
step with their rank. All the ranks are taken to be on one host (``plan_layout`` gives the
planning process's cores): ranks spread over several hosts are predicted too slow.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ._bubble import idle_fractions, step_window
from ._program import COMPUTE, Action, ActionKind, Program

__all__ = ["SimulatedSpan", "Simulation", "StageMemory", "StageTimes", "simulate"]

_K = ActionKind


@dataclass(frozen=True)
class StageTimes:
    """Seconds one stage takes for one micro-batch, and for its collectives."""

    forward: float
    #: The input-gradient pass (with any recomputation: it runs first in the backward).
    backward_input: float
    #: The weight-gradient pass; a full backward costs ``backward_input + backward_weight``.
    backward_weight: float
    #: False: the dialect runs this stage's backward whole in ``I`` and ``W`` does nothing.
    split: bool = True
    #: Seconds of the stage's ``ALL_GATHER`` (sharded data parallelism), on the comm channel.
    all_gather: float = 0.0
    #: Seconds of the stage's ``REDUCE_GRAD``, on the comm channel.
    reduce_grad: float = 0.0
    #: Seconds every computation of the stage costs on top of its work (launch, bookkeeping).
    action_overhead: float = 0.0
    #: Seconds each backward of the stage but its first in the step adds: its weight gradient
    #: added into the gradient the step accumulates ([Note: gradient accumulation]).
    accumulate: float = 0.0
    #: The share of the stage's computation seconds that keeps its threads busy on the CPU
    #: (the rest waits or sleeps): what slows down when ranks share cores ([Note: ranks
    #: sharing cores]); 0 (the default): nothing does.
    cpu_share: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.cpu_share <= 1.0:
            raise ConfigError(f"cpu_share must be between 0 and 1, got {self.cpu_share}")

    @property
    def backward(self) -> float:
        """A full backward."""
        return self.backward_input + self.backward_weight


@dataclass(frozen=True)
class StageMemory:
    """Bytes one stage holds ([Note: simulation])."""

    #: Per micro-batch in flight (what its forward keeps for the backward).
    activation: float = 0.0
    #: From its ``ALL_GATHER`` to its ``RESHARD``: the gathered parameters.
    gathered: float = 0.0
    #: From its first backward to its ``REDUCE_GRAD``: gradients before they are sharded.
    gradient: float = 0.0
    #: While one of its backward passes runs (``B``, or the input pass ``I``): what a
    #: recomputation re-materialises and the input gradient it makes.
    transient: float = 0.0
    #: While one of its forwards runs: what the runtime copies for it (DeepSpeed's engine
    #: computes on a copy of the input buffer).
    forward_copy: float = 0.0
    #: While it makes its weight gradients (``B``, or the weight pass ``W`` of a split
    #: backward): a parameter's gradient before it is added into the accumulated one.
    weight_gradient: float = 0.0


@dataclass(frozen=True)
class SimulatedSpan:
    """One predicted interval of one pipeline rank's time."""

    #: ``forward``, ``backward``, ``backward_input``, ``backward_weight``, ``send``, ``recv``,
    #: ``all_gather``, ``reduce_grad``, ``all_reduce`` or ``optimizer``.
    kind: str
    #: ``F3``, ``B3``, ``I3``, ``W3``, ``send F3``, ...
    name: str
    rank: int
    stage: int
    step: int
    micro_batch: int | None
    start: float
    end: float


@dataclass(frozen=True)
class Simulation:
    """What :func:`simulate` predicts ([Note: simulation])."""

    program: Program
    #: Seconds per step (makespan of one step, or the steady period over several).
    step_time: float
    #: Computation seconds of each rank per step.
    busy: tuple[float, ...]
    #: Seconds each rank spends per step blocked in communication (blocking sends, receives and
    #: all-reduces, and waiting for its collectives at the end of the step).
    communication: tuple[float, ...]
    #: Peak micro-batches in flight on each stage.
    in_flight: tuple[int, ...]
    #: Peak stage-micro-batches in flight on each rank at once (chunks, for several stages).
    rank_in_flight: tuple[int, ...]
    #: Peak bytes of each rank (None without memory inputs).
    peak_memory: tuple[float, ...] | None
    spans: tuple[SimulatedSpan, ...] = field(repr=False)

    @property
    def bubble(self) -> tuple[float, ...]:
        """Each rank's idle fraction, ``1 - busy / window`` ([Note: simulation])."""
        window = self.step_time
        if not any(s.step for s in self.spans):
            computations = (
                (s.rank, s.start, s.end) for s in self.spans if s.kind in _COMPUTE_SPANS
            )
            window, _ = step_window(computations)
        return tuple(idle_fractions(dict(enumerate(self.busy)), window).values())

    @property
    def bubble_fraction(self) -> float:
        """The mean bubble over ranks."""
        return sum(self.bubble) / len(self.bubble)


class _Barrier:
    """The end-of-step barrier, as a stream item."""

    def __init__(self, step: int) -> None:
        self.step = step


def _deadlock(program: Program, heads: Sequence[Any], indices: Sequence[int]) -> ConfigError:
    waiting = ", ".join(
        f"rank {r} at {item if not isinstance(item, _Barrier) else 'the end of the step'}"
        for r, item in enumerate(heads)
        if item is not None
    )
    return ConfigError(
        f"program {program.schedule!r} deadlocks: no rank can go on ({waiting}); every rank "
        "waits for something no other rank will produce"
    )


def simulate(
    program: Program,
    stages: Sequence[StageTimes],
    *,
    boundaries: Sequence[float] | float = 0.0,
    all_reduce: Sequence[float] | float = 0.0,
    optimizer: Sequence[float] | float = 0.0,
    memory: Sequence[StageMemory] | None = None,
    base_memory: Sequence[float] | float = 0.0,
    all_reduce_memory: Sequence[float] | float = 0.0,
    steps: int = 1,
    barrier: bool = True,
    queue_messages: bool = True,
    cores: float | None = None,
    threads: int = 1,
    processes_per_rank: int = 1,
) -> Simulation:
    """Replay ``program`` with the given costs ([Note: simulation]).

    Args:
        program: what every rank runs (see :mod:`pipedialect.cost`'s program builders).
        stages: one :class:`StageTimes` per stage.
        boundaries: seconds of one message across each boundary (``num_stages - 1`` values;
            the activation and its gradient alike), or one value for all.
        all_reduce: seconds of each rank's ``ALL_REDUCE``, or one value for all.
        optimizer: seconds of each rank's ``OPTIMIZER``, or one value for all.
        memory: one :class:`StageMemory` per stage, for :attr:`Simulation.peak_memory`.
        base_memory: bytes each rank always holds (its parameters and optimizer state), or one
            value for all.
        all_reduce_memory: bytes each rank holds beyond its base while its ``ALL_REDUCE``
            runs (the packed gradients, [Note: packing the gradients] in ``cost._predict``), or
            one value for all.
        steps: consecutive steps to run; above 1 the step time is the steady period.
        barrier: whether every step ends with a barrier over all ranks.
        queue_messages: whether a rank's asynchronous messages leave one after another on its
            link (False: each arrives ``boundary`` after its send, however many overlap).
        cores: the cores every rank of the program shares (one host); None: each rank has
            cores of its own ([Note: ranks sharing cores]).
        threads: the intra-op threads each process computes with.
        processes_per_rank: processes that compute in step with each pipeline rank on those
            cores (its data- and tensor-parallel peers: ``d * t``).

    Raises:
        ConfigError: costs that do not fit the program, or a program that deadlocks.
    """
    n, p = program.num_stages, program.num_ranks
    if len(stages) != n:
        raise ConfigError(f"the program has {n} stages but {len(stages)} stage costs were given")
    if steps < 1:
        raise ConfigError(f"steps must be at least 1, got {steps}")
    bounds = _per(boundaries, n - 1, "boundaries")
    reduce_time = _per(all_reduce, p, "all_reduce")
    optimizer_time = _per(optimizer, p, "optimizer")
    sharing = cores is not None and any(t.cpu_share > 0 for t in stages)
    if cores is not None and cores <= 0:
        raise ConfigError(f"cores must be positive, got {cores}")
    if threads < 1 or processes_per_rank < 1:
        raise ConfigError(
            f"threads and processes_per_rank must be at least 1, got {threads} and "
            f"{processes_per_rank}"
        )

    def replay(
        others: Sequence[_Others] | None,
    ) -> tuple[list[SimulatedSpan], list[float], dict[int, float], list[float]]:
        streams: list[list[tuple[int, Any]]] = []
        for r in range(p):
            stream: list[tuple[int, Any]] = []
            for k in range(steps):
                stream += [(k, a) for a in program.ranks[r]]
                if barrier:
                    stream.append((k, _Barrier(k)))
            streams.append(stream)
        gathers = [{a.stage for a in program.ranks[r] if a.kind == _K.ALL_GATHER} for r in range(p)]
        pc = [0] * p
        clock = [0.0] * p
        channel = [0.0] * p
        pending = [0.0] * p
        # When each rank's link is free again for its next outgoing message.
        outgoing = [0.0] * p
        waited = [0.0] * p
        done: dict[tuple[int, int, str, int], float] = {}
        arrived: dict[tuple[int, str, int, int], float] = {}
        gathered: dict[tuple[int, int], float] = {}
        step_end: dict[int, float] = {}
        spans: list[SimulatedSpan] = []
        place = program.placement
        # The (step, stage) pairs whose first weight gradient is written: later ones accumulate.
        accumulating: set[tuple[int, int]] = set()

        def head(r: int) -> tuple[int, Any] | None:
            return streams[r][pc[r]] if pc[r] < len(streams[r]) else None

        def compute_ready(r: int, k: int, a: Action) -> float | None:
            need: list[float | None] = []
            s, mb = a.stage, a.micro_batch
            assert mb is not None
            if s in gathers[r]:
                need.append(gathered.get((k, s)))
            if a.kind == _K.FORWARD and s > 0:
                if place[s - 1] == r:
                    need.append(done.get((k, s - 1, "F", mb)))
                else:
                    need.append(arrived.get((k, "F", s - 1, mb)))
            elif a.kind in (_K.BACKWARD, _K.BACKWARD_INPUT):
                need.append(done.get((k, s, "F", mb)))
                if s < n - 1:
                    if place[s + 1] == r:
                        need.append(done.get((k, s + 1, "I", mb)))
                    else:
                        need.append(arrived.get((k, "B", s + 1, mb)))
            elif a.kind == _K.BACKWARD_WEIGHT:
                need.append(done.get((k, s, "I", mb)))
            if any(t is None for t in need):
                return None
            return max([clock[r], *(t for t in need if t is not None)])

        def run_compute(r: int, k: int, a: Action, start: float) -> None:
            t = stages[a.stage]
            s, mb = a.stage, a.micro_batch
            assert mb is not None
            if a.kind == _K.FORWARD:
                dur, kind = t.forward, "forward"
            elif a.kind == _K.BACKWARD:
                dur, kind = t.backward, "backward"
            elif a.kind == _K.BACKWARD_INPUT:
                dur, kind = (t.backward_input if t.split else t.backward), "backward_input"
            else:
                dur, kind = (t.backward_weight if t.split else 0.0), "backward_weight"
            end = start + dur
            if others is not None and dur:
                end = others[r].finish(start, dur, t.cpu_share)
            if dur or a.kind != _K.BACKWARD_WEIGHT:
                end += t.action_overhead
            # The pass that writes the weight gradient: W, or the whole backward (B, or I on a
            # stage whose backward runs in one piece). [Note: gradient accumulation]
            writes = a.kind == _K.BACKWARD or (
                a.kind == (_K.BACKWARD_WEIGHT if t.split else _K.BACKWARD_INPUT)
            )
            if writes:
                if (k, s) in accumulating:
                    end += t.accumulate
                accumulating.add((k, s))
            clock[r] = end
            if a.kind == _K.FORWARD:
                done[(k, s, "F", mb)] = end
            if a.kind in (_K.BACKWARD, _K.BACKWARD_INPUT):
                done[(k, s, "I", mb)] = end
            if a.kind in (_K.BACKWARD, _K.BACKWARD_WEIGHT):
                done[(k, s, "W", mb)] = end
            spans.append(SimulatedSpan(kind, f"{a.kind.value}{mb}", r, s, k, mb, start, end))

        def partner(a: Action) -> tuple[int, Action]:
            if a.kind == _K.SEND_F:
                return place[a.stage + 1], Action(_K.RECV_F, a.stage + 1, a.micro_batch)
            if a.kind == _K.SEND_B:
                return place[a.stage - 1], Action(_K.RECV_B, a.stage - 1, a.micro_batch)
            if a.kind == _K.RECV_F:
                return place[a.stage - 1], Action(_K.SEND_F, a.stage - 1, a.micro_batch)
            return place[a.stage + 1], Action(_K.SEND_B, a.stage + 1, a.micro_batch)

        def message_key(k: int, a: Action) -> tuple[int, str, int, int]:
            assert a.micro_batch is not None
            return (k, "F" if a.kind == _K.SEND_F else "B", a.stage, a.micro_batch)

        def boundary_of(a: Action) -> float:
            return bounds[a.stage if a.kind == _K.SEND_F else a.stage - 1]

        def step(r: int) -> bool:
            item = head(r)
            if item is None:
                return False
            k, a = item
            if isinstance(a, _Barrier):
                heads = [head(q) for q in range(p)]
                if not all(
                    h is not None and isinstance(h[1], _Barrier) and h[0] == k for h in heads
                ):
                    return False
                end = max(clock)
                for q in range(p):
                    clock[q] = end
                    pc[q] += 1
                return True
            if a.kind == _K.OVERLAP:
                # An OVERLAP runs its parts in turn: split it into its leaves in place.
                streams[r][pc[r] : pc[r] + 1] = [(k, leaf) for leaf in a.parts]
                return True
            if a.kind in COMPUTE:
                start = compute_ready(r, k, a)
                if start is None:
                    return False
                run_compute(r, k, a, start)
            elif a.kind in (_K.SEND_F, _K.SEND_B) and not program.blocking_p2p:
                s_key = (k, a.stage, "F" if a.kind == _K.SEND_F else "I", a.micro_batch or 0)
                if s_key not in done:
                    return False
                start = max(clock[r], outgoing[r]) if queue_messages else clock[r]
                outgoing[r] = start + boundary_of(a)
                arrived[message_key(k, a)] = outgoing[r]
            elif a.kind in (_K.RECV_F, _K.RECV_B) and not program.blocking_p2p:
                pass
            elif a.kind in (_K.SEND_F, _K.SEND_B, _K.RECV_F, _K.RECV_B):
                other, match = partner(a)
                theirs = head(other)
                if theirs is None or theirs[0] != k or theirs[1] != match:
                    return False
                send = a if a.kind in (_K.SEND_F, _K.SEND_B) else match
                start = max(clock[r], clock[other])
                end = start + boundary_of(send)
                for q in (r, other):
                    waited[q] += end - clock[q] if k == 0 else 0.0
                    clock[q] = end
                arrived[message_key(k, send)] = end
                sender = r if send is a else other
                spans.append(
                    SimulatedSpan(
                        "send",
                        f"send {'F' if send.kind == _K.SEND_F else 'B'}{send.micro_batch}",
                        sender,
                        send.stage,
                        k,
                        send.micro_batch,
                        start,
                        end,
                    )
                )
                pc[other] += 1
            elif a.kind in (_K.ALL_GATHER, _K.REDUCE_GRAD):
                t = stages[a.stage]
                dur = t.all_gather if a.kind == _K.ALL_GATHER else t.reduce_grad
                start = max(clock[r], channel[r])
                channel[r] = start + dur
                if a.kind == _K.ALL_GATHER:
                    gathered[(k, a.stage)] = channel[r]
                else:
                    pending[r] = max(pending[r], channel[r])
                if dur:
                    name = "all-gather" if a.kind == _K.ALL_GATHER else "reduce-grad"
                    kind = "all_gather" if a.kind == _K.ALL_GATHER else "reduce_grad"
                    spans.append(SimulatedSpan(kind, name, r, a.stage, k, None, start, channel[r]))
            elif a.kind == _K.RESHARD:
                pass
            elif a.kind == _K.ALL_REDUCE:
                ready = max(clock[r], channel[r], pending[r])
                if k == 0:
                    waited[r] += ready - clock[r] + reduce_time[r]
                end = ready + reduce_time[r]
                if reduce_time[r]:
                    stage0 = program.stages_of(r)[0]
                    spans.append(
                        SimulatedSpan("all_reduce", "all-reduce", r, stage0, k, None, ready, end)
                    )
                clock[r] = end
            elif a.kind == _K.OPTIMIZER:
                end = clock[r] + optimizer_time[r]
                if optimizer_time[r]:
                    stage0 = program.stages_of(r)[0]
                    spans.append(
                        SimulatedSpan("optimizer", "opt", r, stage0, k, None, clock[r], end)
                    )
                clock[r] = end
                step_end[k] = max(step_end.get(k, 0.0), end)
            else:  # pragma: no cover - every kind is handled above
                raise ConfigError(f"the simulator cannot run {a}")
            pc[r] += 1
            return True

        while any(pc[r] < len(streams[r]) for r in range(p)):
            progress = False
            for r in range(p):
                while step(r):
                    progress = True
            if not progress:
                heads = [h[1] if (h := head(r)) is not None else None for r in range(p)]
                raise _deadlock(program, heads, pc)
        return spans, clock, step_end, waited

    spans, clock, step_end, waited = replay(None)
    if sharing:
        assert cores is not None
        per_share = float(threads * processes_per_rank)
        for _ in range(SHARING_PASSES):
            others = [_Others.of(spans, r, stages, cores, per_share) for r in range(p)]
            again = replay(others)
            moved = _largest_move(spans, again[0])
            spans, clock, step_end, waited = again
            if moved <= 1e-9 * max(clock, default=0.0):
                break
    ends = [step_end.get(k, max(clock)) for k in range(steps)]
    if steps == 1:
        step_time = max(clock)
    else:
        step_time = ends[-1] - ends[-2]
    busy = [0.0] * p
    for s in spans:
        if s.step == 0 and s.kind in _COMPUTE_SPANS:
            busy[s.rank] += s.end - s.start
    in_flight, rank_in_flight, peak = _occupancy(
        program, stages, memory, base_memory, _per(all_reduce_memory, p, "all_reduce_memory")
    )
    return Simulation(
        program=program,
        step_time=step_time,
        busy=tuple(busy),
        communication=tuple(waited),
        in_flight=in_flight,
        rank_in_flight=rank_in_flight,
        peak_memory=peak,
        spans=tuple(spans),
    )


_COMPUTE_SPANS = frozenset({"forward", "backward", "backward_input", "backward_weight"})

#: The most replays :func:`simulate` runs to settle how ranks that share cores slow each other
#: down ([Note: ranks sharing cores]).
SHARING_PASSES = 30


class _Others:
    """The CPU demand of every other rank's computations over time, as the previous replay
    placed them: a step function ([Note: ranks sharing cores])."""

    def __init__(
        self, times: list[float], levels: list[float], cores: float, per_share: float
    ) -> None:
        #: ``levels[i]``: the others' demand (cores) from ``times[i]`` to ``times[i + 1]``.
        self.times = times
        self.levels = levels
        self.cores = cores
        #: Cores a computation of this rank demands per unit of its ``cpu_share`` (its threads
        #: times its processes).
        self.per_share = per_share

    @classmethod
    def of(
        cls,
        spans: Sequence[SimulatedSpan],
        rank: int,
        stages: Sequence[StageTimes],
        cores: float,
        per_share: float,
    ) -> _Others:
        """The demand of the computations in ``spans`` of every rank but ``rank``."""
        changes: dict[float, float] = {}
        for s in spans:
            if s.rank == rank or s.kind not in _COMPUTE_SPANS or s.end <= s.start:
                continue
            demand = stages[s.stage].cpu_share * per_share
            changes[s.start] = changes.get(s.start, 0.0) + demand
            changes[s.end] = changes.get(s.end, 0.0) - demand
        times, levels, level = [0.0], [0.0], 0.0
        for t in sorted(changes):
            level += changes[t]
            if t == 0.0:
                levels[0] = max(0.0, level)
                continue
            times.append(t)
            levels.append(max(0.0, level))
        return cls(times, levels, cores, per_share)

    def finish(self, start: float, seconds: float, share: float) -> float:
        """When a computation that takes ``seconds`` with the cores to itself, ``share`` of
        them on the CPU, ends if it starts at ``start`` beside the others' demand."""
        own = share * self.per_share
        i = max(0, bisect.bisect_right(self.times, start) - 1)
        t, left = start, seconds
        while True:
            load = own + self.levels[i]
            rate = 1.0 if load <= self.cores else self.cores / load
            pace = share / rate + (1.0 - share)
            until = self.times[i + 1] if i + 1 < len(self.times) else math.inf
            if (until - t) / pace >= left:
                return t + left * pace
            left -= (until - t) / pace
            t = until
            i += 1


def _largest_move(before: Sequence[SimulatedSpan], after: Sequence[SimulatedSpan]) -> float:
    """How far the computations moved between two replays (seconds)."""
    ends = {(s.rank, s.step, s.name, s.stage): s.end for s in before}
    moved = 0.0
    for s in after:
        was = ends.get((s.rank, s.step, s.name, s.stage))
        moved = max(moved, math.inf if was is None else abs(s.end - was))
    return moved


def _per(value: Sequence[float] | float, count: int, what: str) -> list[float]:
    if isinstance(value, int | float):
        return [float(value)] * count
    values = [float(v) for v in value]
    if len(values) != count:
        raise ConfigError(f"{what} needs {count} values, got {len(values)}")
    return values


def _occupancy(
    program: Program,
    stages: Sequence[StageTimes],
    memory: Sequence[StageMemory] | None,
    base_memory: Sequence[float] | float,
    all_reduce_memory: Sequence[float],
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[float, ...] | None]:
    """Peak in-flight counts per stage and per rank, and peak bytes per rank, from each rank's
    order ([Note: simulation])."""
    n, p = program.num_stages, program.num_ranks
    if memory is not None and len(memory) != n:
        raise ConfigError(f"memory needs one StageMemory per stage ({n}), got {len(memory)}")
    base = _per(base_memory, p, "base_memory")
    peak_stage = [0] * n
    peak_rank = [0] * p
    peak_bytes = [0.0] * p
    for r in range(p):
        count = [0] * n
        gathered = [False] * n
        grads = [False] * n
        for action in program.ranks[r]:
            for a in action.leaves():
                s = a.stage
                # What the action takes first (its micro-batch's activations, its gradients,
                # the gathered parameters), then the peak, then what it frees.
                releases = False
                during = 0.0
                if a.kind == _K.FORWARD:
                    count[s] += 1
                    if memory is not None:
                        during = memory[s].forward_copy
                elif a.kind in (_K.BACKWARD, _K.BACKWARD_INPUT, _K.BACKWARD_WEIGHT):
                    grads[s] = True
                    if a.kind != _K.BACKWARD_WEIGHT and memory is not None:
                        during = memory[s].transient
                    makes_weight_gradient = a.kind == _K.BACKWARD or (
                        a.kind == (_K.BACKWARD_WEIGHT if stages[s].split else _K.BACKWARD_INPUT)
                    )
                    if makes_weight_gradient and memory is not None:
                        during += memory[s].weight_gradient
                    releases = (
                        a.kind == _K.BACKWARD
                        or (a.kind == _K.BACKWARD_INPUT and not stages[s].split)
                        or (a.kind == _K.BACKWARD_WEIGHT and stages[s].split)
                    )
                elif a.kind == _K.ALL_GATHER:
                    gathered[s] = True
                elif a.kind == _K.ALL_REDUCE:
                    during = all_reduce_memory[r]
                for k in program.stages_of(r):
                    peak_stage[k] = max(peak_stage[k], count[k])
                peak_rank[r] = max(peak_rank[r], sum(count))
                if memory is not None:
                    held = (
                        during
                        + base[r]
                        + sum(
                            count[k] * memory[k].activation
                            + (memory[k].gathered if gathered[k] else 0.0)
                            + (memory[k].gradient if grads[k] else 0.0)
                            for k in program.stages_of(r)
                        )
                    )
                    peak_bytes[r] = max(peak_bytes[r], held)
                if releases:
                    count[s] -= 1
                elif a.kind == _K.RESHARD:
                    gathered[s] = False
                elif a.kind == _K.REDUCE_GRAD:
                    grads[s] = False
    return tuple(peak_stage), tuple(peak_rank), (tuple(peak_bytes) if memory is not None else None)
