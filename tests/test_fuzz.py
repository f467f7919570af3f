"""The differential fuzzer (issue #12): random models on every dialect against the unsplit model.

Hand-picked models miss silent wrong results, so hypothesis generates models
(``_fuzz_models``): random boundary structures (nested dict/list/tuple, None, Python numbers and
bools, int and bool tensors, float tensors with and without a gradient), skip connections over
several stages, ties between random blocks, values used only stages later, Python control flow
on boundary values, random split points or ``num_stages`` with a random balance method, fx and
export capture, checkpointed blocks (some with dropout), meta-device models filled per stage,
calls inside ``pipedialect.trace``, SGD and Adam, with and without dynamic shapes, training and
evaluation interleaved, bf16 on the local dialect (one spec in five, against DeepSpeed's bf16
recipe written out on the unsplit model). Each is trained on a dialect and compared,
loss by loss and parameter by parameter, with a deep copy of the model trained by a plain loop.
A refusal counts only when it is a named pipedialect error raised before any batch ran.

Runs are deterministic (``derandomize``, no example database). A failure prints the spec
(readable, and as a ``FuzzSpec(...)`` expression to replay with ``run_local``); seeds drawn by
``random.Random`` reproduce with ``python tests/_fuzz_models.py <seed>``.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import _fuzz_models as fm
import _fuzz_workers as workers
import pytest
from hypothesis import HealthCheck, Phase, given, settings

from pipedialect.launch import launch

#: Generated models per run on the local dialect (the issue asks for at least 200).
LOCAL_EXAMPLES = 200
#: Shrinking a failing spec takes minutes on two shared cores; CI reports the spec as found.
#: ``FUZZ_SHRINK=1 pytest tests/test_fuzz.py -k local_dialect`` shrinks it to a minimal model.
PHASES = (Phase.explicit, Phase.generate) + (
    (Phase.shrink,) if os.environ.get("FUZZ_SHRINK") else ()
)


def _summary(outcomes: list[fm.Outcome]) -> str:
    refusals = Counter(
        f"{o.phase}: {(o.refused or '').split(':')[0]}" for o in outcomes if not o.ran
    )
    return f"{sum(o.ran for o in outcomes)} of {len(outcomes)} ran; refusals {dict(refusals)}"


def _checkpointed(spec: fm.FuzzSpec) -> fm.FuzzSpec:
    """``spec`` with its single-tensor blocks checkpointed (every other one with dropout), when
    it is captured with torch.fx; otherwise ``spec`` itself."""
    leaves = [i for i, block in enumerate(spec.blocks) if isinstance(block.out, fm.Leaf)]
    if spec.capture != "fx" or not leaves:
        return spec
    return replace(
        spec,
        checkpoint=tuple(f"blocks.{i}" for i in leaves[:2]),
        dropout=tuple(leaves[:1]) if spec.seed % 2 else (),
    )


def test_local_dialect_matches_the_unsplit_model_on_random_models() -> None:
    outcomes: list[fm.Outcome] = []

    @settings(
        max_examples=LOCAL_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=PHASES,
    )
    @given(spec=fm.fuzz_specs("local"))
    def check(spec: fm.FuzzSpec) -> None:
        outcomes.append(fm.run_local(spec))

    check()
    print(_summary(outcomes))
    assert len(outcomes) >= LOCAL_EXAMPLES
    ran = [o.spec for o in outcomes if o.ran]
    # The fuzzer must keep exercising what it exists for, not pass by being refused.
    assert len(ran) >= len(outcomes) // 2, _summary(outcomes)
    assert sum(s.capture == "export" for s in ran) >= 5, _summary(outcomes)
    assert sum(s.dynamic and "eval" in s.schedule for s in ran) >= 15, _summary(outcomes)
    assert sum(bool(s.ties) or s.tie_head for s in ran) >= 20, _summary(outcomes)
    assert sum(len(s.split_points) >= 3 for s in ran) >= 10, _summary(outcomes)
    assert sum(s.bf16 for s in ran) >= 20, _summary(outcomes)
    # The features of 8ed2218 and d6ce582: balanced partitions, checkpointed blocks (some with
    # dropout, whose masks recomputation must replay), meta-device models, traced calls. They
    # are counted over the hypothesis run plus a fixed sweep of seeded models (random.Random,
    # independent of hypothesis): inside the full suite the hypothesis run once drew far fewer
    # checkpointed models than alone, for a reason not yet found.
    swept = [fm.run_local(_checkpointed(fm.spec_from_seed(seed))) for seed in range(1000, 1060)]
    ran += [o.spec for o in swept if o.ran]
    outcomes += swept
    assert sum(s.num_stages is not None for s in ran) >= 20, _summary(outcomes)
    assert sum(bool(s.checkpoint) for s in ran) >= 20, _summary(outcomes)
    replayed = [s for s in ran if {f"blocks.{i}" for i in s.dropout} & set(s.checkpoint)]
    assert len(replayed) >= 3, _summary(outcomes)
    assert sum(s.meta for s in ran) >= 10, _summary(outcomes)
    assert sum(s.trace_from is not None for s in ran) >= 8, _summary(outcomes)


#: Seeds whose local model found a bug on f795e34, the code before the fixes of issue #12 (the
#: fuzzer's own finds, kept as a regression corpus; ``python tests/_fuzz_models.py <seed>``).
FOUND = {
    5: "bug 3: evaluating first under dynamic shapes broke the next train_batch (RuntimeError)",
    106: "bug 3: evaluating after training under dynamic shapes decoded floats swapped",
    122: "bug 3: evaluating after training under dynamic shapes: shape mismatch (RuntimeError)",
    198: "bug 3: evaluating first under dynamic shapes broke the next train_batch",
    6: "bug 1: isinstance(v, float) on the list split point blocks.0 returned was traced False",
    27: "bug 1: `is None` on the None split point blocks.0 returned was traced as not None",
    46: "bug 1: a walk over [None, tensor] from split point blocks.0 saw a Proxy, not None",
    23: "bug 1: a walk reaching the True split point blocks.0 returned saw a Proxy",
}


@pytest.mark.parametrize("seed", sorted(FOUND), ids=lambda s: f"seed{s}")
def test_models_that_found_bugs_now_train_like_the_unsplit_model(seed: int) -> None:
    assert fm.run_local(fm.spec_from_seed(seed)).ran, FOUND[seed]


def test_a_checkpointed_block_returning_none_and_a_bool_is_refused_by_name() -> None:
    """Seed 15's model: ``blocks.0`` returns ``False`` and ``None`` that later code branches on.

    A checkpointed module runs as one opaque call, so the code after it would see those values
    as a traced tensor and take other branches (a silent wrong loss, found by this fuzzer); the
    capture refuses such a module by name instead.
    """
    spec = replace(
        fm.spec_from_seed(15), checkpoint=("blocks.0",), dropout=(), meta=False, trace_from=None
    )
    outcome = fm.run_local(spec)
    assert not outcome.ran
    assert outcome.refused is not None
    assert outcome.refused.startswith("ActivationCheckpointError: checkpointed module 'blocks.0'")


def test_a_failure_names_the_spec_and_its_seed() -> None:
    """What a maintainer gets when the fuzzer finds something: the seed and the model."""
    spec = fm.spec_from_seed(3)
    broken = fm.failure(spec, "call 1 (eval): loss 1.0 != unsplit 2.0")
    text = str(broken)
    assert text.startswith("seed 3 call 1 (eval)")
    assert "v3 = blocks.0(" in text
    replay = text.split("replay: ", 1)[1]
    assert eval(replay, vars(fm)) == spec  # the printed spec is the spec


def test_a_refusal_counts_only_when_it_is_a_named_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness's own rules, on a spec that runs: a named error before the first batch is
    a refusal; any other exception, or a named error once a batch has run, is a failure."""
    from pipedialect import CaptureError, WireError
    from pipedialect.dialects.local.engine import LocalEngine

    spec = fm.spec_from_seed(4)
    assert fm.run_local(spec).ran
    real_partition = fm.partition_spec

    def refuse(*args: Any) -> Any:
        raise CaptureError("refused on purpose")

    monkeypatch.setattr(fm, "partition_spec", refuse)
    outcome = fm.run_local(spec)
    assert (outcome.ran, outcome.phase) == (False, "partition")
    assert outcome.refused == "CaptureError: refused on purpose"

    def crash(*args: Any) -> Any:
        raise AttributeError("not a named error")

    monkeypatch.setattr(fm, "partition_spec", crash)
    with pytest.raises(fm.FuzzFailure, match="partition raised AttributeError"):
        fm.run_local(spec)
    monkeypatch.setattr(fm, "partition_spec", real_partition)

    real_train = LocalEngine.train_batch

    def refuse_second_step(self: LocalEngine, data_iter: Any = None) -> Any:
        if self.global_steps == 1:
            raise WireError("[Stage 1] too late to refuse")
        return real_train(self, data_iter)

    monkeypatch.setattr(LocalEngine, "train_batch", refuse_second_step)
    assert spec.schedule.count("train") == 2
    with pytest.raises(fm.FuzzFailure, match="raised after earlier calls ran: WireError"):
        fm.run_local(spec)


