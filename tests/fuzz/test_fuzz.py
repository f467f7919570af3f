"""The differential fuzzer: random models on every dialect against the unsplit model.

Hand-picked models miss silent wrong results, so hypothesis generates models
(``_fuzz_models``): random boundary structures (nested dict/list/tuple, None, Python numbers and
bools, int and bool tensors, float tensors with and without a gradient), skip connections over
several stages, ties between random blocks, values used only stages later, Python control flow
on boundary values, random split points or ``num_stages`` with a random balance method, fx and
export capture, recomputed blocks (some with dropout), meta-device models filled per stage,
calls inside ``pipedialect.trace``, SGD and Adam, with and without dynamic shapes, training and
evaluation interleaved, bf16 on the local dialect (one spec in five, against DeepSpeed's bf16
recipe written out on the unsplit model). Then module state (``fm.DIMENSIONS``):
buffers (BatchNorm, hand-written running statistics, non-persistent buffers), Python counters,
a buffer written by one block and read by another (in a later or an earlier stage),
``self.training`` branches, ``no_grad``/``enable_grad``/autocast regions, in-place ops on
boundary tensors and on buffers saved for backward, frozen parameters and frozen or
parameterless stages, and bf16 on the export path. Each is trained on a dialect and compared,
loss by loss (eval losses included), parameter by parameter and buffer by buffer, with a copy of
the model trained by a plain loop (``model.train()`` for train calls, ``model.eval()`` under
``no_grad`` for eval calls); ``partition()`` must leave the model unchanged. A refusal counts
only when it is a named pipedialect error raised before any batch ran; the tests count ran and
refused models per dimension and require enough that ran.

Runs are deterministic (``derandomize``, no example database). A failure prints the spec
(readable, and as a ``FuzzSpec(...)`` expression to replay with ``run_local``); seeds drawn by
``random.Random`` reproduce with ``python tests/_fuzz_models.py <seed>`` (``--only buffers``
keeps one dimension of its state, ``--dialect torch`` replays it on two ranks).
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import _fuzz_models as fm
import _fuzz_workers as workers
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings

from pipedialect import PipeDialectError
from pipedialect.runtime.launch import launch

#: Generated models per run on the local dialect (the issue asks for at least 200).
LOCAL_EXAMPLES = 200
#: Shrinking a failing spec takes minutes on two shared cores; CI reports the spec as found.
#: ``FUZZ_SHRINK=1 pytest tests/fuzz/test_fuzz.py -k local_dialect`` shrinks it to a minimal model.
PHASES = (Phase.explicit, Phase.generate) + (
    (Phase.shrink,) if os.environ.get("FUZZ_SHRINK") else ()
)


def _summary(outcomes: list[fm.Outcome]) -> str:
    refusals = Counter(
        f"{o.phase}: {(o.refused or '').split(':')[0]}" for o in outcomes if not o.ran
    )
    table = fm.dimension_counts([(o.spec, "ran" if o.ran else "refused") for o in outcomes])
    return (
        f"{sum(o.ran for o in outcomes)} of {len(outcomes)} ran; refusals {dict(refusals)}\n"
        f"by module-state dimension and feature:\n{fm.format_counts(table)}"
    )


#: Seeds of the sweep for the module-state dimensions (``random.Random``: stable counts, where the
#: hypothesis run's draws of the new dimensions shift with any change to the generator).
STATE_SEEDS = range(2000, 2060)
#: The fewest local models that must run (not be refused) per module-state dimension or feature,
#: over the hypothesis run and both seeded sweeps: about a third of those the two sweeps draw
#: (a dimension counts when its whole model ran, its other dimensions included).
LOCAL_MINIMUM_RAN = {
    "buffers": 20,
    "buffers:bn": 5,
    "buffers:stats": 5,
    "counter": 8,
    "cross_buffer": 12,
    "cross_buffer:across_stages": 6,
    "modes": 12,
    "regions": 12,
    "regions:no_grad": 4,
    "inplace": 20,
    "inplace:after_split": 3,
    "frozen": 15,
    "bf16_export": 6,
    "recompute_export": 3,
}
#: Local models whose plan has a stage with nothing to train (frozen or parameterless).
LOCAL_MINIMUM_UNTRAINED_STAGES = 5


def _assert_dimensions_ran(outcomes: list[fm.Outcome]) -> None:
    table = fm.dimension_counts([(o.spec, "ran" if o.ran else "refused") for o in outcomes])
    short = {
        name: (table.get(name, Counter())["ran"], least)
        for name, least in LOCAL_MINIMUM_RAN.items()
        if table.get(name, Counter())["ran"] < least
    }
    assert not short, f"too few models ran (ran, required): {short}\n{_summary(outcomes)}"
    untrained = sum(o.ran and o.untrained_stages > 0 for o in outcomes)
    assert untrained >= LOCAL_MINIMUM_UNTRAINED_STAGES, (
        f"only {untrained} models with a frozen or parameterless stage ran"
    )


def _recomputed(spec: fm.FuzzSpec) -> fm.FuzzSpec:
    """``spec`` with its single-tensor blocks recomputed (every other one with dropout), when
    it is captured with torch.fx; otherwise ``spec`` itself."""
    # Not a block split at its ``lin``: a split point inside a recomputed module is refused
    # (it runs as one call), which is not what this sweep is for.
    # Nor a block writing a parameter in forward: recomputing it is refused at the first
    # training call (RecomputeError), which the generator never draws either.
    leaves = [
        i
        for i, block in enumerate(spec.blocks)
        if isinstance(block.out, fm.Leaf)
        and f"blocks.{i}.lin" not in spec.split_points
        and i not in spec.param_write
    ]
    if spec.capture != "fx" or not leaves:
        return spec
    return replace(
        spec,
        recompute=tuple(f"blocks.{i}" for i in leaves[:2]),
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
    # The features of 8ed2218 and d6ce582: balanced partitions, recomputed blocks (some with
    # dropout, whose masks recomputation must replay), meta-device models, traced calls. They
    # are counted over the hypothesis run plus a fixed sweep of seeded models (random.Random,
    # independent of hypothesis): inside the full suite the hypothesis run once drew far fewer
    # recomputed models than alone, for a reason not yet found.
    swept = [fm.run_local(_recomputed(fm.spec_from_seed(seed))) for seed in range(1000, 1060)]
    ran += [o.spec for o in swept if o.ran]
    outcomes += swept
    assert sum(s.num_stages is not None for s in ran) >= 20, _summary(outcomes)
    assert sum(bool(s.recompute) for s in ran) >= 20, _summary(outcomes)
    replayed = [s for s in ran if {f"blocks.{i}" for i in s.dropout} & set(s.recompute)]
    assert len(replayed) >= 3, _summary(outcomes)
    assert sum(s.meta for s in ran) >= 10, _summary(outcomes)
    assert sum(s.trace_from is not None for s in ran) >= 8, _summary(outcomes)
    outcomes += [fm.run_local(fm.spec_from_seed(seed)) for seed in STATE_SEEDS]
    print(_summary(outcomes))
    _assert_dimensions_ran(outcomes)


#: Seeds whose local model found a bug on f795e34, the code before the fuzzer's first fixes (the
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
    assert fm.run_local(fm.spec_from_seed(seed, dims=())).ran, FOUND[seed]


def test_a_checkpointed_block_returning_none_and_a_bool_is_refused_by_name() -> None:
    """Seed 15's model: ``blocks.0`` returns ``False`` and ``None`` that later code branches on.

    A recomputed module runs as one opaque call, so the code after it would see those values
    as a traced tensor and take other branches (a silent wrong loss, found by this fuzzer); the
    capture refuses such a module by name instead.
    """
    spec = replace(
        fm.spec_from_seed(15, dims=()),
        recompute=("blocks.0",),
        dropout=(),
        meta=False,
        trace_from=None,
    )
    outcome = fm.run_local(spec)
    assert not outcome.ran
    assert outcome.refused is not None
    assert outcome.refused.startswith("RecomputeError: recomputed module 'blocks.0'")


#: ``describe()`` of seeds 0-199 per dialect at 445325a (before the module-state dimensions): a
#: sha256 prefix of the strings joined by newlines. Drawn without the new dimensions, every
#: older seed must still be the same model (the new draws come last).
DESCRIBE_AT_445325A = {
    "local": "fadc5d8df62958cf",
    "deepspeed": "c7922916bc3f2cf2",
    "torch": "c0aacdd63a3e38c2",
}
#: One of them in full, to read: seed 17 on the local dialect at 445325a.
SEED_17_AT_445325A = """\
FuzzSpec seed=45589 origin=17 dim=8 vocab=11 batch=3 capture=fx dynamic=False optimizer=sgd \
gas=1 schedule=['train', 'train', 'eval'] split=['blocks.0', 'blocks.1', 'blocks.3']
  v0 = x, v1 = ids, v2 = tanh(stem(x)) + embed(ids)
  v3 = blocks.0(v2) -> {'h': <act>}
      top: walk v2
  v4 = blocks.1(v3['h']) -> <act>
      inside: isinstance 'tuple' v3
      top: walk v3['h']
      inside: walk v3['h']
  v5 = blocks.2(v4) -> (<act>, False)
  v6 = blocks.3(v5[0]) -> <act>
  out = head(softsign(v6)) as tensor
      top: walk v0
      top: is_none v3"""


@pytest.mark.parametrize("dialect", sorted(DESCRIBE_AT_445325A))
def test_older_seeds_keep_their_models_without_the_new_dimensions(dialect: fm.Dialect) -> None:
    digest = hashlib.sha256()
    for seed in range(200):
        digest.update(fm.spec_from_seed(seed, dialect, dims=()).describe().encode() + b"\n")
    assert digest.hexdigest()[:16] == DESCRIBE_AT_445325A[dialect]
    if dialect == "local":
        assert fm.spec_from_seed(17, dims=()).describe() == SEED_17_AT_445325A
        # With them, the same model gains state and nothing else changes.
        full = fm.spec_from_seed(17)
        assert full.dims() and fm.restrict(full, ()) == fm.spec_from_seed(17, dims=())


def _one_block_state(seed: int, **state: Any) -> fm.FuzzSpec:
    """Seed ``seed``'s model without module state, except ``state`` on ``blocks.0``."""
    spec = fm.spec_from_seed(seed, dims=())
    states = [fm.BlockState()] * len(spec.blocks)
    states[0] = fm.BlockState(**state)
    return replace(spec, state=tuple(states), meta=False, recompute=(), dropout=(), bf16=False)


