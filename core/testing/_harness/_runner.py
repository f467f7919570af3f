"""What runs where the dialect's engines live: on each rank of a launch, or in the test process.

:func:`run_cases` builds and drives one engine per case and leaves one record per case and rank
in ``out_dir`` (``<case>.rank<r>.pkl``) as soon as the case is done, so that the test process
keeps what finished even when a later case brings the launch down. A case that raises is
recorded with its exception; in a multi-process run the rank then stops (its peers may be
waiting for it in a collective, and the launcher ends them), except after a build mistake the
dialect refused with a :class:`~pipedialect.PipeDialectError`, which every rank raises alike
before any collective.

[Note: a case that hangs in the test process]
A multi-process launch that makes no progress is stopped by the test process, which ends the
ranks. A single-process dialect runs its cases in the test process itself, so a
:class:`_CaseWatchdog` thread watches each case instead. After ``timeout`` seconds it records
where the case is stuck (the running thread's stack) and interrupts it: first with ``SIGALRM``,
whose handler raises (this wakes a sleep, a lock or a queue wait), then, if the case is still
running a second later, with an exception set asynchronously in the thread (for code that
blocks the signal but still runs Python). The case then fails with the same "made no progress"
report as a launch (its message and that stack, in ``<case>.stopped``) and the next case runs.
A case stuck outside Python for ``_HARD_STOP_GRACE`` seconds more cannot be interrupted at all:
the watchdog writes the report and every thread's stack to the terminal and ends the process,
rather than leave the session hanging.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ... import checkpoint
from ...contracts import Capability, CheckpointingEngine, RuntimeEngine, Topology
from ...dialect import Dialect
from ...errors import PipeDialectError
from ...plan.partition import PipelinePlan, partition
from ...plugins import get_dialect
from ...runtime.sharded import gathered
from ...runtime.stage import StageWrapper
from ...trace import trace
from .._options import EngineOptions
from ._cases import Case, get_case
from ._data import eval_stream, suite_config, train_stream
from ._models import suite_model

__all__ = [
    "ContractError",
    "Probe",
    "detached",
    "ends_launch",
    "one_thread",
    "read_stopped",
    "record_path",
    "run_cases",
]

Record = dict[str, Any]


class ContractError(AssertionError):
    """The dialect broke a contract the suite checks on a rank (not an error it raised)."""


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one intra-op thread: the suite's models are tiny, and on a few shared cores
    more threads only contend (each launched rank already runs with ``OMP_NUM_THREADS=1``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def record_path(out_dir: str | Path, case_id: str, rank: int) -> Path:
    """Where rank ``rank`` leaves its record of ``case_id``."""
    return Path(out_dir) / f"{case_id}.rank{rank}.pkl"


def _write(out_dir: str, case_id: str, rank: int, record: Record) -> None:
    record["time"] = time.time()
    path = record_path(out_dir, case_id, rank)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(record))
    tmp.replace(path)  # atomic: the test process never reads half a record


def stopped_path(out_dir: str | Path, case_id: str) -> Path:
    """Where the in-process watchdog leaves its report on a case it stopped."""
    return Path(out_dir) / f"{case_id}.stopped"


def read_stopped(out_dir: str | Path, case_id: str) -> str | None:
    """The watchdog's report on ``case_id`` (it made no progress), or None if it ran out."""
    path = stopped_path(out_dir, case_id)
    return path.read_text() if path.exists() else None


#: Seconds a case that was interrupted may take to unwind before the process is ended.
_HARD_STOP_GRACE = 10.0
#: Frames of the stuck thread's stack the report shows.
_STACK_FRAMES = 12
#: Exit status of a process ended by the watchdog (pytest's "tests failed").
_HARD_STOP_STATUS = 1


class _NoProgress(BaseException):
    """Raised into a stuck case; a BaseException, so that ``except Exception`` lets it pass."""