# -- distributed dialects ----------------------------------------------------------------------

#: Seeds of the models each distributed dialect trains per run (one launch of two ranks each):
#: the first eight, plus DeepSpeed seeds that found the stale wire metadata under dynamic shapes
#: on f795e34 (126: a wrong eval loss; 94: evaluating first broke the next train_batch), and
#: torch seeds that found the zero-bubble schedules' split-backward bugs on f5064c4 (94: a
#: stage output needing a gradient from no input that needs one lost its weight gradient;
#: 91, 93, 138, 185, 186: a stage output also used inside its stage was detached in place).
#: Then seeds drawing checkpointed blocks and meta-device models (8ed2218): 26 and 54 both, 14
#: and 17 checkpoint, 16 and 18 meta (DeepSpeed); 14 and 128 both, 27 checkpoint, 11 meta (torch).
DEEPSPEED_SEEDS = (*range(8), 94, 126, 14, 16, 17, 18, 26, 54)
TORCH_SEEDS = (*range(8), 91, 93, 94, 138, 185, 186, 11, 14, 27, 128)


def _balanced(dialect: fm.Dialect) -> list[fm.FuzzSpec]:
    """Plans whose two split points the balancer chooses (partition(num_stages=2, balance=...)),
    one per cost model, so balanced plans are checked on the multi-process dialects too."""
    return [
        replace(
            fm.spec_from_seed(seed, dialect),
            num_stages=2,
            balance=balance,
            split_points=(),
            pipe_schedule="1f1b",
        )
        for seed, balance in ((3, "parameters"), (4, "flops"), (5, "memory"))
    ]


