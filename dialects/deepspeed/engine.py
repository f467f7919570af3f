"""The DeepSpeed runtime engine: ``deepspeed.initialize`` over the pipeline module.

:func:`init_ds_engine` calls ``deepspeed.initialize`` and returns DeepSpeed's own
``PipelineEngine``, specialised by a few methods. Receive buffers are pooled per position *and
dtype*: upstream pools them per position only and reuses a slot in its old dtype when it is big
enough; a middle stage that sends more gradient-carrying floats than it receives (an
encoder-decoder stage forwarding the encoder output next to its own activation) would then get a
float gradient in a bool or integer slot, which gloo rejects and NCCL corrupts. And
``reset_activation_shape()``, DeepSpeed's way to change the sequence length, also resets the
stage wrappers' frozen wire layouts and shapes (``pipedialect.runtime.wire`` [Note: wire state]).

``train_batch`` and ``eval_batch`` read the step's micro-batches (on the first and last stages)
before DeepSpeed runs its schedule, check that DeepSpeed can load them, and tell every rank
whether one of them failed (``pipedialect.runtime.agreement`` [Note: rank agreement]): a data
iterator that runs out is a :class:`~pipedialect.DataExhaustedError` on every rank, not a
``StopIteration`` on one and a hang on the others, and nothing was computed. A failed step stops
the timers DeepSpeed started (so the next call can start them again) and drops the gradients.
With ``check_finite`` the micro-batch losses and the gradients are checked at the optimizer
step, on every rank alike, before DeepSpeed steps.

[Note: metadata sent once]
A stage wrapper's wire tuple ends with the layout's metadata tensor
(``pipedialect.runtime.wire`` [Note: wire layout]), and DeepSpeed sends every tensor of the tuple
as a message of its own: one more point-to-point message per micro-batch than a hand-written
pipeline sends, which costs a round trip on every boundary (measured at about 5% of a step on a
loaded two-core machine, far more than every check of the stage wrappers together). Once a
boundary's layout is frozen its metadata cannot change until ``reset_activation_shape()``, and
the receiver keeps it, so it crosses once: the sending engine sends the metadata tensor with the
first micro-batch whose layout is final and leaves it out of every later message; the receiving
engine reads the metadata of each message until one is final, keeps that tensor, and from then on
receives one tensor less and hands the kept one to the stage wrapper in its place. Both ends
decide from the same messages, so they always agree on how many tensors travel; neither does it
with dynamic shapes (DeepSpeed's tensor metadata is sent every time then) or when DeepSpeed
converts the last tensor itself (``has_attention_mask``, ``has_bool_tensors``). A frozen layout
sent again with new metadata is refused by name (it could only come from resetting a wrapper
without the engine). ``reset_activation_shape()`` forgets both ends' state with the layouts.

Importing this module imports deepspeed.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import deepspeed
import torch
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.runtime.utils import clip_grad_norm_
from torch import nn

from pipedialect import (
    ConfigError,
    DataError,
    MetadataError,
    PipeDialectError,
    StageWrapper,
    WireError,
)
from pipedialect.sdk import (
    ParamGroupsFn,
    agree_on_error,
    agreed,
    begin_streams,
    check_config_keys,
    check_inputs,
    check_one_optimizer,
    check_trainable,
    checkpoint_files,
    first_nonfinite_grad,
    first_nonfinite_loss,
    input_spec,
    kept_loss,
    nonfinite_grad_error,
    nonfinite_loss_error,
    pull_micro_batches,
    read_layout,
    resolve_param_groups,
    root_nonfinite,
    stage_root,
)

from .pipeline import without_slapo_keys

__all__ = [
    "PASSED_INITIALIZE_ARGS",
    "REFUSED_INITIALIZE_ARGS",
    "PipeDialectEngine",
    "init_ds_engine",
]


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
        engine's buffer pool, the wire metadata sent and received ([Note: metadata sent once]),
        and every local stage wrapper's frozen wire layout and shapes.
        """
        super().reset_activation_shape()
        for key in ("buffers", "metadata_out", "metadata_in"):
            self.__dict__.pop(f"_pipedialect_{key}", None)
        for layer in self.module.forward_funcs:
            if isinstance(layer, StageWrapper):
                layer.reset_wire_state()

    # -- whole steps ---------------------------------------------------------------------------

    def _agreed(self, what: str) -> Any:
        """A phase every rank runs together: an error on one rank is raised on every rank
        (``pipedialect.runtime.agreement`` [Note: one error, every rank])."""
        return agreed(what, where=f"[Stage {self.stage_id}] ")

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> Any:
        """DeepSpeed's ``train_batch``, on micro-batches read (and checked) before it starts;
        an error on any rank is raised on every rank, never a hang."""
        with self._agreed(f"train_batch (step {self.global_steps + 1})"):
            return self._train_batch(data_iter)

    def _train_batch(self, data_iter: Iterator[Any] | None) -> Any:
        if not torch.is_grad_enabled():
            raise ConfigError("train_batch() needs gradients enabled; use eval_batch() instead")
        check_trainable(self._stage_wrappers(), self.global_steps + 1, self.device)
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        source = self.data_iterator
        items = self._pull_step(source, self.micro_batches, "train_batch", None)
        self.__dict__["_pipedialect_losses"] = []
        self._begin_streams("train", self.global_steps + 1)
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
        """DeepSpeed's ``eval_batch``, on micro-batches read (and checked) before it starts;
        an error on any rank is raised on every rank, never a hang."""
        with self._agreed("eval_batch"):
            return self._eval_batch(data_iter, *args, **kwargs)

    def _eval_batch(self, data_iter: Iterator[Any] | None, *args: Any, **kwargs: Any) -> Any:
        count = kwargs.get("num_micro_batches")
        if len(args) >= 5:
            count = args[4]
        source = "num_micro_batches" if count is not None else None
        items = self._pull_step(
            data_iter, self.micro_batches if count is None else count, "eval_batch", source
        )
        self._begin_streams("eval", self.global_steps)
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
                    items = self._by_name(items)
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

    def _by_name(self, items: list[Any]) -> list[Any]:
        """Dict micro-batches as ``(inputs, labels)`` pairs, each input checked against stage 0
        (``pipedialect.plan.batches`` [Note: inputs by name])."""
        wrapper = next((f for f in self.module.forward_funcs if isinstance(f, StageWrapper)), None)
        if wrapper is None:
            return items
        spec = input_spec(wrapper.input_names, wrapper.mod if wrapper.stage_id == 0 else None)
        return [spec.pair(batch, i) for i, batch in enumerate(items)]

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
        # Remember the micro-batch the buffer holds, for a recomputation in its backward
        # ([Note: random streams] in pipedialect.runtime.randomness).
        wrappers = self._stage_wrappers()
        if wrappers:
            held = self.__dict__.setdefault("_pipedialect_micro_batch_of", {})
            held[buffer_id] = wrappers[0].random.next_micro_batch
        PipelineEngine._exec_forward_pass(self, buffer_id)
        if self.check_finite and self.module.training and self.is_last_stage():
            loss = self.loss
            if isinstance(loss, torch.Tensor):
                loss = kept_loss(loss)
            else:  # a new tensor already
                loss = torch.cat([part.detach().reshape(-1) for part in loss])
            self.__dict__.setdefault("_pipedialect_losses", []).append(loss)

    def _exec_optimizer_step(self, lr_kwargs: Any = None) -> None:
        if self.check_finite:
            self._check_finite_step()
        if self._fp32_without_clipping():
            self._global_grad_norm = self._grad_norm()
        PipelineEngine._exec_optimizer_step(self, lr_kwargs)

    # -- the global gradient norm ---------------------------------------------------------------

    def clip_fp32_gradients(self) -> None:
        """DeepSpeed's fp32 clip, keeping the global norm it computes: upstream drops it, and
        ``get_global_grad_norm()`` is None for an fp32 pipeline (only the ZeRO and bf16
        optimizers record one)."""
        self._global_grad_norm = clip_grad_norm_(
            parameters=self.module.parameters(), max_norm=self.gradient_clipping(), mpu=self.mpu
        )

    def _fp32_without_clipping(self) -> bool:
        return self.gradient_clipping() <= 0.0 and not (
            self.fp16_enabled() or self.bfloat16_enabled() or self.zero_optimization()
        )

    def _grad_norm(self) -> torch.Tensor:
        """The global 2-norm of the step's gradients, unclipped, for ``get_global_grad_norm``
        when ``gradient_clipping`` is off: each rank's squared norms (a tied weight counted on
        the first stage holding it only), summed over the pipeline's ranks. The gradients are
        already averaged over the replicas then, so every replica finds the same norm."""
        squares = [
            p.grad.detach().float().norm(2).pow(2)
            for p in self.module.parameters()
            if p.grad is not None and not getattr(p, "ds_pipe_replicated", False)
        ]
        total = torch.stack(squares).sum() if squares else torch.zeros(())
        total = total.to(self.device)
        torch.distributed.all_reduce(total, group=self.grid.get_pipe_parallel_group())
        return total.sqrt()

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

    # -- random streams ([Note: random streams] in pipedialect.runtime.randomness) -------------

    def _stage_wrappers(self) -> list[StageWrapper]:
        return [f for f in self.module.forward_funcs if isinstance(f, StageWrapper)]

    def _begin_streams(self, kind: str, step: int) -> None:
        """Start the batch's random streams; forget which buffer held which micro-batch."""
        begin_streams(self._stage_wrappers(), kind, step)
        self.__dict__["_pipedialect_micro_batch_of"] = {}

    def _exec_backward_pass(self, buffer_id: int) -> None:
        # A stage with nothing to train: its one parameter gets a zero gradient, so that
        # DeepSpeed's bf16 optimizer has a gradient to take the norm of (see _nothing_to_train).
        placeholder = self.module._parameters.get(NOTHING_TO_TRAIN)
        if placeholder is not None and placeholder.grad is None:
            placeholder.grad = torch.zeros_like(placeholder)
        # DeepSpeed's activation checkpointing runs the stage's forward again here: it must
        # draw the micro-batch's numbers once more, and count nothing.
        micro_batch = self.__dict__.get("_pipedialect_micro_batch_of", {}).get(buffer_id)
        wrappers = self._stage_wrappers()
        saved = [w.random.next_micro_batch for w in wrappers]
        if micro_batch is not None:
            for w in wrappers:
                w.random.next_micro_batch = micro_batch
        try:
            PipelineEngine._exec_backward_pass(self, buffer_id)
        finally:
            for w, n in zip(wrappers, saved, strict=True):
                w.random.next_micro_batch = n

    # -- the wire's metadata tensor, sent once ([Note: metadata sent once]) ---------------------

    def _carries_wire(self) -> bool:
        """Whether this stage's activations are stage wrappers' wire tuples whose metadata
        tensor may be left out: static shapes, and no tensor DeepSpeed re-casts."""
        found: bool | None = self.__dict__.get("_pipedialect_wire")
        if found is None:
            found = (
                not self.dynamic_shape
                and not (self.has_attention_mask or self.has_bool_tensors)
                and any(isinstance(f, StageWrapper) for f in self.module.forward_funcs)
            )
            self.__dict__["_pipedialect_wire"] = found
        return found

    def _exec_send_activations(self, buffer_id: int) -> None:
        outputs = self.pipe_buffers["outputs"][buffer_id]
        if not (self._carries_wire() and isinstance(outputs, tuple) and outputs):
            PipelineEngine._exec_send_activations(self, buffer_id)
            return
        metadata = outputs[-1]
        sent: torch.Tensor | None = self.__dict__.get("_pipedialect_metadata_out")
        if sent is None:
            PipelineEngine._exec_send_activations(self, buffer_id)
            if _is_final_layout(metadata):
                self.__dict__["_pipedialect_metadata_out"] = metadata
            return
        if metadata is not sent:
            # The same layout may come as another tensor (evaluation detaches what it sends):
            # compare the bytes once, then follow the new tensor.
            if not (isinstance(metadata, torch.Tensor) and torch.equal(metadata, sent)):
                raise WireError(
                    f"[Stage {self.stage_id}] the layout of the values sent to stage "
                    f"{self.stage_id + 1} changed after the first micro-batch fixed it, and that "
                    "stage no longer receives it; call the engine's reset_activation_shape() on "
                    "every rank before such a change"
                )
            self.__dict__["_pipedialect_metadata_out"] = metadata
        self.pipe_buffers["outputs"][buffer_id] = outputs[:-1]
        try:
            PipelineEngine._exec_send_activations(self, buffer_id)
        finally:
            self.pipe_buffers["outputs"][buffer_id] = outputs

    def _exec_recv_activations(self, buffer_id: int) -> None:
        kept: torch.Tensor | None = self.__dict__.get("_pipedialect_metadata_in")
        buffers: Any = self.pipe_recv_buf  # type: ignore[has-type]
        if kept is None or not isinstance(buffers, tuple):
            PipelineEngine._exec_recv_activations(self, buffer_id)
            received = self.pipe_buffers["inputs"][buffer_id]
            wire = self._carries_wire() and isinstance(received, tuple) and bool(received)
            if wire and _is_final_layout(received[-1]):
                self.__dict__["_pipedialect_metadata_in"] = received[-1]
            return
        self.pipe_recv_buf = buffers[:-1]
        try:
            PipelineEngine._exec_recv_activations(self, buffer_id)
        finally:
            self.pipe_recv_buf = buffers
        self.pipe_buffers["inputs"][buffer_id] = (*self.pipe_buffers["inputs"][buffer_id], kept)

    _INSTRUCTION_MAP: ClassVar[dict[type, Any]] = {
        **PipelineEngine._INSTRUCTION_MAP,
        schedule.ForwardPass: _exec_forward_pass,
        schedule.BackwardPass: _exec_backward_pass,
        schedule.OptimizerStep: _exec_optimizer_step,
        schedule.SendActivation: _exec_send_activations,
        schedule.RecvActivation: _exec_recv_activations,
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
        [Note: crash-safe checkpoints]); ``latest`` only ever names a complete checkpoint. An
        error on any rank is raised on every rank."""
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"
        with self._agreed(f"save_checkpoint {tag!r}"):
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
        or a load of wrong weights. The random number generators are restored too. An error on
        any rank is raised on every rank."""
        with self._agreed("load_checkpoint"):
            return self._load_verified(load_dir, tag, **kwargs)

    def _load_verified(self, load_dir: str, tag: str | None, **kwargs: Any) -> Any:
        if self.load_universal_checkpoint():
            return super().load_checkpoint(load_dir, tag, **kwargs)
        found = checkpoint_files.latest_tag(load_dir, tag)
        if found is None:
            return super().load_checkpoint(load_dir, tag, **kwargs)
        path = checkpoint_files.resolve(load_dir, found[0], from_latest=found[1])
        result = super().load_checkpoint(load_dir, path.name, **kwargs)
        checkpoint_files.load_rng_state(path)
        return result


