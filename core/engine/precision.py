"""bf16 mixed precision with DeepSpeed's semantics, for the engines that do not run DeepSpeed.

[Note: bf16 as DeepSpeed does it]
With ``"bf16": {"enabled": true}`` DeepSpeed 0.19.8's pipeline engine trains through its
``BF16_Optimizer`` (``runtime/bf16_optimizer.py``); the local and torch engines follow the same
policy, implemented once here by :class:`BF16Master`:

- when the engine is built, every *parameter* of the stages in fp16, bf16, fp32 or fp64 is cast
  to bf16 in place, frozen ones too (``param.data``, so ties stay one object); buffers keep
  their dtype, so floating buffers stay fp32 (DeepSpeed's ``_cast_module_mixed_precision``
  without ``data_types.buffer_dtype``; its ``keep_in_fp32_modules`` only ever upcasts buffers
  that are not fp32 already). Activations are then bf16 wherever the model computes from its
  parameters; float model inputs are passed as they come, as DeepSpeed passes them, so a model
  that takes float inputs casts them itself (or the data iterator yields bf16). A module that
  mixes its bf16 parameters with its fp32 buffers runs as it does under DeepSpeed: on the CPU
  ``nn.BatchNorm`` with ``affine=True`` refuses that mix ("expected scalar type BFloat16 but
  found Float") on every dialect alike, while ``affine=False`` runs, updating its fp32
  statistics from bf16 activations;
- the optimizer steps fp32 *master* copies, made from the bf16 parameters (so they start at the
  bf16-rounded weights, as DeepSpeed's ``fp32_groups_flat_partition``), and its state is fp32;
- after each micro-batch's backward, on each stage, every bf16 gradient is added into a
  high-precision gradient buffer and dropped (``update_hp_grads``). The buffer's dtype is
  ``data_types.grad_accum_dtype``, which defaults to the model dtype: with ZeRO stage 0 (the
  only stage these engines run) DeepSpeed accumulates pipeline gradients *in bf16* (and warns
  that this is "not safe numerically with large number of accumulation steps"). ``"fp32"``
  accumulates in fp32, which is what DeepSpeed's ``BF16_Optimizer`` does under ZeRO stage 1
  (DeepSpeed refuses fp32 accumulation at stage 0 with ``NotImplementedError``);
- tied-weight gradient sums run on those buffers (DeepSpeed all-reduces ``weight._hp_grad``);
  then the buffers are reduced over the data-parallel replicas in ``communication_data_type``,
  which defaults to bf16 under bf16: each buffer is cast to it, summed, and cast back *even with
  one replica* (DeepSpeed's ``_bf16_reduce_grads`` -> ``allreduce_bucket`` always runs), so
  fp32-accumulated gradients are rounded to bf16 there unless the config says
  ``"communication_data_type": "fp32"``;
- the step computes the global 2-norm of the buffers (each tensor's fp32 norm, squares summed,
  square root; a tied copy counted once), and *skips the step* when it is not finite (the
  gradients are dropped, the learning-rate schedule does not advance: DeepSpeed's
  ``overflow``); with ``gradient_clipping > 0`` and ``coef = max_norm / (norm + 1e-6) < 1`` every
  buffer is multiplied by ``coef`` (an fp32 scalar: a bf16 buffer is scaled in bf16);
- every master gets its buffer as fp32 gradient (zeros for a parameter that received none: the
  flat buffer holds zeros there, so Adam's moments still decay, as in DeepSpeed), the optimizer
  steps, and every bf16 parameter is overwritten with its master rounded to bf16
  (``update_lp_params``).

The returned loss is the mean of the micro-batch losses in the loss's own dtype (bf16 when the
loss is computed from bf16 logits), as DeepSpeed sums and divides it, returned as fp32.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError, ConfigError
from ..runtime.sharded import counted_square_norm, local_part

__all__ = ["CASTABLE_DTYPES", "BF16Master", "Precision", "cast_parameters", "parse_precision"]

#: DeepSpeed's ``DtypeEnum`` spellings of the dtypes ``grad_accum_dtype`` may name here.
_DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "torch.float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "torch.bfloat16": torch.bfloat16,
}

#: DeepSpeed's spellings of ``communication_data_type`` (fp16 is not run here).
_COMM_NAMES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}

#: The keys of DeepSpeed 0.19.8's ``bf16`` section that these engines honour as DeepSpeed does.
#: ``immediate_grad_update`` moves each gradient into the buffer from a hook rather than after
#: the micro-batch's backward: the same sums. ``check_grad_overflow`` only concerns ZeRO; the
#: BF16 optimizer always skips a step whose gradient norm is not finite.
_BF16_KEYS = frozenset({"enabled", "immediate_grad_update", "check_grad_overflow"})
#: Keys that change the numbers and are ZeRO-only in DeepSpeed.
_BF16_ZERO_ONLY = ("bf16_master_weights_and_grads", "bf16_optimizer_states")


@dataclass(frozen=True)
class Precision:
    """The training precision a config asks for."""

    #: The dtype parameters and activations are computed in (fp32 or bf16).
    param_dtype: torch.dtype = torch.float32
    #: The dtype gradients are accumulated in over the micro-batches of a step.
    grad_accum_dtype: torch.dtype = torch.float32
    #: The dtype gradients are reduced in over the data-parallel replicas.
    communication_dtype: torch.dtype = torch.float32

    @property
    def bf16(self) -> bool:
        """Whether parameters are bf16 with fp32 master weights."""
        return self.param_dtype == torch.bfloat16


def _enabled(config: Mapping[str, Any], key: str) -> Mapping[str, Any] | None:
    section = config.get(key)
    if isinstance(section, Mapping) and section.get("enabled", False):
        return section
    return None


def parse_precision(config: Mapping[str, Any]) -> Precision:
    """The :class:`Precision` of a DeepSpeed config dict (``bf16``/``bfloat16``, ``fp16``,
    ``data_types``), as DeepSpeed 0.19.8 resolves it for a pipeline at ZeRO stage 0.

    Raises:
        ConfigError: fp16 (loss scaling is not implemented by these engines), bf16 options that
            are ZeRO-only, or a ``grad_accum_dtype`` these engines do not run.
    """
    if _enabled(config, "fp16") is not None:
        raise ConfigError(
            "config['fp16'] is enabled; the local and torch engines do not implement fp16: it "
            "needs dynamic loss scaling (DeepSpeed's FP16_Optimizer) to train at all, and "
            'DeepSpeed itself runs fp16 only on a GPU. Use "bf16": {"enabled": true} '
            "(same range as fp32, no loss scaling), or the deepspeed dialect on a GPU"
        )
    if _enabled(config, "amp") is not None:
        raise ConfigError(
            "config['amp'] (NVIDIA apex) is not implemented by this engine; use "
            '"bf16": {"enabled": true}'
        )
    section = _enabled(config, "bf16") or _enabled(config, "bfloat16")
    data_types = config.get("data_types")
    accum_name = data_types.get("grad_accum_dtype") if isinstance(data_types, Mapping) else None
    comm_name = config.get("communication_data_type")
    comm = None if comm_name is None else _COMM_NAMES.get(str(comm_name).lower())
    if section is None:
        if accum_name is not None and _DTYPE_NAMES.get(str(accum_name)) != torch.float32:
            raise ConfigError(
                f"config['data_types']['grad_accum_dtype'] is {accum_name!r} but bf16 is not "
                "enabled; an fp32 model accumulates in fp32 (remove the entry or set 'fp32')"
            )
        if comm_name is not None and comm != torch.float32:
            raise ConfigError(
                f"config['communication_data_type'] is {comm_name!r}; an fp32 model reduces "
                "gradients in fp32 on this engine (remove it or set 'fp32')"
            )
        return Precision()
    if comm_name is not None and comm is None:
        raise ConfigError(
            f"config['communication_data_type'] is {comm_name!r}; with bf16 this engine reduces "
            "gradients in 'bf16' (DeepSpeed's default) or 'fp32'"
        )
    unknown = sorted(set(section) - _BF16_KEYS - set(_BF16_ZERO_ONLY))
    if unknown:
        raise ConfigError(f"config['bf16'] has keys DeepSpeed 0.19.8 does not know: {unknown}")
    for key in _BF16_ZERO_ONLY:
        if section.get(key, False):
            raise ConfigError(
                f"config['bf16'][{key!r}] is a ZeRO option (bf16 master weights or optimizer "
                "state); this engine keeps fp32 master weights and fp32 optimizer state. "
                "Remove it"
            )
    accum = torch.bfloat16
    if accum_name is not None:
        found = _DTYPE_NAMES.get(str(accum_name))
        if found is None:
            raise ConfigError(
                f"config['data_types']['grad_accum_dtype'] is {accum_name!r}; with bf16 this "
                "engine accumulates in 'bf16' (DeepSpeed's default) or 'fp32'"
            )
        accum = found
    return Precision(
        param_dtype=torch.bfloat16,
        grad_accum_dtype=accum,
        communication_dtype=torch.bfloat16 if comm is None else comm,
    )


#: The parameter dtypes DeepSpeed 0.19.8 casts to the training dtype (``CASTABLE_DTYPES`` of
#: ``runtime/engine.py``); parameters of other dtypes keep theirs.
CASTABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def cast_parameters(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast every parameter of ``module`` whose dtype DeepSpeed casts (fp16, bf16, fp32, fp64),
    frozen ones included, to ``dtype`` in place; buffers keep theirs.

    This is DeepSpeed 0.19.8's ``_cast_module_mixed_precision`` without a
    ``data_types.buffer_dtype``: floating buffers (BatchNorm's running statistics, rotary
    tables) stay fp32 ([Note: bf16 as DeepSpeed does it]). ``param.data`` is replaced, so a
    parameter shared by several stages stays one object.
    """
    for param in module.parameters():
        if param.dtype in CASTABLE_DTYPES and param.dtype != dtype:
            param.data = param.data.to(dtype)


