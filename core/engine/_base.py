"""What every DeepSpeed-style engine shares, for dialect authors: config, optimizer and data.

DeepSpeed's ``PipelineEngine`` is the model every engine follows: ``train_batch`` pulls
``gradient_accumulation_steps`` ``(inputs, labels)`` micro-batches, steps the optimizer once and
returns the mean micro-batch loss. :class:`EngineBase` holds what that needs besides
the schedule itself -- the parsed config, the optimizer (with parameter groups), the learning
rate schedule, the step counter and whole-step data reads -- so a dialect's engine adds only
how its stages run. The local and torch dialects' engines build on it.

[Note: client optimizer]
The optimizer is the config's ``optimizer`` section or ``runtime_engine(optimizer=...)``, as
``deepspeed.initialize`` takes a client optimizer, never both (DeepSpeed would ignore the
section without a word). The natural shape is a factory, ``optimizer(groups)``, called once with
the groups the engine steps: ``param_groups`` resolved over this rank's trainable parameters
(each once, a tied weight under its canonical name), or one group of all of them; under bf16
the groups of the fp32 master copies, so the factory never sees a bf16 parameter. An optimizer
*object* is taken in fp32 only, and only when it holds exactly this engine's trainable
parameters: one built over the unsplit model (or another stage) would step parameters this
engine never gives a gradient, and is refused by name. A client ``lr_scheduler`` is built over
(or must be bound to) that optimizer, and is stepped after every applied optimizer step.

:meth:`EngineBase.get_global_grad_norm` is the global gradient norm of the last step,
computed whether or not ``gradient_clipping`` clips (Hugging Face's ``Trainer`` logs it).

With ``"bf16": {"enabled": true}`` it also holds the bf16 policy
(:mod:`pipedialect.engine.precision` [Note: bf16 as DeepSpeed does it]): the stages' parameters
are cast to bf16 when the engine is built, the optimizer steps fp32 master copies, an engine
calls :meth:`accumulate_grads` after each micro-batch's backward and :meth:`take_step` once per
step, and reads gradients through :meth:`grad_of` (the high-precision buffer under bf16,
``param.grad`` in fp32).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from torch import nn

from ..contracts import AttributeCounters, EngineState, HeldStage
from ..errors import CheckpointError, ConfigError, DataError, NonFiniteError, PipeDialectError
from ..plan.batches import input_spec
from ..plan.ties import tie_keys
from ..runtime.agreement import agree_on_error
from ..runtime.micro_batches import pull_micro_batches
from ..runtime.nonfinite import first_nonfinite_grad, nonfinite_grad_error
from ..runtime.sharded import local_part
from ..runtime.stage import stage_root
from . import checkpoint_files
from .checkpoint_files import LATEST_FILE
from .config import TrainingConfig, build_optimizer, check_one_optimizer
from .lr_schedules import build_schedule, current_lrs, resolve_client_schedule
from .param_groups import ParamGroupsFn, resolve_param_groups
from .precision import BF16Master, cast_parameters

if TYPE_CHECKING:
    from ..plan.partition import PipelinePlan

__all__ = [
    "EngineBase",
    "SharedEngineArgs",
    "nothing_to_train",
    "read_checkpoint_file",
    "shape_mismatch",
    "stage_param_name",
]


class SharedEngineArgs(TypedDict, total=False):
    """The shared ``runtime_engine`` arguments :class:`EngineBase` takes, as keywords: written
    once here, so an engine or ``build_engine`` that forwards them names them all at once."""

    #: Refuse a step whose loss or gradients are not finite.
    check_finite: bool
    #: A client scheduler, or a callable building one from the optimizer.
    lr_scheduler: Any
    #: Groups the optimizer's parameters (see :mod:`pipedialect.engine.param_groups`).
    param_groups: ParamGroupsFn | None
    #: A client optimizer, or a factory building one from the parameter groups.
    optimizer: Any


class EngineBase:
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
        optimizer: Any = None,
    ) -> None:
        self.module = module
        self.config = config
        #: Refuse a step whose loss or gradients are not finite (see :meth:`check_finite_grads`).
        self.check_finite = bool(check_finite)
        #: The fp32 master weights and gradient buffers under bf16; None in fp32.
        self.mixed: BF16Master | None = None
        if config.precision.bf16:
            cast_parameters(module, config.precision.param_dtype)
            trainable = [p for p in module.parameters() if p.requires_grad]
            self.mixed = BF16Master(trainable, config.precision.grad_accum_dtype)
        # parameters() yields a parameter shared by several local stages once: it is stepped,
        # and clipped, once.
        groups: list[Any] = (
            list(module.parameters())
            if param_groups is None
            else resolve_param_groups(param_groups, self.named_trainable())
        )
        if self.mixed is not None:
            groups = self.mixed.groups(groups)
        if optimizer is not None:
            self.optimizer = self._client_optimizer(optimizer, groups, param_groups is not None)
        elif _any_trainable(groups):
            self.optimizer = build_optimizer(config, groups)
        else:
            # [Note: nothing to train] A stage whose parameters are all frozen (or that has
            # none) still runs forward and backward. Its optimizer is the config's, built over
            # one empty parameter (torch's optimizers refuse an empty list) that is then taken
            # out again: its group keeps the hyper-parameters the schedule sets, and stepping,
            # saving and loading it do nothing.
            self.optimizer = build_optimizer(config, [nothing_to_train(_device_of(module))])
            for group in self.optimizer.param_groups:
                group["params"] = []
        #: The global gradient norm of the last step (a tensor; see get_global_grad_norm).
        self._grad_norm: torch.Tensor | None = None
        #: Stepped after each optimizer step, as DeepSpeed's engine steps it: the client's
        #: ``lr_scheduler`` (an object, or a callable building one from the optimizer) wins
        #: over the config's ``scheduler`` section, as in ``deepspeed.initialize``.
        self.lr_scheduler: Any = None
        if lr_scheduler is not None:
            self.lr_scheduler = resolve_client_schedule(lr_scheduler, self.optimizer)
        elif config.scheduler is not None:
            self.lr_scheduler = build_schedule(config.scheduler, self.optimizer)
        self.global_steps = 0
        self._skipped_steps = 0  # fp32 never skips a step; a checkpoint may still set it
        self.micro_batches = config.gradient_accumulation_steps
        self._data_iterator: Iterator[Any] | None = None

    def named_trainable(self) -> list[tuple[str, nn.Parameter]]:
        """This engine's parameters under their original names, for ``param_groups``: a
        parameter held by several stages appears once, under its first name."""
        return [(stage_param_name(n)[1], p) for n, p in self.module.named_parameters()]

    def _client_optimizer(
        self, optimizer: Any, groups: list[Any], grouped: bool
    ) -> torch.optim.Optimizer:
        """The client's optimizer over ``groups``; see [Note: client optimizer].

        Raises:
            ConfigError: the config has an ``optimizer`` section too; an object under bf16 or
                with ``param_groups``; a factory that does not return an optimizer; an
                optimizer that leaves out, repeats or adds a parameter.
        """
        check_one_optimizer(self.config.optimizer_type)
        trainable = [(n, p) for n, p in self.named_trainable() if p.requires_grad]
        names = {id(p): n for n, p in trainable}
        if isinstance(optimizer, torch.optim.Optimizer):
            if self.mixed is not None:
                raise ConfigError(
                    "an optimizer object cannot train a bf16 engine: the engine steps fp32 "
                    "master copies it makes of the parameters. Pass a factory, "
                    "optimizer=lambda groups: torch.optim.AdamW(groups, ...), which is called "
                    "with the master groups"
                )
            if grouped:
                raise ConfigError(
                    "param_groups cannot be used with an optimizer object: it already holds its "
                    "parameter groups. Pass a factory optimizer(groups) that builds it from the "
                    "groups, or drop param_groups"
                )
            _check_optimizer_params(optimizer, names, "the optimizer object")
            return optimizer
        if not callable(optimizer):
            raise ConfigError(
                "optimizer must be a torch.optim.Optimizer or a callable(param_groups) -> "
                f"Optimizer, got {type(optimizer).__name__}"
            )
        if not all(isinstance(g, Mapping) for g in groups):  # no param_groups: one group
            groups = [{"params": [p for p in groups if p.requires_grad]}]
        built = optimizer(groups)
        if not isinstance(built, torch.optim.Optimizer):
            raise ConfigError(
                f"the optimizer factory returned {type(built).__name__}, not a "
                "torch.optim.Optimizer"
            )
        if self.mixed is not None:
            names = {id(self.mixed.master_of(p)): n for n, p in trainable}
        _check_optimizer_params(built, names, "the optimizer the factory built")
        return built

    def engine_state(self, stages: Sequence[HeldStage], plan: PipelinePlan) -> EngineState:
        """What a dialect's ``engine_state`` hook returns for this engine running ``stages`` of
        ``plan`` (the plan gives the number of stages, the tie keys and the buffers' owners;
        the counters are ``global_steps`` and ``skipped_steps``)."""
        return EngineState(
            stages=tuple(sorted(stages, key=lambda s: s.stage_id)),
            num_stages=int(plan.num_stages),
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            tie_keys=tie_keys(plan.tie_groups, [(s.stage_id, s.module) for s in stages]),
            buffer_owners=plan.buffer_owners(),
            counters=AttributeCounters(self, ("global_steps", "skipped_steps")),
            gradient_accumulation_steps=self.gradient_accumulation_steps(),
            train_batch_size=self.train_batch_size(),
        )

    def get_global_grad_norm(self) -> float | None:
        """The global 2-norm of the last step's gradients, before clipping (over every stage
        and replica, a tied weight counted once), as DeepSpeed's ``get_global_grad_norm``;
        None before the first step. Computed whether or not ``gradient_clipping`` clips."""
        return None if self._grad_norm is None else float(self._grad_norm)

    # -- gradients and the step (fp32, or bf16 with master weights) ---------------------------

    def grad_of(self, param: nn.Parameter) -> torch.Tensor | None:
        """The step's gradient of ``param``: its high-precision buffer under bf16, else
        ``param.grad``."""
        if self.mixed is not None:
            return self.mixed.grad_of(param)
        return param.grad

    def accumulate_grads(self, params: Iterable[nn.Parameter] | None = None) -> None:
        """After a micro-batch's backward: under bf16, move the bf16 gradients of ``params``
        (default: all) into their buffers; nothing in fp32 (autograd accumulates there)."""
        if self.mixed is not None:
            self.mixed.accumulate(params)

    def reduce_grads(self, sum_: Callable[[torch.Tensor], None] | None = None) -> None:
        """Under bf16, reduce the gradient buffers over the data-parallel replicas in the
        config's ``communication_data_type`` (``sum_`` sums a flat tensor over them; None: one
        replica), as DeepSpeed's bf16 pipeline does even with one replica; nothing in fp32."""
        if self.mixed is not None:
            self.mixed.reduce_grads(self.config.precision.communication_dtype, sum_)

    def zero_grads(self) -> None:
        """Drop every gradient of the step (after a failed step, say)."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.mixed is not None:
            self.mixed.zero_grad()

    def take_step(
        self,
        clip_fp32: Callable[[], Any],
        *,
        skip: set[int] | None = None,
        all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> bool:
        """Clip, step the optimizer and the schedule, count the step (DeepSpeed's
        ``_take_model_step``); return whether the optimizer stepped.

        In fp32 ``clip_fp32()`` clips with ``gradient_clipping`` (only computing the norm when it
        is 0) and returns the global norm. Under bf16 the master weights step ([Note: bf16 as
        DeepSpeed does it]): ``skip`` and ``all_reduce`` make the gradient norm global across
        ranks, and a non-finite norm skips the step and the schedule, as DeepSpeed's BF16
        optimizer does. Either way the norm is kept for :meth:`get_global_grad_norm`.
        """
        applied = True
        if self.mixed is None:
            self._grad_norm = clip_fp32()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        else:
            applied = self.mixed.step(
                self.optimizer, self.config.gradient_clipping, skip=skip, all_reduce=all_reduce
            )
            self._grad_norm = self.mixed.last_norm
        if applied:
            self.step_lr_scheduler()
        self.global_steps += 1
        return applied

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because the bf16 gradient norm was not finite (DeepSpeed's counter)."""
        return self._skipped_steps if self.mixed is None else self.mixed.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        """Set the counter, as a resumed checkpoint does."""
        if self.mixed is None:
            self._skipped_steps = int(value)
        else:
            self.mixed.skipped_steps = int(value)

    def precision_state(self) -> dict[str, Any] | None:
        """The fp32 master weights for a checkpoint (None in fp32)."""
        return None if self.mixed is None else self.mixed.state_dict()

    def load_precision_state(self, state: Mapping[str, Any] | None, where: str) -> None:
        """Restore the master weights a checkpoint saved (:meth:`BF16Master.load_state_dict`)."""
        if self.mixed is not None:
            self.mixed.load_state_dict(state, where)

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

        With a plan (``module.plan``), a micro-batch may also be a dict keyed by the model's
        input names and ``"labels"``, and each input is checked against stage 0
        (:mod:`pipedialect.plan.batches` [Note: inputs by name]).

        Raises:
            DataExhaustedError: ``data_iter`` ran out first (nothing was computed).
            DataError: an item is not an ``(inputs, labels)`` pair (or a dict of them by name).
        """
        items = pull_micro_batches(data_iter, count, what=what, source=source)
        plan = getattr(self.module, "plan", None)
        if plan is None:
            return [self.check_pair(batch, i) for i, batch in enumerate(items)]
        spec = input_spec(plan.input_names, plan.stages[0])
        return [spec.pair(batch, i) for i, batch in enumerate(items)]

    def eval_micro_batches(self, num_micro_batches: int | None) -> tuple[int, str]:
        """How many micro-batches ``eval_batch`` reads, and the setting that says so.

        Raises:
            ConfigError: ``num_micro_batches`` is below 1.
        """
        if num_micro_batches is None:
            return self.config.gradient_accumulation_steps, "gradient_accumulation_steps"
        if num_micro_batches < 1:
            raise ConfigError(f"num_micro_batches must be at least 1, got {num_micro_batches}")
        return num_micro_batches, "num_micro_batches"

    def save_checkpoint(
        self,
        save_dir: str | Path,
        tag: str | None = None,
        client_state: Mapping[str, Any] | None = None,
        save_latest: bool = True,
    ) -> bool:
        """Save the engine's state under ``save_dir/tag``; every rank calls it, inside
        :meth:`_agreed`.

        The files go to a staging directory, with each rank's random number generators, and are
        published as ``tag`` only once every rank wrote its own (:mod:`pipedialect.
        checkpoint_files` [Note: crash-safe checkpoints]). Returns True, as DeepSpeed does.
        """
        with self._agreed("save_checkpoint"):
            return self._save_checkpoint(save_dir, tag, client_state, save_latest)

    def _agreed(self, what: str) -> contextlib.AbstractContextManager[None]:
        """The context of a phase every rank runs together (``what``: its name): nothing here;
        an engine over several ranks raises an error of one rank on every rank."""
        return contextlib.nullcontext()

    def _save_checkpoint(
        self,
        save_dir: str | Path,
        tag: str | None,
        client_state: Mapping[str, Any] | None,
        save_latest: bool,
    ) -> bool:
        tag = tag or f"global_step{self.global_steps}"
        staged = checkpoint_files.stage(save_dir, tag)
        error: PipeDialectError | None = None
        try:
            self._write_checkpoint(staged, dict(client_state or {}))
            checkpoint_files.save_rng_state(staged)
        except PipeDialectError as exc:
            error = exc
        except Exception as exc:
            error = CheckpointError(
                f"saving checkpoint {tag!r} into {staged} failed ({type(exc).__name__}: {exc}); "
                f"{save_dir}/{tag} and its latest file are as they were"
            )
            error.__cause__ = exc
        # Every rank is here: one that could not write stops them all before publishing.
        agree_on_error(error, device=self._agreement_device(), what=f"save_checkpoint {tag!r}")
        checkpoint_files.publish(save_dir, tag, save_latest=save_latest)
        return True

    def _agreement_device(self) -> torch.device:
        """Where the agreement's flag lives: the CUDA device under NCCL, else the CPU."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def load_checkpoint(
        self,
        load_dir: str | Path,
        tag: str | None = None,
        load_optimizer_states: bool = True,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Load what :meth:`save_checkpoint` saved; return ``(path, client_state)``.

        Without ``tag``, the one recorded in ``load_dir/latest``; ``(None, None)`` when there is
        none, as DeepSpeed returns. Every rank calls it, inside :meth:`_agreed`.
        """
        with self._agreed("load_checkpoint"):
            found = checkpoint_files.latest_tag(load_dir, tag)
            if found is None:
                return None, None
            tag, from_latest = found
            path, state = self._read_checkpoint(
                Path(load_dir),
                tag,
                load_optimizer_states=load_optimizer_states,
                from_latest=from_latest,
            )
            return str(path), state

    def _write_checkpoint(self, staged: Path, client_state: dict[str, Any]) -> None:
        """Write this engine's files into the staging directory ``staged``."""
        raise NotImplementedError(f"{type(self).__name__} does not save checkpoints")

    def _read_checkpoint(
        self, load_dir: Path, tag: str, load_optimizer_states: bool, from_latest: bool
    ) -> tuple[Path, dict[str, Any]]:
        """Verify and load checkpoint ``tag`` of ``load_dir``; return its path and client state.

        ``from_latest``: the tag was read from the directory's ``latest`` file.
        """
        raise NotImplementedError(f"{type(self).__name__} does not load checkpoints")

    def check_finite_grads(
        self, stages: Iterable[tuple[int, nn.Module]], step: int
    ) -> NonFiniteError | None:
        """The error for the first stage (in order) with a non-finite gradient, or None (under
        bf16 the gradient buffers are checked)."""
        for stage_id, stage in stages:
            named = stage_root(stage).named_parameters()
            found = (
                first_nonfinite_grad(named)
                if self.mixed is None
                else _first_nonfinite(
                    [(n, g) for n, p in named if (g := self.mixed.grad_of(p)) is not None]
                )
            )
            if found is not None:
                return nonfinite_grad_error(*found, step=step, stage=stage_id)
        return None