class _CaseWatchdog:
    """Stops the case run by the calling thread once it has run ``timeout`` seconds.

    See [Note: a case that hangs in the test process].
    """

    def __init__(self, case_id: str, timeout: float) -> None:
        self.case_id = case_id
        self.timeout = timeout
        self.thread_id = threading.get_ident()
        self.report = ""
        self._lock = threading.Lock()
        self._ended = threading.Event()
        self._fired = False
        self._previous: Any = None
        self._signal = (
            threading.current_thread() is threading.main_thread()
            and hasattr(signal, "pthread_kill")
            and hasattr(signal, "SIGALRM")
        )
        self._thread = threading.Thread(
            target=self._watch, name=f"pipedialect-watchdog-{case_id}", daemon=True
        )

    def __enter__(self) -> _CaseWatchdog:
        if self._signal:
            self._previous = signal.signal(signal.SIGALRM, self._on_alarm)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.end()
        finally:
            if self._signal:
                if self._fired and signal.SIGALRM in signal.sigpending():
                    # Ours, still pending because the case blocked it: never deliver it later.
                    signal.sigwait({signal.SIGALRM})
                signal.signal(signal.SIGALRM, self._previous)

    def end(self) -> None:
        """The case is over: fire nothing more, and drop an exception not yet delivered."""
        with self._lock:
            self._ended.set()
            if self._fired:
                _set_async_exc(self.thread_id, None)

    def _on_alarm(self, signum: int, frame: Any) -> None:
        if self._fired and not self._ended.is_set():
            raise _NoProgress(self.report)
        previous = self._previous
        if callable(previous):  # someone else's alarm (pytest-timeout, say)
            previous(signum, frame)

    def _watch(self) -> None:
        if self._ended.wait(self.timeout):
            return
        frame = sys._current_frames().get(self.thread_id)
        # The innermost frames: where it waits (the report stays short enough to show whole).
        stack = "".join(traceback.format_stack(frame, _STACK_FRAMES)) if frame else "(unknown)\n"
        with self._lock:
            if self._ended.is_set():
                return
            self.report = (
                f"case {self.case_id!r} made no progress for {self.timeout:.0f}s in the test "
                "process: the dialect hangs (a call into it never returned). Raise "
                "--conformance-timeout if the machine is merely slow. It was stuck here:\n" + stack
            )
            self._fired = True
            if self._signal:
                signal.pthread_kill(self.thread_id, signal.SIGALRM)
        if self._ended.wait(1.0):
            return
        with self._lock:
            if self._ended.is_set():
                return
            _set_async_exc(self.thread_id, _NoProgress)
        if self._ended.wait(max(_HARD_STOP_GRACE, self.timeout / 2)):
            return
        self._hard_stop()

    def _hard_stop(self) -> None:
        fd = _terminal_fd()
        text = (
            f"\npipedialect conformance suite: {self.report}\nThe case could not be "
            "interrupted (it is stuck outside Python); ending the process. Every thread:\n"
        )
        with contextlib.suppress(OSError):
            os.write(fd, text.encode(errors="replace"))
            faulthandler.dump_traceback(file=fd, all_threads=True)
        os._exit(_HARD_STOP_STATUS)


def _set_async_exc(thread_id: int, exc: type[BaseException] | None) -> None:
    """Raise ``exc`` in the thread ``thread_id`` when it next runs Python (None: cancel it)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else None
    )


def _terminal_fd() -> int:
    """The terminal's stderr, from before pytest captured it, if the plugin kept it."""
    from .._terminal import terminal_fd

    fd = terminal_fd()
    return 2 if fd is None else fd


def ends_launch(case: Case, record: Record) -> bool:
    """Whether a multi-process rank stops after recording ``record`` of ``case``."""
    if record.get("status", "ok") == "ok":
        return False
    return not (case.kind == "build-error" and record.get("pipedialect_error", False))