def test_the_reference_is_the_model_run_by_a_plain_loop_with_its_own_semantics() -> None:
    """The reference itself, checked by hand: BatchNorm's running statistics follow the train
    calls' micro-batches only, a counter counts every forward, eval leaves the buffers alone,
    frozen parameters stay put, a parameterless block has none, and bf16 keeps buffers fp32."""
    spec = replace(_one_block_state(2, buffer="bn", counter=True), schedule=("train", "eval"))
    model = fm.FuzzModel(spec)
    seen: list[torch.Tensor] = []
    norm = model.blocks[0].norm
    norm.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach().clone()))
    batches = fm.micro_batches(spec)
    fm.reference_run(spec, model, batches)
    assert len(seen) == 2 * spec.gas  # one forward per micro-batch, train and eval
    mean, var = torch.zeros(spec.dim), torch.ones(spec.dim)
    for x in seen[: spec.gas]:  # the train call's micro-batches; eval updates nothing
        mean = 0.9 * mean + 0.1 * x.mean(0)
        var = 0.9 * var + 0.1 * x.var(0, unbiased=True)
    torch.testing.assert_close(norm.running_mean, mean)
    torch.testing.assert_close(norm.running_var, var)
    assert int(norm.num_batches_tracked) == spec.gas
    assert model.blocks[0].calls == 2 * spec.gas
    assert not model.training  # the eval call came last

    spec = replace(_one_block_state(3, params="frozen", buffer="stats"), frozen_prefix=None)
    spec = replace(spec, state=(*spec.state[:1], fm.BlockState(params="none"), *spec.state[2:]))
    model = fm.FuzzModel(spec)
    assert not list(model.blocks[1].parameters())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    fm.reference_run(spec, model, fm.micro_batches(spec))
    after = dict(model.named_parameters())
    assert torch.equal(after["blocks.0.lin.weight"], before["blocks.0.lin.weight"])
    assert not torch.equal(after["head.bias"], before["head.bias"])

    spec = replace(_one_block_state(5, buffer="stats", scale="train"), bf16=True)
    model = fm.FuzzModel(spec)
    fm.reference_run(spec, model, fm.micro_batches(spec))
    assert {b.dtype for b in model.buffers()} == {torch.float32}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    trains = spec.schedule.count("train") * spec.gas
    assert torch.allclose(model.blocks[0].scale, torch.full((spec.dim,), 0.97**trains))


