"""An alias of :mod:`pipedialect.config`, where DeepSpeed's config semantics now live.

Several dialects share them, and a dialect must not import another dialect, so the module moved
into the core; this name keeps working for code written against it.
"""

from pipedialect.config import (
    TrainingConfig,
    batch_triple,
    build_optimizer,
    clip_gradients,
    parse_config,
)

__all__ = ["TrainingConfig", "batch_triple", "build_optimizer", "clip_gradients", "parse_config"]