def run_cases(
    dialect: Dialect,
    case_ids: Sequence[str],
    out_dir: str,
    options: EngineOptions,
    in_process: bool = False,
    timeout: float | None = None,
) -> int:
    """Run ``case_ids`` in order on this rank; return how many were recorded.

    With ``in_process`` and a ``timeout``, a case running longer is stopped and reported by
    :func:`read_stopped` instead of recorded ([Note: a case that hangs in the test process]).
    """
    multi = not in_process and Capability.MULTI_PROCESS in dialect.capabilities
    rank = int(os.environ.get("RANK", "0")) if multi else 0
    if multi:
        dialect.init_distributed()
    done = 0
    for case_id in case_ids:
        case = get_case(case_id)
        record: Record = {"case": case_id, "rank": rank}
        partial: Record = {}
        watchdog = _CaseWatchdog(case_id, timeout) if in_process and timeout else None
        try:
            with watchdog or contextlib.nullcontext():
                record.update(_RUNNERS[case.kind](dialect, case, options, out_dir, multi, partial))
            record["status"] = "ok"
        except _NoProgress:
            if watchdog is not None:
                watchdog.end()
                stopped_path(out_dir, case_id).write_text(watchdog.report)
            continue
        except Exception as exc:
            record.update(partial)
            record.update(
                status="raised",
                error_type=type(exc).__name__,
                pipedialect_error=isinstance(exc, PipeDialectError),
                contract_error=isinstance(exc, ContractError),
                message=str(exc),
                traceback=traceback.format_exc(),
            )
            _write(out_dir, case_id, rank, record)
            done += 1
            if multi and ends_launch(case, record):
                raise
            continue
        _write(out_dir, case_id, rank, record)
        done += 1
    return done


# -- building -------------------------------------------------------------------------------