def test_partition_must_leave_the_model_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """A harness rule: a buffer or Python counter that ``partition()`` changed is a failure,
    even when the pipeline would then agree (or refuse by name)."""
    spec = _one_block_state(4, counter=True, buffer="table")
    real_partition = fm.partition_spec

    def count_once(model: Any, *args: Any) -> Any:
        plan = real_partition(model, *args)
        model.blocks[0].calls = 0
        model.blocks[0].table.mul_(2.0)
        return plan

    monkeypatch.setattr(fm, "partition_spec", count_once)
    with pytest.raises(fm.FuzzFailure, match=r"partition\(\) changed the buffer blocks.0.table"):
        fm.run_local(spec)


def test_a_traced_counter_is_refused_naming_leaf_modules_and_runs_as_a_leaf() -> None:
    """The fuzzer passes ``leaf_modules=`` for counters in traced code (``counter_leaves``):
    without it the refusal must name exactly that fix, on both capture paths, and leave the
    model's counter alone; with it the model trains as the unsplit one."""
    from pipedialect import CaptureError, partition

    spec = _one_block_state(22, counter=True)  # blocks.0 returns one tensor, traced through
    assert fm.counter_leaves(spec) == ["blocks.0"]
    model = fm.FuzzModel(spec)
    with pytest.raises(CaptureError, match=r"changes 'calls'.*leaf_modules=\['blocks.0'\]"):
        partition(model, list(spec.split_points))
    assert model.blocks[0].calls == 0
    (x, ids), _ = fm.micro_batches(spec)[0]
    with pytest.raises(CaptureError, match=r"torch.export.*leaf_modules=\['blocks.0'\]"):
        partition(model, list(spec.split_points), example_inputs={"x": x, "ids": ids})
    assert model.blocks[0].calls == 0
    assert fm.run_local(spec).ran


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

    spec = fm.spec_from_seed(4, dims=())
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
#: Then seeds drawing recomputed blocks and meta-device models (8ed2218): 26 and 54 both, 14
#: and 17 checkpoint, 16 and 18 meta (DeepSpeed); 14 and 128 both, 27 checkpoint, 11 meta (torch).
#: These are drawn without the module-state dimensions (the models they were chosen for).
DEEPSPEED_SEEDS = (*range(8), 94, 126, 14, 16, 17, 18, 26, 54)
TORCH_SEEDS = (*range(8), 91, 93, 94, 138, 185, 186, 11, 14, 27, 128)
#: Seeds drawn with the module-state dimensions, chosen so that between them every dimension the
#: dialect draws appears at least twice, as do a buffer written in one stage and read in the
#: next, an in-place op on the tensor a stage received, a frozen first stage (LoRA-like) and a
#: parameterless block, BatchNorm, a ``no_grad`` region and an in-place buffer update saved for
#: backward; none reads a buffer written by a later stage (which may be refused), none has
#: more than three dimensions. On torch they cover the 1F1B, zero-bubble and DualPipeV
#: schedules. (``dropout`` modes and bf16 are drawn for local only.)
STATE_DEEPSPEED_SEEDS = (238, 123, 178, 219, 180, 64, 44, 118)
STATE_TORCH_SEEDS = (61, 159, 255, 171, 97, 215, 58)
#: Seeds drawing every run-time dimension at once (noise and dropout, a parameter
#: written in forward, a trainability flip refused and undone), which run on their dialect:
#: DeepSpeed's 1F1B, torch's DualPipeV.
RUNTIME_DEEPSPEED_SEEDS = (646,)
RUNTIME_TORCH_SEEDS = (569,)


