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

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipedialect import (
    CheckpointError,
    ConfigError,
    DataError,
    NonFiniteError,
    StageWrapper,
    _ckpt_io,
)
from pipedialect._agreement import (
    check_inputs,
    first_nonfinite_grad,
    first_nonfinite_loss,
    nonfinite_grad_error,
    nonfinite_loss_error,
    pull_micro_batches,
)
from pipedialect.lr_schedules import build_schedule, current_lrs, resolve_client_schedule
from pipedialect.param_groups import ParamGroupsFn, resolve_param_groups
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

    def __init__(
        self,
        module: nn.Module,
        config: TrainingConfig,
        *,
        check_finite: bool = False,
        lr_scheduler: Any = None,
        param_groups: ParamGroupsFn | None = None,
    ) -> None:
        self.module = module
        self.config = config
        #: Refuse a step whose loss or gradients are not finite (see :meth:`check_finite_grads`).
        self.check_finite = bool(check_finite)
        # parameters() yields a parameter shared by several local stages once: it is stepped,
        # and clipped, once.
        if param_groups is None:
            self.optimizer = build_optimizer(config, module.parameters())
        else:
            named = ((_stage_name(n)[1], p) for n, p in module.named_parameters())
            self.optimizer = build_optimizer(config, resolve_param_groups(param_groups, named))
        #: Stepped after each optimizer step, as DeepSpeed's engine steps it: the client's
        #: ``lr_scheduler`` (an object, or a callable building one from the optimizer) wins
        #: over the config's ``scheduler`` section, as in ``deepspeed.initialize``.
        self.lr_scheduler: Any = None
        if lr_scheduler is not None:
            self.lr_scheduler = resolve_client_schedule(lr_scheduler, self.optimizer)
        elif config.scheduler is not None:
            self.lr_scheduler = build_schedule(config.scheduler, self.optimizer)
        self.global_steps = 0
        self.micro_batches = config.gradient_accumulation_steps
        self._data_iterator: Iterator[Any] | None = None

    def get_lr(self) -> list[float]:
        """The learning rate of each parameter group, as DeepSpeed's ``engine.get_lr()``."""
        return current_lrs(self.optimizer)

    def step_lr_scheduler(self) -> None:
        """Step the schedule once, after an optimizer step (DeepSpeed's ``_take_model_step``)."""
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    def scheduler_state(self) -> dict[str, Any] | None:
        """The schedule's state for a checkpoint (None without a schedule)."""
        if self.lr_scheduler is None or not hasattr(self.lr_scheduler, "state_dict"):
            return None
        state: dict[str, Any] = self.lr_scheduler.state_dict()
        return state

    def load_scheduler_state(self, state: Mapping[str, Any] | None) -> None:
        """Resume the schedule where a checkpoint left it, as DeepSpeed's ``load_checkpoint``."""
        if state is not None and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state)

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
        return DeepSpeedStyleEngine.check_pair(next(data_iter), 0)

    @staticmethod
    def check_pair(batch: Any, index: int) -> tuple[Any, Any]:
        """``batch`` as an ``(inputs, labels)`` pair; anything else is refused by name."""
        if not isinstance(batch, tuple | list) or len(batch) != 2:
            raise DataError(
                f"data_iter must yield (inputs, labels) pairs, one per micro-batch; micro-batch "
                f"{index} is {type(batch).__name__}"
                + (f" of length {len(batch)}" if isinstance(batch, tuple | list) else "")
            )
        return batch[0], batch[1]

    def pull_pairs(
        self, data_iter: Iterator[Any], count: int, *, what: str, source: str | None = None
    ) -> list[tuple[Any, Any]]:
        """Read a whole step's ``(inputs, labels)`` micro-batches before any is used.

        Raises:
            DataExhaustedError: ``data_iter`` ran out first (nothing was computed).
            DataError: an item is not an ``(inputs, labels)`` pair.
        """
        items = pull_micro_batches(data_iter, count, what=what, source=source)
        return [self.check_pair(batch, i) for i, batch in enumerate(items)]

    def check_finite_grads(
        self, stages: Iterable[tuple[int, nn.Module]], step: int
    ) -> NonFiniteError | None:
        """The error for the first stage (in order) with a non-finite gradient, or None."""
        for stage_id, stage in stages:
            found = first_nonfinite_grad(getattr(stage, "mod", stage).named_parameters())
            if found is not None:
                return nonfinite_grad_error(*found, step=step, stage=stage_id)
        return None


def shape_mismatch(
    saved: Mapping[str, Any], current: Mapping[str, Any]
) -> tuple[str, tuple[int, ...], tuple[int, ...]] | None:
    """The first entry (in ``current``'s order) whose saved tensor has another shape."""
    for name, value in current.items():
        old = saved.get(name)
        if not isinstance(old, torch.Tensor) or not isinstance(value, torch.Tensor):
            continue
        if old.shape != value.shape:
            return name, tuple(old.shape), tuple(value.shape)
    return None


def read_checkpoint_file(
    path: Path, tag: str, device: torch.device | str, *, from_latest: bool
) -> dict[str, Any]:
    """``torch.load`` one checkpoint file, refusing a missing, empty or unreadable one by name.

    ``from_latest``: the tag was read from the directory's ``latest`` file.
    """
    if not path.parent.is_dir():
        named = f" (named by {path.parent.parent / _LATEST_FILE})" if from_latest else ""
        raise CheckpointError(
            f"no checkpoint tag {tag!r}{named} in {path.parent.parent}: {path.parent} does not "
            "exist; pass the tag of a checkpoint that was saved, or fix the latest file"
        )
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {path.parent} has no {path.name}; it was saved by another engine or "
            "number of ranks, or its save was interrupted"
        )
    try:
        state: dict[str, Any] = torch.load(path, map_location=device, weights_only=True)
    except (EOFError, RuntimeError, OSError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint {path} cannot be read ({type(exc).__name__}: {exc}); the file is empty "
            "or truncated, as an interrupted save leaves it. Load another tag"
        ) from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} holds {type(state).__name__}, not a state dict")
    return state