def _is_final_layout(metadata: Any) -> bool:
    """Whether ``metadata`` is a wire metadata tensor of a layout its sender froze."""
    if not isinstance(metadata, torch.Tensor) or metadata.dtype != torch.uint8:
        return False
    try:
        return read_layout(metadata).final
    except MetadataError:
        return False


#: ``deepspeed.initialize`` arguments a pipeline cannot take, each with the reason.
REFUSED_INITIALIZE_ARGS: dict[str, str] = {
    "mpu": (
        "a PipelineModule brings its own process grid (built from the topology given to "
        "pipe_engine), and deepspeed.initialize requires mpu=None for a pipeline"
    ),
    "distributed_port": (
        "the process group is already initialised when the pipeline module is built (the "
        "module creates process groups), so the port would never be used; set MASTER_PORT for "
        "the launcher instead"
    ),
    "mesh_param": (
        "DeepSpeed's data/sequence-parallel device mesh is not used by its PipelineEngine; the "
        "topology given to pipe_engine is the process grid"
    ),
    "model": "the module is the first argument (what pipe_engine returned)",
}
#: ``deepspeed.initialize`` arguments passed through unchanged.
PASSED_INITIALIZE_ARGS = (
    "optimizer",
    "lr_scheduler",
    "training_data",
    "collate_fn",
    "dist_init_required",
)


