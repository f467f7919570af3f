"""DeepSpeed configuration semantics, for the engines that do not run DeepSpeed.

Every dialect takes a DeepSpeed config dict, and the same config must give the same numbers
on every dialect, so this module follows
DeepSpeed 0.19.8 exactly where it matters:

- the batch-size triple (``runtime/config.py``, ``_set_batch_related_parameters`` and
  ``_batch_assertion``): ``train_batch_size = micro * gas * data-parallel size``; any two
  derive the third with integer division, one alone sets ``gradient_accumulation_steps = 1``;
- the optimizer (``runtime/engine.py``, ``_configure_basic_optimizer``): ``Adam`` means AdamW
  unless ``adam_w_mode`` is false; ``torch_adam`` selects torch's class with torch's defaults
  (AdamW's ``weight_decay`` is then 0.01), otherwise DeepSpeed's FusedAdam with its defaults
  (``weight_decay`` 0); any other name is looked up in ``torch.optim``;
- ``gradient_clipping`` defaults to 1.0 and clips with the norm over all parameters
  (``runtime/utils.py``, ``clip_grad_norm_``).

A ``scheduler`` section is checked here and built by :mod:`pipedialect.engine.lr_schedules`; the
``bf16`` section (and ``data_types.grad_accum_dtype``) by :mod:`pipedialect.engine.precision`, which
trains as DeepSpeed's ``BF16_Optimizer`` does. Keys that would change the numbers and are not
implemented (fp16, ZeRO stage > 0, ...) raise :class:`~pipedialect.ConfigError` naming the key;
logging keys are ignored.

[Note: unknown config keys]
DeepSpeed ignores a key it does not know without a word: ``"gradient_accumulation_step": 4``
trains with accumulation 1. :func:`check_config_keys` refuses such a key, on every dialect
(``Dialect.pipe_engine`` and ``runtime_engine`` call it before any rank builds anything), with
:class:`~pipedialect.errors.UnknownConfigKeyError` naming its path and the closest key DeepSpeed
knows. What DeepSpeed 0.19.8 knows is data (``_deepspeed_keys``), checked against the installed
deepspeed by the test suite; keys DeepSpeed has removed (and refuses) are refused here too.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConfigError, UnknownConfigKeyError
from ._deepspeed_keys import KNOWN_KEYS, REMOVED_KEYS, Section
from .lr_schedules import check_schedule_section
from .precision import Precision, parse_precision

__all__ = [
    "TrainingConfig",
    "batch_triple",
    "build_optimizer",
    "check_config_keys",
    "check_one_optimizer",
    "clip_gradients",
    "handled_keys",
    "parse_config",
]

logger = logging.getLogger(__name__)

#: DeepSpeed 0.19.8's ``GRADIENT_CLIPPING_DEFAULT``.
GRADIENT_CLIPPING_DEFAULT = 1.0

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")

#: Keys that only affect logging, profiling, checkpoint layout or memory, never the numbers (or
#: only with a feature refused here: ``data_parallel_size`` goes with ``sequence_parallel_size``,
#: ``weight_quantization`` with ZeRO-3's initialisation).
_IGNORED = frozenset(
    {
        "activation_checkpointing",
        "aio",
        "autotuning",
        "checkpoint",
        "comet",
        "comms_logger",
        "csv_monitor",
        "data_parallel_size",
        "dataloader_drop_last",
        "datastates_ckpt",
        "disable_allgather",
        "disable_python_gc",
        "dump_state",
        "flops_profiler",
        "log_level",
        "memory_breakdown",
        "pipeline",
        "prescale_gradients",
        "seq_parallel_communication_data_type",
        "steps_per_print",
        "tensorboard",
        "timers",
        "use_data_before_expert_parallelism",
        "vocabulary_size",
        "wall_clock_breakdown",
        "wandb",
        "weight_quantization",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
    }
)

#: Precision sections, checked by :func:`pipedialect.engine.precision.parse_precision`.
_PRECISION_SECTIONS = frozenset({"bf16", "bfloat16", "fp16"})

#: Sections that change the numbers when ``enabled`` is true.
_ENABLED_SECTIONS = frozenset({"data_efficiency", "expert_parallel", "torch_autocast"})

#: Sections that change the numbers whenever present.
_UNSUPPORTED_SECTIONS = frozenset({"hybrid_engine"})

#: The other keys this module reads (``_check_unsupported`` and :func:`parse_config`).
_CHECKED = frozenset(
    {
        "communication_data_type",
        "compile",
        "data_types",
        "gradient_allreduce_op",
        "gradient_clipping",
        "gradient_predivide_factor",
        "managed_gradient_accumulation",
        "optimizer",
        "scheduler",
        "sequence_parallel_size",
        "tensor_parallel",
        "zero_optimization",
    }
)

#: DeepSpeed optimizer names with no torch equivalent here.
_DS_ONLY_OPTIMIZERS = frozenset(
    {
        "lamb",
        "lion",
        "muadam",
        "muadamw",
        "musgd",
        "muon",
        "onebitadam",
        "onebitlamb",
        "zerooneadam",
    }
)

_FUSED_ADAM_DEFAULTS: dict[str, Any] = {
    "lr": 1e-3,
    "bias_correction": True,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 0.0,
    "amsgrad": False,
    "set_grad_none": True,
}


@dataclass(frozen=True)
class TrainingConfig:
    """What a DeepSpeed config dict asks of a training loop, resolved as DeepSpeed resolves it."""

    #: Samples per optimizer step over all data-parallel replicas.
    train_batch_size: int
    #: Samples per micro-batch.
    micro_batch_size: int
    #: Micro-batches per optimizer step (each loss is scaled by its inverse).
    gradient_accumulation_steps: int
    #: Global gradient-norm limit; 0 disables clipping.
    gradient_clipping: float
    #: The optimizer's ``type`` as written in the config; None without an ``optimizer``
    #: section (the optimizer then comes from ``runtime_engine(optimizer=...)``).
    optimizer_type: str | None
    #: The optimizer's ``params`` as written in the config.
    optimizer_params: Mapping[str, Any] = field(default_factory=dict)
    #: The checked ``scheduler`` section (``type`` and ``params``), or None.
    scheduler: Mapping[str, Any] | None = None
    #: fp32, or bf16 with fp32 master weights (see :mod:`pipedialect.engine.precision`).
    precision: Precision = field(default_factory=Precision)


def _positive_int(config: Mapping[str, Any], key: str) -> int | None:
    value = config.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config[{key!r}] must be an integer, got {value!r}")
    return value


def batch_triple(config: Mapping[str, Any], world_size: int) -> tuple[int, int, int]:
    """``(train_batch_size, micro batch size, gradient_accumulation_steps)`` as DeepSpeed
    derives them for ``world_size`` data-parallel replicas; inconsistent sizes raise
    :class:`~pipedialect.ConfigError` with DeepSpeed's own rule."""
    train, micro, gas = (_positive_int(config, key) for key in _BATCH_KEYS)
    if train is not None and micro is not None and gas is not None:
        pass
    elif train is not None and micro is not None:
        gas = train // micro // world_size
    elif train is not None and gas is not None:
        micro = train // world_size // gas
    elif micro is not None and gas is not None:
        train = micro * gas * world_size
    elif train is not None:
        gas = 1
        micro = train // world_size
    elif micro is not None:
        train = micro * world_size
        gas = 1
    else:
        raise ConfigError(
            "config needs train_batch_size or train_micro_batch_size_per_gpu (as DeepSpeed does)"
        )
    for key, value in zip(_BATCH_KEYS, (train, micro, gas), strict=True):
        if value <= 0:
            raise ConfigError(f"config[{key!r}] resolves to {value}; it must be greater than 0")
    if train != micro * gas * world_size:
        raise ConfigError(
            f"train_batch_size ({train}) must equal train_micro_batch_size_per_gpu ({micro}) * "
            f"gradient_accumulation_steps ({gas}) * data-parallel size ({world_size}); fix the "
            "batch-size entries of the config"
        )
    return train, micro, gas


