"""What a DeepSpeed ``PipelineEngine`` trains in this process, as ``Dialect.engine_state`` says.

The engine runs one stage: the wrapper layers of its ``PipelineModule`` (``forward_funcs``),
each holding the stage's module under the model's names (``mod``). A tied weight's copies are
the module's ``tie_specs`` (``_module``); the step counters are DeepSpeed's four.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pipedialect import ConfigError
from pipedialect.contracts import AttributeCounters, EngineState, HeldStage
from pipedialect.sdk import stage_root

__all__ = ["deepspeed_engine_state"]

#: DeepSpeed's ``PipelineEngine`` step counters.
_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


def deepspeed_engine_state(engine: Any) -> EngineState:
    """The :class:`~pipedialect.contracts.EngineState` of a DeepSpeed ``PipelineEngine``.

    Raises:
        ConfigError: ``engine`` does not train a ``PipelineModule``.
    """
    module = getattr(engine, "module", None)
    layers = getattr(module, "forward_funcs", None)
    if layers is None:
        raise ConfigError(
            f"not a DeepSpeed PipelineEngine over a PipelineModule: {type(engine).__name__}"
        )
    held: list[HeldStage] = []
    for layer in layers:
        if not isinstance(layer, nn.Module):
            continue
        root = stage_root(layer)
        stage_id = getattr(layer, "stage_id", None)
        held.append(HeldStage(int(engine.stage_id if stage_id is None else stage_id), layer, root))
    return EngineState(
        stages=tuple(sorted(held, key=lambda s: s.stage_id)),
        num_stages=int(getattr(engine, "num_stages", len(held))),
        optimizer=getattr(engine, "optimizer", None),
        lr_scheduler=getattr(engine, "lr_scheduler", None),
        tie_keys=_tie_keys(module, held),
        counters=AttributeCounters(engine, _COUNTERS),
        gradient_accumulation_steps=int(engine.gradient_accumulation_steps()),
        train_batch_size=int(engine.train_batch_size()),
    )


def _tie_keys(module: Any, held: list[HeldStage]) -> dict[int, str]:
    """``id(parameter) -> key`` from the module's ``tie_specs``, for the stages held here."""
    keys: dict[int, str] = {}
    ids = {s.stage_id for s in held}
    for spec in getattr(module, "tie_specs", ()):
        for stage_id, (owner, attr) in spec.owners.items():
            if stage_id in ids:
                param = getattr(owner, attr, None)
                if isinstance(param, torch.Tensor):
                    keys[id(param)] = str(spec.key)
    return keys
