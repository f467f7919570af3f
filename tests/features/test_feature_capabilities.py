"""Portable checkpoints and traces go through the Dialect contract.

``pipedialect.checkpoint`` and ``pipedialect.trace`` read an engine only through its dialect's
``engine_state`` (and ``instrument``) hooks, declared as the ``portable-checkpoints`` and
``tracing`` capabilities. Checked here: a dialect that does not declare one is refused by name
(dialect and capability); a dialect of our own making -- the local dialect's engine under a
class that is none of the built-in ones -- saves, resumes and traces through the hooks alone;
and the conformance suite's new cases fail a dialect whose ``engine_state`` is wrong, naming
what is wrong. The reference is the unsplit model (the suite's own reference loop).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import pipedialect
import pipedialect.checkpoint as ckpt
from pipedialect import Capability, ConfigError, MissingCapabilityError
from pipedialect.contracts import AttributeCounters, EngineState, HeldStage
from pipedialect.dialects.local import LocalDialect
from pipedialect.testing._harness._models import suite_model

CONFTEST = 'pytest_plugins = ["pipedialect.testing.plugin"]\n'
CONFIG = {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
}


class _Bare(LocalDialect):
    """The local dialect without the two capabilities (and so without their hooks' use)."""

    name = "bare"
    capabilities = LocalDialect.capabilities - {
        Capability.PORTABLE_CHECKPOINTS,
        Capability.TRACING,
    }


class _Wrapped:
    """An engine class none of the built-in dialects defines: it forwards to a local engine."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.global_steps = 0

    def train_batch(self, data_iter: Any = None) -> torch.Tensor:
        self.global_steps += 1
        loss: torch.Tensor = self.inner.train_batch(data_iter)
        return loss

    def eval_batch(self, data_iter: Any) -> torch.Tensor:
        loss: torch.Tensor = self.inner.eval_batch(data_iter)
        return loss


class _Third(LocalDialect):
    """A "third-party" dialect: its engine is a :class:`_Wrapped`, known to no core module (it
    saves no checkpoint of its own, so it does not declare checkpoints)."""

    name = "third"
    capabilities = LocalDialect.capabilities - {Capability.CHECKPOINTS}

    def _build_engine(self, request: Any) -> Any:
        return _Wrapped(super()._build_engine(request))

    def local_stages(self, engine: Any) -> list[int]:
        return list(super().local_stages(engine.inner))

    def engine_state(self, engine: Any) -> EngineState:
        inner = engine.inner
        held = [HeldStage(k, s, s.mod) for k, s in enumerate(inner.module.stages)]
        state = inner.engine_state(held, inner.module.plan)
        return EngineState(
            stages=state.stages,
            num_stages=state.num_stages,
            optimizer=state.optimizer,
            tie_keys=state.tie_keys,
            counters=AttributeCounters(engine, ("global_steps",)),
            gradient_accumulation_steps=4,
            train_batch_size=8,
        )


def _engine(dialect: pipedialect.Dialect, seed: int = 0) -> Any:
    spec = suite_model("gpt")
    plan = pipedialect.partition(spec.build(seed), spec.split_points_for(2))
    return dialect.runtime_engine(
        dialect.pipe_engine(plan, config=CONFIG, loss_fn=spec.loss_fn), config=CONFIG
    )


def _batches(count: int = 4, seed: int = 5) -> list[Any]:
    return list(suite_model("gpt").micro_batches(count, batch_size=2, seed=seed))


def test_checkpoint_refuses_a_dialect_without_portable_checkpoints(tmp_path: Path) -> None:
    engine = _engine(_Bare())
    with pytest.raises(MissingCapabilityError) as info:
        ckpt.save(engine, tmp_path)
    assert (info.value.dialect, info.value.capability) == ("bare", "portable-checkpoints")
    assert "the bare dialect does not declare" in str(info.value)
    with pytest.raises(MissingCapabilityError, match="portable-checkpoints"):
        ckpt.load(engine, tmp_path)
    assert not list(tmp_path.iterdir())


def test_trace_refuses_a_dialect_without_tracing() -> None:
    engine = _engine(_Bare())
    with pytest.raises(MissingCapabilityError) as info:
        pipedialect.trace(engine).__enter__()
    assert (info.value.dialect, info.value.capability) == ("bare", "tracing")
    assert "the bare dialect does not declare" in str(info.value)
    assert "train_batch" not in vars(engine)  # nothing was installed


def test_an_engine_no_dialect_built_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot tell which dialect built this object"):
        ckpt.save(object(), tmp_path)


def test_a_declared_capability_without_its_hook_is_named() -> None:
    class Forgot(_Bare):
        name = "forgot"
        capabilities = _Bare.capabilities | {Capability.TRACING}
        engine_state = pipedialect.Dialect.engine_state  # the base's: not implemented

    engine = _engine(Forgot())
    with pytest.raises(MissingCapabilityError, match="does not implement engine_state"):
        pipedialect.trace(engine).__enter__()


def test_a_third_party_engine_saves_resumes_and_traces_through_the_hooks(tmp_path: Path) -> None:
    """Saved from a third-party engine, resumed on local (and back); both equal to the local
    dialect trained without interruption, which the suite's cases compare with the unsplit
    model; the trace times every stage of the wrapped engine."""
    third, local = _Third(), pipedialect.get_dialect("local")
    straight = _engine(local)
    saving = _engine(third)
    for step in range(2):
        expected = float(straight.train_batch(iter(_batches(seed=step))))
        assert float(saving.train_batch(iter(_batches(seed=step)))) == expected
    ckpt.save(saving, tmp_path / "third")
    assert ckpt.read_index(tmp_path / "third")["layout"]["dialect"] == "third"
    after = float(straight.train_batch(iter(_batches(seed=2))))
    resumed = _engine(local, seed=7)
    ckpt.load(resumed, tmp_path / "third")
    assert float(resumed.train_batch(iter(_batches(seed=2)))) == after
    back = _engine(third, seed=7)
    ckpt.save(resumed, tmp_path / "local")
    ckpt.load(back, tmp_path / "local")
    assert back.global_steps == 3
    with pipedialect.trace(back, png=False) as recorded:
        back.train_batch(iter(_batches(seed=3)))
    assert recorded.timeline is not None
    spans = {(s.kind, s.stage, s.micro_batch) for s in recorded.timeline.spans}
    for stage in range(2):
        for micro in range(4):
            assert {("forward", stage, micro), ("backward", stage, micro)} <= spans


def _run_suite(tmp_path: Path, body: str, select: str) -> str:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_broken.py").write_text(textwrap.dedent(body))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", select],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    return " ".join(proc.stdout.split())


@pytest.mark.distributed  # runs the conformance suite in a fresh pytest process
def test_the_suite_fails_an_engine_state_that_names_the_wrappers(tmp_path: Path) -> None:
    """Reporting the stage wrapper as the stage's module stores ``mod.``-prefixed names: the
    checkpoint does not load on the local dialect, and the suite says so."""
    out = _run_suite(
        tmp_path,
        """
        import pytest
        from pipedialect.contracts import HeldStage
        from pipedialect.dialects.local import LocalDialect
        from pipedialect.testing.suite import TestPortableCheckpoints


        class Misnamed(LocalDialect):
            name = "misnamed"

            def engine_state(self, engine):
                held = [HeldStage(k, s, s) for k, s in enumerate(engine.module.stages)]
                return engine.engine_state(held, engine.module.plan)


        class TestMisnamed(TestPortableCheckpoints):
            @pytest.fixture
            def dialect(self):
                return Misnamed()
        """,
        "portable-2",
    )
    assert "conformance of 'misnamed': FAILED" in out
    assert "portable checkpoints [plain, 2 stages]: the engine raised CheckpointError" in out
    assert "missing: " in out


@pytest.mark.distributed  # runs the conformance suite in a fresh pytest process
def test_the_suite_fails_an_engine_state_that_hides_a_stage(tmp_path: Path) -> None:
    """A dialect that reports one stage runner for the whole pipeline fails the trace case
    with the stage whose spans are missing."""
    out = _run_suite(
        tmp_path,
        """
        import pytest
        from pipedialect.contracts import HeldStage
        from pipedialect.dialects.local import LocalDialect
        from pipedialect.testing.suite import TestTracing


        class OneRunner(LocalDialect):
            name = "one-runner"

            def engine_state(self, engine):
                first = engine.module.stages[0]
                held = [HeldStage(0, engine.module, first.mod)]
                return engine.engine_state(held, engine.module.plan)


        class TestOneRunner(TestTracing):
            @pytest.fixture
            def dialect(self):
                return OneRunner()
        """,
        "trace-2",
    )
    assert "conformance of 'one-runner': FAILED" in out
    assert (
        "tracing [plain, 2 stages]: [Stage 1] train_batch() 1: forward spans of micro-batches "
        "[], expected [0, 1, 2, 3]" in out
    )
