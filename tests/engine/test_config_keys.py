"""Config keys DeepSpeed does not know are refused, by name, on every dialect.

DeepSpeed 0.19 ignores an unknown key without a word (``"gradient_accumulation_step": 4``
trains with accumulation 1); pipedialect refuses it in the shared ``pipe_engine`` and
``runtime_engine``, before anything is built, with the closest key DeepSpeed knows. What
DeepSpeed knows is a table in core (which never imports deepspeed); the first tests here derive
the same table from the installed deepspeed, independently, so that no key DeepSpeed reads is
ever refused:

- the top-level keys ``DeepSpeedConfig`` looks up, recorded by a dict that logs every lookup;
- in each section, the fields and aliases of the pydantic model DeepSpeed validates it with
  (found by the model's own "extra inputs are not permitted" error on a probe key), nested
  models included; or, for a section read as a plain dict, the keys looked up in it;
- the ``pipeline`` section, which DeepSpeed copies whole, by the keys ``PipelineEngine`` reads.
"""

from __future__ import annotations

import inspect
import json
import logging
import re
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import pipedialect
from pipedialect import ConfigError
from pipedialect.engine._deepspeed_keys import KNOWN_KEYS, REMOVED_KEYS
from pipedialect.engine.config import check_config_keys, handled_keys, parse_config
from pipedialect.errors import UnknownConfigKeyError
from pipedialect.models import get_model

_PROBE = "__pipedialect_probe__"
_BASE = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1}
#: Top-level keys read outside ``DeepSpeedConfig``, each with the module whose source reads it.
_READ_ELSEWHERE = {"sequence_parallel_size": "deepspeed", "data_parallel_size": "deepspeed"}
#: Sections DeepSpeed copies whole and reads later: the table does not look inside them.
_COPIED = {
    ("datastates_ckpt",),
    ("data_efficiency", "data_sampling"),
    ("data_efficiency", "data_routing"),
}


class _Recorder(dict[str, Any]):
    """A dict that records every key looked up in it."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.seen: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.seen.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self.seen.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.seen.add(str(key))
        return super().__contains__(key)

    def keys(self) -> Any:
        outer = self

        class Keys:
            def __contains__(self, key: object) -> bool:
                return key in outer

            def __iter__(self) -> Iterator[str]:
                return iter(dict.keys(outer))

            def __len__(self) -> int:
                return dict.__len__(outer)

        return Keys()


def _nest(path: tuple[str, ...], leaf: Any) -> dict[str, Any]:
    value = leaf
    for key in reversed(path):
        value = {key: value}
    return dict(value)


def _parse(config: dict[str, Any]) -> Exception | None:
    from deepspeed.runtime.config import DeepSpeedConfig

    try:
        DeepSpeedConfig({**_BASE, **config})
    except Exception as exc:
        return exc
    return None


def _model_keys(model: Any) -> dict[str, Any]:
    """A pydantic section model's fields and aliases; nested models as sections."""
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    def types(annotation: Any) -> list[Any]:
        args = typing.get_args(annotation)
        return [t for a in args for t in types(a)] if args else [annotation]

    keys: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        nested = [
            t
            for t in types(info.annotation)
            if isinstance(t, type) and issubclass(t, DeepSpeedConfigModel)
        ]
        section = _model_keys(nested[0]) if nested else None
        aliases = {name, info.alias}
        choices = getattr(info.validation_alias, "choices", [info.validation_alias])
        aliases.update(c for c in choices if isinstance(c, str))
        keys.update(dict.fromkeys((a for a in aliases if a), section))
    return keys


def _subclasses(cls: type) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))]


def _pydantic_section(path: tuple[str, ...]) -> dict[str, Any] | None:
    """The keys of the pydantic model DeepSpeed validates the section at ``path`` with."""
    import pydantic
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    exc = _parse(_nest(path, {_PROBE: 0}))
    if not isinstance(exc, pydantic.ValidationError):
        return None
    for error in exc.errors():
        loc = error["loc"]
        if error["type"] == "extra_forbidden" and loc and loc[-1] == _PROBE:
            model = next(c for c in _subclasses(DeepSpeedConfigModel) if c.__name__ == exc.title)
            keys = _model_keys(model)
            for key in loc[:-1]:
                keys = keys[key]
            return keys
    return None


