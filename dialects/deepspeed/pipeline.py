"""The API of Slapo's ``slapo.framework_dialect.deepspeed.pipeline``, under the same names.

Code written against the seed's documentation keeps working: the names and signatures below are
the seed's. The module is an adapter over the DeepSpeed dialect, and the only place where the
seed's shapes live (its stage wrapper's positional tables, the ``-1`` key for the model's
inputs). It does not import deepspeed.

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
(the top level decodes as a list, nested sequences as tuples); its ``keeps_containers`` says so,
and the split-point guards judge what it decodes by that.

The pipeline engine
===================

:func:`deepspeed_pipe_engine` is the DeepSpeed dialect's ``pipe_engine`` under the seed's
signature: the same checks, the same ``PipelineModule`` (see docs/deepspeed.rst). It takes the
config dicts Slapo's ``get_ds_config`` writes: the two keys they carry that DeepSpeed does not
know (:data:`SLAPO_CONFIG_KEYS`) are left out, as DeepSpeed and Slapo's public fork ignore them;
any other key DeepSpeed does not know is refused, as everywhere.
:class:`DeepSpeedPipeStageWrapper` is the dialect's stage wrapper with the seed's constructor;
:func:`analyze_pipeline_module` gives a plan's tables in the seed's format for it (Slapo's
function of the same name). :func:`analyze_tie_ranks` maps tied parameters onto ranks. Unlike
Slapo's, they run on upstream DeepSpeed (no fork) and drop nothing: tied weights across stages
are registered with DeepSpeed's own tie machinery, and several gradient-carrying tensors may
cross one boundary. The wrapper uses :class:`~pipedialect.SchemaCodec` (lossless) unless given
``codec=PathCodec()``, the seed's own wire.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import fx, nn

from pipedialect import ConfigError, PipelinePlan, TensorCodec
from pipedialect.contracts import StageSpec
from pipedialect.sdk import analyze_tie_ranks

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
from ._plugin import DeepSpeedDialect
from ._stage import DeepSpeedStageWrapper

__all__ = [
    "SLAPO_CONFIG_KEYS",
    "DeepSpeedPipeStageWrapper",
    "PathCodec",
    "WrappedTypeCode",
    "analyze_pipeline_module",
    "analyze_tie_ranks",
    "decode_metadata",
    "deepspeed_pipe_engine",
    "encode_metadata",
    "flat_and_name_tensor_list",
    "flatten",
    "get_simple_nested_list_str",
    "unflatten",
    "without_slapo_keys",
]


#: The seed's ``stage_id_2_arg_names`` key for the model's inputs (in data-loader order).
_INPUTS = -1


class DeepSpeedPipeStageWrapper(DeepSpeedStageWrapper):
    """The DeepSpeed dialect's stage wrapper, built from the seed's arguments.

    Args:
        mod: the stage's GraphModule (``plan.stages[stage_id]``).
        stage_id: this stage's index.
        name: the stage's value name in the plan's graph (``"submod_<stage_id>"``).
        total_stages: the number of stages.
        liveness: for every stage id, the names of the values it receives.
        stage_id_2_arg_names: for every stage id, its argument names; ``-1`` maps to the
            model's inputs in data-loader order.
        codec: the boundary codec: :class:`~pipedialect.SchemaCodec` by default,
            :class:`PathCodec` for the seed's wire.
        dynamic_shapes: as for :class:`~pipedialect.StageWrapper`.

    Raises:
        ConfigError: a table has no entry for this stage (or for the next one), or its entries
            do not describe the stage.
    """

    def __init__(
        self,
        mod: fx.GraphModule | nn.Module,
        stage_id: int,
        name: str,
        total_stages: int,
        liveness: Mapping[int, Sequence[str]],
        stage_id_2_arg_names: Mapping[int, Sequence[str]],
        *,
        codec: TensorCodec | None = None,
        dynamic_shapes: bool = False,
    ) -> None:
        spec = _seed_spec(stage_id, name, total_stages, liveness, stage_id_2_arg_names)
        super().__init__(mod, spec, codec=codec, dynamic_shapes=dynamic_shapes)


def _seed_spec(
    stage_id: int,
    name: str,
    total_stages: int,
    liveness: Mapping[int, Sequence[str]],
    arg_names: Mapping[int, Sequence[str]],
) -> StageSpec:
    """The :class:`~pipedialect.contracts.StageSpec` the seed's tables give ``stage_id``."""

    def lookup(table: Mapping[int, Sequence[str]], key: int) -> tuple[str, ...]:
        try:
            return tuple(table[key])
        except KeyError:
            raise ConfigError(
                f"[Stage {stage_id}] no entry for stage {key} in the liveness/argument tables "
                f"(keys: {sorted(table)})"
            ) from None

    inputs = tuple(arg_names.get(_INPUTS, ()))
    in_range = 0 <= stage_id < total_stages  # else the wrapper refuses the stage id
    last = stage_id == total_stages - 1
    return StageSpec(
        stage_id=stage_id,
        num_stages=total_stages,
        name=name,
        input_names=inputs,
        arg_names=lookup(arg_names, stage_id) if in_range else (),
        receives=inputs if stage_id == 0 or not in_range else lookup(liveness, stage_id),
        sends=() if last or not in_range else lookup(liveness, stage_id + 1),
    )


