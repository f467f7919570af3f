"""The example models' first home: :mod:`pipedialect.models` now; this name keeps working."""

from __future__ import annotations

from ..models import *  # noqa: F403
from ..models import __all__ as __all__