def _balanced(dialect: fm.Dialect) -> list[fm.FuzzSpec]:
    """Plans whose two split points the balancer chooses (partition(num_stages=2, balance=...)),
    one per cost model, so balanced plans are checked on the multi-process dialects too."""
    return [
        replace(
            fm.spec_from_seed(seed, dialect, dims=()),
            num_stages=2,
            balance=balance,
            split_points=(),
            pipe_schedule="1f1b",
        )
        for seed, balance in ((3, "parameters"), (4, "flops"), (5, "memory"))
    ]


def _cases(dialect: fm.Dialect, seeds: Sequence[int], state_seeds: Sequence[int]) -> list[Any]:
    """The specs one launch trains: the older seeds as they were, the balanced plans, then the
    seeds with module state."""
    return [
        *(fm.spec_from_seed(seed, dialect, dims=()) for seed in seeds),
        *_balanced(dialect),
        *(fm.spec_from_seed(seed, dialect) for seed in state_seeds),
    ]


def _check_distributed(
    dialect: fm.Dialect, specs: Sequence[fm.FuzzSpec], launched: list[Any]
) -> None:
    problems: list[str] = []
    outcomes: list[tuple[fm.FuzzSpec, str]] = []
    per_spec = zip(*launched, strict=True)
    for spec, results in zip(specs, per_spec, strict=True):
        try:
            outcomes.append((spec, "ran" if workers.compare(spec, list(results)) else "refused"))
        except fm.FuzzFailure as exc:
            problems.append(str(exc))
    assert not problems, "\n\n".join(problems)
    ran = [spec for spec, status in outcomes if status == "ran"]
    table = fm.format_counts(fm.dimension_counts(outcomes))
    print(f"{dialect}: {len(ran)} of {len(specs)} ran\n{table}")
    assert len(ran) >= len(specs) * 3 // 4, f"only {len(ran)} of {len(specs)} models ran"
    balanced = sum(spec.num_stages is not None for spec in specs)
    balanced_ran = sum(spec.num_stages is not None for spec in ran)
    assert balanced_ran == balanced, f"only {balanced_ran} of {balanced} balanced plans ran"
    # Every module-state dimension the launch draws trains in at least one model.
    drawn = {d for spec in specs for d in spec.dims()}
    trained = {d for spec in ran for d in spec.dims()}
    assert drawn <= trained, f"no model with {sorted(drawn - trained)} ran\n{table}"


