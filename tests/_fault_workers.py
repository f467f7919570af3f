"""What each rank runs in the fault-injection tests (module-level, so forked ranks import it).

A fault is injected on one rank (the victim) in one phase the ranks run together -- building the
engine, a training step, ``pipedialect.checkpoint.save``, ``pipedialect.checkpoint.load`` -- as
an exception (an ``OSError`` where a disk would fail) or as a death without a word. The victim
records the wall-clock time of the injection; every rank records what it raised and when, so the
test measures how long the failure took to reach each rank (ranks share one clock: one machine).

A victim dies as SIGKILL would end it -- ``os._exit``: no Python teardown, no error posted, the
kernel closes its sockets -- but with exit status 0, so that the launcher lets the survivors
finish instead of stopping them the moment it sees a rank killed by a signal. Survivors write
their records to files as well (the launch itself fails: the victim reports no result).
"""

from __future__ import annotations

import errno
import os
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _error_records import error_record
from _reliability_workers import config, step_batches

import pipedialect
from pipedialect import checkpoint
from pipedialect.models import get_model
from pipedialect.plan.partition import partition
from pipedialect.runtime.topology import RENDEZVOUS_VARIABLE

#: How long the ranks wait for a rank that never starts.
LONELY_SECONDS = 4.0

PHASES = ("build", "step", "save", "load")
_ATTRS = ("rank", "what", "error", "field", "address", "port")


def _record(exc: BaseException | None) -> dict[str, Any]:
    if exc is None:
        return {"error": None, "at": time.time()}
    return {**error_record(exc, _ATTRS), "at": time.time()}


def _attempt(fn: Callable[[], Any]) -> dict[str, Any]:
    try:
        fn()
    except Exception as exc:
        return _record(exc)
    return _record(None)


class _Injector:
    """Injects the fault on the victim: ``fire()`` raises or dies there, nothing elsewhere."""

    def __init__(self, directory: Path, rank: int, victim: int, how: str, case: str) -> None:
        self.directory, self.rank, self.victim, self.how, self.case = (
            directory,
            rank,
            victim,
            how,
            case,
        )

    def fire(self) -> None:
        if self.rank != self.victim:
            return
        (self.directory / f"{self.case}.injected").write_text(repr(time.time()))
        if self.how == "kill":
            os._exit(0)
        if self.how == "oserror":
            raise OSError(errno.ENOSPC, f"No space left on device (injected in {self.case})")
        raise RuntimeError(f"injected failure in {self.case}")


class _Loader:
    """A data loader's position: what ``checkpoint.save``/``load`` ask of one on every rank."""

    def __init__(self, fault: _Injector | None = None) -> None:
        self.fault = fault

    def state_dict(self) -> dict[str, int]:
        if self.fault is not None:
            self.fault.fire()
        return {"position": 1}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if self.fault is not None:
            self.fault.fire()


class _Run:
    def __init__(self, dialect_name: str) -> None:
        self.name = dialect_name
        self.dialect = pipedialect.get_dialect(dialect_name)
        self.dialect.init_distributed()
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.base = dist.distributed_c10d._get_default_store()
        self.groups = 0

    def fresh_group(self) -> None:
        """A new process group on a fresh part of the launch's store, if the last one was shut
        down (a failure whose peers waited for the failed rank)."""
        if dist.is_initialized():
            return
        self.groups += 1
        store = dist.PrefixStore(f"fresh{self.groups}", self.base)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world)

    def build(self, optimizer: Any = None) -> tuple[Any, Any]:
        spec = get_model("skip")
        plan = partition(spec.factory(seed=0, dim=16), ["blocks.1"])
        module = self.dialect.pipe_engine(
            plan,
            config=config(),
            loss_fn=spec.loss_fn,
            topology=self.dialect.make_topology(plan.num_stages),
        )
        if optimizer is None:
            return plan, self.dialect.runtime_engine(module, config=config())
        cfg = {k: v for k, v in config().items() if k != "optimizer"}
        return plan, self.dialect.runtime_engine(module, config=cfg, optimizer=optimizer)

    def step_with(self, plan: Any, engine: Any, fault: _Injector) -> None:
        """A step whose second micro-batch reaches the fault in this rank's stage forward."""
        calls = {"n": 0}

        def hook(module: Any, args: Any) -> None:
            calls["n"] += 1
            if calls["n"] == 2:
                fault.fire()

        handles = [
            plan.stages[k].register_forward_pre_hook(hook)
            for k in self.dialect.local_stages(engine)
        ]
        try:
            engine.train_batch(iter(step_batches(1)))
        finally:
            for h in handles:
                h.remove()


