"""Optimizer parameter groups that every dialect's engine builds the same way.

``runtime_engine(module, config=..., param_groups=fn)`` calls ``fn(named_parameters)`` with the
trainable parameters this engine steps, each once under its original name (a tied weight once,
under its first name), and builds the config's optimizer over the groups ``fn`` returns (lists
of dicts with ``"params"`` and optional options such as ``weight_decay``, as torch optimizers
take them). :func:`no_weight_decay` is the usual one: biases and norm weights get
``weight_decay=0``. Each trainable parameter must be in exactly one group, so nothing is left
untrained or stepped twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError

__all__ = ["ParamGroupsFn", "no_weight_decay", "resolve_param_groups"]

#: ``fn(named_parameters) -> groups``.
ParamGroupsFn = Callable[[list[tuple[str, nn.Parameter]]], Sequence[Mapping[str, Any]]]


def no_weight_decay(patterns: Sequence[str] = ("bias", "norm", "ln")) -> ParamGroupsFn:
    """Two groups: the parameters with a name component that starts or ends with one of
    ``patterns`` (case-insensitive: ``bias``, ``ln_f``, ``LayerNorm``, ``norm1``) get
    ``weight_decay=0.0``; the others keep the config's weight decay."""
    lowered = tuple(p.lower() for p in patterns)

    def matches(name: str) -> bool:
        parts = name.lower().split(".")
        return any(part.startswith(p) or part.endswith(p) for part in parts for p in lowered)

    def groups(named: list[tuple[str, nn.Parameter]]) -> list[dict[str, Any]]:
        decayed = [p for n, p in named if not matches(n)]
        exempt = [p for n, p in named if matches(n)]
        return [{"params": decayed}, {"params": exempt, "weight_decay": 0.0}]

    return groups


def resolve_param_groups(
    fn: ParamGroupsFn, named: Iterable[tuple[str, nn.Parameter]], *, what: str = "param_groups"
) -> list[dict[str, Any]]:
    """Call ``fn`` on the trainable parameters (each once) and check what it returns.

    ``what`` names the argument the groups came from in the errors (``param_groups``, or
    ``model_parameters`` for groups given to the DeepSpeed dialect as ``deepspeed.initialize``
    takes them).

    Raises:
        ConfigError: not a list of dicts with ``params``, or a parameter in no group, in two
            groups, or not one of this engine's (the message names it).
    """
    unique: list[tuple[str, nn.Parameter]] = []
    names: dict[int, str] = {}
    for name, param in named:
        if param.requires_grad and id(param) not in names:
            names[id(param)] = name
            unique.append((name, param))
    if not callable(fn):
        raise ConfigError(
            f"{what} must be a callable fn(named_parameters) -> list of dicts, got "
            f"{type(fn).__name__}"
        )
    groups = fn(list(unique))
    if not isinstance(groups, Sequence) or not all(
        isinstance(g, Mapping) and "params" in g for g in groups
    ):
        raise ConfigError(f"{what} must be (or return) a list of dicts, each with a 'params' list")
    seen: dict[int, int] = {}
    resolved: list[dict[str, Any]] = []
    for index, group in enumerate(groups):
        given = group["params"]
        # A lone tensor is one parameter, as torch's optimizers read it (not a list of rows).
        params: list[Any] = [given] if isinstance(given, torch.Tensor) else list(given)
        for param in params:
            found = names.get(id(param))
            if found is None:
                raise ConfigError(
                    f"{what}: group {index} holds a parameter this engine does not train "
                    "(frozen, of another stage, or of another model); use the parameters it "
                    "was given"
                )
            if id(param) in seen:
                raise ConfigError(
                    f"{what}: parameter {found!r} is in groups {seen[id(param)]} and "
                    f"{index}; a parameter (a tied one too) must be in one group only"
                )
            seen[id(param)] = index
        if params:
            resolved.append({**group, "params": params})
    missing = [name for name, param in unique if id(param) not in seen]
    if missing:
        raise ConfigError(
            f"{what}: parameter {missing[0]!r} (and {len(missing) - 1} more) is in no "
            "group and would not be trained; put every parameter it is given in one group"
        )
    return resolved