@pytest.mark.distributed
def test_deepspeed_matches_the_unsplit_model_on_random_models() -> None:
    cases = _cases("deepspeed", DEEPSPEED_SEEDS, (*STATE_DEEPSPEED_SEEDS, *RUNTIME_DEEPSPEED_SEEDS))
    launched = launch(workers.run_specs, 2, "deepspeed", cases, timeout=300)
    _check_distributed("deepspeed", cases, launched)


@pytest.mark.distributed
def test_torch_dialect_matches_the_unsplit_model_on_random_models() -> None:
    cases = _cases("torch", TORCH_SEEDS, (*STATE_TORCH_SEEDS, *RUNTIME_TORCH_SEEDS))
    launched = launch(workers.run_specs, 2, "torch", cases, timeout=300)
    _check_distributed("torch", cases, launched)


#: Torch seeds drawing one stage per rank (1F1B or GPipe, what FSDP runs with), chosen so that
#: between them: ties, meta-device builds, recomputed blocks, export capture, frozen
#: parameters, buffers, counters, in-place updates and a buffer shared across stages. 107 and
#: 309 failed on 40122bc, before the fixes of 7dc469b: ``nn.ReLU(inplace=True)`` inside a
#: block's unit, and an in-place update of the tensor a sharded stage received.
FSDP_SEEDS = (0, 2, 4, 11, 20, 27, 52, 57, 107, 309)
#: Torch seeds for tensor parallelism: two stages (one per rank), even widths, colwise and
#: rowwise blocks, ties across and within stages, meta builds, recomputation; 31, 36, 115
#: and 300 are export-captured (sharded in the graph; 300 recomputes its blocks). 48 and 84
#: kept a colwise stem's output sharded into
#: ``tanh(stem(x)) + embed(ids)`` on its way to a rowwise block (a shape error) until a shard
#: stays local only through code of its own; 52 (evaluation first, BatchNorm) was refused by
#: the first batch's check while its unsharded copy still ran in training mode. 31 is
#: export-captured on the meta device: its shards are checked against the gathered weights.
TP_SEEDS = (2, 13, 23, 29, 31, 36, 46, 48, 52, 57, 84, 115, 300)


