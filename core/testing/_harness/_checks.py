"""Turning what the ranks recorded into sentences that name the broken contract.

Each function returns a list of failure messages, empty when the contract holds. Messages start
with the contract area and the case (``tied weights [gpt, 2 stages]: ...``), name the stage,
rank, value or parameter, and say what the dialect must do. A training case that differs from
the unsplit model leads with the rule it broke, when one explains the numbers (``_rules``:
clipping, loss scaling, the optimizer). :func:`fail` ends a test with them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import pytest

from ._cases import Case
from ._compare import first_difference, relative_error
from ._driver import CaseResult
from ._reference import expected_receives, reference, tied_names
from ._rules import broken_rule

__all__ = [
    "LOSS_ATOL",
    "RTOL",
    "boundary_failures",
    "build_error_failures",
    "checkpoint_failures",
    "fail",
    "fail_if",
    "portable_checkpoint_failures",
    "run_error_failures",
    "trace_failures",
    "training_failures",
]

#: Relative tolerance against the unsplit model (tensor-wide for parameters).
RTOL = 1e-6
#: The parameters' tolerance of a tensor-parallel case: every sharded matmul sums in another
#: order than the unsplit model's, and a parameter whose gradient is nearly zero (a key
#: projection without bias under softmax) carries that fp32 rounding relatively larger.
TENSOR_RTOL = 1e-5
#: Absolute tolerance for losses near zero.
LOSS_ATOL = 1e-7
#: Failure lines shown per test; the rest are counted.
SHOWN = 6

_TRACEBACK_LINES = 14
_LAUNCH_ERROR_CHARS = 4000


def fail(failures: Sequence[str]) -> NoReturn:
    """End the test with ``failures`` (the first few, then a count of the rest)."""
    lines = list(failures[:SHOWN])
    if len(failures) > SHOWN:
        lines.append(f"... and {len(failures) - SHOWN} more")
    pytest.fail("\n".join(lines), pytrace=False)


def fail_if(failures: Sequence[str]) -> None:
    """:func:`fail` unless ``failures`` is empty."""
    if failures:
        fail(failures)


def _training_label(case: Case) -> str:
    if case.kind == "checkpoint":
        return "checkpoints"
    if case.kind == "portable-checkpoint":
        return "portable checkpoints"
    if case.kind == "trace":
        return "tracing"
    if case.tensor_parallel > 1:
        return "tensor parallel"
    if case.data_parallel > 1:
        return "data parallel"
    if case.model == "plain-dynamic":
        return "dynamic shapes"
    return "training equivalence"


def _tail(text: str, lines: int = _TRACEBACK_LINES) -> str:
    kept = text.rstrip().splitlines()[-lines:]
    return "\n".join("    " + line for line in kept)


def _first_raised(result: CaseResult) -> tuple[int, dict[str, Any]] | None:
    raised = [(rec["time"], r, rec) for r, rec in result.records.items() if rec["status"] != "ok"]
    if not raised:
        return None
    _, rank, rec = min(raised, key=lambda item: (item[0], item[1]))
    return rank, rec


def crash_failures(result: CaseResult, label: str) -> list[str]:
    """Messages for a case that did not run to the end (a rank raised, or the launch ended)."""
    head = f"{label} [{result.case.title}]"
    first = _first_raised(result)
    if first is not None or result.launch_error is not None:
        # What the stages received before it went wrong often says why.
        probed = _probe_failures(result)
    else:
        probed = []
    if first is not None:
        rank, rec = first
        where = f"rank {rank}" if result.world_size > 1 else "the engine"
        text = f"{head}: {where} raised {rec['error_type']}: {rec['message']}"
        if not rec["contract_error"]:
            text += f"\n{_tail(rec['traceback'])}"
        return [*probed, text]
    if result.launch_error is not None:
        error = result.launch_error
        if len(error) > _LAUNCH_ERROR_CHARS:
            error = "..." + error[-_LAUNCH_ERROR_CHARS:]
        missing = sorted(set(range(result.world_size)) - set(result.records))
        return [*probed, f"{head}: ranks {missing} did not finish the case: {error}"]
    return []


def _loss_close(actual: float, expected: float) -> bool:
    return math.isclose(actual, expected, rel_tol=RTOL, abs_tol=LOSS_ATOL)


def training_failures(result: CaseResult) -> list[str]:
    """Compare every rank's losses and parameters, step by step, with the unsplit model."""
    case = result.case
    label = _training_label(case)
    crashed = crash_failures(result, label)
    if crashed:
        return crashed
    head = f"{label} [{case.title}]"
    failures = _coverage_failures(result, head)
    failures += _probe_failures(result)
    ref = reference(case.id)
    ties = tied_names(case.id)
    events: list[tuple[int, int, str]] = []
    for rank, rec in sorted(result.records.items()):
        events += _step_failures(case, rank, rec["losses"], rec["params"], ref, ties, head)
        if "eval_loss" in rec and not _loss_close(rec["eval_loss"], ref.eval_loss):
            events.append(
                (
                    case.steps + 1,
                    0,
                    f"{head}: eval_batch() returned {rec['eval_loss']:.8g} on rank {rank}; the "
                    f"unsplit model's mean evaluation loss is {ref.eval_loss:.8g}",
                )
            )
    failures += [text for _, _, text in sorted(events, key=lambda e: (e[0], e[1]))]
    if failures:
        rule = broken_rule(case, result.records)
        if rule is not None:
            failures.insert(0, f"{head}: {rule}")
    return failures


