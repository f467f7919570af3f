"""A DeepSpeed ``PipelineModule`` built from pre-wrapped stages, with tied weights on upstream.

Upstream DeepSpeed only knows ties declared with ``TiedLayerSpec``; everything else about ties
(broadcast at start and after loading, gradient all-reduce before each optimizer step, counting a
tied weight once in gradient norms) is driven by ``tied_comms``, ``tied_modules`` and
``tied_weight_attrs``. This subclass fills those from the plan's tie groups instead
(``_index_tied_modules``), so no fork is needed.

[Note: stage recomputation]
DeepSpeed checkpoints activations every ``activation_checkpoint_interval`` layers, and each layer
here is one whole stage (one per rank), so every positive interval means the same: each stage's
forward runs under torch's non-reentrant ``torch.utils.checkpoint`` and is run again during its
backward. Whatever ``activation_checkpoint_func`` DeepSpeed picks (its reentrant default, or its
own non-reentrant one for ``pipeline.use_reentrant: false``) is replaced by that: the reentrant
one gives no gradient to a stage whose inputs are integer token ids, and torch's handles any
input. The recomputation replays the RNG state of the first run, so dropout masks are the same,
and the stage's module state: it starts from the buffers the forward started from and leaves
them as the forward left them, so running statistics count each micro-batch once
(``pipedialect.runtime.module_state`` [Note: recomputation and module state]).
A function other than DeepSpeed's two is refused, and so is a negative interval.

It also makes gradient clipping use the global norm: DeepSpeed 0.19's fp32 ``clip_grad_norm_``
counts only the gradients of model-parallel rank 0 of a pipeline replica (stage 0) unless a
parameter is marked ``model_parallel``; every parameter of the other stages is marked, except the
replicated copies of tied weights, which their first owner counts. And it saves a tied weight
once: replicated copies are left out of the layer files and restored by the broadcast that
follows loading.

Importing this module imports deepspeed.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing
from torch import nn

from pipedialect import ConfigError, Topology
from pipedialect.errors import CheckpointError
from pipedialect.sdk import check_frozen_ties, recompute_with_state, stage_root

__all__ = ["PipeDialectPipelineModule", "TieSpec", "recompute_stage"]


#: The pipeline module whose stage :func:`recompute_stage` is running, and its layers: set by
#: :meth:`PipeDialectPipelineModule.forward`, since DeepSpeed calls the checkpoint function with
#: a closure over its layers only.
_RUNNING: contextvars.ContextVar[tuple[nn.Module, tuple[nn.Module, ...]] | None] = (
    contextvars.ContextVar("pipedialect_deepspeed_stage", default=None)
)


def recompute_stage(function: Callable[..., Any], *args: Any) -> Any:
    """Run ``function(*args)`` (one whole stage) under torch's non-reentrant checkpoint.

    See [Note: stage recomputation]; the RNG state is preserved for the recomputation, and so
    is the stage's module state (``pipedialect.runtime.module_state`` [Note: recomputation and
    module state]).
    """
    running = _RUNNING.get()
    if running is None:
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
    key, layers = running
    return recompute_with_state(function, layers, *args, key=key)


#: The checkpoint functions DeepSpeed itself assigns; each stands for :func:`recompute_stage`.
_DEEPSPEED_CHECKPOINT_FUNCS = (
    ds_checkpointing.checkpoint,
    ds_checkpointing.non_reentrant_checkpoint,
    recompute_stage,
)


@dataclass(frozen=True)
class TieSpec:
    """One tie group, resolved against the stage modules."""

    #: The group's key (a valid ``nn.ModuleDict`` key).
    key: str
    #: For every data-parallel (and model-parallel) fiber, the global ranks that hold the weight.
    rank_groups: tuple[tuple[int, ...], ...]
    #: For every stage holding the weight: the module that owns it and the attribute name.
    owners: dict[int, tuple[nn.Module, str]]


class PipeDialectPipelineModule(PipelineModule):  # type: ignore[misc]
    """``PipelineModule`` over one wrapper per stage, with the plan's ties registered."""

    def __init__(
        self,
        stages: Sequence[nn.Module],
        *,
        topology: Topology,
        loss_fn: Callable[..., Any],
        ties: Sequence[TieSpec],
        dynamic_shape: bool = False,
        activation_checkpoint_interval: int = 0,
    ) -> None:
        # _index_tied_modules runs inside PipelineModule.__init__, so the ties go in first.
        object.__setattr__(self, "_pipedialect_ties", tuple(sorted(ties, key=lambda t: t.key)))
        super().__init__(
            layers=list(stages),
            topology=topology,
            loss_fn=loss_fn,
            partition_method="uniform",
            dynamic_shape=dynamic_shape,
            activation_checkpoint_interval=activation_checkpoint_interval,
        )
        self._mark_parameters_for_grad_norm()

    @property
    def tie_specs(self) -> tuple[TieSpec, ...]:
        """The plan's tie groups resolved against the stage modules, sorted by key."""
        specs: tuple[TieSpec, ...] = self._pipedialect_ties
        return specs

    # -- activation recomputation ([Note: stage recomputation]) -----------------------------

    @property
    def activation_checkpoint_func(self) -> Callable[..., Any]:
        """Always :func:`recompute_stage`, whatever DeepSpeed assigned."""
        return recompute_stage

    @activation_checkpoint_func.setter
    def activation_checkpoint_func(self, func: Callable[..., Any]) -> None:
        if not any(func is known for known in _DEEPSPEED_CHECKPOINT_FUNCS):
            raise ConfigError(
                f"activation_checkpoint_func={getattr(func, '__qualname__', func)!r} is not "
                "supported: the DeepSpeed dialect checkpoints each whole stage with torch's "
                "non-reentrant checkpoint (pipedialect.dialects.deepspeed._module."
                "recompute_stage). Set only activation_checkpoint_interval, or checkpoint "
                "inside your blocks."
            )

    def _is_checkpointable(self, funcs: Sequence[Any]) -> bool:
        # Every layer is a whole stage; checkpointing one without parameters is still exact.
        del funcs
        return True

    def forward(self, forward_input: Any) -> Any:
        """Run the local stage, recomputed when ``activation_checkpoint_interval > 0``."""
        interval = self.activation_checkpoint_interval
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 0:
            raise ConfigError(
                f"[Stage {self.stage_id}] activation_checkpoint_interval={interval!r}; it must "
                "be an int >= 0 (0: no checkpointing; any positive value checkpoints each whole "
                "stage)"
            )
        # Upstream runs no layer at all if the interval changed without set_checkpoint_interval.
        self._precompute_checkpointable_values()
        layers = tuple(f for f in self.forward_funcs if isinstance(f, nn.Module))
        token = _RUNNING.set((self, layers))
        try:
            return super().forward(forward_input)
        finally:
            _RUNNING.reset(token)

    # -- ties ----------------------------------------------------------------------------

    def _index_tied_modules(self) -> dict[str, dict[str, Any]]:
        tied_comms: dict[str, dict[str, Any]] = {}
        if self._topo.get_dim("pipe") == 1:
            return tied_comms
        for spec in self._pipedialect_ties:
            for ranks in spec.rank_groups:
                # Every rank takes part in creating every group, member or not.
                group = dist.new_group(ranks=list(ranks))
                if self.global_rank not in ranks:
                    continue
                module, attr = spec.owners[self.stage_id]
                self.tied_modules[spec.key] = module
                self.tied_weight_attrs[spec.key] = [attr]
                tied_comms[spec.key] = {
                    "ranks": list(ranks),
                    "group": group,
                    "weight_attr": [attr],
                    "module": module,
                }
                if self.global_rank != ranks[0]:
                    getattr(module, attr).ds_pipe_replicated = True
        if self._pipedialect_ties:  # the same ties on every rank: all of them check, or none
            names = {
                id(p): n
                for layer in self.forward_funcs
                if isinstance(layer, nn.Module)
                for n, p in stage_root(layer).named_parameters()
            }
            stage = int(self.stage_id)
            mine: dict[str, tuple[str, int, bool]] = {}
            for key, comm in tied_comms.items():
                for attr in comm["weight_attr"]:
                    weight = getattr(comm["module"], attr)
                    mine[key] = (names.get(id(weight), attr), stage, bool(weight.requires_grad))
            check_frozen_ties(mine)
        return tied_comms

    def get_tied_weights_and_groups(self) -> list[tuple[nn.Parameter, Any]]:
        """The tied weights whose gradients are summed, with their groups: frozen ones have
        none (every rank holding one agrees it is frozen, checked when the module is built)."""
        found: list[tuple[nn.Parameter, Any]] = super().get_tied_weights_and_groups()
        return [(weight, group) for weight, group in found if weight.requires_grad]

    def _synchronize_tied_weights(self) -> None:
        # A broadcast into a leaf parameter is not an autograd operation; say so to torch.
        with torch.no_grad():
            super()._synchronize_tied_weights()

    def _mark_parameters_for_grad_norm(self) -> None:
        counted_by_rank_zero = self._grid.get_model_parallel_rank() == 0
        for p in self.parameters():
            p.model_parallel = not counted_by_rank_zero and not p.ds_pipe_replicated

    # -- checkpoints ---------------------------------------------------------------------

    def _replicated_names(self, layer: nn.Module) -> set[str]:
        return {
            name
            for name, p in layer.named_parameters(remove_duplicate=False)
            if getattr(p, "ds_pipe_replicated", False)
        }

    def save_state_dict(
        self, save_dir: str, checkpoint_engine: Any, exclude_frozen_params: bool = False
    ) -> None:
        """Save each local stage's state, leaving out replicated copies of tied weights."""
        if self._grid.data_parallel_id != 0:
            return
        checkpoint_engine.makedirs(save_dir, exist_ok=True)
        for local_idx, layer in enumerate(self.forward_funcs):
            if not isinstance(layer, nn.Module):
                continue
            state = layer.state_dict()
            drop = self._replicated_names(layer)
            if exclude_frozen_params:
                drop |= {n for n, p in layer.named_parameters() if not p.requires_grad}
            state = {k: v.detach().clone() for k, v in state.items() if k not in drop}
            checkpoint_engine.save(state, self.ckpt_layer_path(save_dir, local_idx))

    def load_state_dir(self, load_dir: str, checkpoint_engine: Any, strict: bool = True) -> None:
        """Load each local stage's state; replicated tied weights come from their owner."""
        for local_idx, layer in enumerate(self.forward_funcs):
            if not isinstance(layer, nn.Module):
                continue
            path = self.ckpt_layer_path(load_dir, local_idx)
            state = checkpoint_engine.load(path, map_location=lambda storage, _loc: storage)
            self._check_shapes(layer, state, path)
            result = layer.load_state_dict(state, strict=False)
            missing = set(result.missing_keys) - self._replicated_names(layer)
            if strict and (missing or result.unexpected_keys):
                raise CheckpointError(
                    f"[Stage {self.stage_id}] checkpoint {path} does not match this stage: "
                    f"missing {sorted(missing)}, unexpected {sorted(result.unexpected_keys)}. "
                    "Load a checkpoint saved from the same plan, or pass "
                    "load_module_strict=False."
                )
        self._synchronize_tied_weights()

    def _check_shapes(self, layer: nn.Module, state: Any, path: str) -> None:
        """Refuse a saved tensor whose shape differs, naming it (torch would say less)."""
        for name, value in layer.state_dict().items():
            saved = state.get(name) if isinstance(state, dict) else None
            if isinstance(saved, torch.Tensor) and saved.shape != value.shape:
                short = name.removeprefix("mod.")
                raise CheckpointError(
                    f"[Stage {self.stage_id}] checkpoint {path} was saved from a differently "
                    f"sized model: parameter {short!r} has shape {tuple(saved.shape)} there but "
                    f"{tuple(value.shape)} here; build the model with the sizes it was saved with",
                    parameter=short,
                )
