"""Tied parameters: which parameters stages share and which ranks must keep them equal.

(Stub: the partition issue implements this module.)
"""

from __future__ import annotations

__all__ = ["DefaultTieAnalyzer", "TieGroup", "TieRanks", "analyze_tie_ranks", "find_tie_groups"]
