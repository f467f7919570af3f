"""The conformance suite's machinery, and the suite run against the local dialect.

The comparison, option and requirement helpers are checked on hand-made values; the plugin in
fresh pytest processes (inert without ``--dialect``, pinned by a subclass fixture, catching a
codec bug); ``pipedialect check local`` end to end. The multi-process dialects, the example
third-party dialect and its broken variants are in test_conformance_dialects.py.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _fresh import CHECK, run_fresh

import pipedialect
from pipedialect import Capability, ConfigError
from pipedialect.cli import main
from pipedialect.testing._harness._cases import CASES, get_case
from pipedialect.testing._harness._checks import boundary_failures
from pipedialect.testing._harness._compare import first_difference
from pipedialect.testing._harness._data import train_stream
from pipedialect.testing._harness._models import suite_model
from pipedialect.testing._harness._reference import expected_receives, reference
from pipedialect.testing._options import parse_dialect_options
from pipedialect.testing._requirements import CAPABILITY_SKIP_PREFIX, missing_requirements

#: The opt-in: what a project running the suite from its own tests puts in its conftest.py.
CONFTEST = 'pytest_plugins = ["pipedialect.testing.plugin"]\n'


def run(
    argv: list[str], cwd: Path, timeout: float = 900, plugin_dir: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in a fresh interpreter (no plugin restriction), capturing its output;
    with ``plugin_dir``, the plugins installed there are found too."""
    return run_fresh(argv, cwd, None if plugin_dir is None else [plugin_dir], timeout)


# -- helpers, on hand-made values ----------------------------------------------------------


def test_dialect_options_read_literals_strings_and_prefixes() -> None:
    given = [
        "schedule=gpipe",
        "n=2",
        "flag=True",
        "names=[1, 2]",
        "path=a:b",
        "torch:runtime.seed='7'",
        "other:only=1",
    ]
    torch_options = parse_dialect_options(given, "torch")
    assert dict(torch_options.pipe) == {
        "schedule": "gpipe",
        "n": 2,
        "flag": True,
        "names": [1, 2],
        "path": "a:b",
    }
    assert dict(torch_options.runtime) == {"seed": "7"}
    assert dict(parse_dialect_options(given, "other").pipe)["only"] == 1
    assert not parse_dialect_options([], "x")
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_dialect_options(["schedule"], "x")
    with pytest.raises(ConfigError, match="passes 'loss_fn' itself"):
        parse_dialect_options(["loss_fn=1"], "x")


def test_first_difference_names_the_path_and_what_differs() -> None:
    t = torch.arange(3)
    assert first_difference({"a": 1}, {"b": 1}) == (
        "at the top level: dict keys ['a'] instead of ['b'] (missing ['b'], unexpected ['a'])"
    )
    assert "another order" in str(first_difference({"a": 1, "b": 2}, {"b": 2, "a": 1}))
    assert (
        first_difference((1,), [1])
        == "at the top level: tuple of length 1 instead of list of length 1"
    )
    assert first_difference([True], [1]) == "at [0]: bool True instead of int 1"
    assert (
        first_difference([(t, {"m": t.bool()})], [(t, {"m": t})])
        == "at [0][1]['m']: dtype torch.bool instead of torch.int64"
    )
    assert (
        first_difference(t, torch.tensor([0, 1, 5]))
        == "at the top level: element [2] is 2 instead of 5"
    )
    x = torch.tensor([1.0, 2.0], dtype=torch.float64)
    assert first_difference(x, x + 1e-3, rtol=1e-6) is not None
    assert first_difference(x, x + 1e-12, rtol=1e-6) is None
    assert first_difference(x, x + 1e-12) is not None  # bit for bit without a tolerance
    nan = torch.tensor([math.nan])
    assert first_difference(nan, nan.clone()) is None
    assert first_difference(-0.0, 0.0) is not None
    assert first_difference(math.nan, math.nan) is None
    assert first_difference(torch.Size([2]), (2,)) is not None


def test_boundary_failures_say_when_values_arrive_reordered() -> None:
    case = get_case("skip-2")
    names, values = expected_receives("skip-2")[1]
    assert len(values) == 2
    assert boundary_failures(case, {1: list(values)}, "boundary") == []
    failures = boundary_failures(case, {1: values[::-1]}, "boundary")
    assert len(failures) == 2
    assert all("arrive reordered" in f and "[Stage 1]" in f for f in failures)
    assert f"it equals the value of {names[1]!r}" in failures[0]


def test_expected_boundary_values_are_what_the_unsplit_model_computes() -> None:
    """The skip model sends its stem output and the block stack's output over the boundary."""
    model = suite_model("skip").build(0)
    x, _ = train_stream(get_case("skip-2"), 0, count=1)[0]
    with torch.no_grad():
        skip = torch.tanh(model.stem(x))
        h = model.blocks[1](model.blocks[0](skip))
    _, values = expected_receives("skip-2")[1]
    found = sorted(values, key=lambda v: float(v.sum()))
    wanted = sorted([skip, h], key=lambda v: float(v.sum()))
    assert all(torch.allclose(a, b) for a, b in zip(found, wanted, strict=True))


