"""What a plan says: capture (torch.fx, torch.export), the cut into stages, liveness, ties,
the plan's own checks, automatic balancing, the micro-batches a plan accepts and the
weights that fill a meta-device plan.

Imports :mod:`pipedialect.runtime` and the root leaves, never a room above it.
:func:`~pipedialect.partition` itself is exported by the package root.
"""

from __future__ import annotations

from .balance import (
    DEFAULT_BANDWIDTH,
    DEFAULT_FLOPS_PER_SECOND,
    BalanceMethod,
    ModelProfile,
    PlanCosts,
    StageCosts,
    choose_split_points,
    plan_costs,
    predicted_bubble,
    profile_model,
)
from .batches import LABELS_KEY, InputSpec, check_loss_fn, input_spec
from .liveness import compute_liveness
from .partition import BoundaryValue, BufferInfo, PipelinePlan, check_capture_dtype
from .ties import (
    DefaultTieAnalyzer,
    analyze_tie_ranks,
    check_tie_objects,
    find_tie_groups,
    retie_parameters,
    tie_keys,
)
from .weights import (
    InitWeights,
    from_pretrained,
    from_safetensors,
    from_state_dict,
    materialise_stages,
    prepare_local_stages,
)

__all__ = [
    "DEFAULT_BANDWIDTH",
    "DEFAULT_FLOPS_PER_SECOND",
    "LABELS_KEY",
    "BalanceMethod",
    "BoundaryValue",
    "BufferInfo",
    "DefaultTieAnalyzer",
    "InitWeights",
    "InputSpec",
    "ModelProfile",
    "PipelinePlan",
    "PlanCosts",
    "StageCosts",
    "analyze_tie_ranks",
    "check_capture_dtype",
    "check_loss_fn",
    "check_tie_objects",
    "choose_split_points",
    "compute_liveness",
    "find_tie_groups",
    "from_pretrained",
    "from_safetensors",
    "from_state_dict",
    "input_spec",
    "materialise_stages",
    "plan_costs",
    "predicted_bubble",
    "prepare_local_stages",
    "profile_model",
    "retie_parameters",
    "tie_keys",
]
