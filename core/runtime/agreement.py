"""What every rank must agree on, checked before disagreement can hang or mistrain a run.

[Note: rank agreement]
Each rank partitions the model itself, so two ranks can build different pipelines: another
split point, another number of stages, another model size. Trained together they either hang
(one rank refuses its topology and leaves the others in ``new_group``) or train a model that is
none of theirs, without a word. :func:`check_plan_agreement` is therefore the first collective
a multi-process dialect's ``pipe_engine`` runs: every rank sends a small summary of what it
built (stage count, topology, split points, inputs, liveness, ties, each stage's parameter
names and shapes, a digest of each stage's code, the dialect and its options) with one
``all_gather_object`` on the default process group, and every rank raises the same
:class:`~pipedialect.PlanDisagreementError` naming the first thing that differs and the ranks
that differ, before any rank can reach a collective the others would miss.

A step has the same problem: a rank whose data iterator runs out, or whose loss is not finite,
must not leave its peers waiting in a send or a collective. :func:`agree_on_error` (one
``all_reduce`` of a flag; the errors themselves are gathered only when one is set) makes every
rank raise when any rank has an error. :func:`pull_micro_batches` reads a whole step's
micro-batches before anything is computed, so a step either runs complete or changes nothing;
:func:`first_nonfinite_loss` and :func:`first_nonfinite_grad` find what ``check_finite``
refuses.

[Note: one error, every rank]
Those checks cover what can be checked at a point every rank reaches. Anything else can fail on
one rank in the middle of a phase the ranks run together -- building an engine, a step
(``train_batch``, ``eval_batch``), saving or loading a checkpoint: a ``loss_fn`` that raises on
the last stage, a data iterator that raises on one rank, a file that cannot be written. The
other ranks are then waiting for that rank in a send, a receive or a collective, and would see a
bare "Connection closed" when its process exits, or wait for ever when it does not.
:func:`agreed` wraps such a phase. Every rank counts the phases it runs, and on the way out
counts itself as arrived (one ``add`` on the process group's store), then joins
:func:`agree_on_error` (one ``all_reduce``): when nobody failed that is all it costs. A rank that
failed posts its error on the store (the first one posted for the phase wins), counts itself as
arrived and waits a few seconds (:data:`ARRIVAL_SECONDS`) for every other rank to arrive:

- if they all do, nobody is waiting for anything else, and it joins :func:`agree_on_error`
  with its error: every rank raises it (a rank with an error of its own raises that one), and
  the process group stays usable (a retry can follow);
- otherwise some rank waits for it in a send, a receive or a collective that will never
  complete, so it shuts the process group down: it closes its connections in every gloo group
  (an operation it left pending would keep them open through an abort) and aborts every group,
  which makes those operations fail at once on every rank. A rank whose operation failed that
  way reads the posted error from the store and raises it, and shuts its own side down too (a
  rank waiting for *it* is released in turn). Before leaving, rank 0 waits (briefly) until
  each rank has read the error, so that it does not take the store it holds away first.
  The process group is gone: every later phase raises the same error, saying that the run
  must be restarted (from a checkpoint).

The error every rank raises is a :class:`~pipedialect.PipeDialectError`: the failing rank's own
when it raised one (the other ranks raise a copy, its message prefixed with that rank and the
phase), else a :class:`~pipedialect.RankFailedError` naming the rank, the stage and the phase
and quoting the original exception (chained on the rank it came from). A rank that lost its
connection to a peer that posted nothing (killed, say) raises a
:class:`~pipedialect.ConnectionLostError`. Only multi-process dialects wrap their phases.

[Note: verdict before leaving]
A verdict every rank computes from one collective (a plan disagreement, a tie frozen on one
rank, the errors :func:`agree_on_error` gathered) is raised by a rank as soon as it has it. A
rank that leaves then -- its process ends, as a script's does after an uncaught error -- closes
its connections while a slower peer may still be receiving what it sent, and that peer sees
"Connection reset by peer" instead of the verdict. So before raising one, every rank counts
itself on the store and waits until every rank has (at most :data:`LEAVE_SECONDS`); only then
is the verdict raised, on every rank. It costs nothing when nobody failed.

[Note: failure bounds]
How soon every rank raises, counted from the failure, on gloo (127.0.0.1 or a network):

- an exception on one rank whose peers can all reach the end of the phase: as soon as they do;
  one whose peers wait for it (inside a step): :data:`ARRIVAL_SECONDS` plus the time to shut
  the group down -- under 2 s;
- a rank that dies without a word (killed, out of memory): a peer talking to it sees its
  connection close at once (the operating system closes a dead process's sockets), waits
  :data:`POST_WAIT_SECONDS` for an error posted by someone else, posts its own and shuts the
  group down, which releases every other peer; rank 0 then waits up to :data:`LEAVE_SECONDS`
  for every survivor to read the error -- under 5 s on every survivor, whichever rank died.
  When rank 0 dies, the store goes with it and each survivor raises its own
  :class:`~pipedialect.ConnectionLostError` at once.

A peer that is busy computing (not communicating) learns of it when it next communicates.
On NCCL a lost peer is seen when the process group's timeout expires.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import pickle
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import (
    ConnectionLostError,
    DataError,
    DataExhaustedError,
    NonFiniteError,
    PipeDialectError,
    PlanDisagreementError,
    RankFailedError,
    TieError,
)
from .sharded import local_part

__all__ = [
    "ARRIVAL_SECONDS",
    "LEAVE_SECONDS",
    "POST_WAIT_SECONDS",
    "agree_on_error",
    "agreed",
    "check_frozen_ties",
    "check_inputs",
    "check_plan_agreement",
    "first_nonfinite_grad",
    "first_nonfinite_loss",
    "is_connection_error",
    "nonfinite_grad_error",
    "nonfinite_loss_error",
    "pull_micro_batches",
    "root_nonfinite",
]

logger = logging.getLogger(__name__)

#: How long a rank that failed waits for every other rank to arrive at the end of the phase
#: before it shuts the process group down ([Note: one error, every rank]). A peer that is
#: waiting for the failed rank never arrives, so this bounds how long an error inside a step
#: takes to reach every rank ([Note: failure bounds]).
ARRIVAL_SECONDS = 1.0
#: How long a rank whose connection failed waits for an error posted on the store before it
#: posts its own :class:`~pipedialect.ConnectionLostError`. A rank that fails by an exception
#: posts it before it does anything that could close a connection, so a connection that fails
#: with nothing posted within this time was lost to a rank that died without a word.
POST_WAIT_SECONDS = 1.0
#: How long the rank that holds the store waits for every rank to have read the error (or a
#: verdict) before it may leave and take the store away; a rank that died never reads.
LEAVE_SECONDS = 2.0

#: Options that legitimately differ per rank (each rank has its own device).
_PER_RANK_OPTIONS = frozenset({"device"})
#: The config entries every rank must share (they fix how many micro-batches each step sends).
_CONFIG_KEYS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
)
#: How each summary field reads in a message.
_LABELS = {
    "dialect": "dialect",
    "num_stages": "number of stages",
    "topology": "topology",
    "split_points": "split after",
    "input_names": "model inputs",
    "stage_arg_names": "stage arguments",
    "liveness": "liveness (values each stage receives)",
    "tie_groups": "tied parameters",
    "parameters": "parameters (name, shape)",
    "code": "stage code digest",
    "options": "pipe_engine options",
}
#: Fields that hold one entry per stage: a difference is reported for the first stage.
_PER_STAGE = frozenset({"stage_arg_names", "liveness", "parameters", "code"})


def _topology_summary(topology: Any) -> Any:
    if topology is None:
        return None
    axes = getattr(topology, "get_axis_names", None)
    names = list(axes()) if callable(axes) else ["pipe", "data", "model"]
    try:
        return {str(axis): int(topology.get_dim(axis)) for axis in names}
    except Exception:  # not a topology: pipe_engine refuses it by name, on every rank alike
        return type(topology).__name__


def _options_summary(options: Mapping[str, Any]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for key in sorted(options):
        value = options[key]
        if key in _PER_RANK_OPTIONS:
            continue
        if value is None or isinstance(value, bool | int | float | str):
            summary[key] = value
        elif key == "config" and isinstance(value, Mapping):
            summary.update({f"config.{k}": value.get(k) for k in _CONFIG_KEYS if k in value})
    return summary


def _plan_summary(
    plan: Any, dialect: str, options: Mapping[str, Any], given: Sequence[nn.Module] | None
) -> dict[str, Any]:
    stages = list(getattr(plan, "stages", None) or given or ())
    ties = getattr(plan, "tie_groups", None)
    return {
        "dialect": dialect,
        "num_stages": len(stages),
        "topology": _topology_summary(options.get("topology")),
        "split_points": list(getattr(plan, "split_points", ())),
        "input_names": list(getattr(plan, "input_names", ())),
        "stage_arg_names": [list(a) for a in getattr(plan, "stage_arg_names", ())],
        "liveness": [list(v) for v in getattr(plan, "liveness", ())],
        "tie_groups": [] if ties is None else [(g.key, list(g.members)) for g in ties],
        "parameters": [
            # Every name, shared or not: a rank that materialised its stage (to_empty(), which
            # unties) must summarise it as one that did not.
            [(n, tuple(p.shape)) for n, p in stage.named_parameters(remove_duplicate=False)]
            for stage in stages
        ],
        "code": [
            hashlib.sha256(str(getattr(stage, "code", "")).encode()).hexdigest()[:16]
            for stage in stages
        ],
        "options": _options_summary(options),
    }


def _ranks_text(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _grouped(values: Sequence[Any]) -> list[tuple[list[int], Any]]:
    """The distinct values, each with the ranks that hold it, in order of first rank."""
    groups: dict[str, tuple[list[int], Any]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(repr(value), ([], value))[0].append(rank)
    return list(groups.values())


def _narrow(field: str, values: list[Any]) -> tuple[str, list[Any]]:
    """For a per-stage field, the first stage (and entry) whose values differ."""
    label = _LABELS[field]
    if field not in _PER_STAGE:
        return label, values
    count = max(len(v) for v in values)
    for stage in range(count):
        at = [v[stage] if stage < len(v) else None for v in values]
        if len({repr(a) for a in at}) == 1:
            continue
        if field != "parameters":
            return f"stage {stage} {label}", at
        entries = max(len(a or ()) for a in at)
        for i in range(entries):
            entry = [a[i] if a is not None and i < len(a) else "(none)" for a in at]
            if len({repr(e) for e in entry}) > 1:
                return f"stage {stage} parameter #{i} (name, shape)", entry
    return label, values


def check_plan_agreement(
    plan: Any,
    *,
    dialect: str,
    options: Mapping[str, Any] | None = None,
    stages: Sequence[nn.Module] | None = None,
) -> None:
    """Raise on every rank unless every rank built the same plan; see [Note: rank agreement].

    Call it on every rank, first thing in ``pipe_engine`` (it is a collective on the default
    process group; without one, or with one rank, it does nothing). ``options`` are the
    ``pipe_engine`` keyword arguments: ``topology`` is summarised by its axes, ``config`` by its
    batch-size entries, plain values as they are; other values and ``device`` are not compared.
    ``stages`` (the stage modules) stand in for a plan that has none (Slapo's metadata).

    Raises:
        PlanDisagreementError: the ranks differ; the message names the first field that
            differs, each rank's value, and the ranks that differ from rank 0.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = _plan_summary(plan, dialect, options or {}, stages)
    summaries: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(summaries, mine)
    if any(repr(s) != repr(mine) for s in summaries):
        _verdict_reached()
    for field in mine:
        values = [s[field] for s in summaries]
        if len({repr(v) for v in values}) == 1:
            continue
        label, shown = _narrow(field, values)
        groups = _grouped(shown)
        odd = tuple(r for r, v in enumerate(values) if repr(v) != repr(values[0]))
        detail = "; ".join(f"{_ranks_text(ranks)}: {value!r}" for ranks, value in groups)
        raise PlanDisagreementError(
            f"the ranks built different pipelines ({dialect} pipe_engine on rank "
            f"{dist.get_rank()}): {label} differs: {detail}. Every rank must partition the "
            "same model at the same split points and pass the same topology and options; "
            f"fix {_ranks_text(odd)} (nothing was built, so no rank is left waiting)",
            field=field,
            ranks=odd,
        )


def agree_on_error(
    error: PipeDialectError | None,
    *,
    device: torch.device,
    what: str,
    choose: Callable[[Sequence[PipeDialectError | None]], int] | None = None,
) -> None:
    """Raise on every rank if any rank has an ``error``; return on every rank otherwise.

    Every rank of the default process group calls it at the same point. Costs one
    ``all_reduce`` of one integer when nobody failed; when somebody did, the errors are gathered
    and a rank raises its own, or without one a copy of the first failing rank's, its message
    prefixed with that rank and ``what``. ``choose`` (given every rank's error, the rank whose
    error every rank raises) picks one error for all instead.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise _agreed(error)
        return
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if int(flag.item()) == 0:
        return
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    _verdict_reached()
    if choose is not None:
        chosen = choose(errors)
    elif error is not None:
        raise _agreed(error)
    else:
        chosen = next(r for r, e in enumerate(errors) if e is not None)
    if chosen == dist.get_rank() and error is not None:
        raise _agreed(error)
    raise _agreed(_copy_from(errors[chosen], chosen, what))


def _verdict_reached() -> None:
    """Every rank has the verdict of the collective just run, before any raises it
    ([Note: verdict before leaving]); nothing without a process group."""
    session = _session()
    if session is not None:
        session.verdict_reached()


def _copy_from(error: PipeDialectError, rank: int, what: str) -> PipeDialectError:
    """Another rank's ``error`` as this rank raises it: the message says where it came from (a
    :class:`~pipedialect.RankFailedError` already does)."""
    if not isinstance(error, RankFailedError):
        error.args = (f"rank {rank} failed {what}, so every rank stops: {error.args[0]}",)
    return error


#: The attribute that marks an error every rank raises at once (no further agreement needed).
_AGREED = "_pipedialect_agreed"


def _agreed(error: PipeDialectError) -> PipeDialectError:
    setattr(error, _AGREED, True)
    return error


def _is_agreed(exc: BaseException) -> bool:
    """Whether every rank raises ``exc`` at once: marked so, or a plan disagreement (found by a
    collective, so raised on every rank)."""
    return isinstance(exc, PlanDisagreementError) or bool(getattr(exc, _AGREED, False))


# -- phases every rank runs together ([Note: one error, every rank]) ---------------------------

_PREFIX = "pipedialect/agreement"


@dataclass
class _Session:
    """This process's guarded phases on one default process group."""

    group: Any
    store: Any
    rank: int
    world: int
    device: torch.device
    phases: int = 0
    verdicts: int = 0

    def arrive(self) -> None:
        self.store.add(f"{_PREFIX}/arrived", 1)

    def all_arrived(self, phase: int, seconds: float) -> bool:
        """Count this rank as arrived; whether every rank arrives at the end of ``phase``
        within ``seconds`` (False when the store is gone)."""
        deadline = time.monotonic() + seconds
        try:
            self.arrive()
            while True:
                if int(self.store.add(f"{_PREFIX}/arrived", 0)) >= self.world * phase:
                    return True
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.005)
        except Exception:  # the store went with a peer
            return False

    def post(self, phase: int, error: PipeDialectError) -> tuple[int, PipeDialectError]:
        """Post ``error`` for ``phase`` unless another rank did first; return the first one
        (this rank's own when the store cannot be reached)."""
        try:
            payload = pickle.dumps((self.rank, error))
            first = self.store.compare_set(f"{_PREFIX}/failure/{phase}", "", payload)
            rank, posted = pickle.loads(first)
        except Exception:  # the store itself is gone: every rank is on its own
            return self.rank, error
        return int(rank), posted

    def posted(self, phase: int, seconds: float) -> tuple[int, PipeDialectError] | None:
        """The error posted for ``phase``, waiting up to ``seconds`` for one; None if none."""
        key = f"{_PREFIX}/failure/{phase}"
        deadline = time.monotonic() + seconds
        while True:
            try:
                if self.store.check([key]):
                    rank, error = pickle.loads(self.store.get(key))
                    return int(rank), error
            except Exception:  # the store itself is gone: nothing more to learn from it
                return None
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)

    def leave_together(self, phase: int) -> None:
        """Count this rank as done with the failure; rank 0 waits (briefly) for the others."""
        self.count_and_wait(f"{_PREFIX}/failure/{phase}/read", waits=self.rank == 0)

    def count_and_wait(self, key: str, *, waits: bool) -> None:
        """Count this rank in ``key``; when ``waits``, wait until every rank has (at most
        :data:`LEAVE_SECONDS`: a rank that died never counts).

        Only rank 0 needs to wait after a failure: with ``torch.distributed``'s default
        rendezvous it holds the store, which goes when its process ends, while every other
        rank has what it needs once it has counted itself.
        """
        with contextlib.suppress(Exception):  # the store is gone: nobody is left to wait for
            self.store.add(key, 1)
            deadline = time.monotonic() + LEAVE_SECONDS
            while (
                waits and int(self.store.add(key, 0)) < self.world and time.monotonic() < deadline
            ):
                time.sleep(0.005)

    def verdict_reached(self) -> None:
        """Wait until every rank has the verdict of the collective it just ran, so that no
        rank leaves (and its process ends, closing its connections) while a peer still
        receives what it sent ([Note: verdict before leaving])."""
        self.verdicts += 1
        self.count_and_wait(f"{_PREFIX}/verdict/{self.verdicts}", waits=True)


