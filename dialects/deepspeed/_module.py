"""A DeepSpeed ``PipelineModule`` built from pre-wrapped stages, with tied weights on upstream.

Upstream DeepSpeed only knows ties declared with ``TiedLayerSpec``; everything else about ties
(broadcast at start and after loading, gradient all-reduce before each optimizer step, counting a
tied weight once in gradient norms) is driven by ``tied_comms``, ``tied_modules`` and
``tied_weight_attrs``. This subclass fills those from the plan's tie groups instead
(``_index_tied_modules``), so no fork is needed.

It also makes gradient clipping use the global norm: DeepSpeed 0.19's fp32 ``clip_grad_norm_``
counts only the gradients of model-parallel rank 0 of a pipeline replica (stage 0) unless a
parameter is marked ``model_parallel``; every parameter of the other stages is marked, except the
replicated copies of tied weights, which their first owner counts. And it saves a tied weight
once: replicated copies are left out of the layer files and restored by the broadcast that
follows loading.

Importing this module imports deepspeed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule
from torch import nn

from pipedialect import Topology
from pipedialect.errors import CheckpointError

__all__ = ["PipeDialectPipelineModule", "TieSpec"]

logger = logging.getLogger(__name__)


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
    ) -> None:
        # _index_tied_modules runs inside PipelineModule.__init__, so the ties go in first.
        object.__setattr__(self, "_pipedialect_ties", tuple(sorted(ties, key=lambda t: t.key)))
        super().__init__(
            layers=list(stages),
            topology=topology,
            loss_fn=loss_fn,
            partition_method="uniform",
            dynamic_shape=dynamic_shape,
        )
        self._mark_parameters_for_grad_norm()

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
        return tied_comms

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