def init_ds_engine(
    model: nn.Module,
    *,
    config: Mapping[str, Any] | str | None = None,
    check_finite: bool = False,
    param_groups: ParamGroupsFn | None = None,
    model_parameters: Any = None,
    args: Any = None,
    config_params: Mapping[str, Any] | str | None = None,
    **kwargs: Any,
) -> PipeDialectEngine:
    """Return the DeepSpeed ``PipelineEngine`` that trains ``model``.

    ``model`` is what :func:`~pipedialect.dialects.deepspeed.pipeline.deepspeed_pipe_engine`
    returned (any ``PipelineModule`` works). ``config`` is the DeepSpeed config (a dict or a JSON
    path); ``config_params`` (its old name) or ``args.deepspeed_config`` may give it instead, as
    in ``deepspeed.initialize``. A key DeepSpeed does not know is refused
    (:class:`~pipedialect.errors.UnknownConfigKeyError`), except Slapo's
    (:data:`~pipedialect.dialects.deepspeed.pipeline.SLAPO_CONFIG_KEYS`), left out as DeepSpeed
    would ignore them. The optimizer steps ``model_parameters`` (tensors, or dicts of
    parameter groups as torch optimizers take them) or the groups ``param_groups`` builds from
    this rank's parameters under the model's names (:mod:`pipedialect.engine.param_groups`; a tied
    weight once, under its name on this stage), by default every trainable parameter: either
    way each trainable parameter of this stage must be in exactly one group. ``optimizer``,
    ``lr_scheduler``, ``training_data``, ``collate_fn`` and ``dist_init_required`` go to
    ``deepspeed.initialize`` unchanged; ``mpu``, ``distributed_port`` and ``mesh_param`` are
    refused (:data:`REFUSED_INITIALIZE_ARGS` says why).

    Every check here runs before ``deepspeed.initialize``, whose collectives would hang the
    other ranks after a failure on one: the argument checks fail alike on every rank, and the
    checks of the groups and of a client optimizer object, which may fail on one stage only,
    end with every rank raising (they gather every rank's result, as does the comparison of a
    tied weight's groups across its stages).

    Raises:
        UnknownConfigKeyError: a config key DeepSpeed does not know, other than Slapo's.
        ConfigError: an argument refused or unknown, two sources of the config, ``optimizer``
            with a config ``optimizer`` section (``pipedialect.engine`` [Note: client
            optimizer]), ZeRO stage 2 or 3, batch sizes DeepSpeed would assert on, groups that
            leave out, repeat or add a parameter, or a tied weight whose copies are in groups
            with different options.
    """
    from ._build import check_zero_stage

    refused = sorted(set(kwargs) & set(REFUSED_INITIALIZE_ARGS))
    if refused:
        raise ConfigError(
            "the DeepSpeed runtime engine refuses "
            + "; ".join(f"{name}: {REFUSED_INITIALIZE_ARGS[name]}" for name in refused)
        )
    unknown = sorted(set(kwargs) - set(PASSED_INITIALIZE_ARGS))
    if unknown:
        accepted = (
            "config, config_params, args, check_finite, param_groups, model_parameters, "
            + ", ".join(PASSED_INITIALIZE_ARGS)
        )
        raise ConfigError(
            f"unknown argument(s) {unknown} for the DeepSpeed runtime engine; accepted: {accepted}"
        )
    source, checked = _resolve_config(config, config_params, args)
    checked = without_slapo_keys(checked)  # Slapo's engine set-up takes its configs as they are
    check_config_keys(checked)
    if source is not None:
        source = checked
    check_zero_stage(checked)
    _check_args(args)
    optimizer = kwargs.get("optimizer")
    if param_groups is not None and model_parameters is not None:
        raise ConfigError(
            "pass param_groups or model_parameters, not both: each says which parameters the "
            "optimizer steps"
        )
    if isinstance(optimizer, torch.optim.Optimizer) and (
        param_groups is not None or model_parameters is not None
    ):
        given = "param_groups" if param_groups is not None else "model_parameters"
        raise ConfigError(
            f"{given} cannot be used with an optimizer object: it already holds its parameter "
            "groups (DeepSpeed would ignore the groups). Pass a callable optimizer(params) "
            f"that builds it from the groups, or drop {given}"
        )
    if not isinstance(model, PipelineModule):
        raise ConfigError(
            f"init_ds_engine needs the PipelineModule built by pipe_engine, got "
            f"{type(model).__name__}"
        )
    if optimizer is not None:
        check_one_optimizer(checked.get("optimizer"))
    _check_batch_sizes(checked, model)
    named = _named_local_parameters(model)
    groups = _optimizer_groups(model, named, param_groups, model_parameters, optimizer)
    if not groups:
        groups = [_nothing_to_train(model, checked)]
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=groups,
        config=source,
        args=args,
        **kwargs,
    )
    if not isinstance(engine, PipelineEngine):
        raise ConfigError(f"deepspeed.initialize returned {type(engine).__name__}, not a pipeline")
    _check_checkpointing(model)
    engine.__class__ = PipeDialectEngine
    engine.check_finite = bool(check_finite)
    return engine  # type: ignore[no-any-return]


