"""The conformance suite against real dialects: ``pipedialect check`` in fresh interpreters.

- ``deepspeed`` (multi-process, gloo) passes it.
- The example third-party dialect (examples/pipedialect-sendrecv, registered by its entry point)
  passes it, with plain ``pipedialect check`` and with its own CI file under plain pytest.
- Its deliberately broken variants (tests/plugins/sendrecv_broken) each fail it with a message
  naming the contract they break: the suite is shown to catch bugs. One ``pipedialect check``
  runs all four, each on the tests that must catch it.

The two distributions are copied and pip-installed into target directories once per session and
put on the checks' PYTHONPATH, so entry points are found exactly as in a user's environment.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from _fresh import CHECK, run_fresh, summary

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def third_party(install_plugin: Callable[[Path], Path]) -> list[Path]:
    """Install the example dialect and its broken variants; return their target directories."""
    sources = (
        ROOT / "examples" / "pipedialect-sendrecv",
        ROOT / "tests" / "plugins" / "sendrecv_broken",
    )
    return [install_plugin(source) for source in sources]


def run(
    argv: list[str],
    cwd: Path,
    paths: list[Path] = (),
    timeout: float = 900,  # type: ignore[assignment]
) -> subprocess.CompletedProcess[str]:
    """``argv`` in a fresh interpreter that finds the plugins installed in ``paths`` only."""
    return run_fresh(argv, cwd, paths, timeout)


def test_deepspeed_passes_the_suite(tmp_path: Path) -> None:
    proc = run([sys.executable, "-c", CHECK, "check", "deepspeed"], tmp_path)
    text = summary(proc)
    assert proc.returncode == 0, text
    assert "conformance of 'deepspeed': PASSED" in text
    # Declared, so tested: multi-process training, data parallel, checkpoints, dynamic shapes.
    assert "does not declare dynamic-shapes" not in text
    assert "does not declare data-parallel" not in text
    assert "does not declare checkpoints" not in text


def test_example_dialect_passes_the_suite(third_party: list[Path], tmp_path: Path) -> None:
    proc = run([sys.executable, "-c", CHECK, "check", "sendrecv"], tmp_path, third_party)
    text = summary(proc)
    assert proc.returncode == 0, text
    assert "dialect 'sendrecv' declares: data-parallel, dynamic-shapes" in text
    assert "1 test(s): dialect 'sendrecv' does not declare checkpoints" in text
    assert "conformance of 'sendrecv': PASSED" in text
    # Its engine_state and instrument hooks: portable checkpoints to and from the local
    # dialect, and a trace, all run and pass (none skipped by capability).
    assert "  portability          3       0                     0" in text
    assert "  tracing              2       0                     0" in text


def test_example_dialect_times_its_sends_and_receives(
    third_party: list[Path], tmp_path: Path
) -> None:
    """The example's ``instrument`` hook: a traced run trains as the untraced one, and each rank
    records one send and one receive per micro-batch in each direction it talks."""
    script = (
        "import json; from pipedialect.runtime.launch import launch; "
        "import _example_dialect_workers as w; "
        "print(json.dumps(launch(w.traced_and_untraced, 2, timeout=600)))"
    )
    proc = run([sys.executable, "-c", script], tmp_path, [*third_party, ROOT / "tests"])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = sorted(json.loads(proc.stdout.strip().splitlines()[-1]), key=lambda r: r["rank"])
    every = [0, 1, 2, 3]
    expected = {
        0: {("send", "activations"): every, ("recv", "grads"): every},
        1: {("recv", "activations"): every, ("send", "grads"): every},
    }
    for result in results:
        assert result["traced"] == result["untraced"]  # tracing changes no value
        found: dict[tuple[str, str], list[int]] = {}
        for kind, carries, micro in result["spans"]:
            found.setdefault((kind, carries), []).append(micro)
        assert found == expected[result["rank"]], result["spans"]


def test_example_runs_the_suite_from_its_own_test_file(
    third_party: list[Path], tmp_path: Path
) -> None:
    """What a third party's CI does: its test module imports the suite; plain pytest runs it."""
    tests = ROOT / "examples" / "pipedialect-sendrecv" / "tests"
    argv = [sys.executable, "-m", "pytest", str(tests), "-p", "no:cacheprovider", "-q"]
    proc = run(
        [*argv, "--dialect", "sendrecv", "-k", "registration or codec"], tmp_path, third_party
    )
    assert proc.returncode == 0, summary(proc)
    assert "8 passed" in proc.stdout
    assert "conformance of 'sendrecv': PASSED" in proc.stdout