class BF16Master:
    """fp32 master weights and high-precision gradient buffers for bf16 parameters.

    See [Note: bf16 as DeepSpeed does it]. ``params`` are the trainable parameters the engine
    steps, each once, already bf16. The optimizer is built over :attr:`masters` (see
    :meth:`groups`).
    """

    def __init__(self, params: Sequence[nn.Parameter], grad_accum_dtype: torch.dtype) -> None:
        self.params = list(params)
        self.grad_accum_dtype = grad_accum_dtype
        bad = [p for p in self.params if p.dtype != torch.bfloat16]
        if bad:
            raise ConfigError(
                f"bf16 training needs bf16 parameters; one of shape {tuple(bad[0].shape)} is "
                f"{bad[0].dtype} (an integer parameter cannot be trained in bf16)"
            )
        #: One fp32 master per parameter, in the same order.
        self.masters = [
            nn.Parameter(p.detach().to(torch.float32).clone(), requires_grad=True)
            for p in self.params
        ]
        #: The step's gradient of each parameter, in ``grad_accum_dtype``.
        self.grads = [torch.zeros_like(p, dtype=grad_accum_dtype) for p in self.params]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        #: Steps skipped because the gradient norm was not finite (DeepSpeed's skipped_steps).
        self.skipped_steps = 0
        #: The global gradient norm of the last step (before clipping), None before the first.
        self.last_norm: torch.Tensor | None = None

    # -- building the optimizer -------------------------------------------------------------

    def master_of(self, param: nn.Parameter) -> nn.Parameter:
        """The fp32 master of a bf16 parameter."""
        return self.masters[self._index[id(param)]]

    def groups(self, groups: Iterable[nn.Parameter] | Iterable[Mapping[str, Any]]) -> list[Any]:
        """Parameters or parameter groups (over the bf16 parameters) mapped to the masters."""
        out: list[Any] = []
        for item in groups:
            if isinstance(item, Mapping):
                out.append({**item, "params": [self.master_of(p) for p in item["params"]]})
            elif item.requires_grad:
                out.append(self.master_of(item))
        return out

    # -- gradients ---------------------------------------------------------------------------

    def grad_of(self, param: nn.Parameter) -> torch.Tensor | None:
        """The high-precision gradient buffer of ``param`` (None if the engine does not step it)."""
        index = self._index.get(id(param))
        return None if index is None else self.grads[index]

    def accumulate(self, params: Iterable[nn.Parameter] | None = None) -> None:
        """Move each bf16 gradient into its buffer (``buffer += grad``) and drop it.

        Called after every micro-batch's backward, on the stages that ran it (all of them when
        ``params`` is None); a parameter without a gradient is left alone.
        """
        with torch.no_grad():
            for param in self.params if params is None else params:
                index = self._index.get(id(param))
                if index is None or param.grad is None:
                    continue
                self.grads[index].add_(param.grad.to(self.grad_accum_dtype))
                param.grad = None

    def zero_grad(self) -> None:
        """Drop the step's gradients (buffers and any bf16 gradient left)."""
        with torch.no_grad():
            for param, grad in zip(self.params, self.grads, strict=True):
                grad.zero_()
                param.grad = None
            for master in self.masters:
                master.grad = None

    def reduce_grads(
        self,
        dtype: torch.dtype,
        sum_: Callable[[torch.Tensor], None] | None = None,
        replicas: int = 1,
    ) -> None:
        """Reduce the buffers over the data-parallel replicas in ``dtype`` (see the module
        note): one flat tensor cast to ``dtype``, summed in place by ``sum_`` (None: one
        replica), divided by ``replicas`` when the engine has not already divided each loss by
        it (pass 1 then), and copied back. With one replica this only rounds to ``dtype``."""
        if not self.grads or (sum_ is None and dtype == self.grad_accum_dtype):
            return
        with torch.no_grad():
            flat = torch.cat([g.reshape(-1) for g in self.grads]).to(dtype)
            if sum_ is not None:
                sum_(flat)
            if replicas != 1:
                flat.mul_(1.0 / replicas)
            offset = 0
            for grad in self.grads:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()

    def local_norm_sq(self, skip: set[int] | None = None) -> torch.Tensor:
        """The sum of the squared fp32 norms of the buffers, skipping the parameters (by ``id``)
        whose gradient another rank counts; of a sharded buffer, the elements this rank counts
        (:mod:`pipedialect.runtime.sharded` [Note: sharded tensors])."""
        squares = [
            counted_square_norm(g)
            for p, g in zip(self.params, self.grads, strict=True)
            if skip is None or id(p) not in skip
        ]
        if not squares:
            return torch.zeros(())
        return torch.stack(squares).sum()

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        *,
        skip: set[int] | None = None,
        all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> bool:
        """Clip, step the masters and copy them into the bf16 parameters; see the module note.

        ``skip``: ids of the parameters another rank counts in the norm; ``all_reduce`` sums the
        squared norm over the ranks of one pipeline (identity in one process). Returns False when
        the step was skipped because the norm was not finite.
        """
        total_sq = self.local_norm_sq(skip)
        if all_reduce is not None:
            total_sq = all_reduce(total_sq)
        norm = total_sq.pow(0.5)
        self.last_norm = norm
        if not math.isfinite(float(norm)):
            self.skipped_steps += 1
            self.zero_grad()
            return False
        with torch.no_grad():
            if max_norm > 0.0:
                coef = max_norm / (norm + 1e-6)
                if float(coef) < 1.0:
                    for grad in self.grads:
                        local_part(grad).mul_(coef)
            for master, grad in zip(self.masters, self.grads, strict=True):
                master.grad = grad if grad.dtype == torch.float32 else grad.to(torch.float32)
            optimizer.step()
            self.copy_to_model()
        self.zero_grad()
        return True

    def copy_to_model(self) -> None:
        """Overwrite every bf16 parameter with its master rounded to bf16."""
        with torch.no_grad():
            for param, master in zip(self.params, self.masters, strict=True):
                param.copy_(master)

    # -- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The masters, for a checkpoint (the bf16 parameters alone lose their low bits)."""
        return {"masters": [m.detach().clone() for m in self.masters]}

    def load_state_dict(self, state: Mapping[str, Any] | None, where: str) -> None:
        """Restore the masters saved by :meth:`state_dict`; without them (a checkpoint saved in
        fp32), the masters are refreshed from the loaded parameters.

        Raises:
            CheckpointError: the saved masters do not match these parameters.
        """
        if state is None:
            with torch.no_grad():
                for param, master in zip(self.params, self.masters, strict=True):
                    master.copy_(param)
            return
        saved = list(state.get("masters", []))
        if len(saved) != len(self.masters) or any(
            s.shape != m.shape for s, m in zip(saved, self.masters, strict=True)
        ):
            raise CheckpointError(
                f"checkpoint {where} holds {len(saved)} fp32 master weights that do not match "
                f"the {len(self.masters)} parameters of this engine; load it into the same model"
            )
        with torch.no_grad():
            for master, value in zip(self.masters, saved, strict=True):
                master.copy_(value)
        self.copy_to_model()