_SESSION: list[_Session] = []
#: The error that shut this process's last process group down, with the phase it failed in.
_STOPPED: list[tuple[str, PipeDialectError]] = []


def _session() -> _Session | None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    group = dist.distributed_c10d._get_default_group()
    if _SESSION and _SESSION[0].group is group:
        return _SESSION[0]
    backend = dist.get_backend()
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if backend == "nccl"
        else torch.device("cpu")
    )
    session = _Session(
        group,
        dist.distributed_c10d._get_default_store(),
        dist.get_rank(),
        dist.get_world_size(),
        device,
    )
    _SESSION[:] = [session]
    _STOPPED.clear()
    return session


def is_connection_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a failed communication, not a failure of its own."""
    import torch.distributed as dist

    markers = (
        "Connection closed",
        "Connection reset",
        "Broken pipe",
        "gloo/transport",
        "NCCL communicator was aborted",
        "process group has not been initialized",
        "has been destroyed",
    )
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, dist.DistError):
            return True
        # torch.distributed.checkpoint reports a rank's failed collective in the message of
        # its own CheckpointException (a BaseException), with the original traceback.
        checkpoint = type(current).__name__ == "CheckpointException"
        worded = isinstance(current, RuntimeError) or checkpoint
        if worded and any(m in str(current) for m in markers):
            return True
        current = current.__cause__ or current.__context__
    return False


def _as_error(exc: Exception, rank: int, what: str, where: str) -> PipeDialectError:
    """The error every rank raises for ``exc``, raised on ``rank`` during ``what``."""
    if isinstance(exc, PipeDialectError):
        return exc
    text = f"{type(exc).__name__}: {exc}"
    root = _root_cause(exc)
    if root is not exc:  # a runtime that wraps the user's exception in its own words
        text += f" (caused by {type(root).__name__}: {root})"
    if is_connection_error(exc):
        return ConnectionLostError(
            f"{where}rank {rank} lost its connection to another rank during {what} ({text}); "
            "a rank crashed or was killed: its own log says why",
            rank=rank,
            what=what,
            error=type(exc).__name__,
        )
    return RankFailedError(
        f"{where}{what} failed on rank {rank}, so every rank stops: {text}",
        rank=rank,
        what=what,
        error=type(exc).__name__,
    )


def _root_cause(exc: BaseException) -> BaseException:
    """The exception at the bottom of ``exc``'s chain of explicit causes."""
    seen = {id(exc)}
    while exc.__cause__ is not None and id(exc.__cause__) not in seen:
        exc = exc.__cause__
        seen.add(id(exc))
    return exc


