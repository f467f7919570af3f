"""The local dialect's pipeline module and engine: every stage in this process.

:class:`LocalPipeline` chains the stage wrappers exactly as a pipeline runtime does (each
wrapper encodes what it sends through the codec and the wire layout, the next one decodes it),
so a partition that runs here runs through the same code as a distributed run.
:class:`LocalEngine` drives it like DeepSpeed's ``PipelineEngine``: ``train_batch`` pulls
``gradient_accumulation_steps`` ``(inputs, labels)`` micro-batches, scales each loss by
``1/gradient_accumulation_steps`` before its backward, clips, steps the optimizer once and
returns the mean micro-batch loss; ``eval_batch`` does the same under ``no_grad`` and changes
nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipedialect import CheckpointError, ConfigError, StageWrapper
from pipedialect.partition import PipelinePlan

from .config import TrainingConfig, build_optimizer, clip_gradients, parse_config

__all__ = ["DeepSpeedStyleEngine", "LocalEngine", "LocalPipeline"]

logger = logging.getLogger(__name__)

LossFn = Callable[[Any, Any], torch.Tensor]

_CHECKPOINT_FILE = "local_engine.pt"
_LATEST_FILE = "latest"


class LocalPipeline(nn.Module):
    """The stage wrappers of one plan, called in order; callable like the unsplit model."""

    def __init__(
        self,
        stages: Sequence[nn.Module],
        *,
        plan: PipelinePlan,
        loss_fn: LossFn,
        config: Mapping[str, Any],
    ) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.plan = plan
        self.loss_fn = loss_fn
        self.config = dict(config)

    @property
    def num_stages(self) -> int:
        """The number of stages."""
        return len(self.stages)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run every stage; the first takes the model's inputs, the last returns its output."""
        value = self.stages[0](*args, **kwargs)
        for stage in self.stages[1:]:
            value = stage(value)
        return value