class Probe:
    """Records what each stage wrapper decodes in its first micro-batch with grad enabled."""

    def __init__(self) -> None:
        self.received: dict[int, list[Any]] = {}

    def attach(self, wrapper: StageWrapper) -> None:
        original = wrapper.receive
        stage = wrapper.stage_id

        def receive(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[Any]:
            values = original(args, kwargs)
            if stage > 0 and stage not in self.received and torch.is_grad_enabled():
                self.received[stage] = detached(values)
            return values

        wrapper.receive = receive  # type: ignore[method-assign]


def detached(value: Any) -> Any:
    """A copy of ``value`` with every tensor detached, cloned and moved to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: detached(v) for k, v in value.items()}
    if isinstance(value, list):
        return [detached(v) for v in value]
    if isinstance(value, tuple) and not isinstance(value, torch.Size):
        return tuple(detached(v) for v in value)
    return value


def _replica(topology: Topology, multi: bool) -> int:
    if not multi:
        return 0
    import torch.distributed as dist

    coord = topology.get_coord(dist.get_rank())
    return int(getattr(coord, "data", 0))


class _Built:
    """A plan, its engine and what the suite needs to read back from it."""

    def __init__(
        self,
        dialect: Dialect,
        case: Case,
        options: EngineOptions,
        multi: bool,
        *,
        seed: int = 0,
        mistake: str = "",
    ) -> None:
        spec = suite_model(case.model)
        self.spec = spec
        self.plan: PipelinePlan = partition(spec.build(seed), spec.split_points_for(case.stages))
        self.config = suite_config(case)
        self.topology = dialect.make_topology(case.stages, case.data_parallel, **case.tensor_kwargs)
        self.replica = _replica(self.topology, multi)
        extra = dict(case.engine_kwargs)
        if extra.get("tensor_parallel") == "model":  # the model's own plan
            extra["tensor_parallel"] = dict(spec.tensor_plan or {})
        kwargs: dict[str, Any] = {
            "config": self.config,
            "loss_fn": spec.loss_fn,
            "topology": self.topology,
            **extra,
            **options.pipe,
        }
        stage_modules: list[nn.Module] | None = None
        self.probe: Probe | None = None
        if not case.default_path:
            wrappers = dialect.wrap_stages(self.plan)
            if case.probe:
                self.probe = Probe()
                for wrapper in wrappers:
                    self.probe.attach(wrapper)
            stage_modules = list(wrappers)
        if mistake == "no-loss-fn":
            del kwargs["loss_fn"]
        elif mistake == "no-config":
            del kwargs["config"]
        elif mistake == "topology":
            kwargs["topology"] = dialect.make_topology(case.stages * 2, 1)
        elif mistake == "stage-count":
            every: list[nn.Module] = list(dialect.wrap_stages(self.plan))
            stage_modules = every[:-1]
        elif mistake == "unknown-kwarg":
            kwargs["no_such_option"] = 1
        module = dialect.pipe_engine(self.plan, stage_modules=stage_modules, **kwargs)
        self.engine: RuntimeEngine = dialect.runtime_engine(
            module, config=self.config, **options.runtime
        )
        self.local = sorted(int(k) for k in dialect.local_stages(self.engine))

    def params(self) -> dict[int, dict[str, torch.Tensor]]:
        """This rank's stages' parameters by their original names (every name of a tied one)."""
        # A sharded parameter is gathered whole: every rank of its mesh reads it here alike.
        return {
            k: {
                name: gathered(p).detach().cpu().clone()
                for name, p in self.plan.stages[k].named_parameters(remove_duplicate=False)
            }
            for k in self.local
        }

    def train(self, batches: Sequence[Any], steps: int) -> tuple[list[float], list[Any]]:
        """Call ``train_batch`` ``steps`` times on ``batches``; losses and params after each."""
        stream = iter(batches)
        losses: list[float] = []
        snapshots: list[Any] = []
        for step in range(1, steps + 1):
            loss = self.engine.train_batch(data_iter=stream)
            losses.append(_loss_value(loss, f"train_batch() of step {step}", self.local))
            snapshots.append(self.params())
        return losses, snapshots


def _loss_value(loss: Any, what: str, stages: Sequence[int]) -> float:
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return float(loss.detach().cpu().item())
    if isinstance(loss, float | int) and not isinstance(loss, bool):
        return float(loss)
    shown = (
        f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else repr(loss)
    )
    raise ContractError(
        f"{what} returned {shown} on the rank of stage(s) {list(stages)}; it must return the "
        "mean micro-batch loss as a one-element tensor on every rank, as DeepSpeed's "
        "PipelineEngine does"
    )


# -- the kinds of case ----------------------------------------------------------------------


def _run_train(
    dialect: Dialect,
    case: Case,
    options: EngineOptions,
    out_dir: str,
    multi: bool,
    partial: Record,
) -> Record:
    built = _Built(dialect, case, options, multi)
    if built.probe is not None:
        partial["received"] = built.probe.received  # filled in as training goes
    batches = train_stream(case, built.replica)
    losses, params = built.train(batches, case.steps)
    eval_loss = _loss_value(
        built.engine.eval_batch(iter(eval_stream(case, built.replica))),
        "eval_batch()",
        built.local,
    )
    return {
        "stages": built.local,
        "replica": built.replica,
        "losses": losses,
        "params": params,
        "eval_loss": eval_loss,
        "received": None if built.probe is None else built.probe.received,
    }


def _run_checkpoint(
    dialect: Dialect,
    case: Case,
    options: EngineOptions,
    out_dir: str,
    multi: bool,
    partial: Record,
) -> Record:
    ckpt = str(Path(out_dir) / f"checkpoint-{case.id}")
    first = _Built(dialect, case, options, multi)
    batches = train_stream(case, first.replica)
    saved_at = case.steps - 1
    losses, params = first.train(batches[: saved_at * case.gas], saved_at)
    _checkpointing(first.engine).save_checkpoint(ckpt, tag="suite")
    more_losses, more_params = first.train(batches[saved_at * case.gas :], 1)
    # A fresh engine on other weights (seed 7): everything must come from the checkpoint.
    resumed = _Built(dialect, case, options, multi, seed=7)
    _checkpointing(resumed.engine).load_checkpoint(ckpt, tag="suite")
    resumed_losses, resumed_params = resumed.train(batches[saved_at * case.gas :], 1)
    return {
        "stages": first.local,
        "replica": first.replica,
        "losses": losses + more_losses,
        "params": params + more_params,
        "resumed_stages": resumed.local,
        "resumed_losses": resumed_losses,
        "resumed_params": resumed_params,
    }


def _checkpointing(engine: RuntimeEngine) -> CheckpointingEngine:
    """``engine`` as the :class:`CheckpointingEngine` its dialect declares it is (checked when
    it was built: ``Dialect.runtime_engine``)."""
    if not isinstance(engine, CheckpointingEngine):
        raise ContractError(
            f"the dialect declares checkpoints but its engine ({type(engine).__name__}) is not a "
            "CheckpointingEngine: it needs save_checkpoint and load_checkpoint (DeepSpeed's "
            "signatures)"
        )
    return engine


#: The dialect a portable checkpoint is carried to and from: every stage in one process.
_REFERENCE_DIALECT = "local"


def _run_portable_checkpoint(
    dialect: Dialect,
    case: Case,
    options: EngineOptions,
    out_dir: str,
    multi: bool,
    partial: Record,
) -> Record:
    """Save on the dialect and resume on the local dialect, and the other way round.

    Every rank of a launch builds the local engine too (it holds every stage), so both
    directions run as one collective checkpoint on the same ranks.
    """
    local = get_dialect(_REFERENCE_DIALECT)
    saved_at = case.steps - 1
    split = saved_at * case.gas
    first = _Built(dialect, case, options, multi)
    batches = train_stream(case, first.replica)
    losses, params = first.train(batches[:split], saved_at)
    out = Path(out_dir)
    checkpoint.save(first.engine, out / f"portable-{case.id}-from-dialect", tag="suite")
    more_losses, more_params = first.train(batches[split:], 1)
    # The local dialect, on other weights (seed 7), resumes from the dialect's checkpoint.
    on_local = _Built(local, case, EngineOptions(), False, seed=7)
    checkpoint.load(on_local.engine, out / f"portable-{case.id}-from-dialect", tag="suite")
    resumed_losses, resumed_params = on_local.train(batches[split:], 1)
    # And the other way: the local dialect trains and saves, the dialect resumes.
    saver = _Built(local, case, EngineOptions(), False)
    saver.train(train_stream(case, 0)[:split], saved_at)
    checkpoint.save(saver.engine, out / f"portable-{case.id}-from-local", tag="suite")
    resumed = _Built(dialect, case, options, multi, seed=7)
    checkpoint.load(resumed.engine, out / f"portable-{case.id}-from-local", tag="suite")
    imported_losses, imported_params = resumed.train(batches[split:], 1)
    return {
        "stages": first.local,
        "replica": first.replica,
        "losses": losses + more_losses,
        "params": params + more_params,
        "resumed_losses": resumed_losses,
        "resumed_params": resumed_params,
        "imported_losses": imported_losses,
        "imported_params": imported_params,
    }


def _run_trace(
    dialect: Dialect,
    case: Case,
    options: EngineOptions,
    out_dir: str,
    multi: bool,
    partial: Record,
) -> Record:
    """Train and evaluate inside :func:`pipedialect.trace`; keep what it recorded."""
    built = _Built(dialect, case, options, multi)
    batches = train_stream(case, built.replica)
    with trace(built.engine, png=False) as recorded:
        losses, params = built.train(batches, case.steps)
        eval_loss = _loss_value(
            built.engine.eval_batch(iter(eval_stream(case, built.replica))),
            "eval_batch()",
            built.local,
        )
    timeline = recorded.timeline
    if timeline is None:  # pragma: no cover - trace() sets it on a clean exit
        raise ContractError("trace() recorded no timeline")
    return {
        "stages": built.local,
        "replica": built.replica,
        "losses": losses,
        "params": params,
        "eval_loss": eval_loss,
        "traced_stages": timeline.num_stages,
        "spans": [
            (s.kind, s.rank, s.stage, s.step, s.micro_batch, s.start_ns, s.end_ns)
            for s in timeline.spans
        ],
    }


def _run_build_error(
    dialect: Dialect,
    case: Case,
    options: EngineOptions,
    out_dir: str,
    multi: bool,
    partial: Record,
) -> Record:
    built = _Built(dialect, case, options, multi, mistake=case.mistake)
    if case.mistake == "untied":
        # Refusing the tie when training starts is acceptable too; training it untied is not.
        built.train(train_stream(case, built.replica), 1)
    return {"outcome": "no error", "stages": built.local}


def _run_run_error(
    dialect: Dialect,
    case: Case,
    options: EngineOptions,
    out_dir: str,
    multi: bool,
    partial: Record,
) -> Record:
    built = _Built(dialect, case, options, multi)
    losses, _ = built.train(train_stream(case, built.replica), case.steps)
    return {"outcome": "no error", "stages": built.local, "losses": losses}


_RUNNERS: dict[str, Callable[[Dialect, Case, EngineOptions, str, bool, Record], Record]] = {
    "train": _run_train,
    "checkpoint": _run_checkpoint,
    "portable-checkpoint": _run_portable_checkpoint,
    "trace": _run_trace,
    "build-error": _run_build_error,
    "run-error": _run_run_error,
}
