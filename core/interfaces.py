"""The contracts a runtime ("dialect") implements.

Nothing here imports a runtime. A dialect is a :class:`Dialect` subclass registered through the
``pipedialect.dialects`` entry-point group (see :mod:`pipedialect.plugins`); it names the
:class:`~pipedialect.stage.StageWrapper` subclass that runs one stage, the
:class:`TensorCodec` that turns boundary values into tensors, the :class:`TieAnalyzer` that maps
tied parameters onto ranks, and builds and runs engines with :meth:`Dialect.pipe_engine` and
:meth:`Dialect.runtime_engine`.
"""

from __future__ import annotations

import abc
import enum
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol, runtime_checkable

import torch
from torch import nn

if TYPE_CHECKING:
    from .partition import PipelinePlan
    from .stage import StageWrapper
    from .ties import TieGroup, TieRanks

__all__ = [
    "Capability",
    "Dialect",
    "GridTopology",
    "RuntimeEngine",
    "TensorCodec",
    "TieAnalyzer",
    "Topology",
]


#: What ``torch.distributed``'s default ``env://`` rendezvous reads; a launcher sets them.
_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


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
    #: Engines can save a checkpoint and resume from it.
    CHECKPOINTS = "checkpoints"
    #: The dialect only runs on CUDA devices.
    CUDA_ONLY = "cuda-only"


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


class GridTopology:
    """A row-major ``pipe`` x ``data`` grid, for dialects that need no runtime topology class.

    Ranks are laid out as DeepSpeed's ``PipeDataParallelTopology`` lays them out: the data axis
    varies fastest, so the ranks of one pipeline stage are contiguous.
    """

    def __init__(self, pipe: int, data: int = 1) -> None:
        from .errors import TopologyError

        if pipe < 1 or data < 1:
            raise TopologyError(f"pipe ({pipe}) and data ({data}) must both be at least 1")
        self._dims = {"pipe": pipe, "data": data}
        self._coord_type = _GridCoord

    def get_dim(self, axis: str) -> int:
        """Return the size of ``axis``; 0 for an axis the grid does not have."""
        return self._dims.get(axis, 0)

    def world_size(self) -> int:
        """Return ``pipe * data``."""
        return self._dims["pipe"] * self._dims["data"]

    def get_coord(self, rank: int) -> _GridCoord:
        """Return the ``(pipe, data)`` coordinate of ``rank``."""
        if not 0 <= rank < self.world_size():
            from .errors import TopologyError

            raise TopologyError(f"rank {rank} is outside a grid of {self.world_size()} ranks")
        pipe, data = divmod(rank, self._dims["data"])
        return _GridCoord(pipe=pipe, data=data)

    def get_rank(self, *, pipe: int, data: int = 0) -> int:
        """Return the global rank at ``(pipe, data)``."""
        return pipe * self._dims["data"] + data

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """Return the ranks whose coordinates match every ``axis=value`` given, in order."""
        return [
            rank
            for rank in range(self.world_size())
            if all(
                getattr(self.get_coord(rank), axis) == value
                for axis, value in filter_kwargs.items()
            )
        ]

    def __repr__(self) -> str:
        return f"GridTopology(pipe={self._dims['pipe']}, data={self._dims['data']})"


class _GridCoord(NamedTuple):
    """A ``(pipe, data)`` coordinate with named fields, like DeepSpeed's ProcessCoord."""

    #: The pipeline stage.
    pipe: int
    #: The data-parallel replica.
    data: int


