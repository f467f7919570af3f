"""The DeepSpeed runtime engine: ``deepspeed.initialize`` over the pipeline module.

:func:`init_ds_engine` calls ``deepspeed.initialize`` and returns DeepSpeed's own
``PipelineEngine``, specialised by two methods. Receive buffers are pooled per position *and
dtype*: upstream pools them per position only and reuses a slot in its old dtype when it is big
enough; a middle stage that sends more gradient-carrying floats than it receives (an
encoder-decoder stage forwarding the encoder output next to its own activation) would then get a
float gradient in a bool or integer slot, which gloo rejects and NCCL corrupts. And
``reset_activation_shape()``, DeepSpeed's way to change the sequence length, also resets the
stage wrappers' frozen wire layouts and shapes (``_wire`` [Note: wire state]).

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

from pipedialect import ConfigError, StageWrapper

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
        """Accept new boundary shapes from the next batch on; call it on every rank at once.

        Forgets the buffer shapes (as upstream does, so tensor metadata is sent again), this
        engine's buffer pool, and every local stage wrapper's frozen wire layout and shapes.
        """
        super().reset_activation_shape()
        self.__dict__.pop("_pipedialect_buffers", None)
        for layer in self.module.forward_funcs:
            if isinstance(layer, StageWrapper):
                layer.reset_wire_state()


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
    _check_checkpointing(model)
    engine.__class__ = PipeDialectEngine
    return engine  # type: ignore[no-any-return]


def _check_checkpointing(model: PipelineModule) -> None:
    """Refuse DeepSpeed's own checkpointing of stage wrappers outside our PipelineModule.

    Its reentrant function gives no gradient to a stage fed integer token ids; ours checkpoints
    each whole stage exactly (``_module`` [Note: stage checkpointing]).
    """
    from ._module import PipeDialectPipelineModule

    if isinstance(model, PipeDialectPipelineModule) or model.activation_checkpoint_interval <= 0:
        return
    if any(isinstance(layer, StageWrapper) for layer in model.forward_funcs):
        raise ConfigError(
            f"activation_checkpoint_interval={model.activation_checkpoint_interval} on a plain "
            "deepspeed.pipe.PipelineModule of stage wrappers: DeepSpeed's checkpoint function "
            "would train them wrongly or fail. Build the module with dialect.pipe_engine (or "
            "deepspeed_pipe_engine), which checkpoints each whole stage exactly."
        )