def test_reference_first_loss_is_the_untrained_models_mean_loss() -> None:
    case = get_case("plain-2x2")
    spec = suite_model(case.model)
    model = spec.build(0)
    with torch.no_grad():
        losses = [
            float(spec.loss_fn(model(x), y))
            for d in range(case.data_parallel)
            for x, y in train_stream(case, d)[: case.gas]
        ]
    assert reference("plain-2x2").losses[0] == pytest.approx(sum(losses) / len(losses), rel=1e-6)
    assert reference("plain-2x2").losses[-1] < reference("plain-2x2").losses[0]  # it trains


def test_every_case_fits_its_model() -> None:
    for case in CASES:
        spec = suite_model(case.model)
        assert len(spec.split_points_for(case.stages)) == case.stages - 1, case.id


class _Declares(pipedialect.Dialect):
    name = "declares"
    capabilities = frozenset({Capability.TIED_WEIGHTS, Capability.CUDA_ONLY})

    def _build_pipeline(self, request):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def _build_engine(self, request):  # type: ignore[no-untyped-def]
        raise NotImplementedError


def test_capability_requirements_give_reasons_the_summary_recognises() -> None:
    dialect = _Declares()
    assert missing_requirements(dialect, [Capability.TIED_WEIGHTS]) is None
    reason = missing_requirements(dialect, [Capability.MULTI_PROCESS, Capability.DATA_PARALLEL])
    assert reason == (
        f"{CAPABILITY_SKIP_PREFIX} dialect 'declares' does not declare data-parallel, multi-process"
    )
    refused = missing_requirements(dialect, [], [Capability.TIED_WEIGHTS])
    assert refused is not None and "declares tied-weights" in refused
    assert missing_requirements(dialect, [], runs=False, cuda_available=False) is None
    cuda = missing_requirements(dialect, [], runs=True, cuda_available=False)
    assert cuda is not None and "cuda-only" in cuda


# -- the plugin, in fresh pytest processes -------------------------------------------------


@pytest.mark.distributed
def test_suite_is_inert_without_a_dialect(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_imports_suite.py").write_text(
        "from pipedialect.testing.suite import *  # noqa: F403\n\n\ndef test_own() -> None:\n"
        "    pass\n"
    )
    proc = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Only the file's own test ran: every test of the suite was deselected, none skipped.
    counts = re.search(r"\b1 passed, (\d+) deselected in", proc.stdout)
    assert counts is not None and int(counts.group(1)) > 0, proc.stdout
    assert "conformance summary" not in proc.stdout


@pytest.mark.distributed
def test_a_subclass_pins_its_dialect_with_a_fixture(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_pinned.py").write_text(
        textwrap.dedent(
            """
            import pytest
            import pipedialect
            from pipedialect.testing.suite import TestRegistration


            class TestLocalRegistration(TestRegistration):
                @pytest.fixture
                def dialect(self):
                    return pipedialect.get_dialect("local")
            """
        )
    )
    proc = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "5 passed, 5 deselected" in proc.stdout  # the imported base class is deselected
    assert "registration         5       0" in proc.stdout


