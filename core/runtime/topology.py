"""Process grids and joining the process group: the concrete side of :class:`Topology`.

:class:`GridTopology` is the ``pipe`` x ``data`` grid for dialects without a runtime topology
class; :func:`join_process_group` is what :meth:`~pipedialect.dialect.Dialect.init_distributed`
does by default. Every check of a topology is here, written once for every dialect:
:func:`check_topology_object` (the calls it answers, its pipe size), :func:`check_topology`
(one pipe coordinate per stage, no model axis), :func:`joined_world_size` and
:func:`check_world_size` (the process group exists and has the topology's ranks);
:meth:`PipelineRequest.process_grid() <pipedialect.dialect.PipelineRequest.process_grid>` runs
them in that order.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import operator
import os
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch

from ..contracts import Capability, Topology
from ..errors import ConfigError, RendezvousError, TopologyError

__all__ = [
    "GridCoord",
    "GridTopology",
    "check_topology",
    "check_topology_object",
    "check_world_size",
    "join_process_group",
    "join_with_deadline",
    "joined_world_size",
    "leave_at_exit",
    "rendezvous_seconds",
]

#: What ``torch.distributed``'s default ``env://`` rendezvous reads; a launcher sets them.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class GridTopology:
    """A row-major ``pipe`` x ``data`` x ``tensor`` grid, for dialects that need no runtime
    topology class.

    Ranks are laid out as DeepSpeed's ``PipeModelDataParallelTopology`` lays out its ``pipe``,
    ``data`` and ``model`` axes: the pipe axis is outermost and the tensor axis innermost, so
    the rank at ``(pipe=p, data=d, tensor=t)`` is ``(p * data + d) * tensor + t`` and the ranks
    of one stage are contiguous. ``tensor`` is 1 unless a dialect runs tensor parallelism.
    """

    def __init__(self, pipe: int, data: int = 1, tensor: int = 1) -> None:
        if pipe < 1 or data < 1 or tensor < 1:
            raise TopologyError(
                f"pipe ({pipe}), data ({data}) and tensor ({tensor}) must all be at least 1"
            )
        self._dims = {"pipe": pipe, "data": data, "tensor": tensor}

    def get_dim(self, axis: str) -> int:
        """Return the size of ``axis``; 0 for an axis the grid does not have."""
        return self._dims.get(axis, 0)

    def world_size(self) -> int:
        """Return ``pipe * data * tensor``."""
        return self._dims["pipe"] * self._dims["data"] * self._dims["tensor"]

    def get_coord(self, rank: int) -> GridCoord:
        """Return the ``(pipe, data, tensor)`` coordinate of ``rank``."""
        if not 0 <= rank < self.world_size():
            raise TopologyError(f"rank {rank} is outside a grid of {self.world_size()} ranks")
        rest, tensor = divmod(rank, self._dims["tensor"])
        pipe, data = divmod(rest, self._dims["data"])
        return GridCoord(pipe=pipe, data=data, tensor=tensor)

    def get_rank(self, *, pipe: int, data: int = 0, tensor: int = 0) -> int:
        """Return the global rank at ``(pipe, data, tensor)``."""
        return (pipe * self._dims["data"] + data) * self._dims["tensor"] + tensor

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """Return the ranks whose coordinates match every ``axis=value`` given, in order."""
        return [
            rank
            for rank in range(self.world_size())
            if all(
                getattr(self.get_coord(rank), axis) == value
                for axis, value in filter_kwargs.items()
            )
        ]

    def __repr__(self) -> str:
        tensor = f", tensor={self._dims['tensor']}" if self._dims["tensor"] > 1 else ""
        return f"GridTopology(pipe={self._dims['pipe']}, data={self._dims['data']}{tensor})"


class GridCoord(NamedTuple):
    """A ``(pipe, data, tensor)`` coordinate with named fields, like DeepSpeed's ProcessCoord."""

    #: The pipeline stage.
    pipe: int
    #: The data-parallel replica.
    data: int
    #: The position on the tensor-parallel axis (0 without tensor parallelism).
    tensor: int = 0


