"""Errors every rank agrees on: a failure on one rank is raised on every rank, before it can
hang the others.

[Note: rank agreement]
Every rank checks what it built before the first step (``plan_agreement`` [Note: plan
agreement]). A step has the same problem: a rank whose data iterator runs out, or whose loss is
not finite, must not leave its peers waiting in a send or a collective. :func:`agree_on_error`
(one ``all_reduce`` of a flag; the errors themselves are gathered only when one is set) makes
every rank raise when any rank has an error.
:func:`~pipedialect.runtime.micro_batches.pull_micro_batches` reads a whole step's
micro-batches before anything is computed, so a step either runs complete or changes nothing;
:func:`~pipedialect.runtime.nonfinite.first_nonfinite_loss` and
:func:`~pipedialect.runtime.nonfinite.first_nonfinite_grad` find what ``check_finite`` refuses.

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
import logging
import pickle
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import (
    ConnectionLostError,
    PipeDialectError,
    PlanDisagreementError,
    RankFailedError,
)

__all__ = [
    "ARRIVAL_SECONDS",
    "LEAVE_SECONDS",
    "POST_WAIT_SECONDS",
    "agree_on_error",
    "agreed",
    "is_connection_error",
    "verdict_reached",
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
    verdict_reached()
    if choose is not None:
        chosen = choose(errors)
    elif error is not None:
        raise _agreed(error)
    else:
        chosen = next(r for r, e in enumerate(errors) if e is not None)
    if chosen == dist.get_rank() and error is not None:
        raise _agreed(error)
    raise _agreed(_copy_from(errors[chosen], chosen, what))


def verdict_reached() -> None:
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