@pytest.mark.distributed
def test_the_suite_catches_a_codec_that_loses_dict_keys(tmp_path: Path) -> None:
    """A single-process dialect with a broken codec fails the codec area, naming the keys."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_broken_codec.py").write_text(
        textwrap.dedent(
            """
            import pytest
            from pipedialect import SchemaCodec
            from pipedialect.dialects.local import LocalDialect
            from pipedialect.testing.suite import TestCodec


            class Renumbering(SchemaCodec):
                def encode(self, obj, device=None):
                    if isinstance(obj, dict):
                        obj = {str(i): v for i, v in enumerate(obj.values())}
                    return super().encode(obj, device)


            class BrokenLocal(LocalDialect):
                name = "broken-local"

                @property
                def codec(self):
                    return Renumbering()


            class TestBrokenCodec(TestCodec):
                @pytest.fixture
                def dialect(self):
                    return BrokenLocal()
            """
        )
    )
    proc = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "codec                1       2" in proc.stdout
    assert "decode(encode(value)) differs from the value" in proc.stdout
    assert "dict keys" in proc.stdout


@pytest.mark.distributed
def test_the_suite_trains_through_the_codec_the_dialect_declares(tmp_path: Path) -> None:
    """A dialect's ``codec`` is the one its engine uses: a lossy one fails the training area.

    The codec rounds floats of 64 elements or more to bfloat16 on the way (small values survive,
    so only a real training run through the engine can see it). Before the shared
    ``Dialect.pipe_engine``, the local engine wrapped its stages with the default codec and this
    dialect passed.
    """
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_lossy_codec.py").write_text(
        textwrap.dedent(
            """
            import pytest
            import torch
            from pipedialect import SchemaCodec
            from pipedialect.dialects.local import LocalDialect
            from pipedialect.testing.suite import TestTraining


            def rounded(value):
                if (
                    isinstance(value, torch.Tensor)
                    and value.is_floating_point()
                    and value.numel() >= 64
                ):
                    return value.to(torch.bfloat16).to(value.dtype)
                if isinstance(value, dict):
                    return {k: rounded(v) for k, v in value.items()}
                if isinstance(value, (list, tuple)):
                    return type(value)(rounded(v) for v in value)
                return value


            class Lossy(SchemaCodec):
                def encode(self, obj, device=None):
                    return super().encode(rounded(obj), device)


            class LossyLocal(LocalDialect):
                name = "lossy-local"

                @property
                def codec(self):
                    return Lossy()


            class TestLossyTraining(TestTraining):
                @pytest.fixture
                def dialect(self):
                    return LossyLocal()
            """
        )
    )
    select = "matches_unsplit and plain-4"
    proc = run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", select], tmp_path
    )
    out = " ".join(proc.stdout.split())
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "conformance of 'lossy-local': FAILED" in out
    assert (
        "boundary [plain, 4 stages]: [Stage 1] received 'submod_0' (value 1 of 1 crossing into "
        "stage 1: ['submod_0']) differently from the unsplit model, at the top level: values "
        "differ" in out
    )


def test_check_refuses_an_unknown_dialect_and_a_malformed_option(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["check", "no-such-dialect"]) == 2
    err = capsys.readouterr().err
    assert "no dialect named 'no-such-dialect'" in err and "'local'" in err
    assert main(["check", "local", "--dialect-option", "oops"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err


@pytest.mark.distributed
def test_local_passes_the_suite(tmp_path: Path) -> None:
    proc = run([sys.executable, "-c", CHECK, "check", "local"], tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:] + proc.stderr[-3000:]
    for area in ("registration", "codec", "stages", "ties", "training", "errors"):
        assert f"\n  {area} " in out, area
    assert "does not declare data-parallel, multi-process" in out
    assert "conformance of 'local': PASSED" in out
    assert "failed" not in out.split("conformance summary")[1].replace("FAILED", "")


# -- a single-process dialect that hangs ----------------------------------------------------

HANG_SELECT = "test_matches_unsplit and plain-2"


@pytest.fixture(scope="module")
def hang_plugin(install_plugin: Callable[[Path], Path]) -> Path:
    """tests/plugins/hang, pip-installed: dialects whose ``train_batch`` never returns."""
    return install_plugin(Path(__file__).resolve().parents[1] / "plugins" / "hang")


@pytest.mark.distributed
def test_check_stops_a_single_process_case_that_makes_no_progress(
    hang_plugin: Path, tmp_path: Path
) -> None:
    """``--timeout`` fails a hanging in-process case with the launcher's report and the stack
    where it waits, then goes on: a sleep (``hang``) and code masking the signal
    (``hang-deaf``) both end, in one session."""
    start = time.monotonic()
    argv = [sys.executable, "-c", CHECK, "check", "hang", "hang-deaf", "--timeout", "10"]
    proc = run([*argv, "-k", HANG_SELECT], tmp_path, timeout=240, plugin_dir=hang_plugin)
    out = proc.stdout
    assert proc.returncode == 1, out[-6000:] + proc.stderr[-3000:]
    assert time.monotonic() - start < 180
    summary = out.split("conformance summary")[1]
    for name in ("hang", "hang-deaf"):
        assert f"[training] TestTraining::test_matches_unsplit[{name}-plain-2]" in summary
        # The hanging case is the one failure; the others the selection matches are skipped
        # for capabilities these single-process dialects do not declare.
        assert re.search(rf"conformance of {name!r}: FAILED: 1 of \d+ test\(s\) failed", summary)
    report = (
        "ranks [0] did not finish the case: case 'plain-2' made no progress for 10s in the "
        "test process: the dialect hangs (a call into it never returned). Raise "
        "--conformance-timeout if the machine is merely slow. It was stuck here:"
    )
    assert out.count(report) == 4  # each failure, and again in the summary
    assert out.count("pipedialect_hang/__init__.py") == 2  # the stacks end in train_batch
    assert out.count("in train_batch\n    time.sleep(") == 2


@pytest.mark.distributed
def test_check_ends_the_process_when_a_case_cannot_be_interrupted(
    hang_plugin: Path, tmp_path: Path
) -> None:
    """A case stuck in one native call, signals blocked, ends the process with the report on
    the terminal (pytest's capture would lose it) instead of hanging forever."""
    start = time.monotonic()
    argv = [sys.executable, "-c", CHECK, "check", "hang-native", "--timeout", "10"]
    proc = run([*argv, "-k", HANG_SELECT], tmp_path, timeout=240, plugin_dir=hang_plugin)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert time.monotonic() - start < 180
    err = proc.stderr
    assert "pipedialect conformance suite: case 'plain-2' made no progress for 10s" in err
    assert "in train_batch\n    time.sleep(3600" in err
    assert "could not be interrupted (it is stuck outside Python); ending the process" in err
    assert "Current thread" in err  # every thread's stack follows
