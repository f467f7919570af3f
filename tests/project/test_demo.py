"""``pipedialect demo``: the README's main job, run as a user runs it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pipedialect import ConfigError
from pipedialect.demo import DemoSettings, check_settings, demo_batches, reference_losses

CLI = [sys.executable, "-m", "pipedialect.cli"]
#: One intra-op thread for the demo process, as its ranks get from the launcher: on two shared
#: cores, tiny ops on two threads contend (a loaded machine made the local demo several times
#: slower).
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run_cli(*args: str, cwd: Path) -> str:
    proc = subprocess.run(
        [*CLI, "demo", *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def largest_difference(output: str) -> float:
    match = re.search(r"largest difference from the single-process reference: (\S+)", output)
    assert match, output
    return float(match.group(1))


def test_demo_data_is_a_learnable_counting_language() -> None:
    (ids, labels), *_ = demo_batches(1, replica=0)
    stride = (labels - ids) % 48
    assert (stride == stride[:, :1]).all()  # every sequence counts with one stride
    losses = reference_losses(DemoSettings(steps=12))
    assert losses[-1] < losses[0] - 0.3


def test_demo_fsdp_runs_the_torch_dialect_over_two_replicas_or_is_refused_by_name() -> None:
    from pipedialect.cli import build_parser, demo_settings

    def settings(*argv: str) -> DemoSettings:
        return demo_settings(build_parser().parse_args(["demo", *argv]))

    chosen = settings("--fsdp")
    assert (chosen.dialect, chosen.dp, chosen.stages, chosen.fsdp) == ("torch", 2, 2, True)
    assert check_settings(chosen).name == "torch"
    assert (settings().dialect, settings().dp) == ("deepspeed", 1)
    with pytest.raises(ConfigError, match="does not declare \\(sharded-data-parallel\\)"):
        check_settings(settings("--fsdp", "--dialect", "deepspeed"))
    with pytest.raises(ConfigError, match="--dp 2 or more"):
        check_settings(settings("--fsdp", "--dp", "1"))


def test_demo_tp_runs_the_torch_dialect_over_a_tensor_axis_or_is_refused_by_name() -> None:
    from pipedialect.cli import build_parser, demo_settings

    def settings(*argv: str) -> DemoSettings:
        return demo_settings(build_parser().parse_args(["demo", *argv]))

    chosen = settings("--tp", "2")
    assert (chosen.dialect, chosen.dp, chosen.tp) == ("torch", 1, 2)
    assert check_settings(chosen).name == "torch"
    with pytest.raises(ConfigError, match="does not declare \\(tensor-parallel\\)"):
        check_settings(settings("--tp", "2", "--dialect", "deepspeed"))
    with pytest.raises(ConfigError, match="--tp must divide"):
        check_settings(settings("--tp", "3"))


@pytest.mark.distributed
def test_local_demo_matches_its_reference(tmp_path: Path) -> None:
    out = run_cli("--dialect", "local", "--stages", "4", "--steps", "3", "--no-plot", cwd=tmp_path)
    assert "step   3/3" in out
    assert largest_difference(out) < 1e-5
    assert not list(tmp_path.glob("*.png"))


def test_run_demo_prints_to_stdout_as_it_is_when_the_demo_runs() -> None:
    """Not to the stdout of whenever pipedialect.demo was imported (a closed capture, say)."""
    import contextlib
    import io

    from pipedialect.demo import run_demo

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run_demo(DemoSettings(dialect="local", steps=1, output=None))
    assert out.getvalue().startswith("pipedialect demo: TinyGPT")


@pytest.mark.distributed
def test_trace_writes_the_timeline_and_changes_no_loss(tmp_path: Path) -> None:
    out = run_cli(
        "--dialect", "local", "--steps", "2", "--trace", "run.json", "--output", "p.png",
        cwd=tmp_path,
    )  # fmt: skip
    assert largest_difference(out) < 1e-5  # the traced run still equals the unsplit model
    events = json.loads((tmp_path / "run.json").read_text())["traceEvents"]
    compute = [e for e in events if e["ph"] == "X" and e["cat"] in ("forward", "backward")]
    seen = {(e["cat"], e["tid"], e["args"]["step"], e["args"]["micro_batch"]) for e in compute}
    # 2 stages x 2 steps x GAS=4 micro-batches, a forward and a backward each
    assert len(seen) == 2 * 2 * 2 * 4, sorted(seen)
    assert (tmp_path / "run.png").stat().st_size > 0
    assert "timeline: run.json and run.png" in out


@pytest.mark.distributed
def test_deepspeed_demo_trains_two_stages_and_writes_the_plot(tmp_path: Path) -> None:
    out = run_cli("--stages", "2", "--steps", "4", "--output", "curve.png", cwd=tmp_path)
    assert "dialect 'deepspeed': 2 stage(s) x 1 replica(s) on 2 process(es), gloo" in out
    assert largest_difference(out) < 1e-5
    assert "SEED_LAYERS" not in out  # the ranks' own chatter goes to their logs
    png = (tmp_path / "curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


#: Steps of the demo the signal tests interrupt: far more than it trains before the signal
#: (the signal follows the first step's line within a launcher poll, 50 ms; each step cost the
#: two ranks about 120 ms of CPU, so 500 of them last about a minute of CPU), yet few enough
#: that building them is quick. Every rank makes all ``steps * GAS`` micro-batches before its
#: first step: 100000 steps took about 30 s of CPU per rank, 5000 steps 0.9 s (a fifth of a
#: signal test's CPU time, over both ranks).
LONG_STEPS = 500


def _terminal_signals() -> None:
    """In the demo's process before it starts: SIGINT as in a terminal, where Ctrl-C is not ignored.

    A pytest started in the background by a non-interactive shell (``nohup ... &``, some CI
    runners) ignores SIGINT, and its children would inherit that: the demo then ignored Ctrl-C
    and the test waited out its timeout.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_training_demo(cwd: Path) -> tuple[subprocess.Popen[str], list[psutil.Process]]:
    """Start a long DeepSpeed demo; return it once every rank trains, with its processes.

    It is still training when this returns (checked), so a test's signal always lands mid-run.
    """
    proc = subprocess.Popen(
        [*CLI, "demo", "--steps", str(LONG_STEPS), "--no-plot"],
        cwd=cwd,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_terminal_signals,
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 300
        while "loss" not in proc.stdout.readline():  # training has started on every rank
            assert time.monotonic() < deadline and proc.poll() is None
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 2
        assert proc.poll() is None and all(p.is_running() for p in children)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc, children


@pytest.mark.distributed
def test_ctrl_c_stops_every_process_the_demo_started(tmp_path: Path) -> None:
    proc, children = _start_training_demo(tmp_path)
    try:
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == 130
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, alive
    assert proc.stderr is not None
    assert "interrupted" in proc.stderr.read()


@pytest.mark.distributed
def test_a_rank_that_dies_leaves_one_clear_line_and_its_logs(tmp_path: Path) -> None:
    proc, children = _start_training_demo(tmp_path)
    ranks = [p for p in children if "spawn" in " ".join(p.cmdline())] or children
    try:
        ranks[-1].kill()  # a rank dies (the OOM killer, say)
        code = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    _, alive = psutil.wait_procs(children, timeout=30)
    for p in alive:
        p.kill()
    assert proc.stderr is not None
    err = proc.stderr.read()
    assert code == 1, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("pipedialect demo failed: "), err
    kept = Path(lines[0].rsplit("every rank's log is kept in ", 1)[1])
    assert sorted(p.name for p in kept.glob("rank*.log")) == ["rank0.log", "rank1.log"]


@pytest.mark.distributed
def test_a_named_error_on_a_rank_reaches_the_demo_s_one_line(tmp_path: Path) -> None:
    """A lock left by a killed op build (what failed a CI run) stops every rank at
    ``init_distributed`` with an ``ExtensionBuildError``; the demo's one line must carry it and
    the file to delete, not only "rank 0 of 2 failed (exit code 1):" as it did."""
    extensions = tmp_path / "extensions"
    lock = extensions / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    then = time.time() - 7200
    os.utime(lock, (then, then))
    proc = subprocess.run(
        [*CLI, "demo", "--steps", "1", "--no-plot"],
        cwd=tmp_path,
        env={**ENV, "TORCH_EXTENSIONS_DIR": str(extensions)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("pipedialect demo")]
    assert len(lines) == 1, proc.stderr
    assert "ExtensionBuildError" in lines[0] and f"(rm {lock})" in lines[0], lines[0]
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.distributed
def test_sigterm_stops_every_process_the_demo_started(tmp_path: Path) -> None:
    """SIGTERM to the demo alone (as a job scheduler sends it), not to its process group."""
    proc, children = _start_training_demo(tmp_path)
    try:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    _, alive = psutil.wait_procs(children, timeout=10)
    for p in alive:
        p.kill()
    assert not alive, alive
    assert code == 128 + signal.SIGTERM


@pytest.mark.distributed
def test_ranks_leave_when_the_demo_is_killed_outright(tmp_path: Path) -> None:
    """SIGKILL gives the demo no chance to clean up: its ranks notice and leave by themselves."""
    proc, children = _start_training_demo(tmp_path)
    proc.kill()
    proc.wait(timeout=60)
    _, alive = psutil.wait_procs(children, timeout=10)
    for p in alive:
        p.kill()
    assert not alive, alive


@pytest.mark.distributed
def test_data_parallel_on_a_one_process_dialect_is_a_usage_error(tmp_path: Path) -> None:
    proc = subprocess.run(
        [*CLI, "demo", "--dp", "2", "--dialect", "local"],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("usage: pipedialect demo")
    assert "pipedialect demo: error: the 'local' dialect runs every stage in one process" in (
        proc.stderr
    )
    assert "use --dp 1" in proc.stderr and not proc.stdout
    unknown = subprocess.run(
        [*CLI, "demo", "--dialect", "no-such-dialect"],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert unknown.returncode == 2 and "Traceback" not in unknown.stderr
    assert "error: no dialect named 'no-such-dialect'" in unknown.stderr
