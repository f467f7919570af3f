"""What runs a stage: the stage wrapper, the wire and its codecs, module state across
recomputation, the checks every rank agrees on, process grids and the local launcher.

The bottom room: it imports only :mod:`pipedialect.contracts` and
:mod:`pipedialect.errors`. ``launch`` is imported from :mod:`pipedialect.runtime.launch`
(the name would shadow that module here).
"""

from __future__ import annotations

from .agreement import ARRIVAL_SECONDS, agree_on_error, agreed
from .codec import SchemaCodec
from .launch import free_port
from .micro_batches import check_inputs, kept_loss, pull_micro_batches
from .module_state import UpdatedBuffers, preserved_state, recompute_with_state
from .nonfinite import (
    first_nonfinite_grad,
    first_nonfinite_loss,
    nonfinite_grad_error,
    nonfinite_loss_error,
    root_nonfinite,
)
from .plan_agreement import check_frozen_ties, check_plan_agreement
from .randomness import (
    ReferenceStreams,
    StageRandomness,
    begin_streams,
    drawing_from,
    not_counted,
    stream_seed,
)
from .sharded import (
    copy_full_into,
    counted_square_norm,
    gathered,
    is_sharded,
    local_part,
    local_slice,
    shard_like,
)
from .stage import StageWrapper, check_trainable, record_trainable, stage_root
from .topology import (
    GridCoord,
    GridTopology,
    check_topology,
    check_topology_object,
    check_world_size,
    join_process_group,
    joined_world_size,
)
from .wire import pass_through, read_layout

__all__ = [
    "ARRIVAL_SECONDS",
    "GridCoord",
    "GridTopology",
    "ReferenceStreams",
    "SchemaCodec",
    "StageRandomness",
    "StageWrapper",
    "UpdatedBuffers",
    "agree_on_error",
    "agreed",
    "begin_streams",
    "check_frozen_ties",
    "check_inputs",
    "check_plan_agreement",
    "check_topology",
    "check_topology_object",
    "check_trainable",
    "check_world_size",
    "copy_full_into",
    "counted_square_norm",
    "drawing_from",
    "first_nonfinite_grad",
    "first_nonfinite_loss",
    "free_port",
    "gathered",
    "is_sharded",
    "join_process_group",
    "joined_world_size",
    "kept_loss",
    "local_part",
    "local_slice",
    "nonfinite_grad_error",
    "nonfinite_loss_error",
    "not_counted",
    "pass_through",
    "preserved_state",
    "pull_micro_batches",
    "read_layout",
    "recompute_with_state",
    "record_trainable",
    "root_nonfinite",
    "shard_like",
    "stage_root",
    "stream_seed",
]