def _coverage_failures(result: CaseResult, head: str) -> list[str]:
    case = result.case
    counts = {k: 0 for k in range(case.stages)}
    for rec in result.records.values():
        for k in rec["stages"]:
            counts[k] = counts.get(k, 0) + 1
    per_stage = 1 if result.world_size == 1 else case.data_parallel * case.tensor_parallel
    wrong = {k: n for k, n in counts.items() if n != per_stage}
    failures = []
    if wrong:
        failures.append(
            f"{head}: local_stages() over the {result.world_size} rank(s) reports stages "
            f"{dict(sorted(counts.items()))} (stage: number of ranks); each of the "
            f"{case.stages} stages must be trained by exactly {per_stage} rank(s)"
        )
    ref_names = set(reference(case.id).initial)
    seen = {
        name
        for rec in result.records.values()
        if rec["params"]
        for named in rec["params"][0].values()
        for name in named
    }
    unseen = sorted(ref_names - seen)
    if unseen and not wrong:
        failures.append(
            f"{head}: parameters {unseen[:5]} of the unsplit model are on no rank's local stages; "
            "every parameter must be trained by the stage that holds it"
        )
    return failures


def _step_failures(
    case: Case,
    rank: int,
    losses: Sequence[float],
    params: Sequence[Mapping[int, Mapping[str, Any]]],
    ref: Any,
    ties: Mapping[str, tuple[str, list[tuple[str, int]]]],
    head: str,
) -> list[tuple[int, int, str]]:
    events: list[tuple[int, int, str]] = []
    if len(losses) != case.steps:
        events.append((0, 0, f"{head}: rank {rank} recorded {len(losses)} steps of {case.steps}"))
    for step, (loss, expected) in enumerate(zip(losses, ref.losses, strict=False), 1):
        if not _loss_close(loss, expected):
            events.append(
                (
                    step,
                    0,
                    f"{head}: train_batch() of step {step} returned loss {loss:.8g} on rank "
                    f"{rank}; the unsplit model's mean micro-batch loss is {expected:.8g} "
                    f"(relative difference {abs(loss - expected) / max(abs(expected), 1e-12):.1e})",
                )
            )
    for step, (snapshot, expected) in enumerate(zip(params, ref.params, strict=False), 1):
        for stage, named in sorted(snapshot.items()):
            for name, value in named.items():
                text = _param_failure(
                    name,
                    value,
                    expected.get(name),
                    stage,
                    rank,
                    step,
                    ties,
                    rtol=TENSOR_RTOL if case.tensor_parallel > 1 else RTOL,
                )
                if text is not None:
                    label = "tied weights" if name in ties else head.split(" [")[0]
                    events.append((step, 1, f"{label} [{case.title}]: {text}"))
    return events