def _section(path: tuple[str, ...]) -> dict[str, Any] | None:
    """What DeepSpeed knows in the section at ``path``: None for a value."""
    found = _pydantic_section(path)
    if found is not None:
        return found
    seen: set[str] = set()
    for seed in ({}, {"enabled": True}, {"type": "Adam"}):
        recorder = _Recorder(seed)
        _parse(_nest(path, recorder))
        seen |= recorder.seen
    if not seen:
        return None
    return {key: _section((*path, key)) for key in sorted(seen)}


def _deepspeed_table() -> dict[str, Any]:
    from deepspeed.runtime.config import DeepSpeedConfig

    logging.disable(logging.WARNING)
    try:
        top = _Recorder(_BASE)
        DeepSpeedConfig(top)
        removed = {path[0] for path in REMOVED_KEYS if len(path) == 1}
        return {key: _section((key,)) for key in sorted(top.seen - removed)}
    finally:
        logging.disable(logging.NOTSET)


def _compare(ours: Any, theirs: Any, path: tuple[str, ...], problems: list[str]) -> None:
    if path in _COPIED:
        assert ours is None, f"{path}: a copied section is not checked inside"
        return
    if theirs is None or ours is None:
        if theirs is not None:
            problems.append(f"{path}: DeepSpeed reads keys {sorted(theirs)}, the table none")
        return
    for key in sorted(set(theirs) - set(ours)):
        problems.append(f"{(*path, key)}: DeepSpeed reads it, the table refuses it")
    for key in sorted(set(ours) - set(theirs)):
        problems.append(f"{(*path, key)}: in the table, DeepSpeed does not read it")
    for key in sorted(set(ours) & set(theirs)):
        _compare(ours[key], theirs[key], (*path, key), problems)


def test_the_table_is_what_deepspeed_reads() -> None:
    theirs = _deepspeed_table()
    for key, module in _READ_ELSEWHERE.items():  # outside DeepSpeedConfig: read in its source
        source = inspect.getsource(__import__(module))
        assert f'"{key}" in config' in source, key
        theirs[key] = None
    theirs.pop("pipeline")
    ours = dict(KNOWN_KEYS)
    pipeline = ours.pop("pipeline")
    problems: list[str] = []
    _compare(ours, theirs, (), problems)
    assert not problems, "\n".join(problems)
    assert theirs.keys() == ours.keys()

    from deepspeed.runtime.config import get_pipeline_config
    from deepspeed.runtime.pipe.engine import PipelineEngine

    read = set(get_pipeline_config({})) | set(
        re.findall(r"\.pipeline(?:\.get\(|\[)'(\w+)'", inspect.getsource(PipelineEngine))
    )
    assert set(pipeline) == read


def test_the_removed_keys_are_what_deepspeed_refuses() -> None:
    from deepspeed.runtime import config as ds_config

    removed_top = {path[0] for path in REMOVED_KEYS if len(path) == 1}
    removed_zero = {path[1] for path in REMOVED_KEYS if path[0] == "zero_optimization"}
    assert len(REMOVED_KEYS) == len(removed_top) + len(removed_zero)
    assert removed_top == set(ds_config._REMOVED_TOP_LEVEL_CONFIG_KEYS)
    assert removed_zero == set(ds_config._REMOVED_ZERO_CONFIG_KEYS)
    for path in REMOVED_KEYS:
        exc = _parse(_nest(path[:-1], {path[-1]: {}}))
        assert isinstance(exc, ds_config.DeepSpeedConfigError), path
        with pytest.raises(ConfigError, match=r"DeepSpeed 0\.19 removed this key"):
            check_config_keys(_nest(path[:-1], {path[-1]: {}}))


def test_every_key_deepspeed_knows_is_honoured_ignored_or_refused_off_deepspeed() -> None:
    """The local and torch engines decide about each key; none is accepted by default."""
    assert handled_keys() == set(KNOWN_KEYS)