def _resolve_config(
    config: Mapping[str, Any] | str | None, config_params: Any, args: Any
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """The config to pass to ``deepspeed.initialize`` (None: DeepSpeed reads it from ``args``)
    and the config as a dict, for the checks made here.

    ``deepspeed.initialize`` takes the config from ``config``, else ``config_params``, else
    ``args.deepspeed_config`` (``args.deepscale_config`` is its old name); two of them at once
    DeepSpeed either asserts on or silently ignores one, so two are refused.
    """
    from_args = [
        name
        for name in ("deepspeed_config", "deepscale_config")
        if getattr(args, name, None) is not None
    ]
    given = [
        name
        for name, value in (("config", config), ("config_params", config_params))
        if value is not None
    ] + [f"args.{name}" for name in from_args]
    if not given:
        raise ConfigError(
            "init_ds_engine needs config=<DeepSpeed config dict or JSON path> (or "
            "config_params, or args.deepspeed_config)"
        )
    if len(given) > 1:
        raise ConfigError(
            f"the DeepSpeed config is given twice ({' and '.join(given)}); pass one of them"
        )
    value = config if config is not None else config_params
    if value is None:
        value = getattr(args, from_args[0])
    if isinstance(value, str | os.PathLike):
        try:
            loaded = json.loads(Path(value).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"init_ds_engine: cannot read the DeepSpeed config file {value}: {exc}"
            ) from exc
        value = loaded
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"the DeepSpeed config ({given[0]}) must be a dict or a JSON path, got "
            f"{type(value).__name__}"
        )
    checked = dict(value)
    return (None if from_args else checked), checked


