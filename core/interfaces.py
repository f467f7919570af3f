"""The contracts a runtime implements, under their first module name.

The abstract contracts now live in :mod:`pipedialect.contracts`, the :class:`Dialect` base in
:mod:`pipedialect.dialect` and :class:`GridTopology` in :mod:`pipedialect.topology`; this module
keeps ``from pipedialect.interfaces import ...`` working. Nothing in the package imports it.
"""

from __future__ import annotations

from .contracts import Capability, RuntimeEngine, TensorCodec, TieAnalyzer, Topology
from .dialect import Dialect
from .topology import GridTopology

__all__ = [
    "Capability",
    "Dialect",
    "GridTopology",
    "RuntimeEngine",
    "TensorCodec",
    "TieAnalyzer",
    "Topology",
]