def _param_failure(
    name: str,
    value: Any,
    expected: Any,
    stage: int,
    rank: int,
    step: int,
    ties: Mapping[str, tuple[str, list[tuple[str, int]]]],
    *,
    rtol: float = RTOL,
) -> str | None:
    where = f"parameter {name} on stage {stage} (rank {rank})"
    if expected is None:
        return f"{where} is not a parameter of the unsplit model"
    if value.shape != expected.shape:
        return (
            f"{where} has shape {tuple(value.shape)}, the unsplit model's {tuple(expected.shape)}"
        )
    err = relative_error(value, expected)
    if err <= rtol:
        return None
    text = (
        f"{where} differs from the unsplit model after step {step} (relative error "
        f"{err:.1e} > {rtol:.0e})"
    )
    if name in ties:
        key, others = ties[name]
        tied = ", ".join(f"{n} on stage {s}" for n, s in others)
        text += (
            f"; it is tied to {tied} (tie group {key}): the dialect must keep tied copies equal "
            "and sum their gradients every step"
        )
    return text


def _probe_failures(result: CaseResult) -> list[str]:
    failures: list[str] = []
    for rank, rec in sorted(result.records.items()):
        received = rec.get("received")
        if received:
            where = f" on rank {rank}" if result.world_size > 1 else ""
            failures += boundary_failures(result.case, received, "boundary", where)
    return failures


def boundary_failures(
    case: Case, received: Mapping[int, Sequence[Any]], label: str, where: str = ""
) -> list[str]:
    """Compare what each stage received in the first micro-batch with the unsplit values."""
    expected = expected_receives(case.id)
    failures = []
    head = f"{label} [{case.title}]"
    for stage, values in sorted(received.items()):
        names, wanted = expected[stage]
        if len(values) != len(wanted):
            failures.append(
                f"{head}: [Stage {stage}]{where} received {len(values)} values, expected "
                f"{len(wanted)}: {list(names)}"
            )
            continue
        for i, (value, want) in enumerate(zip(values, wanted, strict=True)):
            diff = first_difference(value, want, rtol=RTOL)
            if diff is None:
                continue
            text = (
                f"{head}: [Stage {stage}]{where} received {names[i]!r} (value {i + 1} of "
                f"{len(names)} crossing into stage {stage}: {list(names)}) differently from "
                f"the unsplit model, {diff}"
            )
            same_as = [
                names[j]
                for j, other in enumerate(wanted)
                if j != i and first_difference(value, other, rtol=RTOL) is None
            ]
            if same_as:
                text += (
                    f"; it equals the value of {same_as[0]!r}: the boundary's values arrive "
                    "reordered"
                )
            failures.append(text)
    return failures


def checkpoint_failures(result: CaseResult) -> list[str]:
    """Training before the save must match the unsplit model, and so must the resumed step."""
    failures = training_failures(result)
    if failures:
        return failures
    case = result.case
    ref = reference(case.id)
    ties = tied_names(case.id)
    head = f"checkpoints [{case.title}]"
    for rank, rec in sorted(result.records.items()):
        (loss,) = rec["resumed_losses"]
        if not _loss_close(loss, ref.losses[-1]):
            failures.append(
                f"{head}: after load_checkpoint(), train_batch() returned loss {loss:.8g} on "
                f"rank {rank}; the uninterrupted run's is {ref.losses[-1]:.8g}: the checkpoint "
                "did not restore the parameters (and optimizer state) exactly"
            )
        for stage, named in sorted(rec["resumed_params"][0].items()):
            for name, value in named.items():
                text = _param_failure(name, value, ref.params[-1].get(name), stage, rank, 1, ties)
                if text is not None:
                    text = text.replace("after step 1", "one step after load_checkpoint()")
                    failures.append(f"{head}: after resuming, {text}")
    return failures