def join_process_group(
    dialect_name: str, capabilities: Iterable[Capability], backend: str | None = None
) -> None:
    """Join the process group described by the launcher's environment (RANK, WORLD_SIZE, ...).

    ``backend`` defaults to ``nccl`` when CUDA is available, else ``gloo``. Nothing happens for
    a dialect that does not declare ``multi-process`` (there is no group to join) or when the
    group already exists.

    Raises:
        ConfigError: the process was not started by a launcher (``torchrun``, the conformance
            suite's): the environment lacks the variables that describe the group.
    """
    import torch.distributed as dist

    if Capability.MULTI_PROCESS not in set(capabilities) or dist.is_initialized():
        return
    missing = [name for name in LAUNCH_VARIABLES if name not in os.environ]
    if missing:
        raise ConfigError(
            f"dialect {dialect_name!r} runs one process per pipeline rank, but this process "
            f"was not started by a launcher ({', '.join(missing)} not set): start the "
            "script with `torchrun --nproc_per_node N script.py` (N = stages x replicas), "
            "or use the 'local' dialect to run every stage in this process"
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    join_with_deadline(backend)


#: The environment variable that sets how long ranks wait for each other to join, in seconds.
RENDEZVOUS_VARIABLE = "PIPEDIALECT_RENDEZVOUS_SECONDS"
#: How long ranks wait for each other to join when :data:`RENDEZVOUS_VARIABLE` is not set.
RENDEZVOUS_SECONDS = 300.0
#: How long a rank waits for an answer from a ``MASTER_PORT`` that accepts connections: the
#: store answers at once, a program that is no store never does.
STORE_ANSWER_SECONDS = 10.0


def rendezvous_seconds() -> float:
    """How long ranks wait for each other to join (:data:`RENDEZVOUS_VARIABLE`)."""
    text = os.environ.get(RENDEZVOUS_VARIABLE)
    if text is None:
        return RENDEZVOUS_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise ConfigError(f"{RENDEZVOUS_VARIABLE}={text!r} must be a positive number of seconds")
    return seconds


def join_with_deadline(backend: str, timeout: Any = None) -> None:
    """``torch.distributed.init_process_group`` through the launcher's environment, never a
    hang ([Note: bounded rendezvous]). ``timeout`` is the process group's operation timeout
    (torch's default when None).

    [Note: bounded rendezvous]
    ``init_process_group``'s own rendezvous waits as long as the process group's timeout (30
    minutes) for a rank that never starts, and a rank whose ``MASTER_PORT`` is held by another
    program waits for ever: the store client connects, then waits for an answer that never
    comes. Here rank 0 (the store's host) fails at once on a port in use; every rank waits at
    most :func:`rendezvous_seconds` for the others to join; and a rank that reaches a port
    which accepts connections but does not answer as a store within
    :data:`STORE_ANSWER_SECONDS` stops: another program holds it. Each is a
    :class:`~pipedialect.RendezvousError` naming the address, the port and what to do. A rank
    that gave up on a silent port leaves one blocked thread behind; the process is expected to
    end. Under ``torchrun`` the agent's store is used, as ``init_process_group`` would.

    Raises:
        RendezvousError: the port is in use, or the ranks did not all join in time.
    """
    import torch.distributed as dist
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    address = os.environ["MASTER_ADDR"]
    port = int(os.environ["MASTER_PORT"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    seconds = rendezvous_seconds()
    hosts = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    start = time.monotonic()

    def failed(what: str, cause: BaseException | None = None) -> RendezvousError:
        error = RendezvousError(
            f"rank {rank} of {world} could not join the process group at {address}:{port} "
            f"(MASTER_ADDR:MASTER_PORT) after {time.monotonic() - start:.1f}s: {what}",
            address=address,
            port=port,
            seconds=time.monotonic() - start,
        )
        error.__cause__ = cause
        return error

    if not hosts:
        # Connect only once the port accepts connections, so that the store's answer is due
        # at once (the client's own retries back off for seconds).
        while not _accepts(address, port):
            if time.monotonic() - start > seconds:
                raise failed(
                    f"nothing listens there, and rank 0 (which holds the store) did not start "
                    f"within {seconds:.0f}s ({RENDEZVOUS_VARIABLE}); check that every rank was "
                    "started with the same MASTER_ADDR and MASTER_PORT"
                )
            time.sleep(0.1)
    result: dict[str, Any] = {}

    def form() -> None:
        try:
            result["store"] = TCPStore(
                address,
                port,
                world,
                hosts,
                timeout=datetime.timedelta(seconds=seconds),
                wait_for_workers=True,
            )
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=form, name="pipedialect-rendezvous", daemon=True)
    thread.start()
    answer = start if hosts else time.monotonic()
    while thread.is_alive():
        thread.join(0.05)
        if not hosts and thread.is_alive() and time.monotonic() - answer > STORE_ANSWER_SECONDS:
            raise failed(
                f"the port accepts connections but no torch.distributed store answered within "
                f"{STORE_ANSWER_SECONDS:.0f}s: another program holds MASTER_PORT. Start every "
                "rank with a free MASTER_PORT (rank 0 says which program has it)"
            )
    if "error" in result:
        cause = result["error"]
        if "EADDRINUSE" in str(cause) or "address already in use" in str(cause):
            raise failed(
                "the port is in use by another program, so rank 0 cannot hold the store there; "
                "start every rank with a free MASTER_PORT (`ss -ltnp` shows which program has "
                "it). The other ranks stop too",
                cause,
            ) from cause
        raise failed(
            f"not every rank joined within {seconds:.0f}s ({RENDEZVOUS_VARIABLE}): a rank did "
            f"not start, or was started with another WORLD_SIZE, MASTER_ADDR or MASTER_PORT "
            f"({type(cause).__name__}: {cause})",
            cause,
        ) from cause
    store = result["store"]
    # The store's host waited for every rank to connect; the others wait until every rank
    # has counted itself, so that no rank enters the process group (which waits as long as
    # its operations may) while one is missing.
    key = "pipedialect/rendezvous/joined"
    try:
        joined = int(store.add(key, 1))
        while joined < world:
            if time.monotonic() - start > seconds:
                raise failed(
                    f"only {joined} of {world} ranks joined within {seconds:.0f}s "
                    f"({RENDEZVOUS_VARIABLE}): a rank did not start, or was started with "
                    "another WORLD_SIZE, MASTER_ADDR or MASTER_PORT"
                )
            time.sleep(0.05)
            joined = int(store.add(key, 0))
    except RendezvousError:
        raise
    except Exception as exc:  # the host gave up (and took the store with it)
        raise failed(
            f"rank 0 gave up waiting for every rank to join ({type(exc).__name__}: {exc}); a "
            "rank did not start, or was started with another WORLD_SIZE, MASTER_ADDR or "
            "MASTER_PORT",
            exc,
        ) from exc
    kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, **kwargs)
    # Blocking store calls after the rendezvous wait as long as the process group's operations.
    from torch.distributed.constants import default_pg_timeout

    with contextlib.suppress(Exception):
        store.set_timeout(timeout or default_pg_timeout)
    _register_leave_at_exit()


#: How long a rank ending its script waits for every other rank before it destroys the process
#: group it joined ([Note: leaving at exit]).
LEAVE_AT_EXIT_SECONDS = 60.0


def _register_leave_at_exit() -> None:
    """Register :func:`leave_at_exit` once, however many times the process joins a group."""
    atexit.unregister(leave_at_exit)
    atexit.register(leave_at_exit)


def leave_at_exit(seconds: float | None = None) -> bool:
    """Destroy the gloo process group once every rank has arrived; return whether it did.

    [Note: leaving at exit]
    A script that ends without ``destroy_process_group`` leaves gloo's worker threads to the
    interpreter's finalization, which aborts the process (SIGABRT, "terminate called without
    an active exception") after a run that succeeded: ``torchrun`` then reports the job as
    failed. On two shared cores five ranks that only ran ``all_gather`` aborted that way in
    every one of six runs. So the group :func:`join_with_deadline` formed is destroyed at exit
    (an ``atexit`` hook, while the interpreter is whole), after every rank has arrived
    (``monitored_barrier``, at most ``seconds``, default :data:`LEAVE_AT_EXIT_SECONDS`): a
    rank that closed its connections before a peer had read its last message would fail
    that peer instead. When the barrier fails (a peer died, or is stuck elsewhere and never
    arrives) nothing more is done and the process ends as it would have. A script that
    destroyed the group itself, and groups on another backend than gloo, are left alone
    (NCCL's own teardown is torch's ``destroy_process_group`` contract with the script).
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return False
    try:
        if dist.get_backend() != "gloo":
            return False
        limit = LEAVE_AT_EXIT_SECONDS if seconds is None else seconds
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=limit))
    except Exception:  # a peer is gone or elsewhere: leave as the script would have
        return False
    try:
        dist.destroy_process_group()
    except Exception:
        return False
    return True


def _accepts(address: str, port: int) -> bool:
    """Whether ``address:port`` accepts a TCP connection now."""
    try:
        with socket.create_connection((address, port), timeout=1.0):
            return True
    except OSError:
        return False


#: The calls of a :class:`~pipedialect.Topology` that tie analysis makes.
_TOPOLOGY_CALLS = ("get_dim", "filter_match", "get_coord")


def check_topology_object(topology: Any, calls: Sequence[str] = _TOPOLOGY_CALLS) -> int:
    """Raise :class:`TopologyError` unless ``topology`` answers ``calls``; return its pipe size.

    Checked up front so that a wrong object (a class instead of an instance, a topology of
    another library) gets a named error instead of a ``TypeError`` deep inside the analysis.
    """
    wanted = "get_dim(axis), filter_match(**axes), get_coord(rank) and world_size()"
    if isinstance(topology, type):
        raise TopologyError(
            f"topology must be a topology object, got the class {topology.__name__}; create "
            f"one first (e.g. {topology.__name__}(num_pp=..., num_mp=1, num_dp=...))"
        )
    missing = [call for call in calls if not callable(getattr(topology, call, None))]
    if missing:
        raise TopologyError(
            f"topology {topology!r} ({type(topology).__name__}) has no "
            f"{', '.join(f'{m}()' for m in missing)} method; a topology needs {wanted}, as "
            "DeepSpeed's ProcessTopology and pipedialect.GridTopology provide"
        )
    raw = topology.get_dim("pipe")
    try:
        num_pipe = operator.index(raw)
    except TypeError:
        num_pipe = 0
    if isinstance(raw, bool) or num_pipe < 1:
        raise TopologyError(
            f"topology {type(topology).__name__}.get_dim('pipe') returned {raw!r}; it must "
            "return the number of pipeline stages, a positive int"
        )
    return num_pipe


def check_topology(topology: Any, num_stages: int | None = None) -> int:
    """Raise :class:`TopologyError` unless ``topology`` can hold a plan; return its pipe size.

    It must answer ``get_dim`` with a positive pipe size, equal to ``num_stages`` when given
    (one stage per pipe coordinate), and have no model axis beyond 1: pipedialect does not
    shard stages for tensor parallelism.
    """
    num_pipe = check_topology_object(topology, ("get_dim",))
    model = topology.get_dim("model") or 1
    if model > 1:
        raise TopologyError(
            f"the topology has a model-parallel axis of size {model}; pipedialect does not "
            "shard stages for tensor parallelism: use a topology with model=1 (num_mp=1), e.g. "
            "dialect.make_topology(num_stages, data_parallel)"
        )
    if num_stages is not None and num_pipe != num_stages:
        raise TopologyError(
            f"the topology's pipe axis has {num_pipe} coordinates but the plan has "
            f"{num_stages} stages; build the topology with num_pp={num_stages} "
            "(one stage per pipe rank)"
        )
    return num_pipe


def joined_world_size(dialect_name: str) -> int:
    """The size of the default process group, which a multi-process engine needs.

    Raises:
        ConfigError: the process group is not initialised.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            f"the process group is not initialised: call get_dialect({dialect_name!r})"
            ".init_distributed() on every rank (started by torchrun or an equivalent) "
            "before building the engine"
        )
    return int(dist.get_world_size())


def check_world_size(topology: Topology, world_size: int) -> None:
    """Raise :class:`TopologyError` unless ``topology`` describes ``world_size`` ranks."""
    if topology.world_size() != world_size:
        raise TopologyError(
            f"the topology describes {topology.world_size()} ranks but the process group "
            f"has {world_size}; launch pipe x data = {topology.world_size()} processes"
        )
