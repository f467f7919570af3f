"""The API of Slapo's ``slapo.framework_dialect.deepspeed.pipeline``, under the same names.

Code written against the seed's documentation keeps working: the names and signatures below are
the seed's. This module does not import deepspeed.

The path codec
==============

:func:`flatten` turns a list of boundary values into one tensor per leaf plus metadata
``[(<path>, <type>), ...]``; :func:`encode_metadata` writes it as the string
``"<path>,<type>|<path>,<type>|..."`` that travels as the last wire tensor;
:func:`decode_metadata` and :func:`unflatten` undo both. ``<path>`` is the leaf's position,
one index per level joined with dots (the paths of ``t1`` and ``t2`` are ``"0.0"``, ``"0.1"`` in
``[[t1, t2]]`` and ``"0.0"``, ``"1.0"`` in ``[[t1], [t2]]``); ``<type>`` is a
:class:`WrappedTypeCode` value. For example ``[t0, (t1, None), 3]`` gives
``"0,0|1.0,0|1.1,2|2,1"`` and the wire tensors ``(t0, t1, tensor(0), tensor(3))``.

Compatibility with Slapo 0.0.3
    On every value Slapo 0.0.3 accepts (lists, tuples and dict values, nested, of tensors,
    ``None``, ``bool``, ``int`` and ``float``) the metadata string is Slapo's, byte for byte,
    and the wire tensors are Slapo's, except that a Python ``float`` travels as a float64
    tensor instead of float32 (the metadata does not change), so it keeps its precision. The
    one exception: Slapo iterates a *top-level* dict over its keys; :func:`flatten` takes its
    values, as it does for nested dicts.

Fixed Slapo bugs
    An empty output encodes to ``""``, which decodes to ``[]`` and round-trips (Slapo failed);
    floats keep float64 precision; an int outside int64, a str or any other object raises
    :class:`~pipedialect.UnsupportedValueError` naming its path (e.g. ``"1.0"``); malformed
    metadata (a bad piece, a path given twice, a path through a leaf, a tensor count that does
    not match) raises :class:`~pipedialect.MetadataError` naming the bad piece, never an
    ``IndexError`` or ``KeyError``; :func:`get_simple_nested_list_str` prints every value
    (dicts and strings included) instead of raising; :func:`flat_and_name_tensor_list`
    itemises every list, tuple and dict.

What the seed format cannot express (use :class:`~pipedialect.SchemaCodec` instead)
    Every list, tuple, ``torch.Size`` and dict comes back as a tuple; dict keys are lost; an
    empty container comes back as ``()`` when a later sibling has a path, and vanishes at the
    end of its parent (``[t0, []]`` comes back as ``(t0,)``); the whole empty output is the
    only empty value that survives. ``bool``, ``int`` and ``float`` keep their type; every
    scalar and every ``None`` costs one wire tensor; the receiver must read the metadata
    tensor (a device-to-host copy) to decode.

:class:`PathCodec` puts this codec behind the :class:`~pipedialect.TensorCodec` interface
(the top level decodes as a list, nested sequences as tuples).

The pipeline engine
===================

:class:`DeepSpeedPipeStageWrapper` runs one stage inside DeepSpeed's ``PipelineModule``;
:func:`deepspeed_pipe_engine` builds that ``PipelineModule`` from the stage wrappers;
:func:`analyze_tie_ranks` maps tied parameters onto ranks. Unlike Slapo's, they run on upstream
DeepSpeed (no fork) and drop nothing:

- tied weights across stages are registered with DeepSpeed's own tie machinery: equal at start,
  gradients all-reduced every step, counted once in gradient norms, saved once in checkpoints;
- the stage wrappers use :class:`~pipedialect.SchemaCodec` (lossless) and the wire layout of
  ``pipedialect.wire`` (floats that need no gradient are bit-cast, so DeepSpeed gives none to
  them); several gradient-carrying tensors may cross one boundary;
- every argument, the topology and the ties are checked before the first collective call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from pipedialect.agreement import check_plan_agreement
from pipedialect.ties import analyze_tie_ranks

from ._build import build_pipeline_module
from ._codec_path import (
    PathCodec,
    WrappedTypeCode,
    decode_metadata,
    encode_metadata,
    flat_and_name_tensor_list,
    flatten,
    get_simple_nested_list_str,
    unflatten,
)
from ._stage import DeepSpeedPipeStageWrapper

__all__ = [
    "DeepSpeedPipeStageWrapper",
    "PathCodec",
    "WrappedTypeCode",
    "analyze_tie_ranks",
    "decode_metadata",
    "deepspeed_pipe_engine",
    "encode_metadata",
    "flat_and_name_tensor_list",
    "flatten",
    "get_simple_nested_list_str",
    "unflatten",
]


def deepspeed_pipe_engine(
    sch_metadata: Any, stage_modules: Sequence[nn.Module], **kwargs: Any
) -> nn.Module:
    """DeepSpeed pipeline engine: the ``PipelineModule`` that runs ``stage_modules``.

    Args:
        sch_metadata: the :class:`~pipedialect.PipelinePlan` the stages come from (Slapo's
            ``ScheduleMetadata`` with ``tie_weights`` is accepted too); its tie groups are
            registered with DeepSpeed.
        stage_modules: one stage wrapper per pipeline stage, in stage order.
        **kwargs: ``config`` (the DeepSpeed config), ``loss_fn(outputs, labels)`` and
            ``topology`` (a DeepSpeed ``ProcessTopology`` whose pipe axis has one entry per
            stage) are required; ``fp16`` / ``bf16`` must agree with the config;
            ``dynamic_shapes`` (or DeepSpeed's ``dynamic_shape``) lets boundary shapes change
            between micro-batches; ``activation_checkpoint_interval`` (any value >= 1)
            checkpoints each whole stage with torch's non-reentrant checkpoint.

    Returns:
        The ``deepspeed.pipe.PipelineModule`` (a subclass registering the plan's ties).

    Raises:
        ConfigError: a required argument is missing or unknown, or the process group is not
            initialised.
        TopologyError: the topology's pipe axis differs from the number of stages, it has a
            model-parallel axis, or it does not match the world size.
        TieError: a tie cannot be honoured (two different Parameter objects on one stage).
        PlanDisagreementError: the ranks built different plans, topologies or options.
    """
    check_plan_agreement(sch_metadata, dialect="deepspeed", options=kwargs, stages=stage_modules)
    return build_pipeline_module(sch_metadata, stage_modules, **kwargs)
