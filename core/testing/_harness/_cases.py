"""The runs the suite makes a dialect do, each a :class:`Case`.

A case is one engine built and driven on the suite's data: a training run compared with the
unsplit model, a checkpoint round trip (the dialect's own, or a portable one across dialects),
a traced run, or a mistake the dialect must refuse with a named error.
Cases are grouped by world size and run together (for a multi-process dialect, one launch per
group of as many ranks as ``dialect.make_topology(stages, data_parallel)`` has; in the test
process for a single-process one), so the tests that read them cost one launch, not one each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import pytest

from ...contracts import Capability
from .._requirements import refuses, requires, runs_dialect

__all__ = ["CASES", "Case", "case_params", "get_case"]

Kind = Literal["train", "checkpoint", "portable-checkpoint", "trace", "build-error", "run-error"]

#: Seed of the training micro-batches of data-parallel replica ``d``: ``DATA_SEED + d``.
DATA_SEED = 100
#: Seed of the evaluation micro-batches of replica ``d``: ``EVAL_SEED + d``.
EVAL_SEED = 200


@dataclass(frozen=True)
class Case:
    """One engine the suite builds and drives."""

    #: Unique id, used in test ids: ``skip-2``, ``gpt-2x2``, ``error-topology``.
    id: str
    #: What is done with the engine.
    kind: Kind
    #: The model, a key of the suite's or the shared test models.
    model: str
    #: Pipeline stages.
    stages: int
    #: Data-parallel replicas.
    data_parallel: int = 1
    #: Ranks on the tensor axis (each stage's modules sharded over them, ``tensor_parallel``).
    tensor_parallel: int = 1
    #: Optimizer steps (``train_batch`` calls).
    steps: int = 3
    #: Micro-batches per step.
    gas: int = 4
    #: Samples per micro-batch.
    micro: int = 2
    #: Gradient clipping (DeepSpeed's ``gradient_clipping``); 0 disables it.
    clip: float = 0.0
    #: Record what each stage receives in the first micro-batch (the boundary check).
    probe: bool = False
    #: Let the dialect wrap the stages itself (``stage_modules=None``).
    default_path: bool = False
    #: Extra ``pipe_engine`` keyword arguments.
    engine_kwargs: tuple[tuple[str, Any], ...] = ()
    #: For error cases: the mistake made (see ``_runner``).
    mistake: str = ""
    #: Capabilities the dialect must declare for the case to apply.
    requires: frozenset[Capability] = field(default_factory=frozenset)
    #: Capabilities the dialect must not declare for the case to apply.
    refuses: frozenset[Capability] = field(default_factory=frozenset)

    @property
    def world_size(self) -> int:
        """Ranks a multi-process dialect with one stage per rank needs: ``stages * dp * tp``."""
        return self.stages * self.data_parallel * self.tensor_parallel

    @property
    def tensor_kwargs(self) -> dict[str, int]:
        """``make_topology``'s tensor axis, given only when the case has one (a dialect whose
        ``make_topology`` predates the argument still runs the other cases)."""
        return {"tensor_parallel": self.tensor_parallel} if self.tensor_parallel > 1 else {}

    @property
    def title(self) -> str:
        """``gpt, 2 stages x 2 replicas``: how messages name the case."""
        text = f"{self.model}, {self.stages} stages"
        if self.data_parallel > 1:
            text += f" x {self.data_parallel} replicas"
        if self.tensor_parallel > 1:
            text += f" x tensor {self.tensor_parallel}"
        return text

    def applies_to(self, capabilities: frozenset[Capability]) -> bool:
        """Whether a dialect declaring ``capabilities`` runs this case."""
        if not self.requires <= capabilities or self.refuses & capabilities:
            return False
        return Capability.MULTI_PROCESS in capabilities or (
            self.data_parallel == 1 and self.tensor_parallel == 1
        )


_T = Capability.TIED_WEIGHTS
_G = Capability.MULTI_GRAD_BOUNDARY
_N = Capability.NON_FLOAT_TENSORS
_P = Capability.PYTHON_VALUES
_S = Capability.SKIP_CONNECTIONS
_D = Capability.DYNAMIC_SHAPES
_M = Capability.MULTI_PROCESS
_DP = Capability.DATA_PARALLEL
_SDP = Capability.SHARDED_DATA_PARALLEL
_TP = Capability.TENSOR_PARALLEL
_C = Capability.CHECKPOINTS
_PC = Capability.PORTABLE_CHECKPOINTS
_TR = Capability.TRACING


def _train(id: str, model: str, stages: int, *needs: Capability, **kw: Any) -> Case:
    return Case(id=id, kind="train", model=model, stages=stages, requires=frozenset(needs), **kw)


CASES: tuple[Case, ...] = (
    # The baseline every dialect trains: the dialect wraps the stages itself, and clipping is
    # tight enough to act on every step (the norm is global over all stages).
    _train("plain-2", "plain", 2, default_path=True, clip=0.05),
    _train("plain-4", "plain", 4, probe=True),
    _train("plain-2x2", "plain", 2, _M, _DP, data_parallel=2),
    _train("gpt-2", "gpt", 2, _T, probe=True),
    _train("gpt-4", "gpt", 4, _T, probe=True),
    _train("gpt-2x2", "gpt", 2, _T, _M, _DP, data_parallel=2),
    # Each stage sharded over the replicas (``data_parallel_mode="fsdp"``, the option a dialect
    # declaring sharded-data-parallel takes), a tie across the stages, clipping on every step.
    _train(
        "gpt-2x2-fsdp",
        "gpt",
        2,
        _T,
        _M,
        _SDP,
        data_parallel=2,
        clip=0.05,
        engine_kwargs=(("data_parallel_mode", "fsdp"),),
    ),
    _train(
        "plain-2x2-fsdp",
        "plain",
        2,
        _M,
        _SDP,
        data_parallel=2,
        default_path=True,
        engine_kwargs=(("data_parallel_mode", "fsdp"),),
    ),
    # The modules of each stage sharded over a tensor axis of 2 ranks with the model's own plan
    # (the heads, the MLP's features, the tied embedding and LM head by vocabulary), a tie
    # across the stages, clipping on every step.
    _train(
        "mhgpt-2-tp2",
        "mhgpt",
        2,
        _T,
        _M,
        _TP,
        tensor_parallel=2,
        clip=0.05,
        engine_kwargs=(("tensor_parallel", "model"),),
    ),
    _train("skip-2", "skip", 2, _S, _G, probe=True),
    _train("skip-4", "skip", 4, _S, _G, probe=True),
    _train("mixed-2", "mixed", 2, _N, _P, probe=True),
    _train("mixed-4", "mixed", 4, _N, _P, probe=True),
    _train("encdec-2", "encdec", 2, _G, probe=True),
    _train("encdec-4", "encdec", 4, _G, probe=True),
    _train(
        "dynamic-2",
        "plain-dynamic",
        2,
        _D,
        default_path=True,
        engine_kwargs=(("dynamic_shapes", True),),
    ),
    Case(id="checkpoint-2", kind="checkpoint", model="plain", stages=2, requires=frozenset({_C})),
    # Saved on the dialect, resumed on the local dialect, and the other way round.
    Case(
        id="portable-2",
        kind="portable-checkpoint",
        model="plain",
        stages=2,
        requires=frozenset({_PC}),
    ),
    Case(
        id="portable-gpt-2",
        kind="portable-checkpoint",
        model="gpt",
        stages=2,
        requires=frozenset({_PC, _T}),
    ),
    Case(id="trace-2", kind="trace", model="plain", stages=2, requires=frozenset({_TR})),
    Case(id="error-no-loss-fn", kind="build-error", model="plain", stages=2, mistake="no-loss-fn"),
    Case(id="error-no-config", kind="build-error", model="plain", stages=2, mistake="no-config"),
    Case(id="error-topology", kind="build-error", model="plain", stages=2, mistake="topology"),
    Case(
        id="error-stage-count", kind="build-error", model="plain", stages=2, mistake="stage-count"
    ),
    Case(
        id="error-unknown-option",
        kind="build-error",
        model="plain",
        stages=2,
        mistake="unknown-kwarg",
    ),
    Case(
        id="error-untied",
        kind="build-error",
        model="gpt",
        stages=2,
        mistake="untied",
        refuses=frozenset({_T}),
    ),
    Case(id="error-complex", kind="run-error", model="complex", stages=2, mistake="complex"),
    Case(
        id="error-new-shape",
        kind="run-error",
        model="plain",
        stages=2,
        mistake="new-shape",
        refuses=frozenset({_D}),
    ),
)

_BY_ID = {case.id: case for case in CASES}
if len(_BY_ID) != len(CASES):  # pragma: no cover - a programming error in this module
    raise RuntimeError("conformance case ids must be unique")


def get_case(case_id: str) -> Case:
    """Return the case called ``case_id``."""
    return _BY_ID[case_id]


def case_params(*case_ids: str) -> list[Any]:
    """``pytest.param`` per case, carrying its requirements as markers; for ``parametrize``."""
    params = []
    for case_id in case_ids:
        case = _BY_ID[case_id]
        marks = [runs_dialect()]
        needs = set(case.requires)
        if case.data_parallel > 1:
            needs.add(_M)
        if needs:
            marks.append(requires(*sorted(needs)))
        if case.refuses:
            marks.append(refuses(*sorted(case.refuses)))
        params.append(pytest.param(case_id, marks=marks, id=case_id))
    return params