def _check_unsupported(config: Mapping[str, Any]) -> None:
    for key in sorted(_ENABLED_SECTIONS & config.keys()):
        section = config[key]
        if isinstance(section, Mapping) and section.get("enabled", False):
            raise ConfigError(
                f"config[{key!r}] is enabled; this engine trains in fp32 without it. Disable it "
                "(it would change the numbers)."
            )
    for key in sorted(_UNSUPPORTED_SECTIONS & config.keys()):
        if config[key] is not None:
            raise ConfigError(f"config[{key!r}] is not supported by this engine; remove it")
    zero = config.get("zero_optimization")
    if isinstance(zero, Mapping) and int(zero.get("stage", 0)) > 0:
        raise ConfigError(
            f"config['zero_optimization']['stage'] is {zero['stage']}; only stage 0 is supported"
        )
    data_types = config.get("data_types")
    if isinstance(data_types, Mapping):
        for key in ("param_dtype", "buffer_dtype", "keep_in_fp32_modules"):
            if data_types.get(key) is not None:
                raise ConfigError(
                    f"config['data_types'][{key!r}] is not implemented by this engine; remove it "
                    "(parameters follow bf16.enabled, buffers keep their dtype)"
                )
    if float(config.get("gradient_predivide_factor", 1.0)) != 1.0:
        raise ConfigError("config['gradient_predivide_factor'] must be 1.0 (or absent)")
    _check_parallelism(config)