def _check_optimizer_params(
    optimizer: torch.optim.Optimizer, names: Mapping[int, str], what: str
) -> None:
    """Refuse an optimizer that does not hold exactly the parameters in ``names`` (by ``id``),
    each once: one left out would not train, another model's or stage's would be stepped with
    no gradient from this engine (the unsplit model's parameters, say)."""
    held: set[int] = set()
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in names:
                raise ConfigError(
                    f"{what} holds a parameter of shape {tuple(param.shape)} that this engine "
                    "does not train (frozen, another stage's, or the unsplit model's); build it "
                    "over the groups the engine passes to an optimizer factory, "
                    "runtime_engine(optimizer=lambda groups: ...)"
                )
            held.add(id(param))
    missing = [name for key, name in names.items() if key not in held]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConfigError(
            f"{what} does not hold parameter {missing[0]!r}{more} of this engine, which would "
            "not be trained; build it over the groups the engine "
            "passes to an optimizer factory, runtime_engine(optimizer=lambda groups: ...)"
        )


def nothing_to_train(device: torch.device | str = "cpu") -> nn.Parameter:
    """An empty parameter to build the optimizer of a rank with nothing to train ([Note:
    nothing to train]): torch's optimizers refuse an empty parameter list."""
    return nn.Parameter(torch.zeros(0, device=device))


