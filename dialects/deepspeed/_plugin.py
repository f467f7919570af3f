"""The DeepSpeed dialect's plugin: its Dialect class and registration hook."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

import pipedialect
from pipedialect import Capability, Dialect, PipeDialectError, RuntimeEngine

if TYPE_CHECKING:
    from pipedialect.partition import PipelinePlan

__all__ = ["DeepSpeedDialect", "register_dialects"]


class DeepSpeedDialect(Dialect):
    """DeepSpeed's ``PipelineModule`` and ``PipelineEngine`` (1F1B), upstream DeepSpeed."""

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
        }
    )

    def pipe_engine(
        self, plan: PipelinePlan, stage_modules: Sequence[nn.Module] | None = None, **kwargs: Any
    ) -> nn.Module:
        """Not built yet."""
        raise PipeDialectError("the deepspeed dialect's engine is not built yet")

    def runtime_engine(self, module: nn.Module, **kwargs: Any) -> RuntimeEngine:
        """Not built yet."""
        raise PipeDialectError("the deepspeed dialect's engine is not built yet")


@pipedialect.hookimpl
def register_dialects(register: Callable[[type[Dialect]], None]) -> None:
    """Register the DeepSpeed dialect."""
    register(DeepSpeedDialect)
