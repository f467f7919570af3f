"""Hugging Face ``Trainer`` through a pipeline: :class:`PipelineTrainer`.

``PipelineTrainer(model=..., args=TrainingArguments(...), train_dataset=..., pipeline=
PipelineArguments(dialect="torch", split_points=[...]))`` is a ``transformers.Trainer`` whose
steps run through a pipedialect engine: the model is partitioned (``torch.export`` capture on
one collated micro-batch), every rank builds its stages, and Trainer's own loop -- data loading
and collators, logging, callbacks, evaluation, checkpoints, resuming -- drives
``engine.train_batch``/``eval_batch``. Launched with ``torchrun --nproc_per_node N``, one
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
global gradient norm (:meth:`~pipedialect.engine.EngineBase.get_global_grad_norm`).

[Note: the step's loss]
Trainer's logged loss of a step is token-weighted over the whole step: the model's loss
function divides each micro-batch's summed token loss by the step's token count ``N``, and the
step's loss is their sum. The engines divide each micro-batch loss by
``gradient_accumulation_steps`` (DeepSpeed's semantics) and average over the replicas, so the
last stage's loss function -- the model's own ``loss_function`` on the last stage's logits --
is multiplied back by ``gradient_accumulation_steps`` times the replicas (``N`` then counts
every replica's tokens). ``N`` and the factor travel with each micro-batch's labels (the dict
micro-batch's ``"labels"`` is ``(labels, N, factor)``), so the loss function holds no state and
evaluation passes its own (each batch's token mean, factor 1, as Trainer evaluates). A model
whose loss takes no ``num_items_in_batch`` gets factor 1: the engine's ``1/gas`` is then
Trainer's division by the accumulation steps.

[Note: one data stream per replica]
Under ``torchrun`` accelerate shards Trainer's data loaders over *all* processes, so each
pipeline rank of one replica would read other batches. The loaders here are sharded over the
data-parallel axis only: every pipeline rank of a replica reads the same batches, in the
single-process order (the seedable sampler is seeded alike on every rank). Every rank runs
Trainer's whole loop, since ``train_batch``, ``eval_batch``, the loss gather and the checkpoint
saves are collectives.

What Trainer settings mean here, and which are refused (by name, when the trainer is built):
:data:`REFUSED_TRAINING_ARGUMENTS` and ``docs/huggingface.rst``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch import nn
from transformers.trainer import TRAINING_ARGS_NAME
from transformers.trainer_utils import EvalLoopOutput

from .. import checkpoint as portable
from ..contracts import Capability, RuntimeEngine, Topology
from ..errors import ConfigError, PipeDialectWarning, TrainingArgumentError
from ..plan.partition import PipelinePlan, partition
from ..plugins import get_dialect

__all__ = [
    "REFUSED_TRAINING_ARGUMENTS",
    "PipelineArguments",
    "PipelineTrainer",
    "pp_plan_split_points",
]

logger = logging.getLogger(__name__)

#: The tag of the portable checkpoint inside each of Trainer's ``checkpoint-N`` folders.
PIPELINE_TAG = "pipeline"

#: The ``optim`` values built from parameter groups alone (the others need the model's modules
#: or per-layer state, which a rank holding some stages does not have).
_GROUP_OPTIMIZERS = frozenset(
    {"adamw_torch", "adamw_torch_fused", "adafactor", "sgd", "adagrad", "rmsprop"}
)


@dataclasses.dataclass(frozen=True)
class PipelineArguments:
    """How :class:`PipelineTrainer` pipelines the model (everything else is ``TrainingArguments``).

    The split is ``split_points`` (module paths, each stage ends after one), or ``num_stages``
    chosen by ``balance`` (:func:`pipedialect.partition`), or, with neither, the model config's
    ``base_model_pp_plan`` spread over one stage per pipeline rank
    (:func:`pp_plan_split_points`).
    """

    #: The dialect (``"torch"``, ``"deepspeed"``, ``"local"``, or a plugin's).
    dialect: str = "torch"
    #: Module paths to split after, e.g. ``("model.layers.1",)``.
    split_points: Sequence[str] | None = None
    #: How many stages (the split points are then chosen by ``balance``, or by the model's
    #: ``base_model_pp_plan``); default: one per pipeline rank.
    num_stages: int | None = None
    #: The cost model choosing split points for ``num_stages`` (``"parameters"``, ...).
    balance: str | None = None
    #: The torch dialect's schedule (one stage per rank: ``"1f1b"``, ``"gpipe"``).
    schedule: str | None = None
    #: Data-parallel replicas of the pipeline; default: the processes over the pipeline ranks.
    data_parallel: int | None = None
    #: ``"fsdp"`` shards each stage over the replicas (the torch dialect's
    #: ``data_parallel_mode``); default: whole stages on every replica.
    data_parallel_mode: str | None = None


#: Every Trainer setting refused when the trainer is built, and why.
REFUSED_TRAINING_ARGUMENTS: dict[str, str] = {
    "fp16": "fp16 needs a gradient scaler whose scale, unscale and skip span every stage; "
    "pipedialect trains in fp32 (or DeepSpeed's bf16 through its config)",
    "bf16": "Trainer's bf16 is autocast over fp32 weights; pipedialect's bf16 is DeepSpeed's "
    "(bf16 weights, fp32 masters), which gives other numbers. Train in fp32",
    "bf16_full_eval": "it casts the model for evaluation, and the stages hold its parameters",
    "fp16_full_eval": "it casts the model for evaluation, and the stages hold its parameters",
    "torch_compile": "the stages are captured graphs; compiling them is not implemented",
    "gradient_checkpointing": "it toggles the eager modules after capture, so the stages would "
    "silently not recompute; partition with recompute=['model.layers.*'] instead",
    "activation_checkpointing": "as gradient_checkpointing",
    "label_smoothing_factor": "the label smoother is not wired to the last stage's logits",
    "compute_loss_func": "the loss runs on the last stage, as the model's own loss_function",
    "compute_loss": "a subclass's compute_loss would not run: the loss runs on the last stage",
    "training_step": "a subclass's training_step would not run: the engine runs the step",
    "prediction_step": "a subclass's prediction_step would not run: eval_batch runs it",
    "compute_metrics": "logits exist on the last stage only; evaluate() reports eval_loss",
    "preprocess_logits_for_metrics": "as compute_metrics",
    "predict": "logits exist on the last stage only; use evaluate() for the loss",
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
    "load_best_model_at_end": "loading the best checkpoint into the stages is not implemented",
    "eval_accumulation_steps": "evaluation gathers no predictions here",
    "include_for_metrics": "evaluation gathers no predictions here",
    "batch_eval_metrics": "evaluation gathers no predictions here",
    "label_names": "the labels of a micro-batch are its 'labels' key",
    "accelerator_config": "split_batches and dispatch_batches shard or dispatch batches over "
    "every process, not over the data-parallel axis",
    "fsdp": "a pipeline replaces it",
    "deepspeed": "Trainer's DeepSpeed wraps the unsplit model; use "
    "PipelineArguments(dialect='deepspeed')",
    "parallelism_config": "a pipeline replaces it",
    "train_sampling_strategy": "batch_rebalance balances batches over every process",
}


def _refused(trainer: PipelineTrainer) -> list[str]:
    """The names of the settings of ``trainer`` that :data:`REFUSED_TRAINING_ARGUMENTS` lists."""
    a = trainer.args
    accel = a.accelerator_config
    found = {
        "fp16": a.fp16,
        "bf16": a.bf16,
        "bf16_full_eval": a.bf16_full_eval,
        "fp16_full_eval": a.fp16_full_eval,
        "torch_compile": a.torch_compile,
        "gradient_checkpointing": bool(a.gradient_checkpointing),
        "activation_checkpointing": bool(getattr(a, "activation_checkpointing", False)),
        "label_smoothing_factor": a.label_smoothing_factor != 0,
        "compute_loss_func": trainer.compute_loss_func is not None,
        "compute_metrics": trainer.compute_metrics is not None,
        "preprocess_logits_for_metrics": trainer.preprocess_logits_for_metrics is not None,
        "optimizers": trainer.optimizer is not None or trainer.lr_scheduler is not None,
        "optim": trainer.optimizer_cls_and_kwargs is None
        and str(getattr(a.optim, "value", a.optim)) not in _GROUP_OPTIMIZERS,
        "optim_target_modules": a.optim_target_modules is not None,
        "lr_scheduler_type": str(getattr(a.lr_scheduler_type, "value", a.lr_scheduler_type))
        in ("reduce_lr_on_plateau", "greedy"),
        "model_init": trainer.model_init is not None,
        "auto_find_batch_size": a.auto_find_batch_size,
        "per_device_eval_batch_size": a.per_device_eval_batch_size != a.per_device_train_batch_size,
        "dataloader_drop_last": not a.dataloader_drop_last
        and _short_last_batch(trainer, a.per_device_train_batch_size),
        "neftune_noise_alpha": a.neftune_noise_alpha is not None,
        "use_liger_kernel": a.use_liger_kernel,
        "debug": bool(a.debug),
        "include_num_input_tokens_seen": str(a.include_num_input_tokens_seen)
        not in ("no", "False"),
        "load_best_model_at_end": a.load_best_model_at_end,
        "eval_accumulation_steps": a.eval_accumulation_steps is not None,
        "include_for_metrics": bool(a.include_for_metrics),
        "batch_eval_metrics": a.batch_eval_metrics,
        "label_names": a.label_names is not None and list(a.label_names) != ["labels"],
        "accelerator_config": bool(
            getattr(accel, "split_batches", False) or getattr(accel, "dispatch_batches", None)
        ),
        "fsdp": bool(a.fsdp),
        "deepspeed": a.deepspeed is not None,
        "parallelism_config": a.parallelism_config is not None,
        "train_sampling_strategy": a.train_sampling_strategy == "batch_rebalance",
    }
    for method in ("compute_loss", "training_step", "prediction_step"):
        found[method] = getattr(type(trainer), method) is not getattr(PipelineTrainer, method)
    return [name for name, bad in found.items() if bad]


def _short_last_batch(trainer: PipelineTrainer, batch_size: int) -> bool:
    """Whether a data set the trainer holds has a length ``batch_size`` does not divide."""
    for dataset in (trainer.train_dataset, trainer.eval_dataset):
        datasets = dataset.values() if isinstance(dataset, Mapping) else [dataset]
        for one in datasets:
            if one is not None and hasattr(one, "__len__") and len(one) % batch_size:
                return True
    return False


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
            "pass PipelineArguments(split_points=[...]) or num_stages="
        )
    name, blocks = layers[0]
    count = len(blocks)
    if not 1 <= num_stages <= count:
        raise ConfigError(
            f"{num_stages} stages cannot split the {count} layers of {root}{name}; use 1 to "
            f"{count} stages"
        )
    cuts = [round((k + 1) * count / num_stages) - 1 for k in range(num_stages - 1)]
    return tuple(f"{root}{name}.{cut}" for cut in cuts)


class _EngineOptimizer:
    """What Trainer holds as its optimizer: the engine's, which the engine steps itself."""

    def __init__(self, engine: RuntimeEngine) -> None:
        self.engine: Any = engine

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
        """The engine's optimizer's state dict."""
        state: dict[str, Any] = self.engine.optimizer.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load into the engine's optimizer."""
        self.engine.optimizer.load_state_dict(state)


