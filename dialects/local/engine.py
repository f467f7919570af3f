"""The local dialect's pipeline module and engine: every stage in this process.

:class:`LocalPipeline` chains the stage wrappers exactly as a pipeline runtime does (each
wrapper encodes what it sends through the codec and the wire layout, the next one decodes it),
so a partition that runs here runs through the same code as a distributed run.
:class:`LocalEngine` drives it like DeepSpeed's ``PipelineEngine``: ``train_batch`` pulls
``gradient_accumulation_steps`` ``(inputs, labels)`` micro-batches, scales each loss by
``1/gradient_accumulation_steps`` before its backward, clips, steps the optimizer once and
returns the mean micro-batch loss; ``eval_batch`` does the same under ``no_grad`` and changes
nothing. Both read every micro-batch of the step before computing anything, so an iterator that
runs out raises :class:`~pipedialect.DataExhaustedError` and leaves no gradient behind; with
``check_finite`` a NaN or infinite loss or gradient raises :class:`~pipedialect.NonFiniteError`
before the optimizer steps, and the step's gradients are dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Unpack

import torch
from torch import nn

from pipedialect import CheckpointError, ConfigError, StageWrapper
from pipedialect.sdk import (
    EngineBase,
    PipelinePlan,
    SharedEngineArgs,
    begin_streams,
    check_inputs,
    check_trainable,
    checkpoint_files,
    clip_gradients,
    first_nonfinite_loss,
    kept_loss,
    nonfinite_loss_error,
    parse_config,
    read_checkpoint_file,
    shape_mismatch,
    stage_param_name,
)

__all__ = ["LocalEngine", "LocalPipeline"]


LossFn = Callable[[Any, Any], torch.Tensor]

_CHECKPOINT_FILE = "local_engine.pt"


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


class LocalEngine(EngineBase):
    """Trains a :class:`LocalPipeline` with DeepSpeed ``PipelineEngine`` semantics."""

    module: LocalPipeline

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

    def _pull(self, data_iter: Iterator[Any], count: int, what: str, source: str) -> list[Any]:
        batches = self.pull_pairs(data_iter, count, what=what, source=source)
        for i, (inputs, _) in enumerate(batches):
            check_inputs(inputs, self.module.plan.input_names, i)
        return batches

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """Train on ``gradient_accumulation_steps`` micro-batches; return their mean loss.

        Every micro-batch is read first; a failure anywhere leaves no gradient behind.
        """
        check_trainable(self.module.stages, self.global_steps + 1)
        gas = self.config.gradient_accumulation_steps
        batches = self._pull(
            self._resolve_iter(data_iter), gas, "train_batch", "gradient_accumulation_steps"
        )
        self.module.train()
        step = self.global_steps + 1
        begin_streams(self.module.stages, "train", step)
        losses: list[torch.Tensor] = []
        try:
            for i, (inputs, labels) in enumerate(batches):
                loss, _ = self._loss(inputs, labels)
                if self.check_finite and first_nonfinite_loss([loss]) is not None:
                    raise nonfinite_loss_error(
                        loss, step=step, stage=self.module.num_stages - 1, micro_batch=i
                    )
                if not loss.requires_grad:
                    raise ConfigError(
                        f"micro-batch {i}: the loss needs no gradient, so train_batch has "
                        "nothing to train: no parameter it depends on has requires_grad=True "
                        "(is every parameter frozen?). Unfreeze some, or use eval_batch"
                    )
                torch.autograd.backward(loss / gas)
                self.accumulate_grads()  # bf16: into the high-precision buffers
                losses.append(kept_loss(loss).reshape(()))
            self.reduce_grads()  # bf16: one replica, rounded to the communication dtype
            if self.check_finite:
                error = self.check_finite_grads(enumerate(self.module.stages), step)
                if error is not None:
                    raise error
        except BaseException:
            self.zero_grads()
            raise
        params = list(self.module.parameters())
        self.take_step(lambda: clip_gradients(params, self.config.gradient_clipping))
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
        count, source = self.eval_micro_batches(num_micro_batches)
        batches = self._pull(data_iter, count, "eval_batch", source)
        self.module.eval()
        begin_streams(self.module.stages, "eval", self.global_steps)
        losses: list[torch.Tensor] = []
        outputs: Any = None
        with torch.no_grad():
            for inputs, labels in batches:
                loss, outputs = self._loss(inputs, labels)
                losses.append(kept_loss(loss).reshape(()))
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

    def _write_checkpoint(self, staged: Path, client_state: dict[str, Any]) -> None:
        """Parameters, optimizer state, step count and the plan's fingerprint, in one file."""
        torch.save(
            {
                "module": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "lr_scheduler": self.scheduler_state(),
                "precision": self.precision_state(),
                "global_steps": self.global_steps,
                "client_state": client_state,
                "plan": self.module.plan.fingerprint(),
            },
            staged / _CHECKPOINT_FILE,
        )

    def _read_checkpoint(
        self, load_dir: Path, tag: str, load_optimizer_states: bool, from_latest: bool
    ) -> tuple[Path, dict[str, Any]]:
        """Verify and load what :meth:`_write_checkpoint` wrote; refuse another model or plan."""
        directory = checkpoint_files.resolve(load_dir, tag, from_latest=from_latest)
        path = directory / _CHECKPOINT_FILE
        state = read_checkpoint_file(path, tag, "cpu", from_latest=from_latest)
        mismatch = shape_mismatch(state.get("module", {}), self.module.state_dict())
        if mismatch is not None:
            key, saved, current = mismatch
            stage, name = stage_param_name(key)
            raise CheckpointError(
                f"checkpoint {path} was saved from a differently sized model: parameter "
                f"{name!r} of stage {stage} has shape {saved} there but {current} here; build "
                "the model with the sizes it was saved with",
                parameter=name,
            )
        if state.get("plan") != self.module.plan.fingerprint():
            raise CheckpointError(
                f"checkpoint {path} was saved from a different pipeline plan; partition the same "
                "model with the same split points before loading it"
            )
        self.module.load_state_dict(state["module"])
        self.load_precision_state(state.get("precision"), str(path))
        if load_optimizer_states:
            self.optimizer.load_state_dict(state["optimizer"])
        self.load_scheduler_state(state.get("lr_scheduler"))
        self.global_steps = int(state["global_steps"])
        checkpoint_files.load_rng_state(directory)
        return path, dict(state["client_state"])


def _mean(losses: Sequence[torch.Tensor]) -> torch.Tensor:
    """The mean micro-batch loss, summed in order in the loss's dtype as DeepSpeed accumulates
    it, returned as fp32 (as DeepSpeed returns a bf16 loss)."""
    total = losses[0].clone()
    for loss in losses[1:]:
        total += loss
    return (total / len(losses)).float()


def build_engine(
    module: nn.Module, config: Mapping[str, Any] | None, **options: Unpack[SharedEngineArgs]
) -> LocalEngine:
    """Return the :class:`LocalEngine` training ``module`` (``options``: see
    :class:`~pipedialect.engine.SharedEngineArgs`)."""
    if not isinstance(module, LocalPipeline):
        raise ConfigError(
            f"the local runtime engine trains what LocalDialect.pipe_engine built, got "
            f"{type(module).__name__}"
        )
    return LocalEngine(module, parse_config(config), **options)
