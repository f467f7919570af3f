"""pipedialect: one partitioned PyTorch model, several pipeline-parallel runtimes.

The core splits an ``nn.Module`` into pipeline stages (:func:`partition`), describes what flows
between them, and defines the interfaces a runtime implements (:class:`Dialect`,
:class:`StageWrapper`, :class:`TensorCodec`, :class:`TieAnalyzer`). Runtimes are plugins found
through entry points: ``pipedialect.get_dialect("deepspeed")``.

Importing this package imports nothing else: each name below is loaded from its module on first
use (so ``import pipedialect.testing.plugin``, which pytest loads in every session, does not
import torch), and importing it never imports a runtime (deepspeed is imported when a DeepSpeed
engine is built).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .codec import SchemaCodec
    from .contracts import Capability, RuntimeEngine, TensorCodec, TieAnalyzer, Topology
    from .dialect import Dialect
    from .errors import (
        ActivationCheckpointError,
        BrokenPluginError,
        CaptureError,
        CheckpointError,
        CodecError,
        ConfigError,
        ConnectionLostError,
        DataError,
        DataExhaustedError,
        DialectNotFoundError,
        DuplicateDialectError,
        ExtensionBuildError,
        LaunchError,
        MetadataError,
        NonFiniteError,
        PartitionError,
        PipeDialectError,
        PipeDialectWarning,
        PlanDisagreementError,
        PlanMismatchError,
        PluginError,
        PluginWarning,
        RankFailedError,
        SplitPointError,
        StructureChangedError,
        TieError,
        TopologyError,
        UnsupportedValueError,
        WeightsError,
        WireError,
    )
    from .hookspecs import hookimpl, hookspec
    from .partition import PipelinePlan, partition
    from .plugins import DialectInfo, get_dialect, list_dialects
    from .stage import StageWrapper
    from .ties import DefaultTieAnalyzer, TieGroup, analyze_tie_ranks, find_tie_groups
    from .topology import GridTopology
    from .trace import trace

__all__ = [
    "ActivationCheckpointError",
    "BrokenPluginError",
    "Capability",
    "CaptureError",
    "CheckpointError",
    "CodecError",
    "ConfigError",
    "ConnectionLostError",
    "DataError",
    "DataExhaustedError",
    "DefaultTieAnalyzer",
    "Dialect",
    "DialectInfo",
    "DialectNotFoundError",
    "DuplicateDialectError",
    "ExtensionBuildError",
    "GridTopology",
    "LaunchError",
    "MetadataError",
    "NonFiniteError",
    "PartitionError",
    "PipeDialectError",
    "PipeDialectWarning",
    "PipelinePlan",
    "PlanDisagreementError",
    "PlanMismatchError",
    "PluginError",
    "PluginWarning",
    "RankFailedError",
    "RuntimeEngine",
    "SchemaCodec",
    "SplitPointError",
    "StageWrapper",
    "StructureChangedError",
    "TensorCodec",
    "TieAnalyzer",
    "TieError",
    "TieGroup",
    "Topology",
    "TopologyError",
    "UnsupportedValueError",
    "WeightsError",
    "WireError",
    "__version__",
    "analyze_tie_ranks",
    "find_tie_groups",
    "get_dialect",
    "hookimpl",
    "hookspec",
    "list_dialects",
    "partition",
    "trace",
]


#: Where each public name lives; read by ``__getattr__`` on first use.
_HOME = {
    **dict.fromkeys((n for n in __all__ if n.endswith(("Error", "Warning"))), ".errors"),
    "Capability": ".contracts",
    "RuntimeEngine": ".contracts",
    "TensorCodec": ".contracts",
    "TieAnalyzer": ".contracts",
    "Topology": ".contracts",
    "Dialect": ".dialect",
    "GridTopology": ".topology",
    "SchemaCodec": ".codec",
    "StageWrapper": ".stage",
    "PipelinePlan": ".partition",
    "partition": ".partition",
    "DialectInfo": ".plugins",
    "get_dialect": ".plugins",
    "list_dialects": ".plugins",
    "hookimpl": ".hookspecs",
    "hookspec": ".hookspecs",
    "DefaultTieAnalyzer": ".ties",
    "TieGroup": ".ties",
    "analyze_tie_ranks": ".ties",
    "find_tie_groups": ".ties",
    "trace": ".trace",
}

#: Functions named like the submodule that defines them: importing the submodule must not
#: rebind the package attribute from the function to the module.
_SHADOWED = frozenset({"partition", "trace"})


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("pipedialect")
        except PackageNotFoundError:  # running from a source tree that is not installed
            return "0+unknown"
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    """The package's module type: keeps :func:`partition` and :func:`trace` the functions."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SHADOWED and isinstance(value, types.ModuleType):
            return  # the import system binding the submodule; it stays in sys.modules
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
