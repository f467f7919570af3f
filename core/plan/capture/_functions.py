"""Custom autograd Functions in a stage graph: applied as one call, so their ``backward`` runs
([Note: custom autograd Functions] on :func:`function_call`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__: list[str] = []

#: The graph target that applies each custom autograd Function ([Note: custom autograd
#: Functions]).
_APPLIES: weakref.WeakKeyDictionary[type, Callable[..., Any]] = weakref.WeakKeyDictionary()


def function_call(cls: type[torch.autograd.Function]) -> Callable[..., Any]:
    """The function a stage graph calls to apply the custom autograd Function ``cls``.

    [Note: custom autograd Functions]
    fx traces ``MyFunction.apply(x)`` by running ``MyFunction.forward`` on proxies: the graph
    gets the forward's operations (``x.view_as(x)`` for a gradient reversal) and autograd then
    differentiates those, so ``MyFunction.backward`` is lost and the gradients are wrong with
    no error. While the torch.fx capture traces, ``apply`` of a Function defined outside torch
    called on traced values becomes one node calling this function instead, which calls
    ``cls.apply`` at run time: forward and backward run as in the unsplit model. Functions of
    torch itself (reentrant checkpointing) are traced as before. torch.export records the
    forward's operations too; that capture refuses such a Function by name
    (``_export.refuse_functions``).
    """
    found = _APPLIES.get(cls)
    if found is None:

        def apply(*args: Any, **kwargs: Any) -> Any:
            return cls.apply(*args, **kwargs)  # type: ignore[no-untyped-call]

        apply.__name__ = apply.__qualname__ = f"{cls.__name__}_apply"
        found = _APPLIES[cls] = apply
    return found


def _torch_function(cls: type) -> bool:
    """Whether ``cls`` is an autograd Function of torch itself."""
    return cls.__module__.split(".")[0] == "torch"