def _check_distributed(
    dialect: fm.Dialect, seeds: Sequence[int | fm.FuzzSpec], launched: list[Any]
) -> None:
    specs = [s if isinstance(s, fm.FuzzSpec) else fm.spec_from_seed(s, dialect) for s in seeds]
    problems: list[str] = []
    ran = 0
    balanced_ran = 0
    per_spec = zip(*launched, strict=True)
    for spec, results in zip(specs, per_spec, strict=True):
        try:
            if workers.compare(spec, list(results)):
                ran += 1
                balanced_ran += spec.num_stages is not None
        except fm.FuzzFailure as exc:
            problems.append(str(exc))
    assert not problems, "\n\n".join(problems)
    assert ran >= len(specs) * 3 // 4, f"only {ran} of {len(specs)} models ran"
    balanced = sum(spec.num_stages is not None for spec in specs)
    assert balanced_ran == balanced, f"only {balanced_ran} of {balanced} balanced plans ran"


@pytest.mark.distributed
def test_deepspeed_matches_the_unsplit_model_on_random_models() -> None:
    cases = [*DEEPSPEED_SEEDS, *_balanced("deepspeed")]
    launched = launch(workers.run_specs, 2, "deepspeed", cases, timeout=300)
    _check_distributed("deepspeed", cases, launched)


@pytest.mark.distributed
def test_torch_dialect_matches_the_unsplit_model_on_random_models() -> None:
    cases = [*TORCH_SEEDS, *_balanced("torch")]
    launched = launch(workers.run_specs, 2, "torch", cases, timeout=300)
    _check_distributed("torch", cases, launched)
