"""pipedialect: one partitioned PyTorch model, several pipeline-parallel runtimes.

The core splits an ``nn.Module`` into pipeline stages (:func:`partition`), describes what flows
between them, and defines the interfaces a runtime implements (:class:`Dialect`,
:class:`StageWrapper`, :class:`TensorCodec`, :class:`TieAnalyzer`). Runtimes are plugins found
through entry points: ``pipedialect.get_dialect("deepspeed")``.

Importing this package never imports a runtime (deepspeed is imported when a DeepSpeed engine
is built).
"""

from __future__ import annotations

from typing import Any

from .codec import SchemaCodec
from .errors import (
    ActivationCheckpointError,
    BrokenPluginError,
    CaptureError,
    CheckpointError,
    CodecError,
    ConfigError,
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
    SplitPointError,
    StructureChangedError,
    TieError,
    TopologyError,
    UnsupportedValueError,
    WeightsError,
    WireError,
)
from .hookspecs import hookimpl, hookspec
from .interfaces import (
    Capability,
    Dialect,
    GridTopology,
    RuntimeEngine,
    TensorCodec,
    TieAnalyzer,
    Topology,
)
from .partition import PipelinePlan, partition
from .plugins import DialectInfo, get_dialect, list_dialects
from .stage import StageWrapper
from .ties import DefaultTieAnalyzer, TieGroup, analyze_tie_ranks, find_tie_groups
from .trace import trace

__all__ = [
    "ActivationCheckpointError",
    "BrokenPluginError",
    "Capability",
    "CaptureError",
    "CheckpointError",
    "CodecError",
    "ConfigError",
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


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("pipedialect")
        except PackageNotFoundError:  # running from a source tree that is not installed
            return "0+unknown"
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