#: The tag of the receive that closes a gloo group's connections (no rank ever sends it).
_CLOSE_TAG = 0x5049_5045


def _close_connections() -> None:
    """Close this rank's connections in every gloo process group, so that every operation a
    peer waits on fails at once (an operation this rank left pending keeps them open through an
    abort): a receive nobody sends, given up after a millisecond, makes gloo close every
    connection of its group."""
    import datetime

    import torch.distributed as dist

    world = dist.distributed_c10d._world
    me = dist.get_rank()
    for group in list(world.pg_map):
        with contextlib.suppress(Exception):
            if dist.get_backend(group) != "gloo":
                continue
            others = [r for r in dist.get_process_group_ranks(group) if r != me]
            if not others:
                continue
            probe = torch.zeros(1)
            work = dist.irecv(probe, src=others[0], group=group, tag=_CLOSE_TAG)
            if work is not None:
                work.wait(timeout=datetime.timedelta(milliseconds=1))


def _shut_down(session: _Session, what: str, error: PipeDialectError) -> None:
    """Abort every process group of this process, so that no rank waits on this one."""
    import torch.distributed as dist

    with contextlib.suppress(Exception):
        _close_connections()
    with contextlib.suppress(Exception):
        dist.distributed_c10d._abort_process_group()
    _SESSION.clear()
    _STOPPED[:] = [(what, error)]
    logger.warning("rank %d shut the process group down after: %s", session.rank, error)


