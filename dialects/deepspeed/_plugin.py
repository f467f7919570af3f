"""The DeepSpeed dialect's plugin: its Dialect class and registration hook."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import field
from typing import Any

import torch
from torch import nn

import pipedialect
from pipedialect import Capability, Dialect, RuntimeEngine, Topology
from pipedialect.contracts import (
    BOUNDARY_CAPABILITIES,
    EngineState,
    Instrumented,
    SpanRecorder,
)
from pipedialect.sdk import (
    ENGINE_FEATURES,
    EngineRequest,
    PipelineRequest,
    check_tensor_axis,
    given_options,
    join_with_deadline,
)

from ._stage import DeepSpeedStageWrapper

__all__ = [
    "DeepSpeedDialect",
    "DeepSpeedEngineOptions",
    "DeepSpeedOptions",
    "register_dialects",
]


@dataclasses.dataclass(frozen=True)
class DeepSpeedOptions:
    """What the DeepSpeed dialect's ``pipe_engine`` takes beyond the shared arguments."""

    fp16: bool | None = field(
        default=None, metadata={"doc": "must agree with the config's fp16.enabled"}
    )
    bf16: bool | None = field(
        default=None, metadata={"doc": "must agree with the config's bf16.enabled"}
    )
    activation_checkpoint_interval: int | None = field(
        default=None,
        metadata={"doc": "any value >= 1 checkpoints each whole stage (one DeepSpeed layer)"},
    )
    activation_checkpoint_func: Any = field(
        default=None, metadata={"doc": "refused: stages are recomputed whole, non-reentrant"}
    )
    checkpointable_layers: Any = field(
        default=None, metadata={"doc": "refused: stages are recomputed whole, non-reentrant"}
    )


@dataclasses.dataclass(frozen=True)
class DeepSpeedEngineOptions:
    """What ``runtime_engine`` passes on to ``deepspeed.initialize``, or refuses with the reason.

    Every argument ``deepspeed.initialize`` takes for a pipeline is here: the ones its
    ``PipelineEngine`` honours are passed through, the others are refused by name before
    DeepSpeed runs (see :func:`~pipedialect.dialects.deepspeed.engine.init_ds_engine`).
    """

    model_parameters: Any = field(
        default=None,
        metadata={
            "doc": "the parameters (or dicts of parameter groups) the optimizer steps; each "
            "trainable parameter of this stage exactly once. Default: all of them, or the "
            "groups of param_groups"
        },
    )
    training_data: Any = field(
        default=None,
        metadata={
            "doc": "a map-style dataset of (inputs, labels) items; DeepSpeed's loader reads it "
            "on the first and last stages (each data-parallel rank its share, in order) when "
            "train_batch() gets no iterator"
        },
    )
    collate_fn: Any = field(
        default=None,
        metadata={"doc": "merges training_data items into one micro-batch (DeepSpeed's loader)"},
    )
    args: Any = field(
        default=None,
        metadata={
            "doc": "an argparse namespace: its deepspeed_config may give the config (then not "
            "config=), its local_rank must equal LOCAL_RANK"
        },
    )
    config_params: Any = field(
        default=None, metadata={"doc": "DeepSpeed's old name for config (pass one of them)"}
    )
    dist_init_required: bool | None = field(
        default=None,
        metadata={
            "doc": "passed on; the process group is already initialised by then (pipe_engine "
            "needs it), so it changes nothing"
        },
    )
    mpu: Any = field(
        default=None,
        metadata={
            "doc": "refused: a PipelineModule brings its own process grid, from the topology"
        },
    )
    distributed_port: Any = field(
        default=None,
        metadata={
            "doc": "refused: the process group is initialised before the engine; set "
            "MASTER_PORT for the launcher"
        },
    )
    mesh_param: Any = field(
        default=None,
        metadata={"doc": "refused: DeepSpeed's PipelineEngine does not use a device mesh"},
    )


