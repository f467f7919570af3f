"""The contracts a runtime ("dialect") implements: abstract, and importing no implementation.

This module is a leaf of the package: the protocols a dialect implements and the value types
they exchange (a tie group and its ranks among them). The codec, the stage wrapper, tie analysis
and the :class:`~pipedialect.dialect.Dialect` base all depend on it, and it imports nothing of
ours (tests/project/test_layout.py checks it, counting ``TYPE_CHECKING`` imports).
"""

from __future__ import annotations

import abc
import contextlib
import enum
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, Protocol, runtime_checkable

import torch
from torch import nn

__all__ = [
    "BOUNDARY_CAPABILITIES",
    "AttributeCounters",
    "Capability",
    "CheckpointingEngine",
    "EngineState",
    "HeldStage",
    "Instrumented",
    "RuntimeEngine",
    "SpanRecorder",
    "StageSpec",
    "TensorCodec",
    "TieAnalyzer",
    "TieGroup",
    "TieRanks",
    "Topology",
    "TrainerEngine",
]


class Capability(enum.StrEnum):
    """What a dialect declares it supports; the conformance suite tests exactly these."""

    #: Parameters shared between stages are kept equal and their gradients summed.
    TIED_WEIGHTS = "tied-weights"
    #: A boundary may carry several float tensors that need gradients.
    MULTI_GRAD_BOUNDARY = "multi-grad-boundary"
    #: A boundary may carry int and bool tensors and float tensors that need no gradient.
    NON_FLOAT_TENSORS = "non-float-tensors"
    #: A boundary may carry None, Python numbers, strings, dicts, lists and tuples.
    PYTHON_VALUES = "python-values"
    #: A value computed on one stage may be used several stages later.
    SKIP_CONNECTIONS = "skip-connections"
    #: Boundary shapes may change between micro-batches.
    DYNAMIC_SHAPES = "dynamic-shapes"
    #: Stages run in several processes (torch.distributed).
    MULTI_PROCESS = "multi-process"
    #: Pipelines may be replicated over a data-parallel axis.
    DATA_PARALLEL = "data-parallel"
    #: Each stage's parameters, gradients and optimizer state may be sharded over the data axis
    #: (FSDP2: ``pipe_engine(..., data_parallel_mode="fsdp")``).
    SHARDED_DATA_PARALLEL = "sharded-data-parallel"
    #: Modules inside a stage may be sharded over a tensor axis
    #: (``pipe_engine(..., tensor_parallel={glob: style})``).
    TENSOR_PARALLEL = "tensor-parallel"
    #: Engines can save a checkpoint and resume from it (:class:`CheckpointingEngine`).
    CHECKPOINTS = "checkpoints"
    #: ``Dialect.engine_state`` says what an engine trains, under the model's names, so that
    #: :mod:`pipedialect.checkpoint` saves it for, and resumes it from, any dialect and layout.
    PORTABLE_CHECKPOINTS = "portable-checkpoints"
    #: ``Dialect.engine_state`` gives the modules that run the stages, so that
    #: :func:`pipedialect.trace` times them (``Dialect.instrument`` may add the runtime's sends,
    #: receives and optimizer step).
    TRACING = "tracing"
    #: Engines are :class:`TrainerEngine`\ s (the optimizer, the LR scheduler, the learning
    #: rates and the global gradient norm of the last step), so that a training loop of its own
    #: -- Hugging Face's ``Trainer`` through :mod:`pipedialect.integrations.transformers` --
    #: drives them step by step and logs what they did.
    TRAINER_LOOP = "trainer-loop"
    #: The dialect only runs on CUDA devices.
    CUDA_ONLY = "cuda-only"


#: What the default stage wrapper and codec carry across a boundary on any runtime that hands
#: the wrapper's tensors over as they are: a dialect built on them declares these and adds its own.
BOUNDARY_CAPABILITIES: frozenset[Capability] = frozenset(
    {
        Capability.TIED_WEIGHTS,
        Capability.MULTI_GRAD_BOUNDARY,
        Capability.NON_FLOAT_TENSORS,
        Capability.PYTHON_VALUES,
        Capability.SKIP_CONNECTIONS,
    }
)