def _case(run: _Run, directory: Path, phase: str, how: str, victim: int, case: str) -> Any:
    """Run ``phase`` with the fault of ``case`` injected; return what this rank raised."""
    fault = _Injector(directory, run.rank, victim, how, case)
    if phase == "build":

        def factory(groups: Any) -> torch.optim.Optimizer:
            fault.fire()
            return torch.optim.Adam(groups, lr=1e-2)

        return _attempt(lambda: run.build(optimizer=factory))
    plan, engine = run.build()
    if phase == "step":
        return _attempt(lambda: run.step_with(plan, engine, fault))
    if phase == "save":
        return _attempt(
            lambda: checkpoint.save(engine, directory / "ckpt", tag=case, dataloader=_Loader(fault))
        )
    if phase == "load":
        if how == "kill":
            # Dies as the ranks start reading the tensors together (inside DCP's collectives
            # on the others): a lost peer, never a bad checkpoint.
            original = checkpoint._read_tensors

            def reading(*args: Any, **kwargs: Any) -> Any:
                fault.fire()
                return original(*args, **kwargs)

            checkpoint._read_tensors = reading  # type: ignore[assignment]
            try:
                return _attempt(lambda: checkpoint.load(engine, directory / "ckpt", tag="a"))
            finally:
                checkpoint._read_tensors = original  # type: ignore[assignment]
        loader = _Loader(fault)
        return _attempt(
            lambda: checkpoint.load(engine, directory / "ckpt", tag="a", dataloader=loader)
        )
    raise ValueError(phase)


def faults(
    dialect_name: str,
    directory: str,
    cases: list[tuple[str, str, int]],
    *,
    ports: tuple[int, dict[str, int]] | None = None,
) -> dict[str, Any]:
    """The cases of one launch: with ``ports``, :func:`rendezvous` first; then checkpoint
    ``a`` saved (one step trained) and ``cases`` (phase, how, victim) in turn, each on a fresh
    engine (and a fresh process group when the last was shut down). A ``kill`` case must be
    the last: the victim does not come back."""
    out: dict[str, Any] = {}
    if ports is not None:
        out["rendezvous"] = rendezvous(*ports)
    run = _Run(dialect_name)
    out["rank"] = run.rank
    root = Path(directory)
    (root / f"preamble.rank{run.rank}").write_bytes(pickle.dumps(out))
    _, engine = run.build()
    engine.train_batch(iter(step_batches(0)))
    checkpoint.save(engine, root / "ckpt", tag="a", dataloader=_Loader())
    dist.barrier()
    for phase, how, victim in cases:
        name = f"{phase}-{how}-{victim}"
        out[name] = _case(run, root, phase, how, victim, name)
        (root / f"{name}.rank{run.rank}").write_bytes(pickle.dumps(out[name]))
        if how == "kill":
            break  # the victim is gone: this group can never meet again
        run.fresh_group()
        dist.barrier()
    return out


# -- ranks that disagree, then leave at once ----------------------------------------------------


def disagree_and_exit(dialect_name: str, directory: str) -> None:
    """Build pipelines of 2 and 3 stages on ranks 0 and 1, record the error, and end the
    process at once (as a script that ends on the error does: its sockets close with it), so
    that a rank which raised before its peer had the verdict breaks the peer's collective.
    Exits with status 0 and no result: the record is in ``directory``."""
    run = _Run(dialect_name)
    spec = get_model("skip")
    splits = ["blocks.1"] if run.rank == 0 else ["blocks.0", "blocks.2"]
    plan = partition(spec.factory(seed=0, dim=16), splits)

    def build() -> None:
        run.dialect.pipe_engine(
            plan,
            config=config(),
            loss_fn=spec.loss_fn,
            topology=run.dialect.make_topology(plan.num_stages),
        )

    record = _attempt(build)
    (Path(directory) / f"disagree.rank{run.rank}").write_bytes(pickle.dumps(record))
    os._exit(0)


# -- joining the process group -----------------------------------------------------------------


def rendezvous(busy_port: int, lonely_ports: dict[str, int]) -> dict[str, Any]:
    """Each dialect's ``init_distributed`` with ``MASTER_PORT`` held by another program, then
    with a world of 3 ranks of which only 2 start (a port per dialect)."""
    out: dict[str, Any] = {}
    good = os.environ["MASTER_PORT"]
    for name in ("torch", "deepspeed"):
        os.environ["MASTER_PORT"] = str(busy_port)
        start = time.monotonic()
        out[f"busy-{name}"] = _attempt(pipedialect.get_dialect(name).init_distributed)
        out[f"busy-{name}"]["seconds"] = time.monotonic() - start
    os.environ["WORLD_SIZE"] = "3"
    os.environ[RENDEZVOUS_VARIABLE] = str(LONELY_SECONDS)
    for name in ("torch", "deepspeed"):
        os.environ["MASTER_PORT"] = str(lonely_ports[name])
        start = time.monotonic()
        out[f"lonely-{name}"] = _attempt(pipedialect.get_dialect(name).init_distributed)
        out[f"lonely-{name}"]["seconds"] = time.monotonic() - start
    del os.environ[RENDEZVOUS_VARIABLE]
    os.environ["WORLD_SIZE"] = "2"
    os.environ["MASTER_PORT"] = good
    return out
