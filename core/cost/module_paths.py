"""Module paths of a model: leaf modules, split-point call checks, "did you mean" hints.

Shared by the fx and export capture paths and the balancer, which all resolve user-given module
paths and check the calls found for them.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

from torch import nn

from ..errors import PartitionError, SplitPointError

__all__ = ["check_execution_order", "check_single_call", "close_matches", "resolve_leaves"]


def close_matches(path: str, candidates: Sequence[str]) -> str:
    """A message tail naming the paths close to ``path``, or else the top-level modules."""
    close = difflib.get_close_matches(path, candidates, n=5, cutoff=0.6)
    if close:
        return f"; close matches: {close}"
    top = [c for c in candidates if "." not in c][:10]
    return f"; the model's top-level modules are {top}"


def resolve_leaves(
    model: nn.Module, leaf_modules: Sequence[str | type[nn.Module]]
) -> tuple[frozenset[int], tuple[type[nn.Module], ...], list[str]]:
    """``(module ids, module classes, module paths)`` of ``leaf_modules`` (paths or classes).

    Raises:
        PartitionError: a path that names no module, or an entry that is neither.
    """
    ids: set[int] = set()
    types: list[type[nn.Module]] = []
    paths: list[str] = []
    names = [name for name, _ in model.named_modules() if name]
    for entry in leaf_modules:
        if isinstance(entry, str):
            try:
                ids.add(id(model.get_submodule(entry)))
            except AttributeError:
                raise PartitionError(
                    f"leaf module {entry!r} is not a module of {type(model).__name__}"
                    + close_matches(entry, names)
                ) from None
            paths.append(entry)
        elif isinstance(entry, type) and issubclass(entry, nn.Module):
            types.append(entry)
            paths.extend(name for name, m in model.named_modules() if isinstance(m, entry))
        else:
            raise PartitionError(
                f"leaf_modules entry {entry!r} is neither a module path nor an nn.Module class"
            )
    return frozenset(ids), tuple(types), paths


def check_single_call(path: str, calls: int) -> None:
    """Raise :class:`SplitPointError` unless the split point ``path`` is called once."""
    if calls > 1:
        raise SplitPointError(
            f"split point {path!r} is called {calls} times in forward; a stage "
            "boundary must follow exactly one call. Choose a module forward calls once."
        )


def check_execution_order(points: Sequence[str], positions: Sequence[int], verb: str) -> None:
    """Raise :class:`SplitPointError` unless ``positions`` (one per split point) increase.

    ``verb`` says what the positions are (``"calls"``, ``"finishes"``) in the message.
    """
    order = sorted(range(len(points)), key=lambda i: positions[i])
    if order != list(range(len(points))):
        first_bad = next(i for i, j in enumerate(order) if i != j)
        raise SplitPointError(
            f"split points are out of execution order at {points[first_bad]!r}: forward {verb} "
            f"them in the order {[points[i] for i in order]}; list them in that order"
        )
