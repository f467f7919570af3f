"""The DeepSpeed dialect's plugin: its Dialect class and registration hook."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

import pipedialect
from pipedialect import Capability, Dialect, RuntimeEngine, Topology

from ._stage import DeepSpeedPipeStageWrapper

if TYPE_CHECKING:
    from pipedialect.partition import PipelinePlan

__all__ = ["DeepSpeedDialect", "register_dialects"]


class DeepSpeedDialect(Dialect):
    """DeepSpeed's ``PipelineModule`` trained by its ``PipelineEngine`` (1F1B), upstream DeepSpeed.

    ``pipe_engine(plan, config=..., loss_fn=..., topology=...)`` returns a
    ``deepspeed.pipe.PipelineModule``; ``runtime_engine(module, config=...)`` calls
    ``deepspeed.initialize`` and returns the ``PipelineEngine``.
    """

    name = "deepspeed"
    version = pipedialect.__version__
    description = "DeepSpeed PipelineEngine (NCCL on GPUs, gloo on CPUs)"
    capabilities = frozenset(
        {
            Capability.TIED_WEIGHTS,
            Capability.MULTI_GRAD_BOUNDARY,
            Capability.NON_FLOAT_TENSORS,
            Capability.PYTHON_VALUES,
            Capability.SKIP_CONNECTIONS,
            Capability.MULTI_PROCESS,
            Capability.DATA_PARALLEL,
            Capability.CHECKPOINTS,
            Capability.DYNAMIC_SHAPES,
        }
    )

    @property
    def stage_wrapper(self) -> type[DeepSpeedPipeStageWrapper]:
        """:class:`~pipedialect.dialects.deepspeed.pipeline.DeepSpeedPipeStageWrapper`."""
        return DeepSpeedPipeStageWrapper

    def pipe_engine(
        self, plan: PipelinePlan, stage_modules: Sequence[nn.Module] | None = None, **kwargs: Any
    ) -> nn.Module:
        """Wrap the plan's stages (unless given) and build the ``PipelineModule``.

        Keyword arguments: ``config``, ``loss_fn`` and ``topology`` (required), ``fp16`` /
        ``bf16`` (must agree with the config), ``dynamic_shapes`` (boundary shapes may change
        between micro-batches; DeepSpeed then re-sends tensor metadata every time; DeepSpeed's
        own spelling ``dynamic_shape`` is accepted too), ``init_weights(stage_module)`` (fills
        this rank's stage of a meta-device plan; the others stay on meta).
        """
        from pipedialect._agreement import check_plan_agreement

        from ._build import build_pipeline_module, dynamic_shapes_of

        check_plan_agreement(plan, dialect=self.name, options=kwargs, stages=stage_modules)
        if stage_modules is None:
            stage_modules = plan.wrap(self.stage_wrapper, dynamic_shapes=dynamic_shapes_of(kwargs))
        return build_pipeline_module(plan, stage_modules, **kwargs)

    def runtime_engine(self, module: nn.Module, **kwargs: Any) -> RuntimeEngine:
        """Return DeepSpeed's ``PipelineEngine`` for ``module`` (``deepspeed.initialize``);
        ``check_finite=True`` refuses a step whose loss or gradients are not finite."""
        from .engine import init_ds_engine

        engine: RuntimeEngine = init_ds_engine(module, **kwargs)
        return engine

    def local_stages(self, engine: RuntimeEngine) -> Sequence[int]:
        """The one stage this process trains."""
        return [int(engine.stage_id)]  # type: ignore[attr-defined]

    def make_topology(self, num_stages: int, data_parallel: int = 1) -> Topology:
        """``PipeModelDataParallelTopology(num_pp=num_stages, num_mp=1, num_dp=data_parallel)``."""
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

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
            ExtensionBuildError: a killed build left its lock; the message names the file.
        """
        import deepspeed

        from ._extensions import check_build_locks

        check_build_locks()
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        deepspeed.init_distributed(dist_backend=backend)


@pipedialect.hookimpl
def register_dialects(register: Callable[[type[Dialect]], None]) -> None:
    """Register the DeepSpeed dialect."""
    register(DeepSpeedDialect)
