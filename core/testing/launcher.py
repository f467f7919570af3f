"""The launcher's first home: :mod:`pipedialect.launch` now; this name keeps working."""

from __future__ import annotations

from ..launch import free_port, launch

__all__ = ["free_port", "launch"]