#: Each broken variant, the tests that must catch it (a ``-k`` expression) and what its part
#: of the summary must say.
BROKEN: tuple[tuple[str, str, list[str]], ...] = (
    (
        "notiesync",
        "tied_training and gpt-2 and not 2x2",
        [
            "[ties] TestTies::test_tied_training_matches_unsplit[sendrecv-notiesync-gpt-2]",
            "tied weights [gpt, 2 stages]: parameter wte.weight on stage 0 (rank 0) differs "
            "from the unsplit model after step 1",
            "tied weights [gpt, 2 stages]: parameter lm_head.weight on stage 1 (rank 1) "
            "differs from the unsplit model after step 1",
            "sum their gradients every step",
        ],
    ),
    (
        "nokeys",
        "test_round_trip or matches_unsplit and mixed-2",
        [
            "[codec] TestCodec::test_round_trip[sendrecv-nokeys]",
            "decode(encode(value)) differs from the value at",
            "[training] TestTraining::test_matches_unsplit[sendrecv-nokeys-mixed-2]",
            "boundary [mixed, 2 stages]: [Stage 1] on rank 1 received 'submod_0'",
            "dict keys ['0', '1', '2', '3', '4', '5'] instead of ['h', 'mask', 'ids', "
            "'scale', 'extra', 'factor']",
        ],
    ),
    (
        "reorder",
        "matches_unsplit and skip-2",
        [
            "[training] TestTraining::test_matches_unsplit[sendrecv-reorder-skip-2]",
            "boundary [skip, 2 stages]: [Stage 1] on rank 1 received 'submod_0.1' (value 1 "
            "of 2 crossing into stage 1",
            "the boundary's values arrive reordered",
        ],
    ),
    (
        "lossy",
        "matches_unsplit and plain-2 and not 2x2",
        [
            "[training] TestTraining::test_matches_unsplit[sendrecv-lossy-plain-2]",
            "training equivalence [plain, 2 stages]: train_batch() of step 1 returned loss",
            "differs from the unsplit model after step 1",
        ],
    ),
)


def test_broken_variants_fail_naming_the_broken_contract(
    third_party: list[Path], tmp_path: Path
) -> None:
    """One ``pipedialect check`` of every broken variant, each on the tests that must catch it
    (one interpreter for the four; each variant still has its own launches). Each variant's
    part of the summary must say FAILED and quote what it breaks."""
    names = [f"sendrecv-{variant}" for variant, _, _ in BROKEN]
    select = " or ".join(f"(sendrecv-{variant} and ({k}))" for variant, k, _ in BROKEN)
    proc = run([sys.executable, "-c", CHECK, "check", *names, "-k", select], tmp_path, third_party)
    text = summary(proc)
    assert proc.returncode == 1, text
    sections = _dialect_sections(text)
    assert sorted(sections) == sorted(names), text
    for variant, _, expected in BROKEN:
        name = f"sendrecv-{variant}"
        part = sections[name]
        assert f"conformance of {name!r}: FAILED" in part, part
        flat = " ".join(part.split())
        for fragment in expected:
            assert " ".join(fragment.split()) in flat, (name, fragment)


def _dialect_sections(text: str) -> dict[str, str]:
    """The summary's part for each dialect, by name (each begins ``dialect 'NAME' declares``)."""
    parts = re.split(r"^dialect '([^']+)' declares", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))
