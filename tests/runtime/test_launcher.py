"""The local multi-process launcher: results by rank, fail-fast with the traceback, timeouts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import _launch_targets as targets
import psutil
import pytest

# Imported before any launch of this module, so that the fork server started by the first one
# finds them in this process (test_each_launch_gives_its_ranks_...).
import torch.export._trace  # noqa: F401
import transformers.trainer  # noqa: F401

import pipedialect.models  # noqa: F401
from pipedialect import LaunchError
from pipedialect.runtime.launch import launch

pytestmark = pytest.mark.distributed


def test_ranks_get_torchrun_environment_and_results_come_back_in_order() -> None:
    results = launch(targets.report_env, 3, env={"EXTRA": "x"})
    assert [r["RANK"] for r in results] == ["0", "1", "2"]
    assert {r["WORLD_SIZE"] for r in results} == {"3"}
    assert {r["MASTER_ADDR"] for r in results} == {"127.0.0.1"}
    assert {r["OMP_NUM_THREADS"] for r in results} == {"1"}
    assert {r["EXTRA"] for r in results} == {"x"}


@pytest.mark.parametrize("start_method", [None, "forkserver", "spawn"])
def test_each_launch_gives_its_ranks_this_processs_environment_path_and_directory(
    start_method: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    launch(targets.report_env, 1, start_method=start_method)  # the fork server now runs
    monkeypatch.setenv("LATE", "set after the first launch")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "extra"))
    results = launch(targets.report_start, 2, start_method=start_method)
    for r in results:
        assert r["LATE"] == "set after the first launch"
        assert r["cwd"] == str(tmp_path)
        assert str(tmp_path / "extra") in r["path"]
        assert r["threads"] == 1  # OMP_NUM_THREADS=1, though torch was imported before
        # What this process imported of transformers, pipedialect and torch.export, a forked
        # rank has without importing it.
        forked = start_method != "spawn"
        assert r["transformers"] == r["pipedialect"] == r["torch.export"] == forked, r


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_ranks_leave_when_the_launching_process_is_killed_outright(
    start_method: str, tmp_path: Path
) -> None:
    """SIGKILL leaves the launcher no time to stop its ranks: they notice and leave by
    themselves, even while the killed launcher is a zombie its parent has not reaped yet (a
    forked rank is not the launcher's child, so it watches the launcher's pid)."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import _launch_targets as t; "
        "from pipedialect.runtime.launch import launch; "
        "launch(t.nap_after_saying_so, 2, sys.argv[2], timeout=600, start_method=sys.argv[3])"
    )
    tests = str(Path(targets.__file__).parent)
    proc = subprocess.Popen([sys.executable, "-c", code, tests, str(tmp_path), start_method])
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.iterdir())) < 2:  # both ranks run
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        children = psutil.Process(proc.pid).children(recursive=True)
        os.kill(proc.pid, signal.SIGKILL)  # not reaped: a zombie until proc.wait()
        _, alive = psutil.wait_procs(children, timeout=15)
        assert psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE
    finally:
        proc.kill()
        proc.wait()
    for p in alive:
        p.kill()
    assert not alive, alive


def test_an_unknown_start_method_is_refused() -> None:
    with pytest.raises(ValueError, match="'forkserver' or 'spawn'"):
        launch(targets.report_env, 1, start_method="fork")


def test_ranks_form_a_working_gloo_group() -> None:
    assert launch(targets.all_reduce_rank, 2) == [3.0, 3.0]


def test_a_failing_rank_stops_the_launch_with_its_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(targets.fail_on_rank_one, 2, timeout=120)
    assert time.monotonic() - start < 60
    message = str(info.value)
    assert "rank 1 of 2 failed" in message
    assert "stage exploded on purpose" in message and "Traceback" in message


def test_the_processes_a_rank_started_end_with_it(tmp_path: Path) -> None:
    """A rank that returns, raises, or is stopped by the launcher (SIGTERM) takes the processes
    it started with it: DataLoader workers and the fork server they came from outlived every
    rank the launcher stopped before ([Note: a rank's own children])."""
    launch(targets.start_data_loader_workers, 2, str(tmp_path), None)
    (tmp_path / "failed").mkdir()
    with pytest.raises(LaunchError, match="failed on purpose"):
        launch(targets.start_data_loader_workers, 2, str(tmp_path / "failed"), 1, timeout=120)
    started = []
    for record in [*tmp_path.glob("rank*"), *tmp_path.glob("failed/rank*")]:
        started += [int(pid) for pid in record.read_text().split()]
    assert len(started) >= 12, started  # a fork server and two workers, per rank and launch
    _, alive = psutil.wait_procs([psutil.Process(p) for p in started if psutil.pid_exists(p)], 10)
    for p in alive:
        p.kill()
    assert not alive, [p.cmdline() for p in alive]


def test_a_hanging_launch_times_out() -> None:
    start = time.monotonic()
    with pytest.raises(LaunchError, match="timed out"):
        launch(targets.sleep_forever, 2, timeout=3)
    assert time.monotonic() - start < 30


def test_log_dir_captures_each_rank_and_failures_quote_it(tmp_path: Path) -> None:
    with pytest.raises(LaunchError) as info:
        launch(targets.chatter_then_fail, 2, log_dir=str(tmp_path))
    assert "chatter from rank 0" in (tmp_path / "rank0.log").read_text()
    assert "low-level stderr line" in (tmp_path / "rank0.log").read_text()
    message = str(info.value)
    assert "rank 1 of 2 failed" in message and "rank 1 gives up" in message
    assert "chatter from rank 1" in message  # the tail of the failing rank's log
