"""What every engine shares: the base engine of the dialects that do not run DeepSpeed
(private module ``_base``, its names exported here) and DeepSpeed's semantics for them:
configuration, bf16 precision, learning-rate schedules, parameter groups, and the
crash-safe checkpoint directories (:mod:`pipedialect.engine.checkpoint_files`, used
through its module: ``checkpoint_files.publish(...)``).

Imports :mod:`pipedialect.plan`, :mod:`pipedialect.runtime` and the root leaves.
"""

from __future__ import annotations

from ._base import (
    EngineBase,
    SharedEngineArgs,
    nothing_to_train,
    read_checkpoint_file,
    shape_mismatch,
    stage_param_name,
)
from .config import (
    TrainingConfig,
    batch_triple,
    build_optimizer,
    check_config_keys,
    check_one_optimizer,
    clip_gradients,
    handled_keys,
    parse_config,
)
from .lr_schedules import (
    SCHEDULES,
    OneCycle,
    Schedule,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_schedule,
    check_schedule_section,
    current_lrs,
    resolve_client_schedule,
)
from .param_groups import ParamGroupsFn, no_weight_decay, resolve_param_groups
from .precision import CASTABLE_DTYPES, BF16Master, Precision, cast_parameters, parse_precision

__all__ = [
    "CASTABLE_DTYPES",
    "SCHEDULES",
    "BF16Master",
    "EngineBase",
    "OneCycle",
    "ParamGroupsFn",
    "Precision",
    "Schedule",
    "SharedEngineArgs",
    "TrainingConfig",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "batch_triple",
    "build_optimizer",
    "build_schedule",
    "cast_parameters",
    "check_config_keys",
    "check_one_optimizer",
    "check_schedule_section",
    "clip_gradients",
    "current_lrs",
    "handled_keys",
    "no_weight_decay",
    "nothing_to_train",
    "parse_config",
    "parse_precision",
    "read_checkpoint_file",
    "resolve_client_schedule",
    "resolve_param_groups",
    "shape_mismatch",
    "stage_param_name",
]
