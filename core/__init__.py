"""pipedialect: one partitioned PyTorch model, several pipeline-parallel runtimes.

The core splits an ``nn.Module`` into pipeline stages (:func:`partition`), describes what flows
between them, and defines the interfaces a runtime implements (:class:`Dialect`,
:class:`StageWrapper`, :class:`TensorCodec`, :class:`TieAnalyzer`). Runtimes are plugins found
through entry points: ``pipedialect.get_dialect("deepspeed")``. Importing this package never
imports a runtime: a dialect imports its own (deepspeed, say) when it builds an engine.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from . import errors as _errors
from .contracts import Capability, RuntimeEngine, TensorCodec, TieAnalyzer, TieGroup, Topology
from .dialect import Dialect
from .errors import *  # every exception and warning: errors.__all__
from .hookspecs import hookimpl, hookspec
from .plan.partition import PipelinePlan, partition
from .plan.ties import DefaultTieAnalyzer, analyze_tie_ranks, find_tie_groups
from .planner import plan_layout
from .plugins import DialectInfo, get_dialect, list_dialects
from .runtime.codec import SchemaCodec
from .runtime.stage import StageWrapper
from .runtime.topology import GridTopology
from .trace import trace

try:
    __version__ = version("pipedialect")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

#: The package's own names; every exception and warning is added from ``errors.__all__``.
__all__ = [
    "Capability",
    "DefaultTieAnalyzer",
    "Dialect",
    "DialectInfo",
    "GridTopology",
    "PipelinePlan",
    "RuntimeEngine",
    "SchemaCodec",
    "StageWrapper",
    "TensorCodec",
    "TieAnalyzer",
    "TieGroup",
    "Topology",
    "__version__",
    "analyze_tie_ranks",
    "find_tie_groups",
    "get_dialect",
    "hookimpl",
    "hookspec",
    "list_dialects",
    "partition",
    "plan_layout",
    "trace",
]
__all__ += _errors.__all__
__all__.sort()