class LocalEngine(DeepSpeedStyleEngine):
    """Trains a :class:`LocalPipeline` with DeepSpeed ``PipelineEngine`` semantics."""

    module: LocalPipeline

    def __init__(
        self,
        module: LocalPipeline,
        config: TrainingConfig,
        *,
        check_finite: bool = False,
        lr_scheduler: Any = None,
        param_groups: ParamGroupsFn | None = None,
    ) -> None:
        super().__init__(
            module,
            config,
            check_finite=check_finite,
            lr_scheduler=lr_scheduler,
            param_groups=param_groups,
        )

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
        gas = self.config.gradient_accumulation_steps
        batches = self._pull(
            self._resolve_iter(data_iter), gas, "train_batch", "gradient_accumulation_steps"
        )
        self.module.train()
        step = self.global_steps + 1
        losses: list[torch.Tensor] = []
        try:
            for i, (inputs, labels) in enumerate(batches):
                loss, _ = self._loss(inputs, labels)
                if self.check_finite and first_nonfinite_loss([loss]) is not None:
                    raise nonfinite_loss_error(
                        loss, step=step, stage=self.module.num_stages - 1, micro_batch=i
                    )
                torch.autograd.backward(loss / gas)
                losses.append(loss.detach().reshape(()))
            if self.check_finite:
                error = self.check_finite_grads(enumerate(self.module.stages), step)
                if error is not None:
                    raise error
        except BaseException:
            self.optimizer.zero_grad(set_to_none=True)
            raise
        params = list(self.module.parameters())
        if self.config.gradient_clipping > 0.0:
            clip_gradients(params, self.config.gradient_clipping)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_lr_scheduler()
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
        count = self.config.gradient_accumulation_steps
        if num_micro_batches is not None:
            count = num_micro_batches
        if count < 1:
            raise ConfigError(f"num_micro_batches must be at least 1, got {count}")
        source = "num_micro_batches" if num_micro_batches is not None else None
        batches = self._pull(
            data_iter, count, "eval_batch", source or "gradient_accumulation_steps"
        )
        self.module.eval()
        losses: list[torch.Tensor] = []
        outputs: Any = None
        with torch.no_grad():
            for inputs, labels in batches:
                loss, outputs = self._loss(inputs, labels)
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
        """Save parameters, optimizer state, step count and random number generators under
        ``save_dir/tag``, published only once complete (``_ckpt_io`` [Note: crash-safe
        checkpoints])."""
        tag = tag or f"global_step{self.global_steps}"
        path = _ckpt_io.stage(save_dir, tag)
        torch.save(
            {
                "module": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "lr_scheduler": self.scheduler_state(),
                "global_steps": self.global_steps,
                "client_state": dict(client_state or {}),
                "plan": self.module.plan.fingerprint(),
            },
            path / _CHECKPOINT_FILE,
        )
        _ckpt_io.save_rng_state(path)
        _ckpt_io.publish(save_dir, tag, save_latest=save_latest)
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
        from_latest = tag is None
        if tag is None:
            latest = Path(load_dir) / _LATEST_FILE
            if not latest.is_file():
                logger.warning(
                    "no checkpoint tag given and no %s file in %s", _LATEST_FILE, load_dir
                )
                return None, None
            tag = latest.read_text().strip()
        directory = _ckpt_io.resolve(load_dir, tag, from_latest=from_latest)
        path = directory / _CHECKPOINT_FILE
        state = read_checkpoint_file(path, tag, "cpu", from_latest=from_latest)
        mismatch = shape_mismatch(state.get("module", {}), self.module.state_dict())
        if mismatch is not None:
            key, saved, current = mismatch
            stage, name = _stage_name(key)
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
        if load_optimizer_states:
            self.optimizer.load_state_dict(state["optimizer"])
        self.load_scheduler_state(state.get("lr_scheduler"))
        self.global_steps = int(state["global_steps"])
        _ckpt_io.load_rng_state(directory)
        return str(path), dict(state["client_state"])


def _stage_name(key: str) -> tuple[str, str]:
    """``stages.1.mod.blocks.2.weight`` as stage ``"1"`` and parameter ``"blocks.2.weight"``."""
    parts = key.split(".")
    if len(parts) > 2 and parts[0] == "stages" and parts[1].isdigit():
        rest = parts[3:] if parts[2] == "mod" else parts[2:]
        return parts[1], ".".join(rest)
    return "?", key


def _mean(losses: Sequence[torch.Tensor]) -> torch.Tensor:
    """The mean micro-batch loss, summed in order as DeepSpeed accumulates it."""
    total = losses[0].clone()
    for loss in losses[1:]:
        total += loss
    return total / len(losses)


def build_engine(
    module: nn.Module,
    config: Mapping[str, Any] | None,
    *,
    check_finite: bool = False,
    lr_scheduler: Any = None,
    param_groups: ParamGroupsFn | None = None,
) -> LocalEngine:
    """Return the :class:`LocalEngine` training ``module`` (see ``check_finite``,
    ``lr_scheduler`` and ``param_groups`` above)."""
    if not isinstance(module, LocalPipeline):
        raise ConfigError(
            f"the local runtime engine trains what LocalDialect.pipe_engine built, got "
            f"{type(module).__name__}"
        )
    return LocalEngine(
        module,
        parse_config(config),
        check_finite=check_finite,
        lr_scheduler=lr_scheduler,
        param_groups=param_groups,
    )
