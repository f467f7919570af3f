"""The :class:`Dialect` base: every runtime behind one typed, checked contract.

``Dialect.pipe_engine`` and ``Dialect.runtime_engine`` are template methods. They check the
arguments every dialect shares once, with the same errors for every dialect, wrap the stages
with *this dialect's* :attr:`~Dialect.stage_wrapper` and :attr:`~Dialect.codec`, make sure every
rank built the same plan before any other collective, and only then call the one hook a dialect
implements: :meth:`Dialect._build_pipeline` (given a :class:`PipelineRequest`) and
:meth:`Dialect._build_engine` (given an :class:`EngineRequest`). What a dialect adds to the
shared arguments it declares as a frozen dataclass (:attr:`Dialect.options`,
:attr:`Dialect.engine_options`): an unknown option is refused by name, and ``pipedialect list
--json`` shows them.

[Note: features through the contract]
Features that read a built engine -- portable checkpoints (:mod:`pipedialect.checkpoint`) and
traces (:func:`pipedialect.trace`) -- know no engine class. They ask the dialect that built the
engine (:func:`dialect_of`: ``pipe_engine`` and ``runtime_engine`` record it) for
:meth:`Dialect.engine_state`, an :class:`~pipedialect.contracts.EngineState` naming the stages,
optimizer, scheduler, ties and counters under the model's names, and a trace also for
:meth:`Dialect.instrument`, which times what only the runtime sees (sends, receives, its own
optimizer step). A dialect declares these as :attr:`Capability.PORTABLE_CHECKPOINTS` and
:attr:`Capability.TRACING`; a feature used on an engine whose dialect does not declare it is
refused with :class:`~pipedialect.errors.MissingCapabilityError` naming both
(:func:`require_capability`), and the conformance suite runs the cases of each declared one.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import json
import os
import typing
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Generic, Protocol, TypeVar, final, runtime_checkable

from torch import nn
from torch.optim import Optimizer

from .contracts import (
    Capability,
    CheckpointingEngine,
    EngineState,
    Instrumented,
    RuntimeEngine,
    SpanRecorder,
    TensorCodec,
    TieAnalyzer,
    TieRanks,
    Topology,
)
from .engine import SharedEngineArgs
from .engine.config import check_config_keys
from .engine.param_groups import ParamGroupsFn
from .errors import ConfigError, MissingCapabilityError, TopologyError
from .plan.batches import check_loss_fn
from .plan.partition import PipelinePlan, check_capture_dtype
from .plan.ties import DefaultTieAnalyzer, check_tied_unwritten
from .runtime.agreement import agreed
from .runtime.codec import SchemaCodec
from .runtime.plan_agreement import check_plan_agreement
from .runtime.stage import StageWrapper, record_trainable
from .runtime.topology import (
    GridTopology,
    check_topology,
    check_topology_object,
    check_world_size,
    join_process_group,
    joined_world_size,
)

__all__ = [
    "ENGINE_FEATURES",
    "Dialect",
    "EngineRequest",
    "LossFn",
    "NoOptions",
    "PipelineRequest",
    "check_tensor_axis",
    "dialect_of",
    "given_options",
    "option_descriptions",
    "require_capability",
]

#: Every shared ``runtime_engine`` argument an engine may honour (see ``Dialect.engine_features``).
ENGINE_FEATURES: frozenset[str] = frozenset(
    {"check_finite", "lr_scheduler", "optimizer", "param_groups"}
)

#: ``loss_fn(outputs, labels) -> scalar tensor``.
LossFn = Callable[[Any, Any], Any]
#: ``init_weights(stage_module)``: fills one materialised stage of a meta-device plan.
InitWeights = Callable[[nn.Module], None]

OptionsT = TypeVar("OptionsT")


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """The options of a dialect that adds none to the shared arguments."""


@dataclasses.dataclass(frozen=True)
class PipelineRequest(Generic[OptionsT]):
    """What :meth:`Dialect._build_pipeline` receives: every shared argument already checked.

    Every rank has checked that it holds the same plan as every other rank (a collective on the
    default process group, when there is one) before this exists.
    """

    #: The plan being built.
    plan: PipelinePlan
    #: One module per stage, in stage order: the plan's stages wrapped with the dialect's
    #: ``stage_wrapper`` and ``codec``, or the caller's ``stage_modules``.
    stages: tuple[nn.Module, ...]
    #: A copy of the DeepSpeed-style config dict.
    config: dict[str, Any]
    #: ``loss_fn(outputs, labels)``.
    loss_fn: LossFn
    #: The caller's topology (checked to be a topology object), or None.
    topology: Topology | None
    #: Boundary structure and shapes may change between micro-batches.
    dynamic_shapes: bool
    #: Fills the stages this rank runs of a meta-device plan (see :mod:`pipedialect.plan.weights`).
    init_weights: InitWeights | None
    #: The dialect's own options (an instance of :attr:`Dialect.options`).
    options: OptionsT
    #: The dialect whose pipeline is built.
    dialect: Dialect

    def process_grid(self) -> Topology:
        """The grid to run on, one stage per pipe rank: the caller's topology, checked against
        the plan and the process group (:mod:`pipedialect.runtime.topology`), or ``pipe = stages``
        by ``data = ranks / stages``.

        Raises:
            ConfigError: the process group is not initialised.
            TopologyError: the ranks cannot hold the stages, or the topology does not match
                the plan (a pipe coordinate per stage, no model axis) or the process group.
        """
        world, stages = joined_world_size(self.dialect.name), self.plan.num_stages
        topology = self.topology
        if topology is None:
            if world % stages:
                raise TopologyError(
                    f"{world} ranks cannot hold {stages} stages evenly; launch a multiple of "
                    f"{stages} processes"
                )
            return self.dialect.make_topology(stages, world // stages)
        check_topology(topology, stages)
        check_world_size(topology, world)
        return topology

    def tie_ranks(self, topology: Topology) -> TieRanks:
        """The plan's tie groups mapped onto ``topology`` by the dialect's tie analyzer."""
        return self.dialect.tie_analyzer.analyze_ranks(self.plan.tie_groups, topology)


@dataclasses.dataclass(frozen=True)
class EngineRequest(Generic[OptionsT]):
    """What :meth:`Dialect._build_engine` receives: the shared arguments, checked."""

    #: What :meth:`Dialect.pipe_engine` built.
    module: nn.Module
    #: A copy of the config to train with, or None for the one given to
    #: :meth:`Dialect.pipe_engine`.
    config: dict[str, Any] | None
    #: Refuse a step whose loss or gradients are not finite, on every rank.
    check_finite: bool
    #: A client scheduler (an object with ``step()``, or a callable building one from the
    #: optimizer); it replaces the config's ``scheduler`` section.
    lr_scheduler: Any
    #: Groups the optimizer's parameters (see :mod:`pipedialect.engine.param_groups`).
    param_groups: ParamGroupsFn | None
    #: The dialect's own engine options (an instance of :attr:`Dialect.engine_options`).
    options: OptionsT
    #: A client optimizer: a factory ``optimizer(param_groups) -> torch.optim.Optimizer`` or an
    #: optimizer object; it replaces the config's ``optimizer`` section (which must be absent).
    optimizer: Any = None

    def shared_args(self) -> SharedEngineArgs:
        """The shared arguments as :class:`~pipedialect.engine.EngineBase` takes them."""
        return SharedEngineArgs(
            check_finite=self.check_finite,
            lr_scheduler=self.lr_scheduler,
            param_groups=self.param_groups,
            optimizer=self.optimizer,
        )


class Dialect(abc.ABC):
    """One pipeline runtime.

    A subclass sets the class attributes, declares its options and implements the two hooks
    :meth:`_build_pipeline` and :meth:`_build_engine` (abstract: a class without them cannot be
    registered; :meth:`pipe_engine` and :meth:`runtime_engine` are final); it may override
    :attr:`stage_wrapper`, :attr:`codec`, :attr:`tie_analyzer`, :meth:`make_topology`,
    :meth:`init_distributed` and :meth:`local_stages`. An instance must be cheap to create and
    must not import its runtime until an engine is built, so that listing dialects never
    imports, say, deepspeed.
    """

    #: The name users pass to :func:`pipedialect.get_dialect`.
    name: ClassVar[str]
    #: The dialect's own version.
    version: ClassVar[str] = "0"
    #: One line saying what runtime this is.
    description: ClassVar[str] = ""
    #: What the dialect supports; read by ``pipedialect list`` and the conformance suite.
    capabilities: ClassVar[frozenset[Capability]] = frozenset()
    #: The frozen dataclass of the keyword arguments :meth:`pipe_engine` takes beyond the
    #: shared ones. Field metadata ``{"doc": ...}`` is shown by ``pipedialect list --json``.
    options: ClassVar[type[Any]] = NoOptions
    #: The same for :meth:`runtime_engine`.
    engine_options: ClassVar[type[Any]] = NoOptions
    #: Which shared :meth:`runtime_engine` arguments the engine honours, of
    #: :data:`ENGINE_FEATURES` (``"check_finite"``, ``"lr_scheduler"``, ``"optimizer"``,
    #: ``"param_groups"``); passing another is refused by name, never silently ignored.
    engine_features: ClassVar[frozenset[str]] = frozenset()

    @property
    def stage_wrapper(self) -> type[StageWrapper]:
        """The :class:`~pipedialect.runtime.stage.StageWrapper` subclass that runs one stage."""
        return StageWrapper

    @property
    def codec(self) -> TensorCodec:
        """The codec the stages use for boundary values; :class:`~pipedialect.SchemaCodec`."""
        return SchemaCodec()

    @property
    def tie_analyzer(self) -> TieAnalyzer:
        """The tie analyzer; :class:`~pipedialect.plan.ties.DefaultTieAnalyzer` by default."""
        return DefaultTieAnalyzer()

    def wrap_stages(
        self, plan: PipelinePlan, *, dynamic_shapes: bool = False, seed: int = 0
    ) -> list[StageWrapper]:
        """Wrap every stage of ``plan`` with :attr:`stage_wrapper` and :attr:`codec`, in order.

        Each wrapper gets its own codec instance: codecs keep per-boundary state. ``seed`` roots
        the stages' random streams (``pipedialect.runtime.randomness`` [Note: random streams]).
        """
        return [
            self.stage_wrapper(
                stage,
                plan.stage_spec(k),
                codec=self.codec,
                dynamic_shapes=dynamic_shapes,
                shares_state_with=plan.model,
                seed=seed,
            )
            for k, stage in enumerate(plan.stages)
        ]

    @final
    def pipe_engine(
        self,
        plan: PipelinePlan,
        stage_modules: Sequence[nn.Module] | None = None,
        *,
        config: Mapping[str, Any] | str | None = None,
        loss_fn: LossFn | None = None,
        topology: Topology | None = None,
        dynamic_shapes: bool = False,
        init_weights: InitWeights | None = None,
        seed: int = 0,
        **options: Any,
    ) -> nn.Module:
        """Build this rank's pipeline module of ``plan``; every rank calls it alike.

        Args:
            plan: what :func:`pipedialect.partition` returned.
            stage_modules: already-wrapped stages (one per stage); by default the plan's stages
                wrapped with this dialect's stage wrapper and codec.
            config: a DeepSpeed-style config dict (batch sizes, optimizer, ...), or the path of
                a JSON file holding one. Required.
            loss_fn: ``loss_fn(outputs, labels)``. Required.
            topology: a process grid with a ``pipe`` axis (see :meth:`make_topology`); what
                the dialect assumes without one is in its documentation.
            dynamic_shapes: boundary structure and shapes may change between micro-batches
                (DeepSpeed's spelling ``dynamic_shape`` is accepted too).
            init_weights: fills the stages this rank runs of a meta-device plan
                (:mod:`pipedialect.plan.weights`); the other stages stay on meta.
            seed: the root of the random streams that dropout and ``randn``-style operations in
                forward draw from, one per stage and micro-batch, alike on every rank and
                dialect (``pipedialect.runtime.randomness`` [Note: random streams]); run the
                unsplit reference under :class:`~pipedialect.runtime.ReferenceStreams` with it.
            options: this dialect's own options (:attr:`options`).

        Raises:
            ConfigError: a missing, mistyped or unknown argument; a config key DeepSpeed does
                not know (:class:`~pipedialect.errors.UnknownConfigKeyError`, with the closest
                known key); a ``loss_fn`` that cannot be called as ``loss_fn(outputs, labels)``.
            TopologyError: ``topology`` is not a topology object or does not fit the plan.
            PlanDisagreementError: the ranks built different plans or passed other options.
            RankFailedError: building failed on another rank (a multi-process dialect raises
                every rank's error on every rank: ``agreement`` [Note: one error, every rank]).
        """
        with self._agreed("pipe_engine"):
            module = self._pipe_engine(
                plan,
                stage_modules,
                config=config,
                loss_fn=loss_fn,
                topology=topology,
                dynamic_shapes=dynamic_shapes,
                init_weights=init_weights,
                seed=seed,
                **options,
            )
        _record_builder(module, self)
        return module

    def _agreed(self, what: str) -> contextlib.AbstractContextManager[None]:
        """A phase every rank of a multi-process dialect runs together: an error on one rank is
        raised on every rank (``agreement`` [Note: one error, every rank])."""
        if Capability.MULTI_PROCESS not in self.capabilities:
            return contextlib.nullcontext()
        return agreed(f"{self.name} {what}")

    def _pipe_engine(
        self,
        plan: PipelinePlan,
        stage_modules: Sequence[nn.Module] | None,
        *,
        config: Mapping[str, Any] | str | None,
        loss_fn: LossFn | None,
        topology: Topology | None,
        dynamic_shapes: bool,
        init_weights: InitWeights | None,
        seed: int,
        **options: Any,
    ) -> nn.Module:
        if "dynamic_shape" in options:  # DeepSpeed's spelling
            dynamic_shapes = bool(options.pop("dynamic_shape")) or dynamic_shapes
        _refuse_sharding_options(self, options)
        opts = self.parse_options(options)
        if not isinstance(plan, PipelinePlan):
            raise ConfigError(
                f"pipe_engine() needs the PipelinePlan returned by pipedialect.partition, got "
                f"{type(plan).__name__}"
            )
        missing = [
            text
            for text, value in (
                ("config=<a DeepSpeed-style config dict>", config),
                ("loss_fn=<callable(outputs, labels)>", loss_fn),
            )
            if value is None
        ]
        if missing:
            raise ConfigError(f"the {self.name} pipe_engine() needs {' and '.join(missing)}")
        checked = _check_config(config, f"{self.name} pipe_engine")
        check_capture_dtype(plan, checked)
        if not callable(loss_fn):
            raise ConfigError(f"loss_fn must be callable(outputs, labels), got {loss_fn!r}")
        check_loss_fn(loss_fn)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ConfigError(f"seed must be a non-negative int, got {seed!r}")
        if dynamic_shapes and Capability.DYNAMIC_SHAPES not in self.capabilities:
            raise ConfigError(
                f"the {self.name} dialect does not declare dynamic-shapes, so dynamic_shapes=True "
                "cannot be honoured: its runtime fixes boundary shapes at the first micro-batch. "
                "Pad boundary values to one shape, or use a dialect that declares it (see "
                "`pipedialect list`)"
            )
        if topology is not None:
            check_topology_object(topology)
            if topology.get_dim("data") > 1 and Capability.DATA_PARALLEL not in self.capabilities:
                raise TopologyError(
                    f"the {self.name} dialect does not declare data-parallel, but the topology "
                    f"has a data axis of {topology.get_dim('data')}; use a topology with data=1"
                )
            check_tensor_axis(self, topology.get_dim("tensor") or 1)
        # Before any collective: every rank refuses the same plan alike.
        check_tied_unwritten(plan.stages, plan.tie_groups)
        check_plan_agreement(
            plan,
            dialect=self.name,
            options={
                "config": checked,
                "topology": topology,
                "dynamic_shapes": bool(dynamic_shapes),
                "seed": seed,
                **_plain_fields(opts),
            },
            stages=stage_modules,
        )
        if stage_modules is None:
            stages: tuple[nn.Module, ...] = tuple(
                self.wrap_stages(plan, dynamic_shapes=bool(dynamic_shapes), seed=seed)
            )
        else:
            stages = tuple(stage_modules)
            for stage in stages:
                if isinstance(stage, StageWrapper):
                    stage.random.seed = seed
            if len(stages) != plan.num_stages:
                raise ConfigError(
                    f"got {len(stages)} stage modules for a plan of {plan.num_stages} stages"
                )
        request = PipelineRequest(
            plan=plan,
            stages=stages,
            config=checked,
            loss_fn=loss_fn,
            topology=topology,
            dynamic_shapes=bool(dynamic_shapes),
            init_weights=init_weights,
            options=opts,
            dialect=self,
        )
        return self._build_pipeline(request)

    @final
    def runtime_engine(
        self,
        module: nn.Module,
        *,
        config: Mapping[str, Any] | str | None = None,
        check_finite: bool = False,
        lr_scheduler: Any = None,
        param_groups: ParamGroupsFn | None = None,
        optimizer: Any = None,
        **options: Any,
    ) -> RuntimeEngine:
        """Return the engine that trains ``module`` (what :meth:`pipe_engine` built).

        ``config`` defaults to the one given to :meth:`pipe_engine`; ``check_finite=True``
        refuses a step whose loss or gradients are not finite; ``lr_scheduler`` (an object with
        ``step()``, or a callable building one from the optimizer) replaces the config's
        ``scheduler`` section, as in ``deepspeed.initialize``; ``param_groups`` (see
        :mod:`pipedialect.engine.param_groups`) groups the optimizer's parameters; ``optimizer`` (a
        factory called with the engine's parameter groups -- the fp32 master groups under bf16
        -- or an optimizer object over exactly this rank's trainable parameters) replaces the
        config's ``optimizer`` section, which must then be absent (``pipedialect.engine``
        [Note: client optimizer]); ``options`` are this dialect's own (:attr:`engine_options`).

        Raises:
            ConfigError: a mistyped or unknown argument, a config key DeepSpeed does not know
                (:class:`~pipedialect.errors.UnknownConfigKeyError`), or an engine without the
                methods its capabilities promise (``checkpoints``:
                :class:`~pipedialect.contracts.CheckpointingEngine`).
            RankFailedError: building failed on another rank (see :meth:`pipe_engine`).
        """
        with self._agreed("runtime_engine"):
            engine = self._runtime_engine(
                module,
                config=config,
                check_finite=check_finite,
                lr_scheduler=lr_scheduler,
                param_groups=param_groups,
                optimizer=optimizer,
                **options,
            )
        _record_builder(engine, self)
        return engine

    def _runtime_engine(
        self,
        module: nn.Module,
        *,
        config: Mapping[str, Any] | str | None,
        check_finite: bool,
        lr_scheduler: Any,
        param_groups: ParamGroupsFn | None,
        optimizer: Any,
        **options: Any,
    ) -> RuntimeEngine:
        opts = self.parse_options(options, engine=True)
        checked = None if config is None else _check_config(config, f"{self.name} runtime_engine")
        given = {
            "check_finite": bool(check_finite),
            "lr_scheduler": lr_scheduler is not None,
            "optimizer": optimizer is not None,
            "param_groups": param_groups is not None,
        }
        refused = sorted(k for k, used in given.items() if used and k not in self.engine_features)
        if refused:
            honoured = ", ".join(sorted(self.engine_features)) or "none of them"
            raise ConfigError(
                f"the {self.name} dialect's engine does not support {', '.join(refused)} (of "
                f"{', '.join(sorted(ENGINE_FEATURES))} it honours {honoured})"
            )
        if not (optimizer is None or callable(optimizer) or isinstance(optimizer, Optimizer)):
            raise ConfigError(
                "optimizer must be a callable(param_groups) -> torch.optim.Optimizer or an "
                f"optimizer object, got {type(optimizer).__name__}"
            )
        if param_groups is not None and not callable(param_groups):
            raise ConfigError(
                f"param_groups must be callable(named_parameters) -> groups, got {param_groups!r}"
            )
        request = EngineRequest(
            module=module,
            config=checked,
            check_finite=bool(check_finite),
            lr_scheduler=lr_scheduler,
            param_groups=param_groups,
            options=opts,
            optimizer=optimizer,
        )
        engine = self._build_engine(request)
        _check_engine_protocols(self, engine)
        # What the optimizer was built over (``stage`` [Note: trainability fixed at build]).
        record_trainable(module.modules())
        return engine

    @abc.abstractmethod
    def _build_pipeline(self, request: PipelineRequest[Any]) -> nn.Module:
        """Build this rank's pipeline module from a checked request: what a dialect implements.

        :meth:`pipe_engine` is the only caller, after the shared checks.
        """

    @abc.abstractmethod
    def _build_engine(self, request: EngineRequest[Any]) -> RuntimeEngine:
        """Build the engine that trains ``request.module``: what a dialect implements.

        :meth:`runtime_engine` is the only caller, after the shared checks.
        """

    def parse_options(self, given: Mapping[str, Any], *, engine: bool = False) -> Any:
        """Return :attr:`options` (or :attr:`engine_options`) built from ``given``.

        Raises:
            ConfigError: an option the dialect does not declare, named with the accepted ones.
        """
        cls = self.engine_options if engine else self.options
        where = "runtime_engine" if engine else "pipe_engine"
        fields = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for field, value in given.items():
            if field not in fields:
                shared = _SHARED_ENGINE if engine else _SHARED_PIPELINE
                raise ConfigError(
                    f"unknown argument {field!r} for the {self.name} dialect's {where}(); "
                    f"accepted: {', '.join(sorted({*shared, *fields}))}"
                )
            values[field] = value
        return cls(**values)

    def local_stages(self, engine: RuntimeEngine) -> Sequence[int]:
        """Return the ids of the stages whose parameters ``engine`` trains in this process."""
        raise NotImplementedError(f"dialect {self.name!r} does not report its local stages")

    def engine_state(self, engine: RuntimeEngine) -> EngineState:
        """What ``engine`` trains in this process, under the model's names.

        The hook behind :attr:`Capability.PORTABLE_CHECKPOINTS` and :attr:`Capability.TRACING`
        ([Note: features through the contract]): a dialect that declares either implements it.
        Called with an engine this dialect built (``runtime_engine``, or its runtime's own
        initialisation of a module ``pipe_engine`` built).

        Raises:
            MissingCapabilityError: the dialect declares neither capability (the default).
        """
        wanted = Capability.PORTABLE_CHECKPOINTS
        if Capability.TRACING in self.capabilities:
            wanted = Capability.TRACING
        raise MissingCapabilityError(
            f"the {self.name} dialect does not implement engine_state(), which {wanted.value} "
            "needs; a dialect that declares portable-checkpoints or tracing must implement it",
            dialect=self.name,
            capability=wanted.value,
        )

    def instrument(self, engine: RuntimeEngine, recorder: SpanRecorder) -> Instrumented | None:
        """Make ``engine`` record its runtime's own spans into ``recorder`` during a trace.

        Part of :attr:`Capability.TRACING`: the trace times each stage's forward and backward
        itself (through :meth:`engine_state`); this adds what only the runtime sees -- sends,
        receives, reductions, its own optimizer step -- and returns how to undo it. The
        default adds nothing.
        """
        return None

    def make_topology(
        self, num_stages: int, data_parallel: int = 1, tensor_parallel: int = 1
    ) -> Topology:
        """Return a topology with ``num_stages`` pipeline stages, ``data_parallel`` replicas and
        a tensor axis of ``tensor_parallel`` ranks (above 1 only for a dialect that declares
        ``tensor-parallel``).

        Raises:
            MissingCapabilityError: ``tensor_parallel > 1`` and the dialect does not declare
                ``tensor-parallel``.
        """
        check_tensor_axis(self, tensor_parallel)
        return GridTopology(pipe=num_stages, data=data_parallel, tensor=tensor_parallel)

    def init_distributed(self, backend: str | None = None) -> None:
        """Join the process group described by the usual environment (RANK, WORLD_SIZE, ...).

        ``backend`` defaults to ``nccl`` when CUDA is available, else ``gloo``. A dialect that
        does not declare ``multi-process`` runs every stage in this process: there is nothing to
        join, so the call does nothing and a script written for a multi-process dialect runs
        unchanged under plain ``python``. A dialect whose runtime has its own initialisation
        overrides this.

        The ranks meet with a deadline, never a hang (``pipedialect.runtime.topology``
        [Note: bounded rendezvous]).

        Raises:
            ConfigError: the process was not started by a launcher (``torchrun``, the
                conformance suite's).
            RendezvousError: ``MASTER_PORT`` is held by another program, or not every rank
                joined within ``PIPEDIALECT_RENDEZVOUS_SECONDS``.
        """
        join_process_group(self.name, self.capabilities, backend)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self.version}>"


@runtime_checkable
class _HoldsModule(Protocol):
    """An engine over the module it trains, as ``engine.module`` (DeepSpeed's engines)."""

    module: Any


#: What built each pipeline module and engine: read by :func:`dialect_of`.
_BUILT_BY: weakref.WeakKeyDictionary[Any, Dialect] = weakref.WeakKeyDictionary()


def _record_builder(built: Any, dialect: Dialect) -> None:
    with contextlib.suppress(TypeError):  # not weakly referenceable: dialect_of says so
        _BUILT_BY[built] = dialect


def dialect_of(engine: Any, what: str) -> Dialect:
    """The dialect that built ``engine`` (with ``runtime_engine``), or built the module it
    trains as ``engine.module`` (with ``pipe_engine``; an engine the runtime initialised
    itself, such as ``deepspeed.initialize`` on the seed's module).

    ``what`` names the feature asking, for the error.

    Raises:
        ConfigError: no dialect built ``engine`` or its module.
    """
    held = engine.module if isinstance(engine, _HoldsModule) else None
    for candidate in (engine, held):
        if candidate is None:
            continue
        try:
            found = _BUILT_BY.get(candidate)
        except TypeError:
            continue
        if found is not None:
            return found
    raise ConfigError(
        f"{what} cannot tell which dialect built this {type(engine).__name__}: pass the engine "
        "a dialect's runtime_engine(...) returned (or one whose .module a dialect's "
        "pipe_engine(...) built)"
    )


def require_capability(engine: Any, capability: Capability, what: str) -> Dialect:
    """The dialect that built ``engine``, which must declare ``capability`` for ``what``.

    Raises:
        ConfigError: no dialect built ``engine`` (:func:`dialect_of`).
        MissingCapabilityError: its dialect does not declare ``capability``; the message names
            the dialect, the capability and the hook that provides it.
    """
    dialect = dialect_of(engine, what)
    if capability not in dialect.capabilities:
        declared = ", ".join(sorted(c.value for c in dialect.capabilities)) or "none"
        raise MissingCapabilityError(
            f"{what} needs the {capability.value} capability, which the {dialect.name} dialect "
            f"does not declare (it declares: {declared}); its author adds it by implementing "
            "Dialect.engine_state() (and, for tracing, optionally Dialect.instrument()) and "
            "declaring it, see docs/conformance.rst",
            dialect=dialect.name,
            capability=capability.value,
        )
    return dialect


def check_tensor_axis(dialect: Dialect, tensor_parallel: object) -> None:
    """Refuse a tensor axis of more than one rank on a dialect that does not declare
    ``tensor-parallel``, naming the dialect and the capability.

    Raises:
        TopologyError: ``tensor_parallel`` is not a positive integer.
        MissingCapabilityError: it is above 1 and the dialect does not declare it.
    """
    if (
        isinstance(tensor_parallel, bool)
        or not isinstance(tensor_parallel, int)
        or tensor_parallel < 1
    ):
        raise TopologyError(
            f"tensor_parallel must be a positive integer (ranks on the tensor axis), got "
            f"{tensor_parallel!r}"
        )
    if tensor_parallel > 1 and Capability.TENSOR_PARALLEL not in dialect.capabilities:
        raise MissingCapabilityError(
            f"the {dialect.name} dialect does not declare tensor-parallel, so it cannot shard "
            f"stages over a tensor axis of {tensor_parallel} ranks; use tensor_parallel=1, or a "
            "dialect that declares it (see `pipedialect list`), such as 'torch'",
            dialect=dialect.name,
            capability=Capability.TENSOR_PARALLEL.value,
        )


#: ``pipe_engine`` options that ask for a sharded layout, and the capability each needs.
_SHARDING_OPTIONS = (
    ("data_parallel_mode", "fsdp", Capability.SHARDED_DATA_PARALLEL),
    ("tensor_parallel", None, Capability.TENSOR_PARALLEL),
)


def _refuse_sharding_options(dialect: Dialect, options: Mapping[str, Any]) -> None:
    """Refuse ``data_parallel_mode="fsdp"`` or a ``tensor_parallel`` plan on a dialect that
    does not declare ``sharded-data-parallel`` or ``tensor-parallel``, by capability (rather
    than as an unknown argument), so that the user learns which dialects run it.

    Raises:
        MissingCapabilityError: the option asks for a layout the dialect does not declare.
    """
    for option, value, capability in _SHARDING_OPTIONS:
        given = options.get(option)
        if given is None or capability in dialect.capabilities:
            continue
        if value is not None and given != value:
            continue
        if value is None and not given:
            continue
        raise MissingCapabilityError(
            f"the {dialect.name} dialect does not declare {capability.value}, so it cannot run "
            f"{option}={given!r}; use a dialect that declares it (see `pipedialect list`), such "
            "as 'torch'",
            dialect=dialect.name,
            capability=capability.value,
        )


#: What an engine must answer to for each capability that promises engine methods, and what
#: those methods are.
_ENGINE_PROTOCOLS: Mapping[Capability, tuple[type[RuntimeEngine], str]] = {
    Capability.CHECKPOINTS: (
        CheckpointingEngine,
        "save_checkpoint(save_dir, tag=None, **kwargs) and load_checkpoint(load_dir, tag=None, "
        "**kwargs)",
    ),
}


def _check_engine_protocols(dialect: Dialect, engine: RuntimeEngine) -> None:
    """Refuse an engine that lacks the methods its dialect's capabilities promise, so that what
    uses them (the conformance suite, a training loop) never has to look for them.

    Raises:
        ConfigError: the engine is not an instance of a promised protocol.
    """
    for capability, (protocol, methods) in _ENGINE_PROTOCOLS.items():
        if capability in dialect.capabilities and not isinstance(engine, protocol):
            raise ConfigError(
                f"the {dialect.name} dialect declares {capability.value}, but its engine "
                f"({type(engine).__name__}) is not a pipedialect.contracts.{protocol.__name__}: "
                f"it needs {methods}. Implement them, or do not declare {capability.value}"
            )


_SHARED_PIPELINE = ("config", "loss_fn", "topology", "dynamic_shapes", "init_weights")
_SHARED_ENGINE = ("config", "check_finite", "lr_scheduler", "optimizer", "param_groups")


def _check_config(config: Mapping[str, Any] | str | None, where: str) -> dict[str, Any]:
    """A copy of ``config``; a ``str`` is the path of a JSON file, read here as DeepSpeed does."""
    if config is None:
        raise ConfigError(f"{where} needs config=<a DeepSpeed-style config dict>")
    if isinstance(config, str | os.PathLike):
        try:
            loaded = json.loads(Path(config).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{where}: cannot read the config file {config}: {exc}") from exc
        config = loaded
    if not isinstance(config, Mapping):
        raise ConfigError(f"{where}: config must be a dict, got {type(config).__name__}")
    check_config_keys(config)  # [Note: unknown config keys]: the same refusal on every dialect
    return dict(config)


def given_options(options: Any) -> dict[str, Any]:
    """The fields of an options dataclass instance that were set (are not None), by name."""
    values = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    return {name: value for name, value in values.items() if value is not None}


def _plain_fields(options: Any) -> dict[str, Any]:
    """The options that every rank must pass alike (numbers, strings, None)."""
    return {
        f.name: getattr(options, f.name)
        for f in dataclasses.fields(options)
        if getattr(options, f.name) is None
        or isinstance(getattr(options, f.name), bool | int | float | str)
    }


def option_descriptions(cls: type[Any]) -> list[dict[str, Any]]:
    """Describe an options dataclass: name, type, default and doc of each field."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default: Any = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        if not (default is None or isinstance(default, bool | int | float | str)):
            default = repr(default)
        hint = hints.get(f.name, f.type)
        out.append(
            {
                "name": f.name,
                "type": hint if isinstance(hint, str) else _type_text(hint),
                "default": default,
                "doc": f.metadata.get("doc", ""),
            }
        )
    return out


def _type_text(hint: Any) -> str:
    text = getattr(hint, "__name__", None)
    if text and not typing.get_args(hint):
        return str(text)
    return str(hint).replace("typing.", "")