class TensorCodec(abc.ABC):
    """Turns a boundary value into tensors plus a metadata string, and back.

    ``decode(*encode(obj))`` must give back ``obj``; a fresh instance must be able to decode
    what another encoded (the metadata string carries everything but the tensors).
    """

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
    """What :meth:`Dialect.runtime_engine` returns: DeepSpeed's PipelineEngine is the model.

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


class Dialect(abc.ABC):
    """One pipeline runtime.

    Subclasses set the class attributes and implement :meth:`pipe_engine` and
    :meth:`runtime_engine`. An instance must be cheap to create and must not import its runtime
    until an engine is built, so that listing dialects never imports, say, deepspeed.
    """

    #: The name users pass to :func:`pipedialect.get_dialect`.
    name: ClassVar[str]
    #: The dialect's own version.
    version: ClassVar[str] = "0"
    #: One line saying what runtime this is.
    description: ClassVar[str] = ""
    #: What the dialect supports; read by ``pipedialect list`` and the conformance suite.
    capabilities: ClassVar[frozenset[Capability]] = frozenset()

    @property
    def stage_wrapper(self) -> type[StageWrapper]:
        """The :class:`~pipedialect.stage.StageWrapper` subclass that runs one stage."""
        from .stage import StageWrapper

        return StageWrapper

    @property
    def codec(self) -> TensorCodec:
        """A codec for boundary values; :class:`~pipedialect.codec.SchemaCodec` by default."""
        from .codec import SchemaCodec

        return SchemaCodec()

    @property
    def tie_analyzer(self) -> TieAnalyzer:
        """The tie analyzer; :class:`~pipedialect.ties.DefaultTieAnalyzer` by default."""
        from .ties import DefaultTieAnalyzer

        return DefaultTieAnalyzer()

    def wrap_stages(self, plan: PipelinePlan) -> list[StageWrapper]:
        """Wrap every stage of ``plan`` with :attr:`stage_wrapper`, in stage order."""
        return plan.wrap(self.stage_wrapper)

    @abc.abstractmethod
    def pipe_engine(
        self,
        plan: PipelinePlan,
        stage_modules: Sequence[nn.Module] | None = None,
        **kwargs: Any,
    ) -> nn.Module:
        """Build the runtime's pipeline module from ``plan``.

        ``stage_modules`` are already-wrapped stages; when omitted, the dialect wraps the plan's
        stages itself. ``kwargs`` carry ``config`` (a DeepSpeed-style config dict),
        ``loss_fn(outputs, labels)`` and whatever else the runtime needs.
        """

    @abc.abstractmethod
    def runtime_engine(self, module: nn.Module, **kwargs: Any) -> RuntimeEngine:
        """Return the engine that trains ``module`` (what :meth:`pipe_engine` built)."""

    def local_stages(self, engine: RuntimeEngine) -> Sequence[int]:
        """Return the ids of the stages whose parameters ``engine`` trains in this process."""
        raise NotImplementedError(f"dialect {self.name!r} does not report its local stages")

    def make_topology(self, num_stages: int, data_parallel: int = 1) -> Topology:
        """Return a topology with ``num_stages`` pipeline stages and ``data_parallel`` replicas."""
        return GridTopology(pipe=num_stages, data=data_parallel)

    def init_distributed(self, backend: str | None = None) -> None:
        """Join the process group described by the usual environment (RANK, WORLD_SIZE, ...).

        ``backend`` defaults to ``nccl`` when CUDA is available, else ``gloo``. A dialect that
        does not declare ``multi-process`` runs every stage in this process: there is nothing to
        join, so the call does nothing and a script written for a multi-process dialect runs
        unchanged under plain ``python``. A dialect whose runtime has its own initialisation
        overrides this.

        Raises:
            ConfigError: the process was not started by a launcher (``torchrun``, the
                conformance suite's): the environment lacks the variables that describe the
                group.
        """
        import torch.distributed as dist

        if Capability.MULTI_PROCESS not in self.capabilities or dist.is_initialized():
            return
        missing = [name for name in _LAUNCH_VARIABLES if name not in os.environ]
        if missing:
            from .errors import ConfigError

            raise ConfigError(
                f"dialect {self.name!r} runs one process per pipeline rank, but this process "
                f"was not started by a launcher ({', '.join(missing)} not set): start the "
                "script with `torchrun --nproc_per_node N script.py` (N = stages x replicas), "
                "or use the 'local' dialect to run every stage in this process"
            )
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self.version}>"