def _check_args(args: Any) -> None:
    """Refuse an ``args.local_rank`` DeepSpeed would assert on (it must equal LOCAL_RANK)."""
    local_rank = getattr(args, "local_rank", None)
    if local_rank is None:
        return
    if isinstance(local_rank, bool) or not isinstance(local_rank, int):
        raise ConfigError(f"args.local_rank must be an int, got {local_rank!r}")
    env = os.environ.get("LOCAL_RANK")
    if local_rank >= 0 and env is not None and int(env) != local_rank:
        raise ConfigError(
            f"args.local_rank={local_rank} but the launcher set LOCAL_RANK={env}; DeepSpeed "
            "requires them to agree (pass the launcher's --local_rank, or -1)"
        )


def _named_local_parameters(model: PipelineModule) -> list[tuple[str, nn.Parameter]]:
    """This rank's trainable parameters, each once, under the model's names.

    A stage wrapper holds its stage module (whose names are the model's, as the plan keeps
    them); another layer's parameters keep DeepSpeed's names (``<layer index>.<name>``). A tied
    weight is named where it first appears in the stage.
    """
    named: list[tuple[str, nn.Parameter]] = []
    seen: set[int] = set()
    for index, layer in enumerate(model.forward_funcs):
        if not isinstance(layer, nn.Module):
            continue
        if isinstance(layer, StageWrapper):
            items = stage_root(layer).named_parameters()
        else:
            items = ((f"{index}.{n}", p) for n, p in layer.named_parameters())
        for name, param in items:
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                named.append((name, param))
    for name, param in model.named_parameters():  # anything outside the layers
        if param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            named.append((name, param))
    return named


