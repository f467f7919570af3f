"""The DeepSpeed dialect: stages trained by DeepSpeed's own ``PipelineEngine``.

Runs on upstream DeepSpeed (no fork), NCCL on GPUs and gloo on CPUs. Importing this package does
not import deepspeed; building an engine does. ``pipeline`` holds the API of Slapo's
``slapo.framework_dialect.deepspeed.pipeline`` module under the same names.
"""

from ._plugin import DeepSpeedDialect, register_dialects

__all__ = ["DeepSpeedDialect", "register_dialects"]