@pytest.mark.distributed
def test_torch_fsdp_matches_the_unsplit_model_on_random_models() -> None:
    """Two stages sharded over two replicas (``_fuzz_workers`` [the fsdp note]): four ranks."""
    # A parameter written in forward is refused under FSDP (its write would be lost with the
    # gathered copy; tests/features/test_randomness.py checks the refusal): left out here.
    specs = [fm.spec_from_seed(seed, "torch") for seed in FSDP_SEEDS]
    assert any(s.param_write for s in specs)
    specs = [replace(s, param_write=()) for s in specs]
    assert {s.pipe_schedule for s in specs} <= {"1f1b", "gpipe"}
    launched = launch(workers.run_specs, 4, "torch", specs, True, timeout=600)
    problems, ran = [], 0
    for spec, results in zip(specs, zip(*launched, strict=True), strict=True):
        try:
            ran += workers.compare(spec, list(results))
        except fm.FuzzFailure as exc:
            problems.append(str(exc))
    assert not problems, "\n\n".join(problems)
    assert ran == len(specs), f"only {ran} of {len(specs)} models ran under FSDP"


def test_the_planners_default_cuts_fall_after_blocks_and_train_like_the_unsplit_model() -> None:
    """On seeded random models: every cut the planner considers by default ends a whole block
    (``blocks.<i>``, never ``blocks.<i>.lin``), and a pipeline cut at the planner's cuts
    trains like the unsplit model on the local dialect."""
    from pipedialect.cost import model_chains
    from pipedialect.cost.balance import profile_model

    outcomes = []
    for seed in range(3000, 3012):
        spec = replace(fm.spec_from_seed(seed), num_stages=None, capture="fx", meta=False)
        model = fm.build_model(spec)
        (x, ids), _ = fm.micro_batches(spec)[0]
        leaves = fm.counter_leaves(spec) or None
        inputs = {"x": x, "ids": ids}
        try:
            profile = profile_model(model, example_inputs=inputs, leaf_modules=leaves)
            (chain,) = model_chains(
                model, inputs, flops_per_second=1e9, leaf_modules=leaves, profile=profile
            ).values()
        except PipeDialectError:
            continue  # a model the measurement refuses by name: not this test's subject
        if len(profile.blocks) > 1:
            assert set(chain.cuts) <= set(profile.blocks), (seed, chain.cuts)
        cuts = chain.cuts[: chain.max_stages - 1][:2]
        outcomes.append(fm.run_local(replace(spec, split_points=tuple(cuts))))
    assert sum(o.ran for o in outcomes) >= 4, _summary(outcomes)


@pytest.mark.distributed
def test_torch_tensor_parallel_matches_the_unsplit_model_on_random_models() -> None:
    """Two stages, each sharded over a tensor axis of two ranks (``_fuzz_workers`` [the tp
    note]): four ranks. The export-captured seeds are sharded in their graphs (which call no
    module); every model trains as the unsplit model."""
    specs = [fm.spec_from_seed(seed, "torch") for seed in TP_SEEDS]
    assert sum(spec.capture == "export" for spec in specs) == 4
    assert any(spec.capture == "export" and spec.meta for spec in specs)
    launched = launch(workers.run_specs, 4, "torch", specs, False, True, timeout=600)
    problems, ran = [], 0
    for spec, results in zip(specs, zip(*launched, strict=True), strict=True):
        try:
            ran += workers.compare(spec, list(results))
        except fm.FuzzFailure as exc:
            problems.append(str(exc))
    assert not problems, "\n\n".join(problems)
    assert ran == len(specs), f"only {ran} of {len(specs)} models ran under tensor parallelism"