def _any_trainable(groups: Iterable[Any]) -> bool:
    for item in groups:
        params = item["params"] if isinstance(item, Mapping) else [item]
        if isinstance(params, torch.Tensor):
            params = [params]
        if any(getattr(p, "requires_grad", False) for p in params):
            return True
    return False


def _device_of(module: nn.Module) -> torch.device:
    for param in module.parameters():
        return param.device
    for buf in module.buffers():
        return buf.device
    return torch.device("cpu")


def _first_nonfinite(grads: list[tuple[str, torch.Tensor]]) -> tuple[str, torch.Tensor] | None:
    """The first ``(name, gradient)`` with a NaN or infinite element, or None (one sync)."""
    if not grads:
        return None
    grads = [(name, local_part(g)) for name, g in grads]  # a sharded buffer: this rank's part
    flags = torch.stack([torch.isfinite(g).all() for _, g in grads])
    if bool(flags.all()):
        return None
    return grads[int((~flags).nonzero()[0, 0])]


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
        named = f" (named by {path.parent.parent / LATEST_FILE})" if from_latest else ""
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


def stage_param_name(key: str) -> tuple[str, str]:
    """``stages.1.mod.blocks.2.weight`` as stage ``"1"`` and parameter ``"blocks.2.weight"``."""
    parts = key.split(".")
    if len(parts) > 2 and parts[0] == "stages" and parts[1].isdigit():
        rest = parts[3:] if parts[2] == "mod" else parts[2:]
        return parts[1], ".".join(rest)
    return "?", key
