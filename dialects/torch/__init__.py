"""The torch dialect: stages trained by ``torch.distributed.pipelining``.

A second real runtime beside DeepSpeed, with the schedules DeepSpeed lacks (interleaved, zero
bubble, DualPipeV) and without torch's own limits: boundaries carry whatever the codec accepts
(the stage wrapper's wire), received non-float tensors get no gradient, and tied weights are
kept in sync across ranks. Importing this package does not import
``torch.distributed.pipelining``; building an engine does.
"""

from ._plugin import TorchDialect, register_dialects
from ._schedules import available_schedules, sharded_schedules
from .engine import TorchEngine, TorchPipeline

__all__ = [
    "TorchDialect",
    "TorchEngine",
    "TorchPipeline",
    "available_schedules",
    "register_dialects",
    "sharded_schedules",
]
