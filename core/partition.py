"""Splitting a model into pipeline stages.

(Stub: the partition issue implements this module.)
"""

from __future__ import annotations

__all__ = ["PipelinePlan", "partition"]
