"""The DeepSpeed runtime engine: ``deepspeed.initialize`` over the pipeline module.

:func:`init_ds_engine` calls ``deepspeed.initialize`` and returns DeepSpeed's own
``PipelineEngine``, specialised by two methods. Receive buffers are pooled per position *and
dtype*: upstream pools them per position only and reuses a slot in its old dtype when it is big
enough; a middle stage that sends more gradient-carrying floats than it receives (an
encoder-decoder stage forwarding the encoder output next to its own activation) would then get a
float gradient in a bool or integer slot, which gloo rejects and NCCL corrupts. And
``reset_activation_shape()``, DeepSpeed's way to change the sequence length, also resets the
stage wrappers' frozen wire layouts and shapes (``pipedialect.wire`` [Note: wire state]).

``train_batch`` and ``eval_batch`` read the step's micro-batches (on the first and last stages)
before DeepSpeed runs its schedule, check that DeepSpeed can load them, and tell every rank
whether one of them failed (``pipedialect.agreement`` [Note: rank agreement]): a data iterator
that runs out is a :class:`~pipedialect.DataExhaustedError` on every rank, not a
``StopIteration`` on one and a hang on the others, and nothing was computed. A failed step stops
the timers DeepSpeed started (so the next call can start them again) and drops the gradients.
With ``check_finite`` the micro-batch losses and the gradients are checked at the optimizer
step, on every rank alike, before DeepSpeed steps.

Importing this module imports deepspeed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import deepspeed
import torch
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.module import PipelineModule
from torch import nn

from pipedialect import (
    ConfigError,
    DataError,
    PipeDialectError,
    StageWrapper,
    checkpoint_files,
)
from pipedialect.agreement import (
    agree_on_error,
    check_inputs,
    first_nonfinite_grad,
    first_nonfinite_loss,
    nonfinite_grad_error,
    nonfinite_loss_error,
    pull_micro_batches,
    root_nonfinite,
)

__all__ = ["PipeDialectEngine", "init_ds_engine"]


class PipeDialectEngine(PipelineEngine):  # type: ignore[misc]
    """DeepSpeed's ``PipelineEngine`` with a receive-buffer pool keyed by position and dtype,
    whole steps or none, and an optional finite check (see the module's docstring)."""

    #: Refuse a step whose loss or gradients are not finite (``runtime_engine(check_finite=)``).
    check_finite = False
    #: DeepSpeed's iterator of the first and last stages' data (None elsewhere).
    data_iterator: Iterator[Any] | None

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

    # -- whole steps ---------------------------------------------------------------------------

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> Any:
        """DeepSpeed's ``train_batch``, on micro-batches read (and checked) before it starts."""
        if not torch.is_grad_enabled():
            raise ConfigError("train_batch() needs gradients enabled; use eval_batch() instead")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        source = self.data_iterator
        items = self._pull_step(source, self.micro_batches, "train_batch", None)
        self.__dict__["_pipedialect_losses"] = []
        try:
            if items is not None:
                self.data_iterator = iter(items)
            return super().train_batch()
        except BaseException:
            self._clean_up_failed_step()
            raise
        finally:
            if items is not None:
                self.data_iterator = source

    def eval_batch(self, data_iter: Iterator[Any] | None, *args: Any, **kwargs: Any) -> Any:
        """DeepSpeed's ``eval_batch``, on micro-batches read (and checked) before it starts."""
        count = kwargs.get("num_micro_batches")
        if len(args) >= 5:
            count = args[4]
        source = "num_micro_batches" if count is not None else None
        items = self._pull_step(
            data_iter, self.micro_batches if count is None else count, "eval_batch", source
        )
        try:
            return super().eval_batch(data_iter if items is None else iter(items), *args, **kwargs)
        except BaseException:
            self._clean_up_failed_step(drop_grads=False)
            raise

    def _pull_step(
        self, source: Iterator[Any] | None, count: int, what: str, origin: str | None
    ) -> list[Any] | None:
        """Read a step's micro-batches where DeepSpeed reads data (None elsewhere); every rank
        raises if any of them could not."""
        error: PipeDialectError | None = None
        items: list[Any] | None = None
        if self.is_first_stage() or self.is_last_stage():
            try:
                if source is None:
                    raise ConfigError(
                        f"[Stage {self.stage_id}] {what}() has no data iterator: the first and "
                        f"last stages read the data, so pass {what}(data_iter) there (or "
                        "training_data to deepspeed.initialize)"
                    )
                items = pull_micro_batches(source, count, what=what, source=origin)
                if self.batch_fn is None:
                    for i, batch in enumerate(items):
                        self._check_batch(batch, i)
            except PipeDialectError as exc:
                error = exc
            except Exception as exc:
                error = DataError(
                    f"[Stage {self.stage_id}] the data iterator raised {type(exc).__name__}: {exc}"
                )
                error.__cause__ = exc
        agree_on_error(error, device=self.device, what=what)
        return items

    def _check_batch(self, batch: Any, index: int) -> None:
        """Refuse by name what DeepSpeed's loader would only assert on."""
        where = f"[Stage {self.stage_id}] micro-batch {index}"
        if not isinstance(batch, tuple | list) or len(batch) != 2:
            raise DataError(
                f"{where}: the data iterator must yield (inputs, labels) pairs, got "
                f"{type(batch).__name__}"
            )
        checks = []
        if self.is_first_stage():
            checks.append(("inputs", batch[0], True))
            wrapper = next(
                (f for f in self.module.forward_funcs if isinstance(f, StageWrapper)), None
            )
            if wrapper is not None:
                check_inputs(batch[0], wrapper.input_names, index)
        if self.is_last_stage():
            checks.append(("labels", batch[1], False))
        for name, value, required in checks:
            if isinstance(value, torch.Tensor) or not (required or isinstance(value, tuple | list)):
                continue
            if isinstance(value, tuple | list):
                odd = [i for i, v in enumerate(value) if not isinstance(v, torch.Tensor)]
                if not odd:
                    continue
                item = type(value[odd[0]]).__name__
                found = f"a {type(value).__name__} whose item {odd[0]} is {item}"
            else:
                found = type(value).__name__
            raise DataError(
                f"{where}: its {name} are {found}, but DeepSpeed's pipeline engine loads {name} "
                "as one tensor or a tuple of tensors; convert them (a dict becomes a tuple in "
                "the order of the model's inputs)"
            )

    def _clean_up_failed_step(self, *, drop_grads: bool = True) -> None:
        """Stop the timers the failed step started and (training) drop its gradients."""
        for timer in getattr(self.timers, "timers", {}).values():
            if getattr(timer, "started_", False):
                timer.stop()
        if drop_grads:
            for p in self.module.parameters():
                p.grad = None

    # -- check_finite ---------------------------------------------------------------------------

    def _exec_forward_pass(self, buffer_id: int) -> None:
        PipelineEngine._exec_forward_pass(self, buffer_id)
        if self.check_finite and self.module.training and self.is_last_stage():
            loss = self.loss
            if not isinstance(loss, torch.Tensor):
                loss = torch.cat([part.detach().reshape(-1) for part in loss])
            self.__dict__.setdefault("_pipedialect_losses", []).append(loss.detach())

    def _exec_optimizer_step(self, lr_kwargs: Any = None) -> None:
        if self.check_finite:
            self._check_finite_step()
        PipelineEngine._exec_optimizer_step(self, lr_kwargs)

    def _check_finite_step(self) -> None:
        step = self.global_steps + 1
        error: PipeDialectError | None = None
        losses: list[torch.Tensor] = self.__dict__.get("_pipedialect_losses", [])
        bad = first_nonfinite_loss(losses)
        if bad is not None:
            error = nonfinite_loss_error(
                losses[bad], step=step, stage=self.stage_id, micro_batch=bad
            )
        elif not self.fp16_enabled():  # fp16 overflows are the loss scaler's to skip
            for layer in self.module.forward_funcs:
                if not isinstance(layer, nn.Module):
                    continue
                found = first_nonfinite_grad(getattr(layer, "mod", layer).named_parameters())
                if found is not None:
                    error = nonfinite_grad_error(*found, step=step, stage=self.stage_id)
                    break
        agree_on_error(error, device=self.device, what=f"step {step}", choose=root_nonfinite)

    _INSTRUCTION_MAP: ClassVar[dict[type, Any]] = {
        **PipelineEngine._INSTRUCTION_MAP,
        schedule.ForwardPass: _exec_forward_pass,
        schedule.OptimizerStep: _exec_optimizer_step,
    }

    # -- checkpoints ----------------------------------------------------------------------------

    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: Mapping[str, Any] | None = None,
        save_latest: bool = True,
        **kwargs: Any,
    ) -> bool:
        """DeepSpeed's ``save_checkpoint`` into a staging directory, published as ``tag`` once
        every rank wrote its files, with each rank's random number generators (``checkpoint_files``
        [Note: crash-safe checkpoints]); ``latest`` only ever names a complete checkpoint."""
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"
        staged = checkpoint_files.stage(save_dir, tag)
        super().save_checkpoint(
            save_dir, staged.name, dict(client_state or {}), save_latest=False, **kwargs
        )
        checkpoint_files.save_rng_state(staged)
        checkpoint_files.publish(save_dir, tag, save_latest=save_latest)
        return True

    def load_checkpoint(self, load_dir: str, tag: str | None = None, **kwargs: Any) -> Any:
        """DeepSpeed's ``load_checkpoint`` of a verified checkpoint; a tag (given, or read from
        ``latest``) that names no checkpoint, or one that is incomplete, truncated or corrupted,
        is a :class:`~pipedialect.CheckpointError` naming the file, rather than ``(None, None)``
        or a load of wrong weights. The random number generators are restored too."""
        if self.load_universal_checkpoint():
            return super().load_checkpoint(load_dir, tag, **kwargs)
        found = checkpoint_files.latest_tag(load_dir, tag)
        if found is None:
            return super().load_checkpoint(load_dir, tag, **kwargs)
        path = checkpoint_files.resolve(load_dir, found[0], from_latest=found[1])
        result = super().load_checkpoint(load_dir, path.name, **kwargs)
        checkpoint_files.load_rng_state(path)
        return result


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
    check_finite = bool(kwargs.pop("check_finite", False))
    allowed = {"optimizer", "lr_scheduler", "training_data"}
    unknown = set(kwargs) - allowed
    if unknown:
        raise ConfigError(
            f"unknown argument(s) {sorted(unknown)} for the DeepSpeed runtime engine; "
            f"accepted: config, check_finite, {', '.join(sorted(allowed))}"
        )
    if isinstance(config, Mapping):
        _check_batch_sizes(config, model)
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
    engine.check_finite = check_finite
    return engine  # type: ignore[no-any-return]


def _check_batch_sizes(config: Mapping[str, Any], model: PipelineModule) -> None:
    """Refuse batch-size entries DeepSpeed would assert on, before it does.

    DeepSpeed derives a missing entry with integer division, then requires
    ``train_batch_size == train_micro_batch_size_per_gpu * gradient_accumulation_steps *
    data-parallel size`` with every entry positive.
    """
    from pipedialect.config import batch_triple

    batch_triple(config, int(model._topo.get_dim("data")) or 1)


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