def analyze_pipeline_module(
    plan: PipelinePlan,
) -> tuple[dict[int, list[str]], dict[int, str], dict[int, list[str]]]:
    """The seed's tables of ``plan``: ``(stage_id_2_arg_names, stage_id_2_name, liveness)``.

    What Slapo's ``slapo.pipeline.analyze_pipeline_module`` returns for its partitioned
    module, computed from the plan: ``stage_id_2_arg_names[k]`` the arguments of stage ``k``
    and ``stage_id_2_arg_names[-1]`` the model's inputs, ``stage_id_2_name[k]`` the stage's
    value name, ``liveness[k]`` what stage ``k`` receives. Stage ``k``'s wrapper is
    ``DeepSpeedPipeStageWrapper(plan.stages[k], k, stage_id_2_name[k], plan.num_stages,
    liveness, stage_id_2_arg_names)``.
    """
    arg_names = {_INPUTS: list(plan.input_names)}
    arg_names.update({k: list(names) for k, names in enumerate(plan.stage_arg_names)})
    names = dict(enumerate(plan.stage_names))
    liveness = {k: list(received) for k, received in enumerate(plan.liveness)}
    return arg_names, names, liveness


#: The keys Slapo's DeepSpeed configs carry that DeepSpeed does not know, by path, with what
#: each is for. Slapo's ``get_ds_config`` (in its examples' ``utils.py``, and in
#: ``slapo.framework_dialect.deepspeed.pipeline`` on the branch of its DeepSpeed pipeline tests)
#: writes both into every config; DeepSpeed and Slapo's public fork read neither.
SLAPO_CONFIG_KEYS: Mapping[tuple[str, ...], str] = {
    ("help",): "a free-text description of the config (get_ds_config's desc=)",
    ("pipeline", "sequence_parallel"): (
        "read by Slapo's own engine set-up, which then turns off DeepSpeed's partitioning of "
        "activations and gradients over the tensor-parallel group; a pipeline here has no "
        "tensor-parallel axis (the topology check refuses one), so there is nothing to turn off"
    ),
}


def without_slapo_keys(config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``config`` without the :data:`SLAPO_CONFIG_KEYS` it holds (the caller's dicts
    are left as they are)."""
    out = dict(config)
    for path in SLAPO_CONFIG_KEYS:
        _drop(out, path)
    return out


def _drop(section: dict[str, Any], path: Sequence[str]) -> None:
    """Remove ``path`` from ``section``, copying each dict on the way."""
    head, *rest = path
    if head not in section:
        return
    if not rest:
        del section[head]
        return
    inner = section[head]
    if isinstance(inner, Mapping):
        section[head] = dict(inner)
        _drop(section[head], rest)


def deepspeed_pipe_engine(
    sch_metadata: PipelinePlan, stage_modules: Sequence[nn.Module], **kwargs: Any
) -> nn.Module:
    """DeepSpeed pipeline engine: the ``PipelineModule`` that runs ``stage_modules``.

    ``get_dialect("deepspeed").pipe_engine(sch_metadata, stage_modules, **kwargs)``: every
    argument is checked there, once, as for any dialect.

    Args:
        sch_metadata: the :class:`~pipedialect.PipelinePlan` the stages come from (the seed's
            schedule metadata); its tie groups are registered with DeepSpeed.
        stage_modules: one stage wrapper per pipeline stage, in stage order.
        **kwargs: ``config`` (the DeepSpeed config: a dict may carry
            :data:`SLAPO_CONFIG_KEYS`), ``loss_fn(outputs, labels)`` and
            ``topology`` (a DeepSpeed ``ProcessTopology`` whose pipe axis has one entry per
            stage) are required; ``fp16`` / ``bf16`` must agree with the config;
            ``dynamic_shapes`` (or DeepSpeed's ``dynamic_shape``) lets boundary shapes change
            between micro-batches; ``activation_checkpoint_interval`` (any value >= 1)
            checkpoints each whole stage with torch's non-reentrant checkpoint; ``init_weights``
            fills this rank's stage of a meta-device plan.

    Returns:
        The ``deepspeed.pipe.PipelineModule`` (a subclass registering the plan's ties).

    Raises:
        ConfigError: a required argument is missing or unknown, ``sch_metadata`` is not a
            plan, or the process group is not initialised.
        UnknownConfigKeyError: a config key DeepSpeed does not know, other than Slapo's.
        TopologyError: the topology's pipe axis differs from the number of stages, it has a
            model-parallel axis, or it does not match the world size.
        TieError: a tie cannot be honoured (two different Parameter objects on one stage).
        PlanDisagreementError: the ranks built different plans, topologies or options.
    """
    config = kwargs.get("config")
    if isinstance(config, Mapping):
        kwargs["config"] = without_slapo_keys(config)
    return DeepSpeedDialect().pipe_engine(sch_metadata, stage_modules, **kwargs)