def _stopped_error(what: str) -> PipeDialectError | None:
    import torch.distributed as dist

    if not _STOPPED or (dist.is_available() and dist.is_initialized()):
        return None
    failed, error = _STOPPED[0]
    return RankFailedError(
        f"{what} cannot run: the process group was shut down when {failed} failed "
        f"({error.args[0] if error.args else error}); nothing can run on it any more. Restart "
        "the run (resume from the last checkpoint)",
        rank=getattr(error, "rank", -1),
        what=what,
        error=getattr(error, "error", type(error).__name__),
    )


@contextlib.contextmanager
def agreed(what: str, *, where: str = "") -> Iterator[None]:
    """Run the block as a phase every rank runs together: an exception raised on any rank is
    raised on every rank, within seconds, never a hang ([Note: one error, every rank]).

    ``what`` names the phase in messages (``"train_batch (step 3)"``), ``where`` this rank's
    part in it (``"[Stage 1] "``). Without a process group (or with one rank) the block simply
    runs.

    Raises:
        RankFailedError: a rank raised an exception that is not a
            :class:`~pipedialect.PipeDialectError` (its own error otherwise, or a copy of it).
        ConnectionLostError: a rank lost its connection to one that posted no error.
    """
    session = _session()
    if session is None:
        stopped = _stopped_error(what)
        if stopped is not None:
            raise stopped
        yield
        return
    session.phases += 1
    phase = session.phases
    try:
        yield
    except Exception as exc:
        if _is_agreed(exc):
            with contextlib.suppress(Exception):  # the store went with a peer: no one counts
                session.arrive()
            raise
        raise _fail(session, phase, exc, what, where) from exc
    try:
        session.arrive()
        agree_on_error(None, device=session.device, what=what)
    except Exception as exc:
        if _is_agreed(exc):
            raise
        raise _fail(session, phase, exc, what, where) from exc


