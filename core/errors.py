"""The exceptions and warnings pipedialect raises.

One root, :class:`PipeDialectError`, so that ``except pipedialect.PipeDialectError`` catches
everything the library raises on purpose. Below it, one branch per concern::

    PipeDialectError
    ├── PluginError
    │   ├── DialectNotFoundError
    │   ├── DuplicateDialectError
    │   └── BrokenPluginError
    ├── PartitionError
    │   ├── SplitPointError
    │   └── CaptureError
    ├── CodecError
    │   ├── UnsupportedValueError
    │   ├── MetadataError
    │   └── StructureChangedError
    ├── TieError
    ├── TopologyError
    ├── WireError
    ├── ConfigError
    ├── CheckpointError
    └── LaunchError

Messages name the culprit (the stage, the value's path, the parameter) and say what to do.
"""

from __future__ import annotations

__all__ = [
    "BrokenPluginError",
    "CaptureError",
    "CheckpointError",
    "CodecError",
    "ConfigError",
    "DialectNotFoundError",
    "DuplicateDialectError",
    "LaunchError",
    "MetadataError",
    "PartitionError",
    "PipeDialectError",
    "PipeDialectWarning",
    "PluginError",
    "PluginWarning",
    "SplitPointError",
    "StructureChangedError",
    "TieError",
    "TopologyError",
    "UnsupportedValueError",
    "WireError",
]


class PipeDialectError(Exception):
    """Base class of every error pipedialect raises on purpose."""


class PluginError(PipeDialectError):
    """A dialect plugin could not be found, loaded or told apart from another."""


class DialectNotFoundError(PluginError, LookupError):
    """No installed dialect has the requested name."""


class DuplicateDialectError(PluginError):
    """Two plugins register a dialect under the same name."""


class BrokenPluginError(PluginError):
    """A plugin failed to import or to register its dialects."""


class PartitionError(PipeDialectError):
    """A model could not be split into pipeline stages."""


class SplitPointError(PartitionError, ValueError):
    """A split point is unknown, never called, called twice or out of execution order."""


class CaptureError(PartitionError):
    """torch.fx could not capture the model's forward."""


class CodecError(PipeDialectError):
    """A value could not be encoded into tensors, or tensors could not be decoded."""


class UnsupportedValueError(CodecError, TypeError):
    """A value of a type the codec cannot carry; the message names its path."""


class MetadataError(CodecError, ValueError):
    """A metadata string is malformed or does not match the tensors given with it."""


class StructureChangedError(CodecError):
    """A value's structure differs from the structure frozen by the first micro-batch."""


class TieError(PipeDialectError):
    """Tied parameters cannot be honoured as declared."""


class TopologyError(PipeDialectError, ValueError):
    """A process topology does not fit the pipeline plan."""


class WireError(PipeDialectError):
    """A stage payload breaks a rule of the runtime that has to carry it."""


class ConfigError(PipeDialectError, ValueError):
    """A required argument or configuration entry is missing or invalid."""


class CheckpointError(PipeDialectError):
    """A checkpoint does not match the pipeline it is loaded into."""


class LaunchError(PipeDialectError):
    """A rank of a local multi-process launch failed or did not finish in time."""


class PipeDialectWarning(UserWarning):
    """Base class of every warning pipedialect emits."""


class PluginWarning(PipeDialectWarning):
    """Something about the installed plugins deserves attention but does not stop loading."""