class _EngineScheduler:
    """What Trainer holds as its LR scheduler: the engine's, which the engine steps itself.

    Trainer reads the learning rate after its (no-op) optimizer step, when the engine has
    already stepped the schedule: :meth:`get_last_lr` returns the rates recorded before the
    engine's step, those the step ran with.
    """

    def __init__(self, engine: RuntimeEngine) -> None:
        self.engine: Any = engine
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


class PipelineTrainer(transformers.Trainer):
    """``transformers.Trainer`` whose steps run through a pipedialect engine.

    Takes Trainer's arguments, plus ``pipeline=``:class:`PipelineArguments`. Every rank builds
    it alike (the checks run before any collective). See the module's notes for how a step
    runs; after ``train()``, ``trainer.model`` on a rank holds the trained weights of the
    stages that rank runs (the stages hold the model's own parameters), and
    :meth:`save_model` writes the whole trained model.

    Raises:
        TrainingArgumentError: a setting a pipeline cannot honour
            (:data:`REFUSED_TRAINING_ARGUMENTS`), named.
    """

    def __init__(self, *args: Any, pipeline: PipelineArguments | None = None, **kwargs: Any):
        if pipeline is None:
            pipeline = PipelineArguments()
        if not isinstance(pipeline, PipelineArguments):
            raise ConfigError(
                f"pipeline must be a PipelineArguments, got {type(pipeline).__name__}"
            )
        super().__init__(*args, **kwargs)
        self.pipeline = pipeline
        check_trainer(self)
        _warn_on_dropout(self.unsplit_model)
        self.pipe_dialect = get_dialect(pipeline.dialect)
        self.pipe_dialect.init_distributed()
        self.engine: Any = None
        self.plan: PipelinePlan | None = None
        self.topology: Topology | None = self._grid()
        self._data_group: Any = None
        self._step_batches: list[Any] = []
        self._step_items: torch.Tensor | None = None
        #: The max_steps the engine's schedule was built for.
        self._schedule_steps: int | None = None

    @property
    def unsplit_model(self) -> Any:
        """The model being trained, whole (Trainer types ``self.model`` loosely)."""
        return self.model

    # -- the process grid ------------------------------------------------------------------------

    @property
    def _multi_process(self) -> bool:
        return Capability.MULTI_PROCESS in self.pipe_dialect.capabilities

    def _num_stages(self) -> int:
        p = self.pipeline
        if p.split_points is not None:
            if p.num_stages is not None and p.num_stages != len(p.split_points) + 1:
                raise ConfigError(
                    f"PipelineArguments: {len(p.split_points)} split points make "
                    f"{len(p.split_points) + 1} stages, not num_stages={p.num_stages}"
                )
            return len(p.split_points) + 1
        if p.num_stages is not None:
            return p.num_stages
        if not self._multi_process:
            raise ConfigError(
                f"the {self.pipe_dialect.name} dialect runs every stage in one process: pass "
                "PipelineArguments(split_points=[...]) or num_stages="
            )
        return dist.get_world_size() // (p.data_parallel or 1)

    def _grid(self) -> Topology | None:
        """This run's topology (None on a dialect that runs every stage in one process)."""
        if not self._multi_process:
            return None
        stages = self._num_stages()
        ranks = self.pipe_dialect.make_topology(stages, 1).world_size()
        data = self.pipeline.data_parallel or max(dist.get_world_size() // ranks, 1)
        return self.pipe_dialect.make_topology(stages, data)

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
        size: int = self._train_batch_size * args.gradient_accumulation_steps
        return size * self.data_parallel_size()

    # -- data ------------------------------------------------------------------------------------

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
            or type(loader).__name__
            not in (
                "DataLoaderShard",
                "SkipDataLoader",
            )
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
        return {k: v for k, v in batch.items() if k != "labels"}

    # -- the engine ------------------------------------------------------------------------------

    def _split(self, stages: int) -> dict[str, Any]:
        p = self.pipeline
        if p.split_points is not None:
            return {"split_points": list(p.split_points)}
        config = getattr(self.unsplit_model, "config", None)
        has_plan = bool(getattr(config, "base_model_pp_plan", None))
        if p.balance is None and has_plan:
            return {"split_points": list(pp_plan_split_points(self.unsplit_model, stages))}
        return {"num_stages": stages, "balance": p.balance}

    def _pipeline_loss(self, outputs: Any, target: Any) -> torch.Tensor:
        """The model's own loss on the last stage's logits ([Note: the step's loss])."""
        labels, items, factor = target
        kwargs = {} if int(items) < 0 else {"num_items_in_batch": items}
        model = self.unsplit_model
        loss: torch.Tensor = model.loss_function(
            logits=outputs[0], labels=labels, vocab_size=model.config.vocab_size, **kwargs
        )
        scaled: torch.Tensor = loss * factor
        return scaled

    def _build_engine(self) -> None:
        """Partition the model and build this rank's engine with Trainer's optimizer and
        schedule (factories over the engine's groups; HF's no-decay rule, by name)."""
        args = self.args
        stages = self._num_stages()
        plan = partition(
            self.unsplit_model,
            example_inputs=self._example_inputs(),
            concrete_args={"return_dict": False, "use_cache": False},
            **self._split(stages),
        )
        config = {
            "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "train_batch_size": args.per_device_train_batch_size
            * args.gradient_accumulation_steps
            * self.data_parallel_size(),
            "gradient_clipping": float(max(args.max_grad_norm, 0.0)),
            "steps_per_print": 2**31 - 1,
        }
        options: dict[str, Any] = {}
        if self.topology is not None:
            options["topology"] = self.topology
        if self.pipeline.schedule is not None:
            options["schedule"] = self.pipeline.schedule
        if self.pipeline.data_parallel_mode is not None:
            options["data_parallel_mode"] = self.pipeline.data_parallel_mode
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
        self.engine = self.pipe_dialect.runtime_engine(
            module,
            config=config,
            param_groups=groups,
            optimizer=lambda g: cls(g, **kwargs),
            lr_scheduler=self._schedule,
        )
        self.plan = plan
        optimizer: Any = _EngineOptimizer(self.engine)
        scheduler: Any = _EngineScheduler(self.engine)
        self.optimizer, self.lr_scheduler = optimizer, scheduler
        # Trainer and accelerate never wrap the model (in DDP over the pipeline ranks, say).
        self.model_wrapped = self.engine.module
        self._data_group = self._data_axis_group()

    def _data_axis_group(self) -> Any:
        """The process group of this rank's copies over the replicas (None with one)."""
        if self.topology is None or self.data_parallel_size() == 1:
            return None
        found = None
        for pipe in range(self.topology.get_dim("pipe")):
            ranks = self.topology.filter_match(pipe=pipe)
            group = dist.new_group(ranks=ranks)  # every rank takes part in every group
            if dist.get_rank() in ranks:
                found = group
        return found

    def _schedule(self, optimizer: torch.optim.Optimizer) -> Any:
        """Trainer's LR schedule over the engine's optimizer, for the run's ``max_steps``."""
        self.lr_scheduler = None  # Trainer builds one only where it has none
        self._schedule_steps = self.state.max_steps
        return transformers.Trainer.create_scheduler(self, self.state.max_steps, optimizer)

    def create_optimizer(self, model: Any = None) -> Any:
        """Build the pipeline and its engine (once); Trainer gets the proxy optimizer.

        An engine built by an ``evaluate()`` before ``train()`` gets its schedule again, now
        that the number of training steps is known."""
        if self.engine is None:
            self._build_engine()
        elif self._schedule_steps != self.state.max_steps:
            self.engine.lr_scheduler = self._schedule(self.engine.optimizer)
        proxy: Any = _EngineScheduler(self.engine)
        self.lr_scheduler = proxy
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """The engine's schedule, behind a proxy (the engine steps it)."""
        if self.engine is None:
            return super().create_scheduler(num_training_steps, optimizer)
        return self.lr_scheduler

    def _clip_grad_norm(self, model: Any) -> torch.Tensor | None:
        """The engine's global gradient norm of the step (it clipped with max_grad_norm)."""
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else torch.tensor(float(norm))

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> float | None:
        """The step's norm as a float, also when max_grad_norm is 0 (no clipping)."""
        if grad_norm is None:
            norm = self.engine.get_global_grad_norm()
            return None if norm is None else float(norm)
        return float(grad_norm)

    # -- one optimizer step ([Note: Trainer's step through an engine]) --------------------------

    def get_batch_samples(
        self, epoch_iterator: Iterator[Any], num_batches: int, device: torch.device
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
        return bool(self.model_accepts_loss_kwargs)

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
        self, batch: Mapping[str, Any], items: torch.Tensor | None, factor: float
    ) -> dict[str, Any]:
        """A collated batch as the engines read it by name: the model's inputs, and the labels
        with the token count and the loss factor ([Note: the step's loss])."""
        if "labels" not in batch:
            raise TrainingArgumentError(
                f"a batch without 'labels' (keys {sorted(batch)}): the pipeline's loss is the "
                "model's loss on the labels; make the collator produce them",
                argument="data_collator",
            )
        count = torch.tensor(-1, dtype=torch.int64) if items is None else items.reshape(())
        target = (batch["labels"], count, torch.tensor(factor, dtype=torch.float32))
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
        pairs = [self._micro_batch(b, self._step_items, factor) for b in self._step_batches]
        self._step_batches = []
        proxy: Any = self.lr_scheduler
        if isinstance(proxy, _EngineScheduler):
            proxy.step_lrs = [float(lr) for lr in self.engine.get_lr()]
        loss: torch.Tensor = self.engine.train_batch(iter(pairs))
        return loss.detach().to(self.args.device)

    # -- evaluation ------------------------------------------------------------------------------

    def evaluation_loop(
        self,
        dataloader: Any,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> EvalLoopOutput:
        """The eval set through ``eval_batch``, in chunks of ``gradient_accumulation_steps``
        batches; ``eval_loss`` is the mean of the batches' token-mean losses, as Trainer's."""
        if self.engine is None:  # evaluate() before train()
            self._build_engine()
        batches = [self._micro_batch(b, None, 1.0) for b in dataloader]
        if not batches:
            raise TrainingArgumentError(
                "the eval set has no batch for this replica", argument="eval_dataset"
            )
        chunk = self.args.gradient_accumulation_steps
        total = 0.0
        for start in range(0, len(batches), chunk):
            part = batches[start : start + chunk]
            mean = self.engine.eval_batch(iter(part), num_micro_batches=len(part))
            total += float(mean) * len(part)
        loss = total / len(batches)
        key = f"{metric_key_prefix}_loss"
        metrics = {key: loss if math.isfinite(loss) else float("nan")}
        samples = len(batches) * self.args.per_device_eval_batch_size * self.data_parallel_size()
        nothing: Any = None  # no predictions are gathered
        return EvalLoopOutput(
            predictions=nothing, label_ids=nothing, metrics=metrics, num_samples=samples
        )

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: logits exist on the last stage only."""
        raise TrainingArgumentError(
            f"PipelineTrainer cannot honour predict: {REFUSED_TRAINING_ARGUMENTS['predict']}",
            argument="predict",
        )

    # -- checkpoints: Trainer's folders, a portable checkpoint inside ---------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Every rank writes its stages into ``output_dir/pipeline`` (a portable checkpoint:
        weights, optimizer, schedule, counters, random generators); then the main process
        consolidates them into ``save_pretrained`` files, so the folder loads with
        ``from_pretrained`` as Trainer's does. A collective."""
        output_dir = output_dir or self.args.output_dir
        if output_dir is None:
            raise TrainingArgumentError("save_model() needs an output_dir", argument="output_dir")
        if self.engine is None:
            super().save_model(output_dir, _internal_call)
            return
        saved = portable.save(self.engine, output_dir, tag=PIPELINE_TAG, save_latest=False)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        if self.args.should_save:
            self.unsplit_model.save_pretrained(output_dir, state_dict=self._model_state(saved))
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, Path(output_dir) / TRAINING_ARGS_NAME)
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

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Nothing: :meth:`save_model` saved them, every rank its own stages."""

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Nothing yet: the engine does not exist when Trainer calls this; everything loads in
        :meth:`_load_optimizer_and_scheduler`, once it does."""

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Load the checkpoint's pipeline folder (any dialect or layout saved it)."""
        if checkpoint is None:
            return
        portable.load(self.engine, Path(checkpoint) / PIPELINE_TAG)


def _warn_on_dropout(model: nn.Module) -> None:
    """Warn when the model's config has active dropout: the stages draw their masks from each
    rank's own random stream, so the run is not the single process's, step for step."""
    config = getattr(model, "config", None)
    active = sorted(
        k
        for k, v in (vars(config).items() if config is not None else [])
        if "dropout" in k and isinstance(v, float) and v > 0
    )
    if active:
        warnings.warn(
            f"{type(model).__name__} has dropout ({', '.join(active)}): the stages draw their "
            "masks on each rank's own random stream, so losses differ from a single process; set "
            "them to 0 for a run that must match it",
            PipeDialectWarning,
            stacklevel=3,
        )
