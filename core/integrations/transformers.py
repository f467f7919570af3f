"""Hugging Face ``Trainer`` through a pipeline: :class:`PipelineTrainer`.

``PipelineTrainer(model=..., args=PipelineTrainingArguments(..., dialect="torch"),
train_dataset=...)`` is a ``transformers.Trainer`` whose steps run through a pipedialect engine:
when it is built, the model is partitioned (``torch.export`` capture on one collated
micro-batch) and every rank builds its stages and engine; then Trainer's own loop -- data
loading and collators, logging, callbacks, evaluation and metrics, checkpoints, resuming --
drives ``engine.train_batch``/``eval_batch``. Launched with ``torchrun --nproc_per_node N``, one
process per pipeline rank (times the data-parallel replicas); the ``local`` dialect runs every
stage in one process.

[Note: Trainer's step through an engine]
Trainer fetches a whole optimizer step (``gradient_accumulation_steps`` micro-batches) in
``get_batch_samples`` before any forward, then calls ``training_step`` once per micro-batch and
steps the optimizer after the last. Here ``get_batch_samples`` keeps the step's micro-batches
and counts their label tokens (``num_items_in_batch``) over this data-parallel replica (and
sums the count over the data axis only: Trainer's own count gathers over *every* process, which
would count each pipeline rank's copy of the same batch); ``training_step`` runs the engine's
``train_batch`` over all of them on the step's last micro-batch (forward, backward, clipping,
the optimizer and the LR schedule run inside it) and returns the step's loss there and zero on
the others, so Trainer's running sum grows by exactly the step's loss. Trainer's optimizer and
scheduler are proxies whose ``step()`` does nothing (the engine has stepped); the learning rate
Trainer logs is the one recorded before the engine's step, and ``grad_norm`` is the engine's
global gradient norm (:class:`~pipedialect.contracts.TrainerEngine`, set in :meth:`log`).

[Note: the step's loss]
Trainer's logged loss of a step is token-weighted over the whole step: the model's loss
function divides each micro-batch's summed token loss by the step's token count ``N``, and the
step's loss is their sum. The engines divide each micro-batch loss by
``gradient_accumulation_steps`` (DeepSpeed's semantics) and average over the replicas, so the
last stage's loss function -- the model's own ``loss_function`` on the last stage's logits --
is multiplied back by ``gradient_accumulation_steps`` times the replicas (``N`` then counts
every replica's tokens). ``N``, the factor and the micro-batch's number travel with its labels
(the dict micro-batch's ``"labels"`` is ``(labels, N, factor, number)``), so the loss function
holds no state and evaluation passes its own (each batch's token mean, factor 1, as Trainer
evaluates). A model whose loss takes no ``num_items_in_batch`` gets factor 1: the engine's
``1/gas`` is then Trainer's division by the accumulation steps.

[Note: one data stream per replica]
Under ``torchrun`` accelerate shards Trainer's data loaders over *all* processes, so each
pipeline rank of one replica would read other batches. The loaders here are sharded over the
data-parallel axis only: every pipeline rank of a replica reads the same batches, in the
single-process order (the seedable sampler is seeded alike on every rank). Every rank runs
Trainer's whole loop, since ``train_batch``, ``eval_batch``, the loss gather and the checkpoint
saves are collectives.

[Note: evaluation through the last stage]
The logits of an evaluation batch exist on the last stage only. While :meth:`evaluation_loop`
runs, the last stage's loss function keeps each micro-batch's loss and predictions (the logits,
or what ``preprocess_logits_for_metrics`` makes of them, moved to the CPU at once: what
``eval_accumulation_steps`` asks for, at every step), by the micro-batch's number; at the end
each replica's last stage broadcasts them to every rank, in Trainer's order (batch ``i`` of
replica ``r`` is batch ``i * replicas + r``, as accelerate shards them), and every rank computes
``eval_loss`` (the mean of the batches' losses) and ``compute_metrics`` from them, as Trainer
does from its gathered arrays. Eval batches run ``gradient_accumulation_steps`` at a time (one
``eval_batch``); a short last group is filled with copies of its last batch, whose results are
dropped, and so are the batches accelerate repeats to give every replica as many.

[Note: checkpoints both ways]
A ``checkpoint-N`` folder holds what plain ``Trainer`` writes -- ``model.safetensors`` (the
consolidated weights), ``optimizer.pt`` and ``scheduler.pt`` in the layout plain ``Trainer``'s
optimizer over the unsplit model has (its two weight-decay groups, parameters in the model's
order), ``rng_state*.pth``, ``trainer_state.json``, the tokenizer -- so plain ``Trainer``
resumes it exactly, and beside them ``pipeline/``: a portable checkpoint of every rank's stages
(:mod:`pipedialect.checkpoint`), which :class:`PipelineTrainer` resumes from, each rank reading
its own stages, on any dialect and layout. A folder plain ``Trainer`` wrote (no ``pipeline/``)
resumes too: the weights through Trainer's own loading into the model the stages share, and the
optimizer's state mapped from ``optimizer.pt`` onto each rank's parameters by name.

What Trainer settings mean here, and which are refused (by name, when the trainer is built):
:data:`REFUSED_TRAINING_ARGUMENTS` and ``docs/huggingface.rst``.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import transformers
from torch import nn
from transformers.trainer_pt_utils import EvalLoopContainer
from transformers.trainer_utils import EvalLoopOutput, EvalPrediction, denumpify_detensorize

from .. import checkpoint as portable
from ..contracts import Capability, Topology, TrainerEngine
from ..errors import (
    CheckpointError,
    ConfigError,
    MissingCapabilityError,
    PipeDialectWarning,
    TopologyError,
    TrainingArgumentError,
)
from ..plan.partition import PipelinePlan, partition
from ..plugins import get_dialect

__all__ = [
    "REFUSED_TRAINING_ARGUMENTS",
    "SUPPORTED_TRANSFORMERS",
    "PipelineTrainer",
    "PipelineTrainingArguments",
    "check_trainer",
    "pp_plan_split_points",
]

logger = logging.getLogger(__name__)

#: The tag of the portable checkpoint inside each of Trainer's ``checkpoint-N`` folders.
PIPELINE_TAG = "pipeline"
#: Trainer's file names in a checkpoint folder (``transformers.trainer``'s constants).
OPTIMIZER_NAME, SCHEDULER_NAME, TRAINING_ARGS_NAME = (
    "optimizer.pt",
    "scheduler.pt",
    ("training_args.bin"),
)

#: The transformers releases this integration is tested with: the oldest (tests/integrations/
#: test_hf_versions.py) and the major release it stays below (pyproject's ``hf`` extra).
SUPPORTED_TRANSFORMERS = ("5.24.0", "6")

#: The ``optim`` values built from parameter groups alone (the others need the model's modules
#: or per-layer state, which a rank holding some stages does not have).
_GROUP_OPTIMIZERS = frozenset(
    {"adamw_torch", "adamw_torch_fused", "adafactor", "sgd", "adagrad", "rmsprop"}
)

#: What each padded batch key is padded with ([Note: one captured length]); ``input_ids`` takes
#: the tokenizer's (or the model config's) pad token.
_PAD_VALUES: dict[str, int] = {
    "attention_mask": 0,
    "token_type_ids": 0,
    "labels": -100,
    "special_tokens_mask": 1,
}


@dataclasses.dataclass
class PipelineTrainingArguments(transformers.TrainingArguments):
    """``TrainingArguments`` with how :class:`PipelineTrainer` pipelines the model.

    ``HfArgumentParser(PipelineTrainingArguments)`` reads them from the command line
    (``--dialect torch --split_points model.layers.1``). The split is ``split_points``
    (module paths, each stage ends after one), or ``num_stages`` chosen by ``balance``
    (:func:`pipedialect.partition`), or, with neither, the model config's
    ``base_model_pp_plan`` spread over one stage per pipeline rank
    (:func:`pp_plan_split_points`).
    """

    dialect: str = dataclasses.field(
        default="torch",
        metadata={"help": "The pipedialect dialect: torch, deepspeed, local, or a plugin's."},
    )
    split_points: list[str] | None = dataclasses.field(
        default=None,
        metadata={"help": "Module paths to split after, e.g. model.layers.1 (one per cut)."},
    )
    num_stages: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "Pipeline stages (split points chosen by --balance or the model's "
            "base_model_pp_plan); default: one per pipeline rank."
        },
    )
    balance: str | None = dataclasses.field(
        default=None,
        metadata={"help": "The cost model choosing split points: parameters, flops, memory, time."},
    )
    pipeline_schedule: str | None = dataclasses.field(
        default=None,
        metadata={"help": "The torch dialect's schedule (1f1b, gpipe, interleaved_1f1b, ...)."},
    )
    data_parallel: int | None = dataclasses.field(
        default=None,
        metadata={"help": "Data-parallel replicas of the pipeline; default: processes / stages."},
    )
    data_parallel_mode: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "fsdp shards each stage over the replicas (the torch dialect's "
            "data_parallel_mode); default: whole stages on every replica."
        },
    )
    tensor_parallel: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "Ranks of the tensor axis each stage is sharded over (the torch dialect), "
            "by the model's base_model_tp_plan; default: 1 (no tensor parallelism)."
        },
    )
    recompute: list[str] | None = dataclasses.field(
        default=None,
        metadata={
            "help": "Module paths or globs recomputed in backward (model.layers.*); "
            "--gradient_checkpointing chooses the model's layers."
        },
    )
    pad_to_length: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "The sequence length every batch is padded to (the stages run one shape); "
            "default: the longest row of the data sets, rounded up to a multiple of 8."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()  # type: ignore[no-untyped-call]
        for name in ("num_stages", "data_parallel", "tensor_parallel", "pad_to_length"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TrainingArgumentError(
                    f"{name} must be a positive integer or None, got {value!r}", argument=name
                )
            if value is not None and value < 1:
                raise TrainingArgumentError(
                    f"{name} must be a positive integer or None, got {value!r}", argument=name
                )


#: Every Trainer setting refused when the trainer is built, and why.
REFUSED_TRAINING_ARGUMENTS: dict[str, str] = {
    "fp16": "fp16 needs a gradient scaler whose scale, unscale and skip span every stage; "
    "train in fp32 or bf16",
    "bf16_full_eval": "it casts the model for evaluation, and the stages hold its parameters",
    "fp16_full_eval": "it casts the model for evaluation, and the stages hold its parameters",
    "torch_compile": "the stages are captured graphs; compiling them is not implemented",
    "gradient_checkpointing_kwargs": "the stages recompute with non-reentrant "
    "torch.utils.checkpoint (the same numbers); only use_reentrant is accepted",
    "label_smoothing_factor": "the label smoother is not wired to the last stage's logits",
    "compute_loss_func": "the loss runs on the last stage, as the model's own loss_function",
    "compute_loss": "a subclass's compute_loss would not run: the loss runs on the last stage",
    "training_step": "a subclass's training_step would not run: the engine runs the step",
    "prediction_step": "a subclass's prediction_step would not run: eval_batch runs it",
    "optimizers": "objects built over the unsplit model's parameters (other stages' too); pass "
    "optimizer_cls_and_kwargs, or set optim and its arguments",
    "optim": "this optimizer needs the model's modules or per-layer state; use one built from "
    "parameter groups (adamw_torch, adamw_torch_fused, adafactor, sgd, adagrad, rmsprop) or "
    "optimizer_cls_and_kwargs",
    "optim_target_modules": "it selects modules of the unsplit model for the optimizer",
    "lr_scheduler_type": "reduce_lr_on_plateau and greedy are stepped by Trainer from metrics, "
    "outside the engine's step",
    "model_init": "the model is partitioned when the trainer is built; pass model=",
    "auto_find_batch_size": "the stages are specialised to one micro-batch shape",
    "per_device_eval_batch_size": "the stages are specialised to one micro-batch shape: it must "
    "equal per_device_train_batch_size",
    "dataloader_drop_last": "a short last batch has another shape than the stages were "
    "captured with: set dataloader_drop_last=True (or use a dataset whose length the batch "
    "size divides)",
    "neftune_noise_alpha": "it hooks the unsplit model's embedding, which the stages do not run",
    "use_liger_kernel": "it patches the model's modules after capture",
    "debug": "underflow_overflow hooks the eager modules, which the stages do not run",
    "include_num_input_tokens_seen": "Trainer gathers the count over every process, which "
    "counts each pipeline rank's copy of a batch",
    "include_for_metrics": "EvalPrediction's inputs and losses are not gathered; "
    "compute_metrics gets the predictions and the labels",
    "batch_eval_metrics": "compute_metrics runs once over the whole eval set",
    "eval_do_concat_batches": "the predictions are concatenated over the batches",
    "label_names": "the labels of a micro-batch are its 'labels' key",
    "accelerator_config": "split_batches and dispatch_batches shard or dispatch batches over "
    "every process, not over the data-parallel axis",
    "fsdp": "a pipeline replaces it",
    "deepspeed": "Trainer's DeepSpeed wraps the unsplit model; use "
    "PipelineTrainingArguments(dialect='deepspeed')",
    "parallelism_config": "a pipeline replaces it",
    "train_sampling_strategy": "batch_rebalance balances batches over every process",
}


def _value(setting: Any) -> str:
    """An enum-valued TrainingArguments field as its string."""
    return str(getattr(setting, "value", setting))


def _checkpointing(args: transformers.TrainingArguments) -> tuple[bool, dict[str, Any]]:
    """Whether activation checkpointing is asked for, and its arguments (transformers 5 calls it
    ``activation_checkpointing``, earlier releases ``gradient_checkpointing``)."""
    on = bool(getattr(args, "activation_checkpointing", False)) or bool(
        getattr(args, "gradient_checkpointing", False)
    )
    kwargs = getattr(args, "activation_checkpointing_kwargs", None) or getattr(
        args, "gradient_checkpointing_kwargs", None
    )
    return on, dict(kwargs or {})


def _refused(trainer: PipelineTrainer) -> list[str]:
    """The names of the settings of ``trainer`` that :data:`REFUSED_TRAINING_ARGUMENTS` lists."""
    a = trainer.args
    accel = a.accelerator_config
    _, checkpointing_kwargs = _checkpointing(a)
    found = {
        "fp16": a.fp16,
        "bf16_full_eval": a.bf16_full_eval,
        "fp16_full_eval": a.fp16_full_eval,
        "torch_compile": a.torch_compile,
        "gradient_checkpointing_kwargs": bool(set(checkpointing_kwargs) - {"use_reentrant"}),
        "label_smoothing_factor": a.label_smoothing_factor != 0,
        "compute_loss_func": getattr(trainer, "compute_loss_func", None) is not None,
        "optimizers": not isinstance(trainer.optimizer, _EngineOptimizer | type(None))
        or not isinstance(trainer.lr_scheduler, _EngineScheduler | type(None)),
        "optim": trainer.optimizer_cls_and_kwargs is None
        and _value(a.optim) not in _GROUP_OPTIMIZERS,
        "optim_target_modules": getattr(a, "optim_target_modules", None) is not None,
        "lr_scheduler_type": _value(a.lr_scheduler_type) in ("reduce_lr_on_plateau", "greedy"),
        "model_init": trainer.model_init is not None,
        "auto_find_batch_size": a.auto_find_batch_size,
        "per_device_eval_batch_size": a.per_device_eval_batch_size != a.per_device_train_batch_size,
        "dataloader_drop_last": not a.dataloader_drop_last
        and _short_last_batch(trainer, a.per_device_train_batch_size),
        "neftune_noise_alpha": a.neftune_noise_alpha is not None,
        "use_liger_kernel": bool(getattr(a, "use_liger_kernel", False)),
        "debug": bool(a.debug),
        "include_num_input_tokens_seen": _value(a.include_num_input_tokens_seen)
        not in ("no", "False"),
        "include_for_metrics": bool(getattr(a, "include_for_metrics", None)),
        "batch_eval_metrics": bool(getattr(a, "batch_eval_metrics", False)),
        "eval_do_concat_batches": not getattr(a, "eval_do_concat_batches", True),
        "label_names": a.label_names is not None and list(a.label_names) != ["labels"],
        "accelerator_config": bool(
            getattr(accel, "split_batches", False) or getattr(accel, "dispatch_batches", None)
        ),
        "fsdp": bool(a.fsdp),
        "deepspeed": a.deepspeed is not None,
        "parallelism_config": getattr(a, "parallelism_config", None) is not None,
        "train_sampling_strategy": getattr(a, "train_sampling_strategy", None) == "batch_rebalance",
    }
    for method in ("compute_loss", "training_step", "prediction_step"):
        found[method] = getattr(type(trainer), method) is not getattr(PipelineTrainer, method)
    return [name for name, bad in found.items() if bad]


def _datasets(trainer: PipelineTrainer) -> list[Any]:
    """The training and eval data sets the trainer holds (an eval dict's every value)."""
    out: list[Any] = []
    for dataset in (trainer.train_dataset, trainer.eval_dataset):
        out.extend(dataset.values() if isinstance(dataset, Mapping) else [dataset])
    return [d for d in out if d is not None]


def _short_last_batch(trainer: PipelineTrainer, batch_size: int) -> bool:
    """Whether a data set the trainer holds has a length ``batch_size`` does not divide."""
    return any(hasattr(d, "__len__") and len(d) % batch_size for d in _datasets(trainer))


def check_trainer(trainer: PipelineTrainer) -> None:
    """Refuse by name every setting of ``trainer`` that a pipeline cannot honour.

    Raises:
        TrainingArgumentError: naming the first such setting (and listing the others).
    """
    found = _refused(trainer)
    if not found:
        return
    first = found[0]
    others = f" (also refused: {', '.join(found[1:])})" if found[1:] else ""
    raise TrainingArgumentError(
        f"PipelineTrainer cannot honour {first}: {REFUSED_TRAINING_ARGUMENTS[first]}{others}",
        argument=first,
    )


def pp_plan_split_points(model: nn.Module, num_stages: int) -> tuple[str, ...]:
    """Split points spreading the layers of the config's ``base_model_pp_plan`` evenly.

    The plan names the base model's blocks (``"layers"``: a ``ModuleList``); stage ``k`` ends
    after layer ``round((k + 1) * L / num_stages) - 1`` of ``L``, so the stages hold as equal a
    share of the layers as ``L`` allows (the embedding goes with the first, the norm and head
    with the last).

    Raises:
        ConfigError: the config has no pp plan with a list of layers, or ``num_stages`` is not
            between 1 and the number of layers.
    """
    root, name, blocks = _pp_layers(model)
    count = len(blocks)
    if not 1 <= num_stages <= count:
        raise ConfigError(
            f"{num_stages} stages cannot split the {count} layers of {root}{name}; use 1 to "
            f"{count} stages"
        )
    cuts = [round((k + 1) * count / num_stages) - 1 for k in range(num_stages - 1)]
    return tuple(f"{root}{name}.{cut}" for cut in cuts)


def _pp_layers(model: nn.Module) -> tuple[str, str, nn.ModuleList]:
    """``(prefix, name, layers)`` of the config's ``base_model_pp_plan``'s list of layers."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_pp_plan", None) or {}
    prefix = str(getattr(model, "base_model_prefix", ""))
    base = getattr(model, prefix, model) if prefix else model
    root = f"{prefix}." if base is not model else ""
    layers = [
        (name, module)
        for name in plan
        if isinstance(module := getattr(base, name, None), nn.ModuleList)
    ]
    if not layers:
        raise ConfigError(
            f"{type(model).__name__}'s config has no base_model_pp_plan with a list of layers; "
            "pass PipelineTrainingArguments(split_points=[...]) or num_stages="
        )
    name, blocks = layers[0]
    return root, name, blocks


def _checkpointed_layers(model: nn.Module) -> list[str]:
    """The modules Hugging Face's gradient checkpointing recomputes: its
    ``GradientCheckpointingLayer``\\ s (the decoder layers), else the pp plan's layers."""
    layer_cls = getattr(
        getattr(transformers, "modeling_layers", None), "GradientCheckpointingLayer", None
    )
    found: list[str] = []
    if isinstance(layer_cls, type):
        for name, module in model.named_modules():
            if isinstance(module, layer_cls) and not any(
                name.startswith(f"{outer}.") for outer in found
            ):
                found.append(name)
    if found:
        return found
    root, name, blocks = _pp_layers(model)
    return [f"{root}{name}.{i}" for i in range(len(blocks))]


class _EngineOptimizer:
    """What Trainer holds as its optimizer: the engine's, which the engine steps itself.

    ``state_dict``/``load_state_dict`` are the engine optimizer's (this rank's parameters):
    checkpoints go through :meth:`PipelineTrainer._save_optimizer_and_scheduler`, which writes
    plain Trainer's layout ([Note: checkpoints both ways]).
    """

    def __init__(self, engine: TrainerEngine) -> None:
        self.engine = engine

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The engine's optimizer's groups (Trainer reads the learning rate there)."""
        groups: list[dict[str, Any]] = self.engine.optimizer.param_groups
        return groups

    @property
    def state(self) -> Any:
        """The engine's optimizer's state."""
        return self.engine.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        """The engine's optimizer's defaults."""
        defaults: dict[str, Any] = self.engine.optimizer.defaults
        return defaults

    def step(self, closure: Any = None) -> None:
        """Nothing: ``train_batch`` stepped the optimizer."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: the engine drops the gradients after its step."""

    def state_dict(self) -> dict[str, Any]:
        """The engine's optimizer's state dict (this rank's parameters)."""
        state: dict[str, Any] = self.engine.optimizer.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load into the engine's optimizer (a state dict of this rank's parameters)."""
        self.engine.optimizer.load_state_dict(state)


class _EngineScheduler:
    """What Trainer holds as its LR scheduler: the engine's, which the engine steps itself.

    Trainer reads the learning rate after its (no-op) optimizer step, when the engine has
    already stepped the schedule: :meth:`get_last_lr` returns the rates recorded before the
    engine's step, those the step ran with.
    """

    def __init__(self, engine: TrainerEngine) -> None:
        self.engine = engine
        #: The rates of the last step, recorded before ``train_batch``.
        self.step_lrs: list[float] | None = None

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: ``train_batch`` stepped the schedule after the optimizer."""

    def get_last_lr(self) -> list[float]:
        """The rates the last step ran with (before any step: the current ones)."""
        if self.step_lrs is not None:
            return list(self.step_lrs)
        return [float(lr) for lr in self.engine.get_lr()]

    def state_dict(self) -> dict[str, Any]:
        """The engine's schedule's state dict."""
        state: dict[str, Any] = self.engine.lr_scheduler.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load into the engine's schedule."""
        self.engine.lr_scheduler.load_state_dict(state)