#: The two directions of a portable-checkpoint case: record key, what was done.
_PORTABLE_DIRECTIONS = (
    ("resumed", "saved on the dialect, resumed on the local dialect"),
    ("imported", "saved on the local dialect, resumed on the dialect"),
)


def portable_checkpoint_failures(result: CaseResult) -> list[str]:
    """Training before the save must match the unsplit model, and so must the step after a
    resume, in either direction between the dialect and the local dialect."""
    failures = training_failures(result)
    if failures:
        return failures
    case = result.case
    ref = reference(case.id)
    ties = tied_names(case.id)
    head = f"portable checkpoints [{case.title}]"
    for rank, rec in sorted(result.records.items()):
        for key, done in _PORTABLE_DIRECTIONS:
            (loss,) = rec[f"{key}_losses"]
            if not _loss_close(loss, ref.losses[-1]):
                failures.append(
                    f"{head}: {done} (pipedialect.checkpoint), train_batch() returned loss "
                    f"{loss:.8g} on rank {rank}; the uninterrupted unsplit run's is "
                    f"{ref.losses[-1]:.8g}: engine_state() did not give every parameter, buffer "
                    "and optimizer state under the model's names"
                )
            for stage, named in sorted(rec[f"{key}_params"][0].items()):
                for name, value in named.items():
                    text = _param_failure(
                        name, value, ref.params[-1].get(name), stage, rank, 1, ties
                    )
                    if text is not None:
                        text = text.replace("after step 1", "one step after the resume")
                        failures.append(f"{head}: {done}, {text}")
    return failures


def trace_failures(result: CaseResult) -> list[str]:
    """A traced run trains like the unsplit model, and its timeline has, for every stage and
    step, one forward per micro-batch (and, in training, one backward after it)."""
    failures = training_failures(result)
    if failures:
        return failures
    case = result.case
    head = f"tracing [{case.title}]"
    for rank, rec in sorted(result.records.items()):
        on = f" (gathered on rank {rank})" if result.world_size > 1 else ""
        if rec["traced_stages"] != case.stages:
            failures.append(
                f"{head}: the timeline{on} says {rec['traced_stages']} stages, the plan has "
                f"{case.stages}: engine_state().num_stages is wrong"
            )
        failures += _timeline_failures(case, rec["spans"], f"{head}:", on)
    return failures


def _timeline_failures(case: Case, spans: Sequence[Any], head: str, on: str) -> list[str]:
    forwards: dict[tuple[int, int], dict[int, tuple[int, int]]] = {}
    backwards: dict[tuple[int, int], dict[int, tuple[int, int]]] = {}
    counts: dict[tuple[str, int, int, int | None], int] = {}
    for kind, _rank, stage, step, micro, start, end in spans:
        counts[(kind, stage, step, micro)] = counts.get((kind, stage, step, micro), 0) + 1
        table = {"forward": forwards, "backward": backwards}.get(kind)
        if table is not None and micro is not None:
            table.setdefault((stage, step), {})[micro] = (start, end)
    failures = []
    want = list(range(case.gas))
    for step in range(case.steps + 1):  # the training steps, then eval_batch
        training = step < case.steps
        what = f"train_batch() {step + 1}" if training else "eval_batch()"
        for stage in range(case.stages):
            fwd = forwards.get((stage, step), {})
            bwd = backwards.get((stage, step), {})
            if sorted(fwd) != want:
                failures.append(
                    f"{head} [Stage {stage}] {what}{on}: forward spans of micro-batches "
                    f"{sorted(fwd)}, expected {want}: engine_state() must give the module that "
                    "runs the stage once per micro-batch"
                )
            if sorted(bwd) != (want if training else []):
                failures.append(
                    f"{head} [Stage {stage}] {what}{on}: backward spans of micro-batches "
                    f"{sorted(bwd)}, expected {want if training else []}"
                )
            for micro, (start, _end) in sorted(bwd.items()):
                if micro in fwd and start < fwd[micro][1]:
                    failures.append(
                        f"{head} [Stage {stage}] {what}{on}: the backward of micro-batch "
                        f"{micro} starts before its forward ends"
                    )
    repeated = sorted(k for k, n in counts.items() if n > 1 and k[0] in ("forward", "backward"))
    if repeated:
        kind, stage, step, micro = repeated[0]
        failures.append(
            f"{head} [Stage {stage}]{on}: {len(repeated)} span(s) recorded twice, first the "
            f"{kind} of micro-batch {micro} in step {step}: a stage's runner is reported twice"
        )
    return failures


