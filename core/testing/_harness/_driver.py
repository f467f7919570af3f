"""The test-process side of the suite's runs: who runs which case where, and what came back.

A :class:`DialectRun` belongs to one dialect (with one set of engine options) for one pytest
session. The first test that asks for a case's result runs every case the session's selected
tests need and the dialect's capabilities admit, grouped by world size: in this process for a
single-process dialect, else one launch per group of the ranks the dialect's topology asks for
(:func:`pipedialect.runtime.launch.launch`). When a launch ends early (a rank raised, or a case
made no progress for ``case_timeout`` seconds) the case it was in takes the launcher's message
and the cases after it run in a new launch, so one broken contract costs one test, not all.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...contracts import Capability
from ...dialect import Dialect
from ...errors import LaunchError, PipeDialectError
from ...runtime.launch import launch
from .._options import EngineOptions
from ._cases import CASES, Case
from ._runner import ends_launch, one_thread, read_stopped, record_path, run_cases

__all__ = ["CaseResult", "DialectRun"]

logger = logging.getLogger(__name__)

_KIND_ORDER = {
    "train": 0,
    "checkpoint": 1,
    "portable-checkpoint": 2,
    "trace": 3,
    "build-error": 4,
    "run-error": 5,
}


@dataclass
class CaseResult:
    """What the ranks of one case recorded."""

    #: The case.
    case: Case
    #: Ranks (processes) the case ran on; 1 in the test process.
    world_size: int
    #: Each rank's record, by rank; a rank that was stopped has none.
    records: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: The launcher's message when the launch ended during this case.
    launch_error: str | None = None

    @property
    def complete(self) -> bool:
        """Every rank recorded the case."""
        return len(self.records) == self.world_size

    @property
    def ended_launch(self) -> bool:
        """The launch stopped in this case: a rank is missing, or one stopped after it."""
        return not self.complete or any(
            ends_launch(self.case, rec) for rec in self.records.values()
        )


class _Watchdog:
    """Stops a launch in which no case has finished for ``timeout`` seconds (a hang)."""

    def __init__(self, out_dir: Path, cases: Sequence[Case], world: int, timeout: float) -> None:
        self.out_dir = out_dir
        self.cases = cases
        self.world = world
        self.timeout = timeout
        self.count = 0
        self.since = time.monotonic()

    def poll(self) -> None:
        count = sum(1 for _ in self.out_dir.glob("*.pkl"))
        now = time.monotonic()
        if count != self.count:
            self.count, self.since = count, now
            return
        if now - self.since > self.timeout:
            current = self._current()
            raise LaunchError(
                f"case {current} made no progress for {self.timeout:.0f}s on {self.world} "
                "ranks: the dialect hangs (a rank waiting for a peer that never sends, or a "
                "collective only some ranks reached). Raise --conformance-timeout if the "
                "machine is merely slow."
            )

    def _current(self) -> str:
        for case in self.cases:
            done = [r for r in range(self.world) if record_path(self.out_dir, case.id, r).exists()]
            if len(done) < self.world:
                return repr(case.id)
        return "(after the last case)"


class DialectRun:
    """Runs cases against one dialect and keeps their results for the session."""

    def __init__(
        self,
        dialect: Dialect,
        options: EngineOptions,
        workdir: Path,
        *,
        case_timeout: float = 180.0,
        wanted: Iterable[str] = (),
    ) -> None:
        self.dialect = dialect
        self.options = options
        self.workdir = workdir
        self.case_timeout = case_timeout
        self.wanted = set(wanted)
        self.results: dict[str, CaseResult] = {}
        self._launches = 0
        self.multi = Capability.MULTI_PROCESS in dialect.capabilities

    def result(self, case_id: str) -> CaseResult:
        """The result of ``case_id``, running it (and every other wanted case) if needed."""
        if case_id not in self.results:
            caps = frozenset(self.dialect.capabilities)
            pending = [
                c
                for c in CASES
                if c.id not in self.results
                and (c.id == case_id or (c.id in self.wanted and c.applies_to(caps)))
            ]
            self._run(pending)
        return self.results[case_id]

    def _run(self, cases: Sequence[Case]) -> None:
        if not self.multi:
            self._run_in_process(cases)
            return
        groups: dict[int, list[Case]] = {}
        for case in cases:
            groups.setdefault(self._world_size(case), []).append(case)
        for world in sorted(groups):
            ordered = sorted(groups[world], key=lambda c: _KIND_ORDER[c.kind])
            self._run_launches(world, ordered)

    def _world_size(self, case: Case) -> int:
        """Ranks the dialect needs for ``case``: what its own topology says.

        One stage per rank gives ``stages * data_parallel``; a dialect that places several
        stages on a rank (an interleaved or V-shaped schedule) asks for fewer. A case the
        dialect cannot place at all runs on ``stages * data_parallel`` ranks, where building
        its engine reports why.
        """
        try:
            return int(
                self.dialect.make_topology(
                    case.stages, case.data_parallel, **case.tensor_kwargs
                ).world_size()
            )
        except PipeDialectError:
            return case.world_size

    def _new_dir(self) -> Path:
        self._launches += 1
        path = self.workdir / f"run{self._launches}"
        path.mkdir(parents=True)
        return path

    def _run_in_process(self, cases: Sequence[Case]) -> None:
        out = self._new_dir()
        start = time.monotonic()
        with one_thread():
            run_cases(
                self.dialect,
                [c.id for c in cases],
                str(out),
                self.options,
                in_process=True,
                timeout=self.case_timeout,
            )
        logger.info("ran %d cases in process in %.1fs", len(cases), time.monotonic() - start)
        for case in cases:
            stopped = read_stopped(out, case.id)  # it made no progress for case_timeout
            self.results[case.id] = CaseResult(case, 1, _read(out, case.id, 1), stopped)

    def _rank_env(self) -> dict[str, str]:
        """Hide GPUs from the ranks unless the dialect is cuda-only.

        The reference trains on the CPU, and the tolerance is the CPU's: fp32 kernels on a GPU
        sum in other orders. Hidden GPUs also keep a dialect from putting two NCCL ranks on one
        device; ``init_distributed()`` then picks gloo.
        """
        if Capability.CUDA_ONLY in self.dialect.capabilities:
            return {}
        return {"CUDA_VISIBLE_DEVICES": ""}

    def _run_launches(self, world: int, cases: Sequence[Case]) -> None:
        remaining = list(cases)
        while remaining:
            out = self._new_dir()
            watchdog = _Watchdog(out, remaining, world, self.case_timeout)
            error: str | None = None
            start = time.monotonic()
            try:
                launch(
                    run_cases,
                    world,
                    self.dialect,
                    [c.id for c in remaining],
                    str(out),
                    self.options,
                    timeout=self.case_timeout * (len(remaining) + 2),
                    env=self._rank_env(),
                    on_poll=watchdog.poll,
                    log_dir=str(out),
                )
            except LaunchError as exc:
                error = str(exc)
            logger.info(
                "launch of %d ranks for %s took %.1fs%s",
                world,
                [c.id for c in remaining],
                time.monotonic() - start,
                "" if error is None else " and failed",
            )
            results = [CaseResult(c, world, _read(out, c.id, world)) for c in remaining]
            ended = next((i for i, r in enumerate(results) if r.ended_launch), None)
            for result in results[: ended if ended is not None else None]:
                self.results[result.case.id] = result
            if ended is None:
                return
            failed = results[ended]
            failed.launch_error = error or "the launch ended without every rank recording it"
            self.results[failed.case.id] = failed
            if ended == 0 and not failed.records:
                # Nothing was recorded at all: the ranks failed before the first case (joining
                # the process group, importing the dialect). Running again would fail again.
                for result in results[1:]:
                    result.launch_error = (
                        f"not run: the launch failed before its first case ({failed.case.id}):"
                        f"\n{failed.launch_error}"
                    )
                    self.results[result.case.id] = result
                return
            remaining = remaining[ended + 1 :]


def _read(out: Path, case_id: str, world: int) -> dict[int, dict[str, Any]]:
    records = {}
    for rank in range(world):
        path = record_path(out, case_id, rank)
        if path.exists():
            records[rank] = pickle.loads(path.read_bytes())
    return records
