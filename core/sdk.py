"""What a dialect is written with: one module for the authors of pipeline runtimes.

A dialect (built in or a third party's) imports what it needs from here, and the built-in ones
import nothing else of the core but :mod:`pipedialect.contracts`, :mod:`pipedialect.errors` and
the package root (``tests/project/test_layout.py`` checks it). Every name is defined in the
room that owns its concept and only re-exported here, so the module is the dialect-facing
surface of the core, not another place where code lives. It re-exports every contract (the
value types and protocols of :mod:`pipedialect.contracts`) and every exception and warning of
:mod:`pipedialect.errors`, from their own ``__all__``; its other names, by what they are for:

Registering a dialect
    :data:`hookimpl`, :class:`~pipedialect.dialect.Dialect` and what its two build hooks receive
    (:class:`~pipedialect.dialect.PipelineRequest`, :class:`~pipedialect.dialect.EngineRequest`,
    :class:`~pipedialect.dialect.NoOptions`, :data:`~pipedialect.dialect.ENGINE_FEATURES`),
    :func:`~pipedialect.dialect.given_options`, :func:`~pipedialect.dialect.check_tensor_axis`,
    and the default topology :class:`~pipedialect.runtime.topology.GridTopology`.

Plans and stages
    :class:`~pipedialect.plan.partition.PipelinePlan`,
    :class:`~pipedialect.runtime.stage.StageWrapper` and
    :func:`~pipedialect.runtime.stage.stage_root` (the module a stage's parameter names come
    from, whether or not it is wrapped); :func:`~pipedialect.plan.weights.prepare_local_stages`;
    tied parameters (:class:`~pipedialect.plan.ties.DefaultTieAnalyzer`,
    :func:`~pipedialect.plan.ties.analyze_tie_ranks`,
    :func:`~pipedialect.plan.ties.retie_parameters`, :func:`~pipedialect.plan.ties.tie_keys`);
    the model's inputs (:func:`~pipedialect.plan.batches.input_spec`).

The wire and module state
    :func:`~pipedialect.runtime.wire.pass_through`, :func:`~pipedialect.runtime.wire.read_layout`,
    :func:`~pipedialect.runtime.wire.leaf_paths`;
    :func:`~pipedialect.runtime.module_state.preserved_state`,
    :func:`~pipedialect.runtime.module_state.recompute_with_state`; the stages' random streams
    (:func:`~pipedialect.runtime.randomness.begin_streams`,
    :func:`~pipedialect.runtime.randomness.not_counted`) and trainability fixed at build
    (:func:`~pipedialect.runtime.stage.check_trainable`); the parameters a stage writes in
    forward (:func:`~pipedialect.plan.ties.written_in_forward`).

Ranks that agree
    :func:`~pipedialect.runtime.topology.check_topology`,
    :func:`~pipedialect.runtime.topology.check_world_size`,
    :func:`~pipedialect.runtime.topology.joined_world_size`,
    :func:`~pipedialect.runtime.topology.join_with_deadline`;
    :func:`~pipedialect.runtime.agreement.agreed`,
    :func:`~pipedialect.runtime.agreement.agree_on_error`,
    :func:`~pipedialect.runtime.plan_agreement.check_frozen_ties`,
    :func:`~pipedialect.runtime.micro_batches.check_inputs`,
    :func:`~pipedialect.runtime.micro_batches.pull_micro_batches`,
    :func:`~pipedialect.runtime.micro_batches.kept_loss`; non-finite losses and gradients
    (:func:`~pipedialect.runtime.nonfinite.first_nonfinite_loss`,
    :func:`~pipedialect.runtime.nonfinite.first_nonfinite_grad`,
    :func:`~pipedialect.runtime.nonfinite.nonfinite_loss_error`,
    :func:`~pipedialect.runtime.nonfinite.nonfinite_grad_error`,
    :func:`~pipedialect.runtime.nonfinite.root_nonfinite`); sharded tensors
    (:func:`~pipedialect.runtime.sharded.is_sharded`,
    :func:`~pipedialect.runtime.sharded.local_part`,
    :func:`~pipedialect.runtime.sharded.gathered`,
    :func:`~pipedialect.runtime.sharded.counted_square_norm`).

DeepSpeed's training semantics, for engines that do not run DeepSpeed
    :class:`~pipedialect.engine.EngineBase` and the shared arguments it takes
    (:class:`~pipedialect.engine.SharedEngineArgs`); the config
    (:class:`~pipedialect.engine.config.TrainingConfig`,
    :func:`~pipedialect.engine.config.parse_config`,
    :func:`~pipedialect.engine.config.batch_triple`,
    :func:`~pipedialect.engine.config.check_config_keys`,
    :func:`~pipedialect.engine.config.check_one_optimizer`,
    :func:`~pipedialect.engine.config.build_optimizer`,
    :func:`~pipedialect.engine.config.clip_gradients`); parameter groups
    (:data:`~pipedialect.engine.param_groups.ParamGroupsFn`,
    :func:`~pipedialect.engine.param_groups.resolve_param_groups`); precision
    (:class:`~pipedialect.engine.precision.Precision`,
    :func:`~pipedialect.engine.precision.cast_parameters`).

Checkpoints and traces
    :mod:`~pipedialect.engine.checkpoint_files` (a module, used through its name:
    ``checkpoint_files.publish(...)``), :func:`~pipedialect.engine.read_checkpoint_file`,
    :func:`~pipedialect.engine.shape_mismatch`, :func:`~pipedialect.engine.stage_param_name`;
    :func:`~pipedialect.trace.patch_attribute` for a dialect's ``instrument`` hook.

No core module imports this one: it sits above every room, as the dialects do.
"""