def _fail(session: _Session, phase: int, exc: Exception, what: str, where: str) -> PipeDialectError:
    """Make every rank raise for ``exc``; return what this rank raises (see the note)."""
    if is_connection_error(exc):
        found = session.posted(phase, POST_WAIT_SECONDS)
        if found is None:
            found = session.post(phase, _as_error(exc, session.rank, what, where))
        _shut_down(session, what, found[1])
        session.leave_together(phase)
        rank, error = found
        return _agreed(error if rank == session.rank else _copy_from(error, rank, what))
    error = _as_error(exc, session.rank, what, where)
    session.post(phase, error)
    if session.all_arrived(phase, ARRIVAL_SECONDS):
        try:
            agree_on_error(error, device=session.device, what=what)
        except PipeDialectError as agreed_exc:
            if _is_agreed(agreed_exc):
                return agreed_exc
        except Exception:  # a peer shut the process group down meanwhile
            pass
    _shut_down(session, what, error)
    session.leave_together(phase)
    return _agreed(error)


def check_frozen_ties(mine: Mapping[str, tuple[str, int, bool]]) -> None:
    """Raise :class:`~pipedialect.TieError` on every rank unless every copy of each tied weight
    is trainable on every rank holding it, or frozen on every one.

    ``mine`` maps each tie group this rank holds a copy of to ``(parameter name, stage,
    requires_grad)``. A frozen tie takes no gradient sum; one frozen copy and one trainable copy
    would leave one rank in a sum the other never joins. A collective on the default process
    group (nothing without one); every rank calls it, holding a copy or not.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, dict(mine))
    seen: dict[str, tuple[int, str, int, bool]] = {}
    for rank, found in enumerate(every):
        for key, (name, stage, trainable) in sorted(found.items()):
            first = seen.setdefault(key, (rank, name, stage, trainable))
            if first[3] == trainable:
                continue
            _verdict_reached()
            frozen = first if not first[3] else (rank, name, stage, trainable)
            other = (rank, name, stage, trainable) if not first[3] else first
            raise TieError(
                f"[Stage {frozen[2]}] tied weight {frozen[1]!r} is frozen (requires_grad=False) "
                f"on rank {frozen[0]} but {other[1]!r} of stage {other[2]} is trainable on rank "
                f"{other[0]}; the copies of a tied weight are one parameter: freeze it (or not) "
                "on every rank"
            )


def root_nonfinite(errors: Sequence[PipeDialectError | None]) -> int:
    """The rank whose :class:`~pipedialect.NonFiniteError` came first: a loss, else the
    earliest stage (a ``choose`` for :func:`agree_on_error`)."""

    def order(rank: int) -> tuple[int, int, int]:
        error = errors[rank]
        if not isinstance(error, NonFiniteError):
            return (2, 0, rank)
        return (0 if error.micro_batch is not None else 1, error.stage, rank)

    return min((r for r, e in enumerate(errors) if e is not None), key=order)


def pull_micro_batches(
    data_iter: Iterator[Any], count: int, *, what: str = "train_batch", source: str | None = None
) -> list[Any]:
    """Read ``count`` items from ``data_iter`` before any of them is used.

    Raises:
        DataExhaustedError: the iterator ran out first; nothing was computed from what it gave.
    """
    source = source or "gradient_accumulation_steps"
    items: list[Any] = []
    for got in range(count):
        try:
            items.append(next(data_iter))
        except StopIteration:
            raise DataExhaustedError(
                f"{what} needs {count} micro-batches ({source}), the data iterator ran out "
                f"after {got}; nothing was computed and no gradient or parameter changed. Pass "
                f"an iterator with at least {count} more micro-batches (a repeating loader "
                "never runs out)",
                expected=count,
                got=got,
            ) from None
    return items


def check_inputs(inputs: Any, input_names: Sequence[str], index: int) -> None:
    """Refuse a tuple or list of more inputs than the model takes, explaining how it is read."""
    if isinstance(inputs, tuple | list) and len(inputs) > len(input_names):
        raise DataError(
            f"micro-batch {index}: its inputs are a {type(inputs).__name__} of {len(inputs)} "
            "values, and a tuple or list is passed as the model's positional inputs, one per "
            f"element (as DeepSpeed does), but the model takes {len(input_names)} "
            f"({list(input_names)}). Yield the input itself for a one-input model, or wrap a "
            "list-valued input in a 1-tuple: ((values,), labels)"
        )


def first_nonfinite_loss(losses: Sequence[torch.Tensor]) -> int | None:
    """The index of the first loss with a NaN or infinite element, or None (one sync)."""
    if not losses:
        return None
    flags = torch.stack([torch.isfinite(loss.detach()).all() for loss in losses])
    if bool(flags.all()):
        return None
    return int((~flags).nonzero()[0, 0])


def first_nonfinite_grad(
    named: Iterable[tuple[str, nn.Parameter]],
) -> tuple[str, torch.Tensor] | None:
    """The first ``(name, gradient)`` with a NaN or infinite element, or None (one sync).

    A sharded gradient is checked on this rank's part (``sharded`` [Note: sharded tensors]).
    """
    grads = [(name, local_part(p.grad)) for name, p in named if p.grad is not None]
    if not grads:
        return None
    flags = torch.stack([torch.isfinite(g).all().to(grads[0][1].device) for _, g in grads])
    if bool(flags.all()):
        return None
    return grads[int((~flags).nonzero()[0, 0])]


def _kind(value: torch.Tensor) -> str:
    return "NaN" if bool(torch.isnan(value).any()) else "infinite"


def nonfinite_loss_error(
    loss: torch.Tensor, *, step: int, stage: int, micro_batch: int
) -> NonFiniteError:
    """The error ``check_finite`` raises for a non-finite loss."""
    return NonFiniteError(
        f"[Stage {stage}] step {step}, micro-batch {micro_batch}: the loss is {_kind(loss)}; the "
        "optimizer did not step and the step's gradients were dropped. Check that "
        "micro-batch's data, lower the learning rate, or pass check_finite=False to train on",
        step=step,
        stage=stage,
        micro_batch=micro_batch,
    )


def nonfinite_grad_error(name: str, grad: torch.Tensor, *, step: int, stage: int) -> NonFiniteError:
    """The error ``check_finite`` raises for a non-finite gradient."""
    return NonFiniteError(
        f"[Stage {stage}] step {step}: the gradient of parameter {name!r} is {_kind(grad)} "
        "(every micro-batch loss was finite); the optimizer did not step and the step's "
        "gradients were dropped. Lower the learning rate, enable gradient_clipping, or pass "
        "check_finite=False to train on",
        step=step,
        stage=stage,
        parameter=name,
    )