def _config(**extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        **extra,
    }


@pytest.mark.parametrize("dialect_name", ["local", "torch", "deepspeed"])
def test_a_typo_is_refused_on_every_dialect_before_anything_is_built(dialect_name: str) -> None:
    """No process group here: the check runs before the dialect needs one."""
    spec = get_model("gpt")
    plan = pipedialect.partition(spec.build(), split_points=list(spec.split_points_for(2)))
    dialect = pipedialect.get_dialect(dialect_name)
    with pytest.raises(UnknownConfigKeyError) as info:
        dialect.pipe_engine(
            plan,
            config=_config(gradient_accumulation_step=4),
            loss_fn=spec.loss_fn,
            topology=dialect.make_topology(2),
        )
    text = str(info.value)
    assert text.startswith("config['gradient_accumulation_step']: DeepSpeed 0.19 knows no key")
    assert "Did you mean 'gradient_accumulation_steps'?" in text
    assert info.value.path == ("gradient_accumulation_step",)
    assert info.value.suggestion == "gradient_accumulation_steps"


def test_runtime_engine_refuses_a_typo_too(tmp_path: Path) -> None:
    spec = get_model("gpt")
    plan = pipedialect.partition(spec.build(), split_points=list(spec.split_points_for(2)))
    dialect = pipedialect.get_dialect("local")
    module = dialect.pipe_engine(plan, config=_config(), loss_fn=spec.loss_fn)
    path = tmp_path / "ds_config.json"  # a JSON file, as DeepSpeed reads one
    path.write_text(json.dumps(_config(zero_optimization={"stag": 1})))
    with pytest.raises(UnknownConfigKeyError, match=r"\['zero_optimization'\]\['stag'\]") as info:
        dialect.runtime_engine(module, config=str(path))
    assert "Did you mean 'stage'?" in str(info.value)
    assert info.value.path == ("zero_optimization", "stag")


@pytest.mark.parametrize(
    ("config", "path", "hint"),
    [
        (
            _config(optimizer={"type": "SGD", "param": {"lr": 0.1}}),
            ("optimizer", "param"),
            "'params'",
        ),
        (
            _config(zero_optimization={"offload_optimizer": {"devic": "cpu"}}),
            ("zero_optimization", "offload_optimizer", "devic"),
            "'device'",
        ),
        (_config(Train_Batch_Size=2), ("Train_Batch_Size",), "'train_batch_size'"),
        (
            _config(load_universal=True),
            ("load_universal",),
            "DeepSpeed knows it as config['checkpoint']['load_universal']",
        ),
        (_config(bf16={"enable": True}), ("bf16", "enable"), "'enabled'"),
    ],
)
def test_unknown_keys_are_named_by_their_path(
    config: dict[str, Any], path: tuple[str, ...], hint: str
) -> None:
    with pytest.raises(UnknownConfigKeyError) as info:
        parse_config(config)
    assert info.value.path == path
    assert hint in str(info.value)


def test_free_form_sections_are_not_checked_inside() -> None:
    """An optimizer's params depend on its type: the optimizer itself checks them."""
    config = _config(
        optimizer={"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}},
        scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 2}},
    )
    check_config_keys(config)
    parse_config(config)


def test_keys_the_local_engines_do_not_honour_stay_refused_with_their_messages() -> None:
    with pytest.raises(ConfigError, match=r"config\['data_efficiency'\] is enabled"):
        parse_config(_config(data_efficiency={"enabled": True}))
    with pytest.raises(ConfigError, match="only stage 0 is supported"):
        parse_config(_config(zero_optimization={"stage": 2}))
    with pytest.raises(ConfigError, match="averages gradients over the replicas"):
        parse_config(_config(gradient_allreduce_op="sum"))
    with pytest.raises(ConfigError, match="no sequence parallelism"):
        parse_config(_config(sequence_parallel_size=2))
    parse_config(_config(steps_per_print=10, wall_clock_breakdown=False, log_level="info"))
