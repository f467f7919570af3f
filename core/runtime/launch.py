"""Run a function on N local ranks, the way ``torchrun`` would, and collect what each returns.

Used by the conformance suite, the test suite and ``pipedialect demo``. Each rank runs with
``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1`` and a
free ``MASTER_PORT`` set, and ``OMP_NUM_THREADS=1`` so that ranks sharing a few cores do not
oversubscribe them. A rank is forked from a fork server that imported torch once, and is given
this process's environment, ``sys.path`` and directory ([Note: how ranks start]). The first
rank to fail stops the launch: the others are terminated and
:class:`~pipedialect.errors.LaunchError` carries the failing rank's traceback. A launch that
outlives ``timeout`` is stopped the same way, never left hanging. The ranks never outlive the
launch: SIGTERM to the launching process stops them before it exits, and a rank whose launching
process is gone (killed outright) exits by itself.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, NamedTuple, NoReturn, TypeVar

from ..errors import LaunchError

__all__ = ["free_port", "launch"]

# [Note: how ranks start]
# By default a rank is forked from multiprocessing's fork server (``forkserver``), which imported
# torch, what ranks use of it (``_PRELOAD``) and, on a machine without CUDA, deepspeed, once,
# when the first launch of this process started it: a fresh interpreter spends 3-4 s of CPU
# on those imports, per rank and per launch, which is most of what a short multi-process run
# costs.
# The fork server is itself a fresh interpreter (never a fork of the launching process, whose
# threads and CUDA state a fork would copy), and it never initialises CUDA, so a rank may. What
# a spawned rank would inherit from the launching process at the time of the launch, a forked
# one is given explicitly before ``fn`` runs: the whole environment (with the rank's variables),
# ``sys.path`` and the working directory; ``OMP_NUM_THREADS`` also sets torch's thread count,
# since torch read it at import. A forked rank is the fork server's child, not the launching
# process's, so it watches the launching process by pid (and start time, against pid reuse),
# not its parent: killed outright (SIGKILL), the launching process may linger as a zombie its
# own parent has not reaped, which counts as gone. ``start_method="spawn"`` gives each rank a
# fresh interpreter instead, for code that must not share the fork server's imports.
# Of the Hugging Face packages (``_MIRRORED``) and, without CUDA, of pipedialect, the fork server
# also imports the modules the launching process had imported when it started the server: a
# rank of a conformance case imports the suite's harness as its launcher did (pytest with it:
# about 0.3 s of CPU per rank), one that trains a transformers model the same Trainer and model
# family (about 2.5 s), and a process that never imported them gives its fork server nothing
# more to import. torch.export's tracer (0.3 s), which the first capture of a model with
# example inputs imports, is mirrored the same way. The server is started by a process's first
# launch and serves every later one: what a later launch needs that the first did not, its
# ranks import themselves.

#: Modules the fork server imports once, for every rank it forks: torch, and what a rank of
#: any built-in dialect imports while it trains (about 1-2 s of CPU per rank otherwise):
#: ``torch._dynamo`` (tracing, export), ``torch.distributed.pipelining`` (the torch dialect)
#: and ``torch.utils.cpp_extension`` (DeepSpeed's communication op on CPUs).
_PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch.distributed.pipelining",
    "torch.utils.cpp_extension",
    "pipedialect",
    "pipedialect.runtime.launch",
)

#: Packages whose modules already imported by the launching process the fork server imports too
#: (pipedialect's as well on a machine without CUDA: [Note: how ranks start]).
_MIRRORED: tuple[str, ...] = ("transformers", "accelerate", "safetensors")

T = TypeVar("T")

_GRACE_SECONDS = 5.0
#: How often a rank checks that the process that launched it is still there.
_LAUNCHER_POLL_SECONDS = 0.5


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _rank_main(
    rank: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    out: str,
    log: str | None,
    start: tuple[dict[str, str], list[str], str, int],
) -> None:
    """Entry point of one rank: run ``fn`` and leave its result or traceback in ``out``.

    ``start`` is the environment, ``sys.path`` and working directory the rank runs with, and the
    pid of the launching process ([Note: how ranks start]).
    """
    environ, path, cwd, launcher = start
    os.environ.clear()
    os.environ.update(environ)
    sys.path[:] = path
    os.chdir(cwd)
    if "OMP_NUM_THREADS" in environ and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(environ["OMP_NUM_THREADS"]))
    # The launcher stops a rank with SIGTERM: leave through _leave, so its children go too.
    signal.signal(signal.SIGTERM, lambda signum, frame: _leave(128 + signum))
    threading.Thread(
        target=_exit_with_launcher,
        args=(launcher, _start_time(launcher)),
        name="pipedialect-launcher-watch",
        daemon=True,
    ).start()
    if log is not None:
        # Redirect at the file-descriptor level, so output of C++ code lands there too.
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    try:
        result: tuple[str, Any] = ("ok", fn(*args, **kwargs))
    except BaseException as exc:
        result = ("error", f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}")
    try:
        payload = pickle.dumps(result)
    except Exception as exc:
        result = ("error", f"rank {rank} returned an unpicklable result: {exc}")
        payload = pickle.dumps(result)
    Path(out).write_bytes(payload)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if result[0] == "error":
        # Leave at once: tearing down a process group whose peers are gone can block.
        _leave(1)
    # [Note: rank exit] The result is safe on disk. Wait until every rank is done with the
    # process group, then leave without interpreter teardown: destroying gloo groups and
    # DeepSpeed's communication state while a peer is still shutting down has aborted a rank
    # ("terminate called without an active exception") after a successful run. A peer that
    # failed never reaches the barrier; the launcher then stops this rank.
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
    _leave(0)


def _leave(code: int) -> NoReturn:
    """End this rank at once (``os._exit``), killing every process it started first.

    [Note: a rank's own children]
    ``os._exit`` skips the clean-up that would stop a rank's children, and so does a SIGTERM
    from the launcher: the workers of a ``DataLoader`` (DeepSpeed's loader for
    ``training_data`` starts two per rank, from a fork server) outlived every run, each with
    the fork server it came from, since a worker watches its parent (that fork server, still
    alive) and the fork server waits for its last client (those workers). So every way a rank
    ends -- its function returned or raised, the launcher is gone, the launcher stops it with
    SIGTERM -- goes through here, and every descendant of the rank (found through ``/proc``)
    is killed before it leaves.
    """
    with contextlib.suppress(Exception):
        for pid in _descendants(os.getpid()):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    os._exit(code)


def _descendants(root: int) -> list[int]:
    """The pids of every process below ``root`` (children first), read from ``/proc``."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        stat = _proc_stat(int(entry.name)) if entry.name.isdigit() else None
        if stat is not None:
            parents.setdefault(stat.parent, []).append(int(entry.name))
    found: list[int] = []
    below = [root]
    while below:
        children = parents.get(below.pop(), [])
        found.extend(children)
        below.extend(children)
    return found


def _exit_with_launcher(pid: int, started: str | None) -> None:
    """Leave at once when the launching process ``pid`` is gone (a rank must not linger)."""
    while _alive(pid, started):
        time.sleep(_LAUNCHER_POLL_SECONDS)
    _leave(1)


class _Stat(NamedTuple):
    """What ``/proc/<pid>/stat`` says of a process that the launcher reads."""

    state: str
    parent: int
    start: str


def _proc_stat(pid: int) -> _Stat | None:
    """The state, parent and start time of process ``pid`` from ``/proc/<pid>/stat``, or None
    where that file cannot be read (the process is gone, or there is no ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name in parentheses may hold spaces: count the fields after its ")".
    fields = stat.rsplit(")", 1)[1].split()
    return _Stat(fields[0], int(fields[1]), fields[19])


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (None where there is no ``/proc``)."""
    stat = _proc_stat(pid)
    return None if stat is None else stat.start


def _alive(pid: int, started: str | None) -> bool:
    """Whether process ``pid`` (started at ``started``) still runs: not gone, reused or a zombie."""
    if started is not None:
        stat = _proc_stat(pid)
        return stat is not None and stat.state not in ("Z", "X") and stat.start == started
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    return True


@contextlib.contextmanager
def _terminate_stops_ranks() -> Iterator[None]:
    """While ranks run, make SIGTERM raise ``SystemExit(143)`` so that they are stopped first.

    SIGTERM's default action ends this process on the spot, leaving its ranks running. A
    handler someone else installed is kept; signal handlers can only be set in the main thread.
    """
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def _environ(values: Mapping[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _context(
    start_method: str | None,
) -> multiprocessing.context.ForkServerContext | multiprocessing.context.SpawnContext:
    """The multiprocessing context ranks start from ([Note: how ranks start])."""
    if start_method is None:
        start_method = "forkserver"
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
    if start_method == "spawn":
        return multiprocessing.get_context("spawn")
    import importlib.util

    import torch

    ctx = multiprocessing.get_context("forkserver")
    preload = ["__main__", *_PRELOAD]
    mirrored = _MIRRORED
    if not torch.cuda.is_available():
        # DeepSpeed may initialise CUDA as it is imported, and so may any module that imports
        # it (the DeepSpeed dialect, a launched function's module): only on a machine
        # without CUDA does the server import them.
        if importlib.util.find_spec("deepspeed") is not None:
            preload += ["deepspeed", "deepspeed.pipe"]
        mirrored += ("pipedialect",)
    # Sorted: a package before its modules.
    preload += sorted(name for name in list(sys.modules) if name.split(".")[0] in mirrored)
    if "torch.export._trace" in sys.modules:
        preload.append("torch.export._trace")
    ctx.set_forkserver_preload(preload)
    return ctx


def launch(
    fn: Callable[..., T],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    env: Mapping[str, str] | None = None,
    on_poll: Callable[[], None] | None = None,
    log_dir: str | None = None,
    start_method: str | None = None,
    **kwargs: Any,
) -> list[T]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` local ranks; return the results by rank.

    ``fn`` must be importable by name (a module-level function), its arguments and result
    picklable. ``env`` adds environment variables for every rank. ``on_poll`` is called about
    every 50 ms while the ranks run (to show progress, say). With ``log_dir``, each rank's
    standard output and error go to ``<log_dir>/rank<r>.log`` instead of this terminal, and a
    failure quotes the end of the failing rank's log. ``start_method`` is ``"forkserver"`` (the
    default: ranks forked from a process that imported torch once, see [Note: how ranks start])
    or ``"spawn"`` (a fresh interpreter per rank); either way a rank sees the environment,
    ``sys.path`` and working directory of this process at the time of the launch.

    Raises:
        LaunchError: a rank raised or died (the message holds its traceback), or the launch
            ran longer than ``timeout`` seconds.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    ctx = _context(start_method)
    port = free_port()
    with (
        _terminate_stops_ranks(),
        tempfile.TemporaryDirectory(prefix="pipedialect-launch-") as tmp,
    ):
        procs: list[BaseProcess] = []
        outs = [str(Path(tmp) / f"rank{r}.pkl") for r in range(world_size)]
        logs = [
            None if log_dir is None else str(Path(log_dir) / f"rank{r}.log")
            for r in range(world_size)
        ]
        try:
            for rank in range(world_size):
                rank_env = {
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(world_size),
                    "LOCAL_WORLD_SIZE": str(world_size),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "OMP_NUM_THREADS": "1",
                    **(env or {}),
                }
                with _environ(rank_env):
                    start = (dict(os.environ), list(sys.path), str(Path.cwd()), os.getpid())
                    p = ctx.Process(
                        target=_rank_main,
                        args=(rank, fn, args, kwargs, outs[rank], logs[rank], start),
                        name=f"pipedialect-rank{rank}",
                    )
                    p.start()
                procs.append(p)
            _wait(procs, outs, logs, timeout, on_poll)
        finally:
            _stop(procs)
        return [_result(outs[r], r) for r in range(world_size)]


def _wait(
    procs: list[BaseProcess],
    outs: list[str],
    logs: list[str | None],
    timeout: float,
    on_poll: Callable[[], None] | None,
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        running = [r for r, p in enumerate(procs) if p.exitcode is None]
        failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if failed:
            # Peers of a failed rank fail too (their connections close); report the first.
            first = min(failed, key=lambda r: _failure_time(outs[r]))
            message = _failure(first, procs[first], outs[first], len(procs))
            message += _log_tail(logs[first])
            others = [r for r in failed if r != first]
            if others:
                message += f"\n(ranks {others} failed after it, most likely as a consequence)"
            raise LaunchError(message)
        if not running:
            return
        if time.monotonic() > deadline:
            raise LaunchError(
                f"launch of {len(procs)} ranks timed out after {timeout:.0f}s; ranks still "
                f"running: {running}. A rank is probably waiting for a peer that never sends."
            )
        procs[running[0]].join(0.05)
        if on_poll is not None:
            on_poll()


def _log_tail(log: str | None, lines: int = 30) -> str:
    if log is None or not Path(log).exists():
        return ""
    tail = Path(log).read_text(errors="replace").splitlines()[-lines:]
    return f"\n--- last {len(tail)} lines of {log} ---\n" + "\n".join(tail)


def _failure_time(out: str) -> float:
    path = Path(out)
    return path.stat().st_mtime if path.exists() else float("inf")


def _failure(rank: int, proc: BaseProcess, out: str, world: int) -> str:
    head = f"rank {rank} of {world} failed (exit code {proc.exitcode})"
    path = Path(out)
    if path.exists():
        status, detail = pickle.loads(path.read_bytes())
        if status == "error":
            return f"{head}:\n{detail}"
    if proc.exitcode is not None and proc.exitcode < 0:
        return f"{head}: killed by signal {signal.Signals(-proc.exitcode).name}"
    return f"{head} without a Python traceback; see the rank's output above"


def _stop(procs: list[BaseProcess]) -> None:
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    deadline = time.monotonic() + _GRACE_SECONDS
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join()


def _result(out: str, rank: int) -> Any:
    path = Path(out)
    if not path.exists():
        raise LaunchError(f"rank {rank} exited without reporting a result")
    status, value = pickle.loads(path.read_bytes())
    if status != "ok":
        raise LaunchError(f"rank {rank} failed:\n{value}")
    return value
