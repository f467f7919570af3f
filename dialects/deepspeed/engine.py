"""The DeepSpeed runtime engine: ``deepspeed.initialize`` over the pipeline module.

:func:`init_ds_engine` calls ``deepspeed.initialize`` and returns DeepSpeed's own
``PipelineEngine``, specialised by one method: receive buffers are pooled per position *and
dtype*. Upstream pools them per position only and reuses a slot in its old dtype when it is big
enough; a middle stage that sends more gradient-carrying floats than it receives (an
encoder-decoder stage forwarding the encoder output next to its own activation) would then get a
float gradient in a bool or integer slot, which gloo rejects and NCCL corrupts.

Importing this module imports deepspeed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import deepspeed
import torch
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.module import PipelineModule
from torch import nn

from pipedialect import ConfigError

__all__ = ["PipeDialectEngine", "init_ds_engine"]

logger = logging.getLogger(__name__)


class PipeDialectEngine(PipelineEngine):  # type: ignore[misc]
    """DeepSpeed's ``PipelineEngine`` with a receive-buffer pool keyed by position and dtype."""

    def _allocate_or_extend_buffers(
        self, idx: int, shape: list[int], dtype: torch.dtype
    ) -> torch.Tensor:
        numel = math.prod(shape)
        pool: dict[tuple[int, torch.dtype], torch.Tensor] = self.__dict__.setdefault(
            "_pipedialect_buffers", {}
        )
        buf = pool.get((idx, dtype))
        if buf is None or buf.numel() < numel:
            buf = torch.zeros(shape, dtype=dtype, device=self.device)
            pool[(idx, dtype)] = buf
            return buf
        return buf.flatten()[:numel].view(shape)

    def reset_activation_shape(self) -> None:
        """Forget buffer shapes (as upstream does), including this engine's pool."""
        super().reset_activation_shape()
        self.__dict__.pop("_pipedialect_buffers", None)


def init_ds_engine(
    model: nn.Module, *, config: Mapping[str, Any] | str | None = None, **kwargs: Any
) -> PipeDialectEngine:
    """Return the DeepSpeed ``PipelineEngine`` that trains ``model``.

    ``model`` is what :func:`~pipedialect.dialects.deepspeed.pipeline.deepspeed_pipe_engine`
    returned (any ``PipelineModule`` works). ``config`` is the DeepSpeed config (a dict or a JSON
    path); ``optimizer``, ``lr_scheduler`` and ``training_data`` are passed to
    ``deepspeed.initialize``.
    """
    if config is None:
        raise ConfigError("init_ds_engine needs config=<DeepSpeed config dict or JSON path>")
    if not isinstance(model, PipelineModule):
        raise ConfigError(
            f"init_ds_engine needs the PipelineModule built by pipe_engine, got "
            f"{type(model).__name__}"
        )
    allowed = {"optimizer", "lr_scheduler", "training_data"}
    unknown = set(kwargs) - allowed
    if unknown:
        raise ConfigError(
            f"unknown argument(s) {sorted(unknown)} for the DeepSpeed runtime engine; "
            f"accepted: config, {', '.join(sorted(allowed))}"
        )
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=dict(config) if isinstance(config, Mapping) else config,
        **kwargs,
    )
    if not isinstance(engine, PipelineEngine):
        raise ConfigError(f"deepspeed.initialize returned {type(engine).__name__}, not a pipeline")
    engine.__class__ = PipeDialectEngine
    return engine  # type: ignore[no-any-return]
