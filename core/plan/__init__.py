"""What a plan says: capture (torch.fx, torch.export), the cut into stages, liveness, ties,
the plan's own checks, the micro-batches a plan accepts and the weights that fill a
meta-device plan. Choosing split points by cost is :mod:`pipedialect.cost`'s.

Imports :mod:`pipedialect.cost`, :mod:`pipedialect.runtime` and the root leaves, never a room
above them.
:func:`~pipedialect.partition` itself is exported by the package root.
"""

from __future__ import annotations

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
    "LABELS_KEY",
    "BoundaryValue",
    "BufferInfo",
    "DefaultTieAnalyzer",
    "InitWeights",
    "InputSpec",
    "PipelinePlan",
    "analyze_tie_ranks",
    "check_capture_dtype",
    "check_loss_fn",
    "check_tie_objects",
    "compute_liveness",
    "find_tie_groups",
    "from_pretrained",
    "from_safetensors",
    "from_state_dict",
    "input_spec",
    "materialise_stages",
    "prepare_local_stages",
    "retie_parameters",
    "tie_keys",
]