@dataclass(frozen=True)
class StageSpec:
    """What a stage wrapper needs to know about its stage; built by the plan.

    Values are named as in the plan's graph: a model input by its parameter name, the output
    of stage ``k`` as ``submod_k`` and its ``i``-th item as ``submod_k.i``
    (:meth:`pipedialect.PipelinePlan.stage_spec`).
    """

    #: The stage's index.
    stage_id: int
    #: The number of stages of the plan.
    num_stages: int
    #: The stage's value name in the plan's graph (``"submod_<stage_id>"``).
    name: str
    #: The model's inputs, in the order the data loader supplies them.
    input_names: tuple[str, ...]
    #: The stage's arguments, in call order.
    arg_names: tuple[str, ...]
    #: What the stage receives, in wire order: its own arguments, then values later stages
    #: need (the first stage receives the model's inputs).
    receives: tuple[str, ...]
    #: What it sends to the next stage (what that one receives); empty for the last stage.
    sends: tuple[str, ...]
    #: forward's default values of model inputs a micro-batch may omit (the first stage fills
    #: them in; :attr:`pipedialect.PipelinePlan.input_defaults`).
    input_defaults: Mapping[str, Any] = field(default_factory=dict)
    #: Submodules of the stage (by path in it) whose train/eval flag is not the stage's: their
    #: flag under ``train()`` and under ``eval()`` (a frozen BatchNorm: ``(False, False)``),
    #: as in the unsplit model (:attr:`pipedialect.PipelinePlan.stage_modes`).
    module_modes: Mapping[str, tuple[bool, bool]] = field(default_factory=dict)
    #: Called with the mode whenever the wrapper is switched to train or eval mode (every
    #: engine does at the start of each ``train_batch`` and ``eval_batch``, on every rank): the
    #: plan's check of what the training loop changed on the model since ``partition``, which
    #: raises before any step when the stages cannot follow it.
    before_step: Callable[[bool], None] | None = field(default=None, compare=False)
    #: The stage's parameters that other stages hold too (tie groups over several stages):
    #: forward must not write them in place (``pipedialect.runtime.stage`` [Note: tied
    #: parameters written in forward]).
    tied_parameters: tuple[str, ...] = ()


@runtime_checkable
class Topology(Protocol):
    """A process grid with a ``pipe`` axis, as DeepSpeed's ``ProcessTopology`` provides.

    Only the calls tie analysis and stage placement need are part of the contract.
    """

    def get_dim(self, axis: str) -> int:
        """Return the size of ``axis`` (``"pipe"``, ``"data"``, ...); 0 if it does not exist."""
        ...

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """Return the global ranks whose coordinates match every ``axis=value`` given."""
        ...

    def get_coord(self, rank: int) -> Any:
        """Return the coordinate of ``rank``: a named tuple with one field per axis."""
        ...

    def world_size(self) -> int:
        """Return the number of ranks in the grid."""
        ...


class TensorCodec(abc.ABC):
    """Turns a boundary value into tensors plus a metadata string, and back.

    ``decode(*encode(obj))`` must give back ``obj``; a fresh instance must be able to decode
    what another encoded (the metadata string carries everything but the tensors). A codec
    whose format cannot tell some containers apart says so in :attr:`keeps_containers`.
    """

    #: The containers ``decode`` gives back as they were encoded, of ``"tuple"``, ``"list"``,
    #: ``"dict"`` and ``"namedtuple"``; any other comes back as a plain tuple (a dict as the
    #: tuple of its values). The split-point guards judge decoded values by it.
    keeps_containers: ClassVar[frozenset[str]] = frozenset({"tuple", "list", "dict", "namedtuple"})

    @abc.abstractmethod
    def encode(
        self, obj: object, device: torch.device | None = None
    ) -> tuple[tuple[torch.Tensor, ...], str]:
        """Return the tensors to put on the wire and the metadata that restores ``obj``.

        ``device`` is where any tensor the codec has to create is placed.
        """

    @abc.abstractmethod
    def decode(self, tensors: Sequence[torch.Tensor], metadata: str) -> Any:
        """Rebuild the value ``encode`` was given from its tensors and metadata."""


class TieRanks(NamedTuple):
    """What :func:`~pipedialect.analyze_tie_ranks` returns: ``(ranks, stages)``, as Slapo's."""

    #: For each group, the rank lists whose members must stay equal: one list per coordinate
    #: on the non-pipe axes, each in stage order.
    ranks: list[list[list[int]]]
    #: For each group, its stage ids, sorted: ``stages[g][j]`` holds ``ranks[g][c][j]``.
    stages: list[list[int]]