def _check_parallelism(config: Mapping[str, Any]) -> None:
    """Refuse the DeepSpeed keys that change how gradients are combined or the model is laid
    out, which these engines do not implement."""
    op = config.get("gradient_allreduce_op", "mean")
    if op != "mean":
        raise ConfigError(
            f"config['gradient_allreduce_op'] is {op!r}; this engine averages gradients over "
            "the replicas ('mean', DeepSpeed's default) only"
        )
    if config.get("managed_gradient_accumulation", True) is not True:
        raise ConfigError(
            "config['managed_gradient_accumulation'] must be true (or absent): train_batch "
            "steps once per gradient_accumulation_steps micro-batches"
        )
    if config.get("sequence_parallel_size", 1) != 1:
        raise ConfigError(
            f"config['sequence_parallel_size'] is {config['sequence_parallel_size']!r}; this "
            "engine has no sequence parallelism: remove it (or set it to 1)"
        )
    tensor_parallel = config.get("tensor_parallel")
    if isinstance(tensor_parallel, Mapping) and (tensor_parallel.get("autotp_size") or 0) > 1:
        raise ConfigError(
            "config['tensor_parallel']['autotp_size'] is "
            f"{tensor_parallel['autotp_size']!r}; this engine has no tensor parallelism"
        )
    compile_section = config.get("compile")
    if isinstance(compile_section, Mapping) and compile_section.get("deepcompile", False):
        raise ConfigError(
            "config['compile']['deepcompile'] is true; DeepCompile is DeepSpeed's own engine "
            "feature: disable it on this engine"
        )


def check_config_keys(config: Mapping[str, Any]) -> None:
    """Refuse a key DeepSpeed 0.19 does not know, or has removed, anywhere in ``config``.

    See [Note: unknown config keys]. Sections are checked as deep as DeepSpeed reads them;
    a value that is not a dict where a section is expected is left to the parser.

    Raises:
        UnknownConfigKeyError: the key, by its path, with the closest key DeepSpeed knows.
        ConfigError: a key DeepSpeed has removed (DeepSpeed refuses it too).
    """
    _check_section(config, KNOWN_KEYS, ())


def _check_section(given: Mapping[str, Any], known: Section, path: tuple[str, ...]) -> None:
    for key, value in given.items():
        where = _path_text((*path, str(key)))
        removed = REMOVED_KEYS.get((*path, str(key)))
        if removed is not None:
            raise ConfigError(
                f"{where}: DeepSpeed 0.19 removed this key and refuses it ({removed}); remove it"
            )
        if key not in known:
            raise _unknown_key(str(key), known, path)
        section = known[key]
        if section is not None and isinstance(value, Mapping):
            _check_section(value, section, (*path, str(key)))


