"""The conformance suite against the torch dialect: ``pipedialect check`` in fresh interpreters.

- ``pipedialect check torch`` (the default schedule, 1F1B) passes the whole suite.
- Every other schedule passes the suite's comparisons with the unsplit model (what a schedule
  changes): the 2-stage training cases and the tied GPT, with the boundary probes (not the
  stage-wrapper chain of TestStages, which runs no schedule). The variants
  are registered in-process as ``torch-<schedule>`` and checked in one run; the suite launches
  as many ranks as each variant's topology asks for. The looped schedules run one stage per
  rank here (their multi-stage runs are in test_torch_dialect.py); the V-shaped ones run two
  stages on one rank.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from _fresh import CHECK, run_fresh, summary

pytestmark = pytest.mark.distributed

TESTS = Path(__file__).resolve().parents[2]
VARIANTS = (
    "import sys; sys.path.insert(0, sys.argv[1]); import _torch_workers as w; "
    "sys.exit(w.check_schedules(sys.argv[3].split(','), sys.argv[2]))"
)
#: The schedules other than the default.
SCHEDULES = (
    "gpipe",
    "interleaved_1f1b",
    "looped_bfs",
    "interleaved_zero_bubble",
    "zbv_zero_bubble",
    "dualpipev",
)


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    # One thread: the references train in the checking process, beside the ranks.
    return run_fresh(argv, cwd, timeout=1200, extra={"OMP_NUM_THREADS": "1"})


def test_torch_passes_the_suite(tmp_path: Path) -> None:
    proc = run([sys.executable, "-c", CHECK, "check", "torch"], tmp_path)
    text = summary(proc)
    assert proc.returncode == 0, text
    assert "conformance of 'torch': PASSED" in text
    # Declared, so tested: multi-process training, ties, rich boundaries, checkpoints.
    assert "does not declare checkpoints" not in text
    assert "does not declare tied-weights" not in text
    assert "does not declare dynamic-shapes" in text  # torch fixes boundary shapes


def test_every_other_schedule_passes_the_suites_unsplit_comparisons(tmp_path: Path) -> None:
    # The 2-stage training runs (with replicas and tensor parallel): a launch per world size per
    # schedule. Not TestStages: it chains the dialect's stage wrappers in one process, which no
    # schedule changes (test_torch_passes_the_suite runs it on the same wrappers).
    select = "unsplit and not 4 and not TestStages"
    proc = run([sys.executable, "-c", VARIANTS, str(TESTS), select, ",".join(SCHEDULES)], tmp_path)
    text = summary(proc)
    assert proc.returncode == 0, text
    for schedule in SCHEDULES:
        passed = re.search(rf"conformance of 'torch-{schedule}': PASSED: (\d+) of", text)
        assert passed is not None, text
        assert int(passed.group(1)) >= 5, text  # the training runs did run
        assert f"dialect 'torch-{schedule}' declares: checkpoints" in text