class DeepSpeedDialect(Dialect):
    """DeepSpeed's ``PipelineModule`` trained by its ``PipelineEngine`` (1F1B), upstream DeepSpeed.

    ``pipe_engine(plan, config=..., loss_fn=..., topology=...)`` returns a
    ``deepspeed.pipe.PipelineModule``; ``runtime_engine(module, config=...)`` calls
    ``deepspeed.initialize`` and returns the ``PipelineEngine``.
    """

    name = "deepspeed"
    options = DeepSpeedOptions
    engine_options = DeepSpeedEngineOptions
    version = pipedialect.__version__
    description = "DeepSpeed PipelineEngine (NCCL on GPUs, gloo on CPUs)"
    engine_features = ENGINE_FEATURES
    capabilities = BOUNDARY_CAPABILITIES | {
        Capability.MULTI_PROCESS,
        Capability.DATA_PARALLEL,
        Capability.CHECKPOINTS,
        Capability.DYNAMIC_SHAPES,
        Capability.PORTABLE_CHECKPOINTS,
        Capability.TRACING,
        Capability.TRAINER_LOOP,
    }

    @property
    def stage_wrapper(self) -> type[DeepSpeedStageWrapper]:
        """The wrapper adding DeepSpeed's wire rules to :class:`~pipedialect.StageWrapper`."""
        return DeepSpeedStageWrapper

    def _build_pipeline(self, request: PipelineRequest[DeepSpeedOptions]) -> nn.Module:
        """Build DeepSpeed's ``PipelineModule`` of the wrapped stages.

        ``topology`` is required (one of DeepSpeed's topology classes, e.g.
        :meth:`make_topology`); ``init_weights`` fills this rank's stage of a meta-device plan,
        the others stay on meta.
        """
        from ._build import build_pipeline_module

        module = build_pipeline_module(request, self.tie_analyzer)
        module.pipedialect_config = request.config  # runtime_engine's default config
        return module

    def _build_engine(self, request: EngineRequest[DeepSpeedEngineOptions]) -> RuntimeEngine:
        """DeepSpeed's ``PipelineEngine`` for the module (``deepspeed.initialize``).

        ``param_groups`` builds ``deepspeed.initialize``'s ``model_parameters`` from this
        rank's stage, under the model's names; ``optimizer`` (a factory called with them, or an
        optimizer object) and ``lr_scheduler`` are ``deepspeed.initialize``'s.
        """
        from .engine import init_ds_engine

        opts = request.options
        extra = given_options(opts)
        if request.lr_scheduler is not None:
            extra["lr_scheduler"] = request.lr_scheduler
        if request.optimizer is not None:  # the shared optimizer= is deepspeed.initialize's
            extra["optimizer"] = request.optimizer
        config = request.config
        if config is None and opts.config_params is None and opts.args is None:
            config = getattr(request.module, "pipedialect_config", None)  # pipe_engine's
        engine: RuntimeEngine = init_ds_engine(
            request.module,
            config=config,
            check_finite=request.check_finite,
            param_groups=request.param_groups,
            **extra,
        )
        return engine

    def local_stages(self, engine: RuntimeEngine) -> Sequence[int]:
        """The one stage this process trains."""
        return [int(engine.stage_id)]  # type: ignore[attr-defined]

    def engine_state(self, engine: RuntimeEngine) -> EngineState:
        """This process's stage of a ``PipelineEngine`` (ours, or one ``deepspeed.initialize``
        built from the seed's module), its ties from the module's ``tie_specs``."""
        from ._engine_state import deepspeed_engine_state

        return deepspeed_engine_state(engine)

    def instrument(self, engine: RuntimeEngine, recorder: SpanRecorder) -> Instrumented:
        """Time the engine's send, receive, reduce and optimizer instructions (``_trace``)."""
        from ._trace import instrument

        return instrument(engine, recorder)

    def make_topology(
        self, num_stages: int, data_parallel: int = 1, tensor_parallel: int = 1
    ) -> Topology:
        """``PipeModelDataParallelTopology(num_pp=num_stages, num_mp=1, num_dp=data_parallel)``.

        Raises:
            MissingCapabilityError: ``tensor_parallel > 1``: this dialect does not declare
                tensor-parallel.
        """
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

        check_tensor_axis(self, tensor_parallel)

        topology: Topology = PipeModelDataParallelTopology(
            num_pp=num_stages, num_mp=1, num_dp=data_parallel
        )
        return topology

    def init_distributed(self, backend: str | None = None) -> None:
        """``deepspeed.init_distributed``: NCCL with CUDA (on the local device), else gloo.

        On a CPU this builds DeepSpeed's shared-memory op the first time (cached in torch's
        extensions directory). A build killed midway leaves a lock that would make this wait
        forever: it is detected first (``_extensions`` [Note: stale build lock]).

        Raises:
            ConfigError: the process was not started by a launcher (plain ``python``): DeepSpeed
                would look for an MPI job instead and fail inside ``mpi4py``.
            ExtensionBuildError: a killed build left its lock; the message names the file.
            RendezvousError: ``MASTER_PORT`` is held by another program, or not every rank
                joined in time (the ranks meet with a deadline before DeepSpeed adopts the
                process group: ``pipedialect.runtime.topology`` [Note: bounded rendezvous]).
        """
        import deepspeed

        from ._extensions import check_build_locks

        _check_launched()
        check_build_locks()
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if not _discovered_job() and not torch.distributed.is_initialized():
            # Joined first with a deadline (``pipedialect.runtime.topology`` [Note: bounded
            # rendezvous]); DeepSpeed then adopts the process group.
            from deepspeed.constants import default_pg_timeout

            join_with_deadline(backend, default_pg_timeout)
        deepspeed.init_distributed(dist_backend=backend)


#: What ``deepspeed.init_distributed`` needs from a launcher before it falls back to MPI.
_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
#: Set in the jobs DeepSpeed discovers itself: MPI (Open MPI, MPICH/PMI, MVAPICH), AzureML and
#: SageMaker.
_DISCOVERED_JOB_VARIABLES = (
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
    "PMIX_RANK",
    "MV2_COMM_WORLD_SIZE",
    "AZUREML_EXPERIMENT_ID",
    "SM_TRAINING_ENV",
)


def _discovered_job() -> bool:
    """Whether DeepSpeed finds this job's ranks itself (MPI, AzureML, SageMaker) rather than
    from a launcher's variables."""
    missing = [name for name in _LAUNCH_VARIABLES if name not in os.environ]
    return bool(missing) and any(name in os.environ for name in _DISCOVERED_JOB_VARIABLES)


def _check_launched() -> None:
    """Refuse by name a process no launcher started, before DeepSpeed tries MPI discovery."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    missing = [name for name in _LAUNCH_VARIABLES if name not in os.environ]
    if not missing or any(name in os.environ for name in _DISCOVERED_JOB_VARIABLES):
        return
    raise pipedialect.ConfigError(
        "the deepspeed dialect runs one process per pipeline rank, but this process was not "
        f"started by a launcher ({', '.join(missing)} not set), so DeepSpeed would look for "
        "an MPI job and fail inside mpi4py. Start the script with `torchrun --nproc_per_node "
        "N script.py` or DeepSpeed's `deepspeed --num_gpus N script.py` (N = stages x "
        "replicas), or from Python with pipedialect.runtime.launch.launch(fn, N); or use the "
        "'local' dialect to run every stage in this process"
    )


@pipedialect.hookimpl
def register_dialects(register: Callable[[type[Dialect]], None]) -> None:
    """Register the DeepSpeed dialect."""
    register(DeepSpeedDialect)