_BUILD_HINTS = {
    "no-loss-fn": ("pipe_engine() without loss_fn", ["loss_fn"]),
    "no-config": ("pipe_engine() without config", ["config"]),
    "topology": ("pipe_engine() with a topology of twice the plan's stages", []),
    "stage-count": ("pipe_engine() with one stage module fewer than the plan has stages", []),
    "unknown-kwarg": ("pipe_engine(no_such_option=1)", ["no_such_option"]),
    "untied": (
        "a plan with tied weights on a dialect that does not declare tied-weights",
        ["wte.weight", "lm_head.weight"],
    ),
}


def build_error_failures(result: CaseResult) -> list[str]:
    """Every rank must refuse the mistake with a PipeDialectError that names the culprit."""
    case = result.case
    what, names = _BUILD_HINTS[case.mistake]
    head = f"error behaviour [{case.id}]"
    failures = []
    for rank in range(result.world_size):
        rec = result.records.get(rank)
        on = f" on rank {rank}" if result.world_size > 1 else ""
        if rec is None:
            crashed = crash_failures(result, "error behaviour")
            return crashed or [f"{head}: rank {rank} recorded nothing"]
        if rec["status"] == "ok":
            failures.append(
                f"{head}: {what} was accepted{on}; it must raise a pipedialect.PipeDialectError "
                "(ConfigError, TopologyError, TieError, ...) before any collective"
            )
        elif not rec["pipedialect_error"]:
            failures.append(
                f"{head}: {what} raised {rec['error_type']}{on} instead of a "
                f"pipedialect.PipeDialectError: {rec['message']}\n{_tail(rec['traceback'], 6)}"
            )
        elif names and not any(n in rec["message"] for n in names):
            failures.append(
                f"{head}: {what} raised {rec['error_type']}{on}, but its message does not name "
                f"{' or '.join(repr(n) for n in names)}: {rec['message']!r}"
            )
    return failures


_STAGE_TAG = re.compile(r"\[Stage \d+\]")


def run_error_failures(result: CaseResult, what: str) -> list[str]:
    """A rank must raise a PipeDialectError naming the stage; never train on, hang or crash."""
    case = result.case
    head = f"error behaviour [{case.id}]"
    first = _first_raised(result)
    if first is None:
        if result.launch_error is not None:
            return crash_failures(result, "error behaviour")
        return [
            f"{head}: {what} trained without an error on every rank; it must raise a "
            "pipedialect.PipeDialectError naming the stage and the value"
        ]
    rank, rec = first
    on = f" on rank {rank}" if result.world_size > 1 else ""
    if not rec["pipedialect_error"]:
        return [
            f"{head}: {what} raised {rec['error_type']}{on} instead of a "
            f"pipedialect.PipeDialectError: {rec['message']}\n{_tail(rec['traceback'], 8)}"
        ]
    if not _STAGE_TAG.search(rec["message"]):
        return [
            f"{head}: {what} raised {rec['error_type']}{on}, but its message does not name the "
            f"stage as '[Stage k]': {rec['message']!r}"
        ]
    return []