def _check_client_optimizer(
    optimizer: torch.optim.Optimizer, named: list[tuple[str, nn.Parameter]], model: PipelineModule
) -> None:
    """Refuse a client optimizer that leaves out a trainable parameter of this stage."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = [name for name, param in named if id(param) not in held]
    if missing:
        raise ConfigError(
            f"[Stage {model.stage_id}] the client optimizer does not hold parameter "
            f"{missing[0]!r} (and {len(missing) - 1} more) of this stage, which would not be "
            "trained; build it over the stage's parameters (engine-side: pass a callable "
            "optimizer(params))"
        )


def _optimizer_groups(
    model: PipelineModule,
    named: list[tuple[str, nn.Parameter]],
    param_groups: ParamGroupsFn | None,
    model_parameters: Any,
    optimizer: Any,
) -> list[Any]:
    """``model_parameters`` for ``deepspeed.initialize``: the trainable parameters, or the
    checked groups of ``param_groups`` / ``model_parameters``.

    The groups (or a client optimizer object) are checked on every rank, and every rank raises
    if one of them failed: a rank that stopped here alone would leave the others waiting in
    ``deepspeed.initialize``. With groups, each tied weight's copies (one per stage holding it)
    must be in groups with the same options: they get the same gradient, and different options
    (a weight decay on one stage only) would make the copies drift apart silently.
    """
    client = isinstance(optimizer, torch.optim.Optimizer)
    if param_groups is None and model_parameters is None and not client:
        return [p for _, p in named]
    error: PipeDialectError | None = None
    groups: list[dict[str, Any]] = []
    try:
        if client:
            _check_client_optimizer(optimizer, named, model)
        elif param_groups is not None:
            groups = resolve_param_groups(param_groups, named)
        else:
            given = _as_groups(model_parameters)
            groups = resolve_param_groups(lambda _: given, named, what="model_parameters")
    except PipeDialectError as exc:
        if not str(exc.args[0]).startswith("[Stage "):
            exc.args = (f"[Stage {model.stage_id}] {exc.args[0]}",)
        error = exc
    agree_on_error(error, device=_device_of(named), what="checking the optimizer's parameters")
    if client:
        return [p for _, p in named]  # DeepSpeed steps the client optimizer's own groups
    _check_tied_groups(model, named, groups)
    return groups


#: The name of the parameter a stage with nothing to train gets (see :func:`_nothing_to_train`).
NOTHING_TO_TRAIN = "pipedialect_nothing_to_train"


def _nothing_to_train(model: PipelineModule, config: Mapping[str, Any]) -> nn.Parameter:
    """The one parameter the optimizer of a stage with nothing to train steps (``pipedialect.
    engine`` [Note: nothing to train]). DeepSpeed's bf16 and fp16 optimizers leave out an empty
    parameter and then fail on a group with none, and they look each parameter up in the
    module: so it has one element, the training dtype, the stage's device, and is registered on
    the pipeline module (outside its layers, so no checkpoint file holds it). Its gradient is
    zero (:meth:`PipeDialectEngine._exec_backward_pass`), which leaves Adam's step zero."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    else:
        device = torch.device("cpu")
    dtype = torch.float32
    for key, low in (("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp16", torch.half)):
        section = config.get(key)
        if isinstance(section, Mapping) and section.get("enabled", False):
            dtype = low
    param = nn.Parameter(torch.zeros(1, device=device, dtype=dtype))
    # What PipelineModule sets on every parameter it holds.
    param.ds_pipe_replicated = False  # type: ignore[attr-defined]
    model.register_parameter(NOTHING_TO_TRAIN, param)
    return param