@dataclass(frozen=True)
class TieGroup:
    """One shared parameter: every ``(name, stage)`` that holds it.

    Iterating a group yields its ``(name, stage)`` pairs, so it can be passed wherever Slapo's
    ``analyze_tie_ranks`` expects an iterable of pairs.
    """

    #: Deterministic, unique among the plan's groups, valid as an ``nn.ModuleDict`` key.
    key: str
    #: ``(parameter name, stage id)`` pairs, sorted by stage, then name.
    members: tuple[tuple[str, int], ...]

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return iter(self.members)

    def __len__(self) -> int:
        return len(self.members)

    @property
    def stages(self) -> tuple[int, ...]:
        """The stage ids holding the parameter, sorted, without repeats."""
        return tuple(sorted({stage for _, stage in self.members}))

    def names_on(self, stage: int) -> tuple[str, ...]:
        """The names the parameter has on ``stage`` (several when tied within the stage too)."""
        return tuple(name for name, s in self.members if s == stage)

    def __str__(self) -> str:
        return f"{self.key}: " + ", ".join(f"{name}@{stage}" for name, stage in self.members)


class TieAnalyzer(abc.ABC):
    """Finds parameters shared between stages and maps them onto the ranks that hold them."""

    @abc.abstractmethod
    def find_groups(self, stages: Sequence[nn.Module]) -> tuple[TieGroup, ...]:
        """Return the tie groups among ``stages`` (index = stage id), in a deterministic order."""

    @abc.abstractmethod
    def analyze_ranks(self, groups: Sequence[TieGroup], topology: Topology) -> TieRanks:
        """Return, for each group, the rank lists whose members must stay equal."""


@runtime_checkable
class RuntimeEngine(Protocol):
    """What ``Dialect.runtime_engine`` returns: DeepSpeed's ``PipelineEngine`` is the model.

    ``data_iter`` yields one ``(inputs, labels)`` pair per micro-batch; ``train_batch`` pulls
    ``gradient_accumulation_steps`` of them, steps the optimizer once and returns the mean
    micro-batch loss.
    """

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """Train on one batch and return its mean loss."""
        ...

    def eval_batch(self, data_iter: Iterator[Any]) -> torch.Tensor:
        """Evaluate one batch without changing parameters and return its mean loss."""
        ...


