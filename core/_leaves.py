"""Module paths of a model: leaf modules named by path or class, and "did you mean" hints.

Shared by the partitioner and the balancer, which both trace with user-chosen leaf modules.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

from torch import nn

from .errors import PartitionError

__all__ = ["close_matches", "resolve_leaves"]


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