def _as_groups(model_parameters: Any) -> list[dict[str, Any]]:
    """``model_parameters`` (tensors, or dicts with ``params``) as a list of groups."""
    if isinstance(model_parameters, torch.Tensor | Mapping):
        model_parameters = [model_parameters]
    items = list(model_parameters)
    if all(isinstance(item, Mapping) for item in items):
        return [dict(item) for item in items]
    if all(isinstance(item, torch.Tensor) for item in items):
        return [{"params": items}]
    raise ConfigError(
        "model_parameters must be parameters or dicts of parameter groups (with 'params'), not "
        "a mix of them"
    )


def _check_tied_groups(
    model: PipelineModule,
    named: list[tuple[str, nn.Parameter]],
    groups: list[dict[str, Any]],
) -> None:
    """Refuse, on every rank, a tied weight whose stages put it in groups of different options."""
    import torch.distributed as dist

    names = {id(p): n for n, p in named}
    mine: dict[str, tuple[int, str, str]] = {}
    for key, comm in sorted(getattr(model, "tied_comms", {}).items()):
        for attr in comm["weight_attr"]:
            weight = getattr(comm["module"], attr)
            for group in groups:
                if any(p is weight for p in group["params"]):
                    options = repr(sorted((k, v) for k, v in group.items() if k != "params"))
                    name = names.get(id(weight), attr)
                    mine[f"{key}.{attr}"] = (int(model.stage_id), name, options)
    if not (dist.is_available() and dist.is_initialized()):
        return
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    seen: dict[str, tuple[int, str, str]] = {}
    for found in every:
        for key, (stage, name, options) in sorted(found.items()):
            first = seen.setdefault(key, (stage, name, options))
            if first[2] != options:
                raise ConfigError(
                    f"a tied weight is {first[1]!r} on stage {first[0]}, in a group with options "
                    f"{first[2]}, and {name!r} on stage {stage}, in a group with options "
                    f"{options}; its copies get the same gradient and must be stepped alike, so "
                    "put both names in groups with the same options"
                )


def _device_of(named: list[tuple[str, nn.Parameter]]) -> torch.device:
    """The device of this rank's parameters (the CPU without any)."""
    return named[0][1].device if named else torch.device("cpu")


def _check_batch_sizes(config: Mapping[str, Any], model: PipelineModule) -> None:
    """Refuse batch-size entries DeepSpeed would assert on, before it does.

    DeepSpeed derives a missing entry with integer division, then requires
    ``train_batch_size == train_micro_batch_size_per_gpu * gradient_accumulation_steps *
    data-parallel size`` with every entry positive.
    """
    from pipedialect.sdk import batch_triple

    batch_triple(config, int(model._topo.get_dim("data")) or 1)


def _check_checkpointing(model: PipelineModule) -> None:
    """Refuse DeepSpeed's own checkpointing of stage wrappers outside our PipelineModule.

    Its reentrant function gives no gradient to a stage fed integer token ids; ours checkpoints
    each whole stage exactly (``_module`` [Note: stage recomputation]).
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