@runtime_checkable
class TrainerEngine(RuntimeEngine, Protocol):
    """A :class:`RuntimeEngine` a training loop of its own can drive: what
    :attr:`Capability.TRAINER_LOOP` promises (DeepSpeed's ``PipelineEngine`` has it all).

    The loop reads the learning rates and the gradient norm of each step here, and swaps the
    LR scheduler once it knows the run's length; checkpoints go through the portable ones
    (:attr:`Capability.PORTABLE_CHECKPOINTS`).
    """

    #: The module the engine trains (what ``pipe_engine`` built): the loop's model.
    module: nn.Module
    #: The optimizer ``train_batch`` steps (``param_groups``, ``state_dict()``).
    optimizer: Any
    #: The LR scheduler ``train_batch`` steps after the optimizer, or None; assignable.
    lr_scheduler: Any

    def eval_batch(
        self, data_iter: Iterator[Any], num_micro_batches: int | None = None
    ) -> torch.Tensor:
        """Evaluate ``num_micro_batches`` micro-batches (default: the step's) and return their
        mean loss."""
        ...

    def get_lr(self) -> list[float]:
        """The learning rate of every parameter group, as the next step will use it."""
        ...

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last step (before clipping), or None before one."""
        ...


@runtime_checkable
class CheckpointingEngine(RuntimeEngine, Protocol):
    """An engine that saves and resumes checkpoints, with DeepSpeed's signatures: what a dialect
    declaring :attr:`Capability.CHECKPOINTS` returns from ``runtime_engine`` (checked there)."""

    def save_checkpoint(self, save_dir: str, tag: str | None = None, **kwargs: Any) -> Any:
        """Save everything training needs to resume into ``save_dir`` under ``tag``."""
        ...

    def load_checkpoint(self, load_dir: str, tag: str | None = None, **kwargs: Any) -> Any:
        """Resume from the checkpoint ``tag`` (by default the latest) in ``load_dir``."""
        ...


@dataclass(frozen=True)
class HeldStage:
    """One stage an engine runs in this process (part of :class:`EngineState`)."""

    #: The stage's index in the plan.
    stage_id: int
    #: The module whose ``forward`` runs the stage once per micro-batch (the stage wrapper):
    #: a trace hooks it, so a forward re-run inside a backward must go through it too.
    runner: nn.Module
    #: The module whose parameter and buffer names are the unsplit model's (the wrapper's
    #: ``mod``): a portable checkpoint stores the stage under these names.
    module: nn.Module


@dataclass(frozen=True)
class EngineState:
    """What an engine trains in this process, by the model's names: ``Dialect.engine_state``.

    Portable checkpoints (:mod:`pipedialect.checkpoint`) and traces (:func:`pipedialect.trace`)
    read an engine through this record only, so that they work for any dialect that declares
    :attr:`Capability.PORTABLE_CHECKPOINTS` or :attr:`Capability.TRACING`.
    """

    #: This process's stages, in stage order.
    stages: tuple[HeldStage, ...]
    #: The number of stages of the whole pipeline.
    num_stages: int
    #: The optimizer that steps the stages' parameters (a plain ``torch.optim.Optimizer`` for a
    #: portable checkpoint: it stores each parameter's state under the parameter's name).
    optimizer: Any
    #: The LR scheduler stepped with it (an object with ``state_dict``), or None.
    lr_scheduler: Any = None
    #: ``id(parameter) -> tie group key`` for the local parameters of cross-stage tie groups
    #: (:func:`pipedialect.plan.ties.tie_keys`): the copies of one tied weight are stored once.
    tie_keys: Mapping[int, str] = field(default_factory=dict)
    #: Buffer name -> the stage that writes it (:attr:`pipedialect.PipelinePlan.buffers`): a
    #: buffer several stages hold is saved from that stage only.
    buffer_owners: Mapping[str, int] = field(default_factory=dict)
    #: The engine's step counters by name, live (DeepSpeed's ``global_steps``,
    #: ``global_samples``, ``micro_steps``, ``skipped_steps``): read when a checkpoint is saved
    #: and written on resume; a counter the saving engine did not keep is derived. An engine
    #: that keeps them as attributes gives :class:`AttributeCounters`.
    counters: MutableMapping[str, int] = field(default_factory=dict)
    #: Micro-batches per optimizer step.
    gradient_accumulation_steps: int = 1
    #: Samples per optimizer step (over every replica).
    train_batch_size: int = 0


class AttributeCounters(MutableMapping[str, int]):
    """The step counters ``owner`` keeps as int attributes of the given names, as the live
    mapping :attr:`EngineState.counters` is: what a dialect hands over for an engine that counts
    ``self.global_steps += 1``."""

    def __init__(self, owner: Any, names: Sequence[str]) -> None:
        self._owner = owner
        self._names = tuple(names)

    def __getitem__(self, name: str) -> int:
        if name not in self._names:
            raise KeyError(name)
        return int(getattr(self._owner, name))

    def __setitem__(self, name: str, value: int) -> None:
        if name not in self._names:
            raise KeyError(f"{name!r} is not one of the counters {list(self._names)}")
        setattr(self._owner, name, int(value))

    def __delitem__(self, name: str) -> None:
        raise TypeError("an engine's step counters cannot be removed")

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


@dataclass(frozen=True)
class Instrumented:
    """What ``Dialect.instrument`` did to an engine for a trace."""

    #: Puts the engine back as it was.
    undo: Callable[[], None]
    #: Span kinds the dialect records itself (``"optimizer"``: the core leaves the optimizer).
    records: frozenset[str] = frozenset()


class SpanRecorder(Protocol):
    """What a dialect's ``instrument`` hook writes to (:class:`pipedialect.trace.Recorder`)."""

    #: The rank's first stage: where rank-wide spans (sends, the optimizer) go.
    home_stage: int
    #: What the dialect keeps for the current step (cleared when the step ends).
    step_state: dict[Any, Any]

    @property
    def recording(self) -> bool:
        """Whether a step is running and recording is not paused."""
        ...

    def now(self) -> int:
        """Nanoseconds since the common origin."""
        ...

    def add(
        self,
        kind: str,
        name: str,
        stage: int,
        start: int,
        end: int,
        micro_batch: int | None = None,
        detail: str | None = None,
    ) -> int:
        """Record a span; return its index."""
        ...

    def extend(self, index: int, end: int) -> bool:
        """Stretch span ``index`` to ``end`` if it is still the last one recorded."""
        ...

    def next_index(self, key: Any) -> int:
        """0, 1, 2, ... for each ``key`` within the current step (micro-batch numbers)."""
        ...

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """Record nothing inside (set-up work that is not part of the schedule)."""
        ...