def _path_text(path: tuple[str, ...]) -> str:
    return "config" + "".join(f"[{key!r}]" for key in path)


def _unknown_key(key: str, known: Section, path: tuple[str, ...]) -> UnknownConfigKeyError:
    names = sorted(known)
    lowered = {name.lower(): name for name in names}
    close = difflib.get_close_matches(key.lower(), list(lowered), n=1, cutoff=0.6)
    suggestion = lowered[close[0]] if close else None
    where = _path_text((*path, key))
    section = f"in {_path_text(path)}" if path else "at the top level"
    text = (
        f"{where}: DeepSpeed 0.19 knows no key {key!r} {section}, and would ignore it without a "
        "word; pipedialect refuses it on every dialect."
    )
    if suggestion is not None:
        text += f" Did you mean {suggestion!r}?"
    else:
        elsewhere = [_path_text(p) for p in _paths_of(key, KNOWN_KEYS, ()) if p[:-1] != path]
        if elsewhere:
            text += f" DeepSpeed knows it as {', '.join(elsewhere)}."
        elif len(names) <= 24:
            text += f" The keys it knows there: {', '.join(names)}."
    return UnknownConfigKeyError(text, path=(*path, key), suggestion=suggestion)


def _paths_of(key: str, known: Section, path: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Every path in the table that ends in ``key``."""
    found = [(*path, key)] if key in known else []
    for name, section in known.items():
        if section is not None:
            found.extend(_paths_of(key, section, (*path, name)))
    return found


def parse_config(config: Mapping[str, Any] | None, *, world_size: int = 1) -> TrainingConfig:
    """Resolve a DeepSpeed config dict; ``world_size`` is the data-parallel size.

    Every key DeepSpeed knows is honoured, ignored (it changes no number) or refused here
    (:func:`handled_keys`); a key it does not know is refused (:func:`check_config_keys`).

    Raises:
        ConfigError: the config is missing, inconsistent, or asks for something not implemented.
    """
    if config is None:
        raise ConfigError("config is required: a DeepSpeed config dict (train_batch_size, ...)")
    if not isinstance(config, Mapping):
        raise ConfigError(f"config must be a dict, got {type(config).__name__}")
    check_config_keys(config)
    _check_unsupported(config)
    precision = parse_precision(config)
    train, micro, gas = batch_triple(config, world_size)
    clipping = config.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT)
    if isinstance(clipping, bool) or not isinstance(clipping, int | float) or clipping < 0:
        raise ConfigError(f"config['gradient_clipping'] must be a number >= 0, got {clipping!r}")
    optimizer = config.get("optimizer")
    if "optimizer" in config and (
        not isinstance(optimizer, Mapping) or not isinstance(optimizer.get("type"), str)
    ):
        raise ConfigError(
            "config['optimizer'] must be a dict with a 'type' (Adam, AdamW, SGD, ...) and "
            "optional 'params'"
        )
    params = {} if optimizer is None else optimizer.get("params") or {}
    if not isinstance(params, Mapping):
        raise ConfigError("config['optimizer']['params'] must be a dict")
    return TrainingConfig(
        train_batch_size=train,
        micro_batch_size=micro,
        gradient_accumulation_steps=gas,
        gradient_clipping=float(clipping),
        optimizer_type=None if optimizer is None else str(optimizer["type"]),
        optimizer_params=dict(params),
        scheduler=check_schedule_section(config.get("scheduler")),
        precision=precision,
    )


def handled_keys() -> frozenset[str]:
    """The top-level keys :func:`parse_config` honours, ignores or refuses by value."""
    return (
        frozenset(_BATCH_KEYS)
        | _IGNORED
        | _ENABLED_SECTIONS
        | _PRECISION_SECTIONS
        | _UNSUPPORTED_SECTIONS
        | _CHECKED
    )


def build_optimizer(
    config: TrainingConfig, parameters: Iterable[torch.nn.Parameter] | Iterable[Mapping[str, Any]]
) -> torch.optim.Optimizer:
    """Build the optimizer DeepSpeed would build for ``config`` (fp32, no ZeRO), over
    parameters or over parameter groups (dicts with ``params``, as torch optimizers take)."""
    params: list[Any] = [p for p in parameters if isinstance(p, Mapping) or p.requires_grad]
    name = config.optimizer_type
    if name is None:
        raise ConfigError(
            "config has no 'optimizer' section and no optimizer was given: add one (e.g. "
            '"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}) or pass '
            "runtime_engine(optimizer=<callable(param_groups) -> torch.optim.Optimizer>)"
        )
    options = dict(config.optimizer_params)
    where = f"config['optimizer'] (type {name!r})"
    if "max_grad_norm" in options:
        raise ConfigError(
            f"{where}: 'max_grad_norm' is not an optimizer parameter; use the top-level "
            "'gradient_clipping' entry"
        )
    lowered = name.lower()
    if lowered in ("adam", "adamw"):
        return _build_adam(lowered, options, params, where)
    if lowered in _DS_ONLY_OPTIMIZERS:
        raise ConfigError(f"{where}: DeepSpeed's {name} optimizer is not implemented here")
    cls: Any = torch.optim.Adagrad if lowered == "adagrad" else getattr(torch.optim, name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(
            f"{where}: unknown optimizer; use Adam, AdamW or a torch.optim class name such as "
            "SGD (case-sensitive, as in DeepSpeed)"
        )
    return _construct(cls, params, options, where)


def _build_adam(
    lowered: str, options: dict[str, Any], params: list[Any], where: str
) -> torch.optim.Optimizer:
    adam_w_mode = options.pop("adam_w_mode", True)
    decoupled = lowered == "adamw" or bool(adam_w_mode)
    torch_adam = options.pop("torch_adam", False)
    options.pop("fp32_optimizer_states", None)
    cls: type[torch.optim.Optimizer] = torch.optim.AdamW if decoupled else torch.optim.Adam
    if torch_adam:
        foreach = options.pop("foreach", None)
        return _construct(cls, params, {**options, "foreach": foreach}, where)
    unknown = sorted(set(options) - set(_FUSED_ADAM_DEFAULTS))
    if unknown:
        raise ConfigError(f"{where}: FusedAdam takes no parameter(s) {unknown}")
    merged = {**_FUSED_ADAM_DEFAULTS, **options}
    if merged["amsgrad"]:
        raise ConfigError(f"{where}: FusedAdam does not support amsgrad")
    if not merged["bias_correction"]:
        raise ConfigError(f"{where}: bias_correction=False is not implemented")
    kwargs = {k: merged[k] for k in ("lr", "betas", "eps", "weight_decay")}
    kwargs["betas"] = tuple(kwargs["betas"])
    return _construct(cls, params, kwargs, where)


def _construct(
    cls: type[torch.optim.Optimizer],
    params: list[Any],
    options: Mapping[str, Any],
    where: str,
) -> torch.optim.Optimizer:
    try:
        return cls(params, **options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"{where}: {cls.__name__} rejects its params {dict(options)}: {exc}"
        ) from exc


def check_one_optimizer(section: Any) -> None:
    """Refuse a config ``optimizer`` section (``section``, None when absent) next to
    ``runtime_engine(optimizer=...)``.

    DeepSpeed steps the client optimizer and never reads the section, so its learning rate and
    betas would be ignored without a word; every dialect refuses the pair instead.

    Raises:
        ConfigError: there is a section.
    """
    if section is not None:
        raise ConfigError(
            "runtime_engine(optimizer=...) was given and the config has an 'optimizer' "
            "section too; the client optimizer would be stepped and the section ignored. "
            "Remove the section (or the optimizer argument)"
        )


def clip_gradients(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale gradients so their global 2-norm is at most ``max_norm``; return the norm.

    As DeepSpeed (fp32, no ZeRO): ``coef = min(1, max_norm / (norm + 1e-6))``. Pass each
    parameter once (a tied parameter counts once). ``max_norm <= 0`` (``gradient_clipping``
    off) only computes the norm.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norms = torch.stack([g.detach().float().norm(2) for g in grads])
    total = norms.pow(2).sum().pow(0.5)
    if max_norm <= 0.0:
        return total
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total