class DeepSpeedStyleEngine:
    """What every engine shares with DeepSpeed's ``PipelineEngine``: config, optimizer,
    accessors and the data iterator (the torch dialect's engine builds on it too)."""

    def __init__(self, module: nn.Module, config: TrainingConfig) -> None:
        self.module = module
        self.config = config
        # parameters() yields a parameter shared by several local stages once: it is stepped,
        # and clipped, once.
        self.optimizer = build_optimizer(config, module.parameters())
        self.global_steps = 0
        self.micro_batches = config.gradient_accumulation_steps
        self._data_iterator: Iterator[Any] | None = None

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self.config.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        """Samples per optimizer step."""
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per micro-batch."""
        return self.config.micro_batch_size

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        """Set the iterator ``train_batch()`` uses when called without one."""
        self._data_iterator = iterator

    @staticmethod
    def next_pair(data_iter: Iterator[Any]) -> tuple[Any, Any]:
        """Pull one ``(inputs, labels)`` micro-batch, refusing anything else by name."""
        batch = next(data_iter)
        if not isinstance(batch, tuple | list) or len(batch) != 2:
            raise ConfigError(
                "data_iter must yield (inputs, labels) pairs, one per micro-batch; got "
                f"{type(batch).__name__}"
                + (f" of length {len(batch)}" if isinstance(batch, tuple | list) else "")
            )
        return batch[0], batch[1]


class LocalEngine(DeepSpeedStyleEngine):
    """Trains a :class:`LocalPipeline` with DeepSpeed ``PipelineEngine`` semantics."""

    module: LocalPipeline

    def __init__(self, module: LocalPipeline, config: TrainingConfig) -> None:
        super().__init__(module, config)

    def is_first_stage(self) -> bool:
        """True: this process runs the first stage (and every other)."""
        return True

    def is_last_stage(self) -> bool:
        """True: this process runs the last stage (and every other)."""
        return True

    # -- training ----------------------------------------------------------------------------

    def _loss(self, inputs: Any, labels: Any) -> tuple[torch.Tensor, Any]:
        outputs = self.module(*inputs) if isinstance(inputs, tuple | list) else self.module(inputs)
        loss = self.module.loss_fn(outputs, labels)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ConfigError(
                f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
            )
        return loss, outputs

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """Train on ``gradient_accumulation_steps`` micro-batches; return their mean loss."""
        data_iter = self._resolve_iter(data_iter)
        self.module.train()
        gas = self.config.gradient_accumulation_steps
        losses: list[torch.Tensor] = []
        for _ in range(gas):
            loss, _ = self._loss(*self.next_pair(data_iter))
            torch.autograd.backward(loss / gas)
            losses.append(loss.detach().reshape(()))
        params = list(self.module.parameters())
        if self.config.gradient_clipping > 0.0:
            clip_gradients(params, self.config.gradient_clipping)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_steps += 1
        return _mean(losses)

    def eval_batch(
        self,
        data_iter: Iterator[Any],
        return_logits: bool = False,
        num_micro_batches: int | None = None,
    ) -> Any:
        """Return the mean loss over ``num_micro_batches`` (default: gradient accumulation
        steps) micro-batches, without changing any parameter; with ``return_logits`` also the
        last micro-batch's outputs, as DeepSpeed does."""
        self.module.eval()
        count = self.config.gradient_accumulation_steps
        if num_micro_batches is not None:
            count = num_micro_batches
        if count < 1:
            raise ConfigError(f"num_micro_batches must be at least 1, got {count}")
        losses: list[torch.Tensor] = []
        outputs: Any = None
        with torch.no_grad():
            for _ in range(count):
                loss, outputs = self._loss(*self.next_pair(data_iter))
                losses.append(loss.detach().reshape(()))
        mean = _mean(losses)
        return (mean, outputs) if return_logits else mean

    def reset_activation_shape(self) -> None:
        """Accept new boundary shapes from the next batch on, as DeepSpeed's method does.

        Every stage wrapper forgets its frozen wire layout and shapes.
        """
        for stage in self.module.stages:
            if isinstance(stage, StageWrapper):
                stage.reset_wire_state()

    def _resolve_iter(self, data_iter: Iterator[Any] | None) -> Iterator[Any]:
        if data_iter is not None:
            return data_iter
        if self._data_iterator is None:
            raise ConfigError("train_batch() needs a data_iter (or call set_dataiterator first)")
        return self._data_iterator

    # -- checkpoints -------------------------------------------------------------------------

    def save_checkpoint(
        self,
        save_dir: str | Path,
        tag: str | None = None,
        client_state: Mapping[str, Any] | None = None,
        save_latest: bool = True,
    ) -> bool:
        """Save parameters, optimizer state and step count under ``save_dir/tag``."""
        tag = tag or f"global_step{self.global_steps}"
        path = Path(save_dir) / tag
        path.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "module": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "global_steps": self.global_steps,
                "client_state": dict(client_state or {}),
                "plan": self.module.plan.fingerprint(),
            },
            path / _CHECKPOINT_FILE,
        )
        if save_latest:
            (Path(save_dir) / _LATEST_FILE).write_text(tag)
        return True

    def load_checkpoint(
        self,
        load_dir: str | Path,
        tag: str | None = None,
        load_optimizer_states: bool = True,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Load what :meth:`save_checkpoint` saved; return ``(path, client_state)``.

        Without ``tag``, the one recorded in ``load_dir/latest``; ``(None, None)`` when there is
        none, as DeepSpeed returns.
        """
        if tag is None:
            latest = Path(load_dir) / _LATEST_FILE
            if not latest.is_file():
                logger.warning(
                    "no checkpoint tag given and no %s file in %s", _LATEST_FILE, load_dir
                )
                return None, None
            tag = latest.read_text().strip()
        path = Path(load_dir) / tag / _CHECKPOINT_FILE
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state.get("plan") != self.module.plan.fingerprint():
            raise CheckpointError(
                f"checkpoint {path} was saved from a different pipeline plan; partition the same "
                "model with the same split points before loading it"
            )
        self.module.load_state_dict(state["module"])
        if load_optimizer_states:
            self.optimizer.load_state_dict(state["optimizer"])
        self.global_steps = int(state["global_steps"])
        return str(path), dict(state["client_state"])


def _mean(losses: Sequence[torch.Tensor]) -> torch.Tensor:
    """The mean micro-batch loss, summed in order as DeepSpeed accumulates it."""
    total = losses[0].clone()
    for loss in losses[1:]:
        total += loss
    return total / len(losses)


def build_engine(module: nn.Module, config: Mapping[str, Any] | None) -> LocalEngine:
    """Return the :class:`LocalEngine` training ``module``."""
    if not isinstance(module, LocalPipeline):
        raise ConfigError(
            f"the local runtime engine trains what LocalDialect.pipe_engine built, got "
            f"{type(module).__name__}"
        )
    return LocalEngine(module, parse_config(config))