class _BestIntoStages(transformers.TrainerCallback):
    """``load_best_model_at_end`` on every layout: Trainer loads the best checkpoint's weights
    into the unsplit model, which are the stages' own parameters only where the stages hold
    the model's Parameter objects (not FSDP's shards, not bf16 masters); this loads the best
    checkpoint's ``pipeline/`` folder into the stages themselves, on every rank, at the end of
    training, keeping the optimizer, the schedule and the random generators as they are (as
    Trainer does)."""

    def __init__(self, trainer: PipelineTrainer) -> None:
        self.trainer = trainer

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        best = state.best_model_checkpoint
        if not (args.load_best_model_at_end and best and (Path(best) / PIPELINE_TAG).is_dir()):
            return
        engine = self.trainer.engine
        schedule = None if engine.lr_scheduler is None else engine.lr_scheduler.state_dict()
        generators = (random.getstate(), np.random.get_state(), torch.random.get_rng_state())
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        portable.load(engine, Path(best) / PIPELINE_TAG, load_optimizer_states=False)
        if schedule is not None:
            engine.lr_scheduler.load_state_dict(schedule)
        random.setstate(generators[0])
        np.random.set_state(generators[1])
        torch.random.set_rng_state(generators[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


class _PaddedCollator:
    """The user's collator, then every sequence key padded to one length ([Note: one captured
    length] in :class:`PipelineTrainer`)."""

    def __init__(
        self, collate: Callable[[Any], Any], lengths: Mapping[str, int], pads: Mapping[str, int]
    ) -> None:
        self.collate = collate
        #: ``key -> length`` of the keys padded.
        self.lengths = dict(lengths)
        #: ``key -> pad value``.
        self.pads = dict(pads)
        #: Pad on the left (the tokenizer pads on the left).
        self.left = getattr(getattr(collate, "tokenizer", None), "padding_side", "right") == "left"

    @property
    def tokenizer(self) -> Any:
        """The wrapped collator's tokenizer (Trainer saves it with the model)."""
        return getattr(self.collate, "tokenizer", None)

    def __call__(self, rows: Any) -> Any:
        batch = self.collate(rows)
        if not isinstance(batch, Mapping):
            return batch
        out = dict(batch)
        ids = out.get("input_ids")
        base = ids.shape[1] if isinstance(ids, torch.Tensor) and ids.dim() >= 2 else None
        for key, value in batch.items():
            if not isinstance(value, torch.Tensor) or value.dim() < 2:
                continue
            length = self.lengths.get(key)
            if length is None and base is not None and value.shape[1] == base:
                length = self.lengths.get("input_ids")
                if length is not None and key not in self.pads and length != base:
                    raise TrainingArgumentError(
                        f"the batches' {key!r} has the sequence length of input_ids, which "
                        f"every batch is padded to {length}, and pipedialect does not know "
                        f"what to pad {key!r} with; pad the rows to one length in the data set",
                        argument="data_collator",
                    )
            if length is None:
                continue
            short = length - value.shape[1]
            if short < 0:
                raise TrainingArgumentError(
                    f"a batch's {key!r} has length {value.shape[1]}, longer than the "
                    f"{length} every batch is padded to; set pad_to_length >= "
                    f"{value.shape[1]}",
                    argument="pad_to_length",
                )
            if short:
                pad = self.pads.get(key, self.pads.get("input_ids", 0))
                fill = value.new_full((value.shape[0], short, *value.shape[2:]), pad)
                out[key] = torch.cat([fill, value] if self.left else [value, fill], dim=1)
        return out


def _row_lengths(dataset: Any, limit: int = 1_000_000) -> dict[str, set[int]] | None:
    """``key -> the lengths its rows have`` over a map-style data set of dict rows, or None
    where the rows cannot be read so (an iterable data set, rows that are not dicts)."""
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        return None
    seen: dict[str, set[int]] = {}
    for i in range(min(len(dataset), limit)):
        row = dataset[i]
        if not isinstance(row, Mapping):
            return None
        for key, value in row.items():
            if isinstance(value, torch.Tensor):
                if value.dim() >= 1:
                    seen.setdefault(str(key), set()).add(int(value.shape[0]))
            elif isinstance(value, list | tuple):
                seen.setdefault(str(key), set()).add(len(value))
    return seen


class PipelineTrainer(transformers.Trainer):
    """``transformers.Trainer`` whose steps run through a pipedialect engine.

    Takes Trainer's arguments, with ``args`` a :class:`PipelineTrainingArguments`. Every rank
    builds it alike: the settings are checked, the batches' padding chosen, the model
    partitioned and every rank's engine built here, so a setting that cannot run fails here,
    on every rank, before any step. After ``train()``, ``trainer.model`` on a rank holds the
    trained weights of the stages that rank runs (the stages hold the model's own parameters),
    and :meth:`save_model` writes the whole trained model.

    [Note: one captured length]
    The stages are specialised to the shapes of the micro-batch they were captured on, while
    collators pad each batch to its own longest row. So the batches are padded further, to one
    length per key (``input_ids`` with the pad token, ``attention_mask`` and ``token_type_ids``
    with 0, ``labels`` with -100): ``pad_to_length``, or the longest row of the training and
    eval sets rounded up to a multiple of 8 (read from the rows, when the trainer is built; a
    warning says what was chosen). Padded positions are masked and carry no label, so the loss
    and its gradients are the batch's own; the compute is that of the longest batch.

    Raises:
        TrainingArgumentError: a setting a pipeline cannot honour
            (:data:`REFUSED_TRAINING_ARGUMENTS`), named.
        MissingCapabilityError: the dialect does not declare ``trainer-loop`` and
            ``portable-checkpoints`` (or its engine is not a :class:`TrainerEngine`).
        TopologyError: the processes do not make the pipeline's stages times its replicas.
    """

    def __init__(self, model: Any = None, args: Any = None, *more: Any, **kwargs: Any) -> None:
        _check_transformers()
        if args is None:
            args = PipelineTrainingArguments(output_dir="trainer_output")
        if not isinstance(args, PipelineTrainingArguments):
            raise TrainingArgumentError(
                f"PipelineTrainer takes args=PipelineTrainingArguments(...), got "
                f"{type(args).__name__}: it is a TrainingArguments with the pipeline's fields "
                "(dialect, split_points, num_stages, ...)",
                argument="args",
            )
        if "pipeline" in kwargs:
            raise TrainingArgumentError(
                "PipelineTrainer takes the pipeline's settings in "
                "args=PipelineTrainingArguments(dialect=..., split_points=...), not pipeline=",
                argument="pipeline",
            )
        super().__init__(model, args, *more, **kwargs)
        self.args: PipelineTrainingArguments = args
        check_trainer(self)
        _warn_on_dropout(self.unsplit_model)
        self.pipe_dialect = get_dialect(args.dialect)
        self._check_dialect()
        self.pipe_dialect.init_distributed()
        self.topology: Topology | None = self._grid()
        self._data_group: Any = None
        self._step_batches: list[Any] = []
        self._step_items: torch.Tensor | None = None
        #: While evaluating: micro-batch number -> (loss, predictions) on the last stage.
        self._collected: dict[int, tuple[torch.Tensor, Any]] | None = None
        self._keep_predictions = False
        #: The max_steps the engine's schedule was built for.
        self._schedule_steps: int | None = None
        self._pad_batches()
        self.plan: PipelinePlan = self._partition()
        self.engine: TrainerEngine = self._build_engine(self.plan)
        self.add_callback(_BestIntoStages(self))

    @property
    def unsplit_model(self) -> Any:
        """The model being trained, whole (Trainer types ``self.model`` loosely)."""
        return self.model

    def _check_dialect(self) -> None:
        """The dialect must declare what this loop reads from its engines."""
        for capability in (Capability.TRAINER_LOOP, Capability.PORTABLE_CHECKPOINTS):
            if capability not in self.pipe_dialect.capabilities:
                declared = ", ".join(sorted(c.value for c in self.pipe_dialect.capabilities))
                raise MissingCapabilityError(
                    f"PipelineTrainer needs the {capability.value} capability, which the "
                    f"{self.pipe_dialect.name} dialect does not declare (it declares: "
                    f"{declared}); its engines must be TrainerEngines (optimizer, "
                    "lr_scheduler, get_lr(), get_global_grad_norm()) and save portable "
                    "checkpoints",
                    dialect=self.pipe_dialect.name,
                    capability=capability.value,
                )

    # -- the process grid ------------------------------------------------------------------------

    @property
    def _multi_process(self) -> bool:
        return Capability.MULTI_PROCESS in self.pipe_dialect.capabilities

    def _num_stages(self) -> int:
        a = self.args
        if a.split_points is not None:
            if a.num_stages is not None and a.num_stages != len(a.split_points) + 1:
                raise TrainingArgumentError(
                    f"{len(a.split_points)} split points make {len(a.split_points) + 1} stages, "
                    f"not num_stages={a.num_stages}",
                    argument="num_stages",
                )
            return len(a.split_points) + 1
        if a.num_stages is not None:
            return a.num_stages
        if not self._multi_process:
            raise TrainingArgumentError(
                f"the {self.pipe_dialect.name} dialect runs every stage in one process: set "
                "split_points=[...] or num_stages=",
                argument="num_stages",
            )
        return dist.get_world_size() // ((a.data_parallel or 1) * (a.tensor_parallel or 1))

    def _grid(self) -> Topology | None:
        """This run's topology (None on a dialect that runs every stage in one process).

        Raises:
            TopologyError: the processes are not the pipeline's ranks times its replicas
                (every rank computes the same numbers, so every rank raises it).
        """
        if not self._multi_process:
            return None
        stages = self._num_stages()
        world = dist.get_world_size()
        tensor = self.args.tensor_parallel or 1
        ranks = self.pipe_dialect.make_topology(stages, 1, tensor_parallel=tensor).world_size()
        data = self.args.data_parallel or max(world // ranks, 1)
        if ranks * data != world:
            raise TopologyError(
                f"{world} processes cannot run {stages} stages ({ranks} ranks a pipeline, "
                f"tensor axis included) times {data} data-parallel replicas ({ranks * data} "
                f"processes); launch {ranks * data} processes (torchrun --nproc_per_node), or "
                "change num_stages, split_points, data_parallel or tensor_parallel"
            )
        return self.pipe_dialect.make_topology(stages, data, tensor_parallel=tensor)

    def data_parallel_size(self) -> int:
        """The pipeline's data-parallel replicas."""
        return 1 if self.topology is None else self.topology.get_dim("data")

    def data_parallel_rank(self) -> int:
        """This rank's replica."""
        if self.topology is None:
            return 0
        return int(self.topology.get_coord(dist.get_rank()).data)

    def get_total_train_batch_size(self, args: transformers.TrainingArguments) -> int:
        """Samples per optimizer step: replicas, not processes (Trainer counts processes)."""
        size: int = args.per_device_train_batch_size * args.gradient_accumulation_steps
        return size * self.data_parallel_size()

    # -- data ------------------------------------------------------------------------------------

    def _pad_batches(self) -> None:
        """Choose the one length every batch is padded to ([Note: one captured length])."""
        seen: dict[str, set[int]] = {}
        for dataset in _datasets(self):
            lengths = _row_lengths(dataset)
            if lengths is None:
                if self.args.pad_to_length is None:
                    logger.info(
                        "the rows of %s cannot be read as dicts: the batches are not padded "
                        "(set pad_to_length= if their lengths vary)",
                        type(dataset).__name__,
                    )
                return
            for key, found in lengths.items():
                seen.setdefault(key, set()).update(found)
        varying = {k: v for k, v in seen.items() if len(v) > 1}
        fixed = self.args.pad_to_length
        if not varying and fixed is None:
            return
        sequence = {k for k in seen if k in _PAD_VALUES or k == "input_ids"}
        unknown = sorted(set(varying) - sequence)
        if unknown:
            raise TrainingArgumentError(
                f"the rows' {unknown[0]!r} vary in length, and pipedialect does not know what "
                f"to pad {unknown[0]!r} with (it pads {sorted([*_PAD_VALUES, 'input_ids'])}); "
                "pad the rows to one length in the data set",
                argument="train_dataset",
            )
        too_long = sorted(k for k in sequence if fixed is not None and max(seen[k]) > fixed)
        if too_long:
            raise TrainingArgumentError(
                f"pad_to_length={fixed}, but the rows' {too_long[0]!r} are up to "
                f"{max(seen[too_long[0]])} long, longer than every batch is padded to; set "
                f"pad_to_length >= {max(seen[too_long[0]])}, or truncate the rows",
                argument="pad_to_length",
            )
        keys = sorted(set(varying) | (sequence if fixed is not None else set()))
        chosen = {k: fixed if fixed is not None else -(-max(seen[k]) // 8) * 8 for k in keys}
        pads = {**_PAD_VALUES, "input_ids": self._pad_token()}
        self.data_collator = _PaddedCollator(self.data_collator, chosen, pads)
        if fixed is None:
            spans = ", ".join(f"{k} {min(seen[k])}..{max(seen[k])}" for k in sorted(varying))
            warnings.warn(
                f"the rows vary in length ({spans}) and the pipeline's stages run one shape: "
                f"every batch is padded to {chosen} (input_ids with {pads.get('input_ids')}, "
                "masks with 0, labels with -100; the loss is unchanged); set "
                "pad_to_length= to choose another length",
                PipeDialectWarning,
                stacklevel=3,
            )

    def _pad_token(self) -> int:
        for source in (
            getattr(self.data_collator, "tokenizer", None),
            self.processing_class,
            getattr(self.unsplit_model, "config", None),
        ):
            found = getattr(source, "pad_token_id", None)
            if isinstance(found, int):
                return found
        return 0

    def _shard(self, loader: Any) -> Any:
        """Shard ``loader`` over the data axis only ([Note: one data stream per replica]).

        Raises:
            TrainingArgumentError: under several processes, a loader accelerate does not shard
                with a batch sampler (an iterable data set: accelerate dispatches or shards its
                items over every process), whose pipeline ranks would read other batches.
        """
        if self.args.world_size <= 1:
            return loader
        shard = getattr(loader, "batch_sampler", None)
        if (
            shard is None
            or not hasattr(shard, "num_processes")
            or type(loader).__name__ not in ("DataLoaderShard", "SkipDataLoader")
        ):
            raise TrainingArgumentError(
                f"Trainer's loader is a {type(loader).__name__} that accelerate shards over every "
                "process, so the pipeline ranks of one replica would read other batches; use a "
                "map-style data set (with __len__ and __getitem__), not an iterable one",
                argument="train_dataset",
            )
        shard.num_processes = self.data_parallel_size()
        shard.process_index = self.data_parallel_rank()
        return loader

    def get_train_dataloader(self) -> Any:
        """Trainer's loader (sampler, collator, workers), sharded over the data axis only."""
        return self._shard(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        """Trainer's eval loader, sharded over the data axis only."""
        return self._shard(super().get_eval_dataloader(eval_dataset))

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        """Trainer's test loader, sharded over the data axis only."""
        return self._shard(super().get_test_dataloader(test_dataset))

    def _example_inputs(self) -> dict[str, torch.Tensor]:
        """The first training (else eval) micro-batch as Trainer collates it, without its
        labels: the capture's example (its shapes and dtypes count). Read with the global RNG
        restored."""
        with torch.random.fork_rng(devices=[]):
            loader = (
                self.get_train_dataloader()
                if self.train_dataset is not None
                else self.get_eval_dataloader()
            )
            batch = next(iter(loader))
        if "labels" not in batch:
            raise TrainingArgumentError(
                f"a batch without 'labels' (keys {sorted(batch)}): the pipeline's loss is the "
                "model's loss on the labels; make the collator produce them",
                argument="data_collator",
            )
        return {k: v for k, v in batch.items() if k != "labels"}

    # -- the engine ------------------------------------------------------------------------------

    def _split(self, stages: int) -> dict[str, Any]:
        a = self.args
        if a.split_points is not None:
            return {"split_points": list(a.split_points)}
        config = getattr(self.unsplit_model, "config", None)
        has_plan = bool(getattr(config, "base_model_pp_plan", None))
        if a.balance is None and has_plan:
            return {"split_points": list(pp_plan_split_points(self.unsplit_model, stages))}
        return {"num_stages": stages, "balance": a.balance}

    def _recompute(self) -> list[str] | None:
        """``recompute=`` for the plan: the user's, or the model's layers under Trainer's
        gradient checkpointing."""
        if self.args.recompute is not None:
            return list(self.args.recompute)
        on, _ = _checkpointing(self.args)
        return _checkpointed_layers(self.unsplit_model) if on else None

    def _partition(self) -> PipelinePlan:
        """Capture and cut the model on the first collated micro-batch."""
        recompute = self._recompute()
        extra: dict[str, Any] = {} if recompute is None else {"recompute": recompute}
        if self.args.bf16:  # Trainer's (accelerate's) bf16: autocast over fp32 weights
            extra["autocast"] = torch.bfloat16
        return partition(
            self.unsplit_model,
            example_inputs=self._example_inputs(),
            concrete_args={"return_dict": False, "use_cache": False},
            **self._split(self._num_stages()),
            **extra,
        )

    def _engine_config(self) -> dict[str, Any]:
        """The engines' DeepSpeed-style config, every value from the TrainingArguments."""
        args = self.args
        return {
            "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "train_batch_size": args.per_device_train_batch_size
            * args.gradient_accumulation_steps
            * self.data_parallel_size(),
            "gradient_clipping": float(max(args.max_grad_norm, 0.0)),
            "steps_per_print": 2**31 - 1,
        }

    def _build_engine(self, plan: PipelinePlan) -> TrainerEngine:
        """Build this rank's engine with Trainer's optimizer (a factory over the engine's
        groups; HF's no-decay rule, by name); the schedule comes with ``train()``."""
        args = self.args
        config = self._engine_config()
        options: dict[str, Any] = {}
        if self.topology is not None:
            options["topology"] = self.topology
        if args.pipeline_schedule is not None:
            options["schedule"] = args.pipeline_schedule
        if args.data_parallel_mode is not None:
            options["data_parallel_mode"] = args.data_parallel_mode
        if (args.tensor_parallel or 1) > 1:  # the model's own plan, sharded in its graph
            options["tensor_parallel"] = "auto"
        module = self.pipe_dialect.pipe_engine(
            plan, config=config, loss_fn=self._pipeline_loss, **options
        )
        decay = set(self.get_decay_parameter_names(self.unsplit_model))  # on the unsplit model
        weight_decay = args.weight_decay

        def groups(named: list[tuple[str, nn.Parameter]]) -> list[dict[str, Any]]:
            return [
                {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
                {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
            ]

        cls, kwargs = (
            self.optimizer_cls_and_kwargs
            if self.optimizer_cls_and_kwargs is not None
            else self.get_optimizer_cls_and_kwargs(args, self.unsplit_model)
        )
        engine = self.pipe_dialect.runtime_engine(
            module, config=config, param_groups=groups, optimizer=lambda g: cls(g, **kwargs)
        )
        if not isinstance(engine, TrainerEngine):
            raise MissingCapabilityError(
                f"the {self.pipe_dialect.name} dialect declares trainer-loop, but its "
                f"{type(engine).__name__} is not a TrainerEngine: it needs module, optimizer, "
                "lr_scheduler, eval_batch, get_lr and get_global_grad_norm",
                dialect=self.pipe_dialect.name,
                capability=Capability.TRAINER_LOOP.value,
            )
        optimizer: Any = _EngineOptimizer(engine)
        self.optimizer = optimizer
        # Trainer and accelerate never wrap the model (in DDP over the pipeline ranks, say).
        self.model_wrapped = engine.module
        self._data_group = self._data_axis_group()
        return engine

    def _data_axis_group(self) -> Any:
        """The process group of this rank's copies over the replicas (None with one)."""
        if self.topology is None or self.data_parallel_size() == 1:
            return None
        found = None
        tensor = self.topology.get_dim("tensor") or 1
        for pipe in range(self.topology.get_dim("pipe")):
            for t in range(tensor):  # one group per rank of the tensor axis: its replicas
                where = {"pipe": pipe, "tensor": t} if tensor > 1 else {"pipe": pipe}
                ranks = self.topology.filter_match(**where)
                group = dist.new_group(ranks=ranks)  # every rank takes part in every group
                if dist.get_rank() in ranks:
                    found = group
        return found

    def _pipeline_loss(self, outputs: Any, target: Any) -> torch.Tensor:
        """The model's own loss on the last stage's logits ([Note: the step's loss]); while
        evaluating, also kept with the predictions ([Note: evaluation through the last stage])."""
        labels, items, factor, number = target
        kwargs = {} if int(items) < 0 else {"num_items_in_batch": items}
        model = self.unsplit_model
        logits = outputs[0]
        loss: torch.Tensor = model.loss_function(
            logits=logits, labels=labels, vocab_size=model.config.vocab_size, **kwargs
        )
        if self._collected is not None:
            predictions = None
            if self._keep_predictions:
                kept: Any = outputs[0] if len(outputs) == 1 else tuple(outputs)
                if self.preprocess_logits_for_metrics is not None:
                    kept = self.preprocess_logits_for_metrics(kept, labels)
                predictions = _to_cpu(kept)
            self._collected[int(number)] = (loss.detach().float().cpu(), predictions)
        scaled: torch.Tensor = loss * factor
        return scaled

    def _schedule(self, optimizer: torch.optim.Optimizer) -> Any:
        """Trainer's LR schedule over the engine's optimizer, for the run's ``max_steps``."""
        self.lr_scheduler = None  # Trainer builds one only where it has none
        self._schedule_steps = self.state.max_steps
        return transformers.Trainer.create_scheduler(self, self.state.max_steps, optimizer)

    def create_optimizer(self, model: Any = None) -> Any:
        """The proxy of the engine's optimizer; the engine gets Trainer's schedule for this
        run's length (``train()`` knows it)."""
        if self._schedule_steps != self.state.max_steps:
            self.engine.lr_scheduler = self._schedule(self.engine.optimizer)
        proxy: Any = _EngineScheduler(self.engine)
        self.lr_scheduler = proxy
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """The engine's schedule, behind a proxy (the engine steps it)."""
        if not isinstance(self.lr_scheduler, _EngineScheduler):
            self.create_optimizer()
        return self.lr_scheduler

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Trainer's logging, with the engine's global gradient norm of the step as
        ``grad_norm`` (Trainer measured the stages' gradients after the engine dropped them)."""
        if "grad_norm" in logs:
            norm = self.engine.get_global_grad_norm()
            logs = {**logs, "grad_norm": float("nan") if norm is None else float(norm)}
        super().log(logs, *args, **kwargs)

    # -- one optimizer step ([Note: Trainer's step through an engine]) --------------------------

    def get_batch_samples(
        self, epoch_iterator: Iterator[Any], num_batches: int, device: Any = None
    ) -> tuple[list[Any], torch.Tensor | None]:
        """The step's micro-batches, and their label tokens over the replicas."""
        batches: list[Any] = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        gas = self.args.gradient_accumulation_steps
        if batches and len(batches) != gas:
            raise TrainingArgumentError(
                f"an optimizer step of {len(batches)} micro-batches, but "
                f"gradient_accumulation_steps is {gas}: a pipeline step runs exactly that many. "
                "Make the batches of an epoch a multiple of it (dataset size, batch size), or "
                "set max_steps so that the short last step is never reached",
                argument="gradient_accumulation_steps",
            )
        self._step_batches = batches
        self._step_items = self._count_items(batches) if self._counts_tokens() else None
        return batches, self._step_items

    def _counts_tokens(self) -> bool:
        return bool(getattr(self, "model_accepts_loss_kwargs", False))

    def _count_items(self, batches: Sequence[Mapping[str, torch.Tensor]]) -> torch.Tensor | None:
        """The label tokens of ``batches`` that count in the loss, with the model's own shift
        rule, summed over the data axis when ``average_tokens_across_devices``."""
        if not batches or "labels" not in batches[0]:
            return None
        shifts = bool(getattr(self, "_loss_shifts_labels", False))
        total = torch.zeros((), dtype=torch.int64)
        for batch in batches:
            labels = batch["shift_labels"] if "shift_labels" in batch else batch["labels"]
            if shifts and "shift_labels" not in batch:
                labels = labels[..., 1:]
            total = total + labels.ne(-100).sum().cpu()
        if self.args.average_tokens_across_devices and self._data_group is not None:
            summed = total.to(self.args.device)  # NCCL reduces device tensors only
            dist.all_reduce(summed, group=self._data_group)
            total = summed.cpu()
        return total

    def _micro_batch(
        self, batch: Mapping[str, Any], items: torch.Tensor | None, factor: float, number: int
    ) -> dict[str, Any]:
        """A collated batch as the engines read it by name: the model's inputs, and the labels
        with the token count, the loss factor and the micro-batch's number ([Note: the step's
        loss])."""
        if "labels" not in batch:
            raise TrainingArgumentError(
                f"a batch without 'labels' (keys {sorted(batch)}): the pipeline's loss is the "
                "model's loss on the labels; make the collator produce them",
                argument="data_collator",
            )
        count = torch.tensor(-1, dtype=torch.int64) if items is None else items.reshape(())
        target = (
            batch["labels"],
            count,
            torch.tensor(factor, dtype=torch.float32),
            torch.tensor(number, dtype=torch.int64),
        )
        return {**{k: v for k, v in batch.items() if k != "labels"}, "labels": target}

    def training_step(
        self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """The whole step through the engine, on the step's last micro-batch; 0 on the others."""
        if not self._step_batches or inputs is not self._step_batches[-1]:
            return torch.zeros((), device=self.args.device)
        gas = self.args.gradient_accumulation_steps
        factor = 1.0
        if self._step_items is not None:
            across = self.args.average_tokens_across_devices
            factor = float(gas * (self.data_parallel_size() if across else 1))
        pairs = [
            self._micro_batch(b, self._step_items, factor, i)
            for i, b in enumerate(self._step_batches)
        ]
        self._step_batches = []
        proxy: Any = self.lr_scheduler
        if isinstance(proxy, _EngineScheduler):
            proxy.step_lrs = [float(lr) for lr in self.engine.get_lr()]
        loss: torch.Tensor = self.engine.train_batch(iter(pairs))
        return loss.detach().to(self.args.device)

    # -- evaluation ([Note: evaluation through the last stage]) ---------------------------------

    def evaluation_loop(
        self,
        dataloader: Any,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> EvalLoopOutput:
        """The eval set through ``eval_batch``; ``eval_loss`` (the mean of the batches' losses)
        and ``compute_metrics`` as Trainer computes them."""
        loss_only = (
            prediction_loss_only
            if prediction_loss_only is not None
            else self.args.prediction_loss_only
        )
        self._keep_predictions = not loss_only and (
            self.compute_metrics is not None or description == "Prediction"
        )
        self.callback_handler.eval_dataloader = dataloader
        batches = list(dataloader)
        if not batches:
            raise TrainingArgumentError(
                "the eval set has no batch for this replica", argument="eval_dataset"
            )
        replicas, replica = self.data_parallel_size(), self.data_parallel_rank()
        chunk = self.args.gradient_accumulation_steps
        self._collected = {}
        try:
            for start in range(0, len(batches), chunk):
                part = [
                    self._micro_batch(b, None, 1.0, (start + i) * replicas + replica)
                    for i, b in enumerate(batches[start : start + chunk])
                ]
                part += [part[-1]] * (chunk - len(part))  # dropped: the numbers repeat
                self.engine.eval_batch(iter(part), num_micro_batches=chunk)
                self.control = self.callback_handler.on_prediction_step(
                    self.args, self.state, self.control
                )
            results = self._gather_results(self._collected)
        finally:
            self._collected = None
        total = len(dataloader.dataset) // self.args.per_device_eval_batch_size
        if not hasattr(dataloader.dataset, "__len__"):
            total = len(results)
        ordered = [results[i] for i in range(total)]
        labels: list[Any] = [None] * total
        if self._keep_predictions:
            shared = self._replica_batches(batches, replicas, replica, total)
            labels = [b["labels"] for b in shared]
        return self._eval_output(ordered, labels, metric_key_prefix, total)

    def _replica_batches(
        self, batches: list[Any], replicas: int, replica: int, total: int
    ) -> list[Any]:
        """Every replica's batches in Trainer's order (every rank collated only its own, and
        every replica reads a share of one stream: gather the labels by broadcast)."""
        if replicas == 1:
            return batches[:total]
        shared: list[Any] = []
        for r in range(replicas):
            source = self.topology.filter_match(pipe=0, data=r)[0] if self.topology else 0
            box = [[{"labels": b["labels"]} for b in batches] if replica == r else None]
            dist.broadcast_object_list(box, src=source, device=self._object_device())
            shared.append(box[0])
        return [shared[i % replicas][i // replicas] for i in range(total)]

    def _object_device(self) -> torch.device | None:
        return self.args.device if self.args.device.type == "cuda" else None

    def _gather_results(
        self, mine: dict[int, tuple[torch.Tensor, Any]]
    ) -> dict[int, tuple[torch.Tensor, Any]]:
        """Every replica's last-stage results, on every rank (one broadcast per replica)."""
        if self.topology is None:
            return mine
        last = self.topology.get_dim("pipe") - 1
        out: dict[int, tuple[torch.Tensor, Any]] = {}
        for r in range(self.data_parallel_size()):
            source = self.topology.filter_match(pipe=last, data=r)[0]
            box = [mine if dist.get_rank() == source else None]
            dist.broadcast_object_list(box, src=source, device=self._object_device())
            out.update(box[0] or {})
        return out

    def _eval_output(
        self,
        ordered: list[tuple[torch.Tensor, Any]],
        labels: list[torch.Tensor],
        prefix: str,
        total: int,
    ) -> EvalLoopOutput:
        """Trainer's metrics from the batches' losses, predictions and labels."""
        size = self.args.per_device_eval_batch_size
        losses = EvalLoopContainer(True, padding_index=-100)
        preds = EvalLoopContainer(True, padding_index=-100)
        gathered = EvalLoopContainer(True, padding_index=-100)
        for (loss, predictions), label in zip(ordered, labels, strict=True):
            losses.add(loss.reshape(()).repeat(size))
            if self._keep_predictions:
                preds.add(predictions)
                gathered.add(label)
        all_losses: Any = losses.get_arrays()  # type: ignore[no-untyped-call]
        all_preds: Any = preds.get_arrays()  # type: ignore[no-untyped-call]
        all_labels: Any = gathered.get_arrays()  # type: ignore[no-untyped-call]
        metrics: dict[str, Any] = {}
        if self.compute_metrics is not None and self._keep_predictions:
            metrics = self.compute_metrics(
                EvalPrediction(predictions=all_preds, label_ids=all_labels)
            )
        metrics = denumpify_detensorize(metrics)  # type: ignore[no-untyped-call]
        finite = np.isfinite(all_losses)
        if self.args.logging_nan_inf_filter and finite.any():
            all_losses = all_losses[finite]
        metrics[f"{prefix}_loss"] = all_losses.mean().item()
        for key in list(metrics):
            if not key.startswith(f"{prefix}_"):
                metrics[f"{prefix}_{key}"] = metrics.pop(key)
        nothing: Any = None
        return EvalLoopOutput(
            predictions=all_preds if self._keep_predictions else nothing,
            label_ids=all_labels if self._keep_predictions else nothing,
            metrics=metrics,
            num_samples=total * size,
        )

    # -- checkpoints ([Note: checkpoints both ways]) --------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Every rank writes its stages into ``output_dir/pipeline`` (a portable checkpoint:
        weights, optimizer, schedule, counters, random generators); then the main process
        consolidates them into ``save_pretrained`` files and saves the tokenizer (or the
        collator's) and the arguments beside them, as Trainer does. A collective."""
        output_dir = output_dir or self.args.output_dir
        if output_dir is None:
            raise TrainingArgumentError("save_model() needs an output_dir", argument="output_dir")
        saved = portable.save(self.engine, output_dir, tag=PIPELINE_TAG, save_latest=False)
        self._barrier()
        if self.args.should_save:
            self.unsplit_model.save_pretrained(output_dir, state_dict=self._model_state(saved))
            tokenizer = self.processing_class
            if tokenizer is None:
                tokenizer = getattr(self.data_collator, "tokenizer", None)
            if tokenizer is not None:
                tokenizer.save_pretrained(output_dir)
            torch.save(self.args, Path(output_dir) / TRAINING_ARGS_NAME)
        self._barrier()

    @staticmethod
    def _barrier() -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def _model_state(self, saved: Any) -> dict[str, torch.Tensor]:
        """The consolidated checkpoint with the keys of the model's ``state_dict`` (a buffer
        the model does not save is left out)."""
        state = portable.consolidate(saved)
        wanted = self.unsplit_model.state_dict()
        missing = [k for k in wanted if k not in state]
        if missing:
            raise ConfigError(
                f"the pipeline's checkpoint {saved} lacks {missing[:5]} of the model's state"
            )
        return {k: state[k] for k in wanted}

    def _trainer_groups(self) -> list[list[str]]:
        """The parameter names of plain Trainer's optimizer groups over the unsplit model, in
        its order: the weight-decay group, then the others (trainable parameters only)."""
        decay = set(self.get_decay_parameter_names(self.unsplit_model))
        named = [(n, p) for n, p in self.unsplit_model.named_parameters() if p.requires_grad]
        return [[n for n, _ in named if n in decay], [n for n, _ in named if n not in decay]]

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """``optimizer.pt`` and ``scheduler.pt`` as plain Trainer writes them, from the
        pipeline's checkpoint that :meth:`save_model` just wrote (the main process)."""
        if not self.args.should_save:
            return
        saved = portable.consolidate_optimizer(Path(output_dir) / PIPELINE_TAG)
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        number = 0
        for names in self._trainer_groups():
            hyper = next((saved["groups"][n] for n in names if n in saved["groups"]), None)
            if hyper is None:  # an empty group: the other's hyper-parameters, no decay
                hyper = {**next(iter(saved["groups"].values())), "weight_decay": 0.0}
            groups.append({**hyper, "params": list(range(number, number + len(names)))})
            for name in names:
                if saved["state"].get(name):
                    state[number] = saved["state"][name]
                number += 1
        torch.save({"state": state, "param_groups": groups}, Path(output_dir) / OPTIMIZER_NAME)
        schedule = self.engine.lr_scheduler
        if schedule is not None:
            torch.save(
                _widen_schedule(schedule.state_dict(), len(groups)),
                Path(output_dir) / SCHEDULER_NAME,
            )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Resume the engine from ``checkpoint``'s pipeline folder (any dialect or layout saved
        it), else from plain Trainer's ``optimizer.pt``/``scheduler.pt``, by name.

        Raises:
            CheckpointError: the folder holds neither.
        """
        if checkpoint is None:
            return
        folder = Path(checkpoint)
        if (folder / PIPELINE_TAG).is_dir():
            portable.load(self.engine, folder / PIPELINE_TAG)
            return
        if not ((folder / OPTIMIZER_NAME).is_file() and (folder / SCHEDULER_NAME).is_file()):
            raise CheckpointError(
                f"{folder} holds no {PIPELINE_TAG}/ folder (PipelineTrainer's) and no "
                f"{OPTIMIZER_NAME} and {SCHEDULER_NAME} (plain Trainer's): the run cannot "
                "resume its optimizer and schedule from it (a folder saved with "
                "save_only_model, or by Trainer's DeepSpeed or FSDP?)"
            )
        self._load_trainer_optimizer(torch.load(folder / OPTIMIZER_NAME, weights_only=True))
        schedule = torch.load(folder / SCHEDULER_NAME, weights_only=True)
        groups = len(self.engine.optimizer.param_groups)
        self.engine.lr_scheduler.load_state_dict(_widen_schedule(schedule, groups))

    def _load_trainer_optimizer(self, saved: Mapping[str, Any]) -> None:
        """Plain Trainer's optimizer state, onto this rank's parameters by name."""
        names = [n for group in self._trainer_groups() for n in group]
        hypers: dict[str, dict[str, Any]] = {}
        by_name: dict[str, Any] = {}
        for group in saved["param_groups"]:
            for number in group["params"]:
                if number >= len(names):
                    raise CheckpointError(
                        f"the checkpoint's {OPTIMIZER_NAME} has more parameters than the "
                        f"model's {len(names)} trainable ones: it belongs to another model"
                    )
                hypers[names[number]] = {k: v for k, v in group.items() if k != "params"}
                if number in saved["state"]:
                    by_name[names[number]] = saved["state"][number]
        name_of = {id(p): n for n, p in self.unsplit_model.named_parameters()}
        optimizer = self.engine.optimizer
        current = optimizer.state_dict()
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        number = 0
        for group, group_state in zip(optimizer.param_groups, current["param_groups"], strict=True):
            merged = dict(group_state)
            for p in group["params"]:
                name = name_of.get(id(p))
                if name is None or name not in hypers:
                    raise CheckpointError(
                        f"the checkpoint's {OPTIMIZER_NAME} holds no state for a parameter "
                        f"of shape {tuple(p.shape)} this rank trains ({name}); it was saved "
                        "for another model or other trainable parameters"
                    )
                if name in by_name:
                    state[number] = by_name[name]
                merged.update({k: v for k, v in hypers[name].items() if k in merged})
                number += 1
            groups.append(merged)
        optimizer.load_state_dict({"state": state, "param_groups": groups})


def _to_cpu(value: Any) -> Any:
    """``value``'s tensors detached, as fp32 where floating, on the CPU."""
    if isinstance(value, torch.Tensor):
        out = value.detach()
        return (out.float() if out.is_floating_point() else out).cpu()
    if isinstance(value, tuple | list):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _widen_schedule(state: Mapping[str, Any], groups: int) -> dict[str, Any]:
    """An LR scheduler's state for ``groups`` parameter groups: one schedule drives every
    group here, so a list of one rate per group is its first rate repeated."""
    out = dict(state)
    for key in ("base_lrs", "_last_lr"):
        value = out.get(key)
        if isinstance(value, list) and value and len(value) != groups:
            out[key] = [value[0]] * groups
    lambdas = out.get("lr_lambdas")
    if isinstance(lambdas, list) and lambdas and len(lambdas) != groups:
        out["lr_lambdas"] = [lambdas[0]] * groups
    return out


def _check_transformers() -> None:
    """Refuse a transformers outside :data:`SUPPORTED_TRANSFORMERS` (older ones train other
    numbers than plain Trainer, docs/huggingface.rst "Versions"), or whose Trainer lacks what
    this integration overrides."""
    from packaging.version import Version

    low, high = SUPPORTED_TRANSFORMERS
    version = Version(transformers.__version__)
    needed = ("_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler", "get_batch_samples")
    missing = [m for m in needed if not callable(getattr(transformers.Trainer, m, None))]
    if not Version(low) <= version < Version(high) or missing:
        lacks = f" (its Trainer has no {', '.join(missing)})" if missing else ""
        raise ConfigError(
            f"PipelineTrainer supports transformers>={low},<{high}, not "
            f"{transformers.__version__}{lacks}; install one in that range (pip install "
            "'pipedialect[hf]')"
        )


def _warn_on_dropout(model: nn.Module) -> None:
    """Warn when the model's config has active dropout: the stages draw their masks from one
    stream per stage and micro-batch (``pipedialect.runtime.randomness``), the same on every
    dialect but not the single process's generator, so the run is not plain Trainer's, step for
    step."""
    config = getattr(model, "config", None)
    active = sorted(
        k
        for k, v in (vars(config).items() if config is not None else [])
        if "dropout" in k and isinstance(v, float) and v > 0
    )
    if active:
        warnings.warn(
            f"{type(model).__name__} has dropout ({', '.join(active)}): the stages draw their "
            "masks from one random stream per stage and micro-batch (the same on every dialect "
            "and layout of these stages), not from a single process's generator, so losses "
            "differ from plain Trainer's; set them to 0 for a run that must match it",
            PipeDialectWarning,
            stacklevel=3,
        )