from __future__ import annotations

from . import contracts as _contracts
from . import errors as _errors
from .contracts import *  # every contract: contracts.__all__
from .dialect import (
    ENGINE_FEATURES,
    Dialect,
    EngineRequest,
    NoOptions,
    PipelineRequest,
    check_tensor_axis,
    given_options,
)
from .engine import (
    EngineBase,
    ParamGroupsFn,
    Precision,
    SharedEngineArgs,
    TrainingConfig,
    batch_triple,
    build_optimizer,
    cast_parameters,
    check_config_keys,
    check_one_optimizer,
    checkpoint_files,
    clip_gradients,
    parse_config,
    read_checkpoint_file,
    resolve_param_groups,
    shape_mismatch,
    stage_param_name,
)
from .errors import *  # every exception and warning: errors.__all__
from .hookspecs import hookimpl
from .plan import (
    DefaultTieAnalyzer,
    PipelinePlan,
    analyze_tie_ranks,
    input_spec,
    prepare_local_stages,
    retie_parameters,
    tie_keys,
)
from .plan.ties import written_in_forward
from .runtime import (
    GridTopology,
    StageWrapper,
    agree_on_error,
    agreed,
    begin_streams,
    check_frozen_ties,
    check_inputs,
    check_topology,
    check_trainable,
    check_world_size,
    counted_square_norm,
    first_nonfinite_grad,
    first_nonfinite_loss,
    gathered,
    is_sharded,
    joined_world_size,
    kept_loss,
    local_part,
    nonfinite_grad_error,
    nonfinite_loss_error,
    not_counted,
    pass_through,
    preserved_state,
    pull_micro_batches,
    read_layout,
    recompute_with_state,
    root_nonfinite,
    stage_root,
)
from .runtime.topology import join_with_deadline
from .runtime.wire import leaf_paths
from .trace import patch_attribute

#: The module's own names; every contract and every error is added from their ``__all__``.
__all__ = [
    "ENGINE_FEATURES",
    "DefaultTieAnalyzer",
    "Dialect",
    "EngineBase",
    "EngineRequest",
    "GridTopology",
    "NoOptions",
    "ParamGroupsFn",
    "PipelinePlan",
    "PipelineRequest",
    "Precision",
    "SharedEngineArgs",
    "StageWrapper",
    "TrainingConfig",
    "agree_on_error",
    "agreed",
    "analyze_tie_ranks",
    "batch_triple",
    "begin_streams",
    "build_optimizer",
    "cast_parameters",
    "check_config_keys",
    "check_frozen_ties",
    "check_inputs",
    "check_one_optimizer",
    "check_tensor_axis",
    "check_topology",
    "check_trainable",
    "check_world_size",
    "checkpoint_files",
    "clip_gradients",
    "counted_square_norm",
    "first_nonfinite_grad",
    "first_nonfinite_loss",
    "gathered",
    "given_options",
    "hookimpl",
    "input_spec",
    "is_sharded",
    "join_with_deadline",
    "joined_world_size",
    "kept_loss",
    "leaf_paths",
    "local_part",
    "nonfinite_grad_error",
    "nonfinite_loss_error",
    "not_counted",
    "parse_config",
    "pass_through",
    "patch_attribute",
    "prepare_local_stages",
    "preserved_state",
    "pull_micro_batches",
    "read_checkpoint_file",
    "read_layout",
    "recompute_with_state",
    "resolve_param_groups",
    "retie_parameters",
    "root_nonfinite",
    "shape_mismatch",
    "stage_param_name",
    "stage_root",
    "tie_keys",
    "written_in_forward",
]
__all__ += _contracts.__all__
__all__ += _errors.__all__
__all__.sort()
