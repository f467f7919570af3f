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
    │   ├── CaptureError
    │   ├── PlanMismatchError
    │   ├── RecomputeError
    │   ├── ModelChangedError
    │   └── PlanDisagreementError (also a TopologyError)
    ├── CodecError
    │   ├── UnsupportedValueError
    │   ├── MetadataError
    │   └── StructureChangedError
    ├── TieError
    ├── TopologyError
    ├── WireError
    ├── ConfigError
    │   ├── DataError
    │   │   └── DataExhaustedError (also a StopIteration)
    │   ├── MissingCapabilityError
    │   ├── TrainabilityChangedError
    │   └── UnknownConfigKeyError
    ├── CheckpointError
    │   └── WeightsError
    ├── NonFiniteError
    ├── ExtensionBuildError
    ├── LaunchError
    ├── RendezvousError
    └── RankFailedError
        └── ConnectionLostError

Messages name the culprit (the stage, the value's path, the parameter) and say what to do.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BrokenPluginError",
    "CaptureError",
    "CheckpointError",
    "CodecError",
    "ConfigError",
    "ConnectionLostError",
    "DataError",
    "DataExhaustedError",
    "DialectNotFoundError",
    "DuplicateDialectError",
    "ExtensionBuildError",
    "LaunchError",
    "MetadataError",
    "MissingCapabilityError",
    "ModelChangedError",
    "NonFiniteError",
    "PartitionError",
    "PipeDialectError",
    "PipeDialectWarning",
    "PlanDisagreementError",
    "PlanMismatchError",
    "PluginError",
    "PluginWarning",
    "RankFailedError",
    "RecomputeError",
    "RendezvousError",
    "SplitPointError",
    "StructureChangedError",
    "TieError",
    "TopologyError",
    "TrainabilityChangedError",
    "TrainingArgumentError",
    "UnknownConfigKeyError",
    "UnsupportedValueError",
    "WeightsError",
    "WireError",
]


class PipeDialectError(Exception):
    """Base class of every error pipedialect raises on purpose."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Picklable whatever the subclass's keyword arguments, so that one rank's error can be
        # sent to the others (pipedialect.runtime.agreement).
        return (_rebuild_error, (type(self), self.args, dict(self.__dict__)))


def _rebuild_error(
    cls: type[PipeDialectError], args: tuple[Any, ...], state: dict[str, Any]
) -> PipeDialectError:
    """Recreate a pickled :class:`PipeDialectError` without calling its ``__init__``."""
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


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
    """torch.fx could not capture the model's forward, or a value broke what the capture assumed."""


class RecomputeError(PartitionError, ValueError):
    """A ``recompute=`` pattern matches no module, or names one a stage cannot recompute."""


class PlanMismatchError(PartitionError):
    """A plan computes something other than its model on the inputs it was checked on."""

    def __init__(self, message: str, *, stage: int, path: str | None = None) -> None:
        super().__init__(message)
        #: The first stage whose output differs (or that failed).
        self.stage = stage
        #: The split point whose output differs, if it is one.
        self.path = path


class ModelChangedError(PartitionError):
    """The model was changed after ``partition`` in a way its stages cannot follow (a value
    the capture wrote into the graphs, a hook added); raised before the next step."""

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        #: The model's attribute, buffer or module that changed.
        self.path = path


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


class PlanDisagreementError(PartitionError, TopologyError):
    """Ranks built different pipelines (plan, topology or options); none of them trains."""

    def __init__(self, message: str, *, field: str, ranks: tuple[int, ...]) -> None:
        super().__init__(message)
        #: The first thing the ranks disagree on (``"split_points"``, ``"num_stages"``, ...).
        self.field = field
        #: The ranks whose value differs from rank 0's.
        self.ranks = ranks


class WireError(PipeDialectError):
    """A stage payload breaks a rule of the runtime that has to carry it."""


class ConfigError(PipeDialectError, ValueError):
    """A required argument or configuration entry is missing or invalid."""


class CheckpointError(PipeDialectError):
    """A checkpoint does not match the pipeline it is loaded into."""

    def __init__(self, message: str, *, parameter: str | None = None) -> None:
        super().__init__(message)
        #: The parameter whose saved value does not fit, if one is at fault.
        self.parameter = parameter


class WeightsError(CheckpointError):
    """A stage's weights are missing, misshapen, or still on the meta device after loading."""

    def __init__(
        self, message: str, *, stage: int | None = None, parameter: str | None = None
    ) -> None:
        super().__init__(message, parameter=parameter)
        #: The stage being filled, if known.
        self.stage = stage


class DataError(ConfigError):
    """A data iterator yielded something a step cannot train on (or too little)."""


class DataExhaustedError(DataError, StopIteration):
    """A data iterator ran out before a step had all its micro-batches; nothing was trained."""

    def __init__(self, message: str, *, expected: int, got: int) -> None:
        super().__init__(message)
        #: The micro-batches the step needs.
        self.expected = expected
        #: The micro-batches the iterator yielded before it ran out.
        self.got = got


class MissingCapabilityError(ConfigError):
    """A feature needs a capability (and its hook) the engine's dialect does not declare."""

    def __init__(self, message: str, *, dialect: str, capability: str) -> None:
        super().__init__(message)
        #: The name of the dialect that lacks it.
        self.dialect = dialect
        #: The capability it lacks (a :class:`~pipedialect.Capability` value).
        self.capability = capability


class TrainabilityChangedError(ConfigError):
    """A parameter was frozen or unfrozen after the engine that trains it was built."""

    def __init__(self, message: str, *, stage: int, parameter: str) -> None:
        super().__init__(message)
        #: The stage holding the parameter.
        self.stage = stage
        #: The parameter's name in the model.
        self.parameter = parameter


class UnknownConfigKeyError(ConfigError):
    """A config dict holds a key DeepSpeed does not know (DeepSpeed would ignore it silently)."""

    def __init__(self, message: str, *, path: tuple[str, ...], suggestion: str | None) -> None:
        super().__init__(message)
        #: The key's path: its sections, then the key (``("zero_optimization", "stag")``).
        self.path = path
        #: The closest key DeepSpeed knows in that section, if one is close.
        self.suggestion = suggestion


class TrainingArgumentError(ConfigError):
    """A Trainer setting (a ``TrainingArguments`` field or argument) a pipeline cannot honour."""

    def __init__(self, message: str, *, argument: str) -> None:
        super().__init__(message)
        #: The setting, as ``TrainingArguments`` (or ``Trainer``) names it.
        self.argument = argument


class NonFiniteError(PipeDialectError, FloatingPointError):
    """A loss or a gradient became NaN or infinite; the optimizer did not step."""

    def __init__(
        self,
        message: str,
        *,
        step: int,
        stage: int,
        micro_batch: int | None = None,
        parameter: str | None = None,
    ) -> None:
        super().__init__(message)
        #: The training step (``global_steps`` + 1) that failed.
        self.step = step
        #: The stage whose loss or gradient is not finite.
        self.stage = stage
        #: The micro-batch whose loss is not finite (None for a gradient).
        self.micro_batch = micro_batch
        #: The parameter whose gradient is not finite (None for a loss).
        self.parameter = parameter


class ExtensionBuildError(PipeDialectError):
    """A runtime's C++ extension cannot be built: a killed build left its lock behind, say."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        #: The file to delete, or the directory at fault.
        self.path = path


class LaunchError(PipeDialectError):
    """A rank of a local multi-process launch failed or did not finish in time."""


class RendezvousError(PipeDialectError):
    """The ranks could not form their process group: ``MASTER_PORT`` is held by another
    program, or a rank did not join in time."""

    def __init__(self, message: str, *, address: str, port: int, seconds: float) -> None:
        super().__init__(message)
        #: ``MASTER_ADDR``, where the ranks meet.
        self.address = address
        #: ``MASTER_PORT``.
        self.port = port
        #: How long this rank tried.
        self.seconds = seconds


class PipeDialectWarning(UserWarning):
    """Base class of every warning pipedialect emits."""


class PluginWarning(PipeDialectWarning):
    """Something about the installed plugins deserves attention but does not stop loading."""


class RankFailedError(PipeDialectError):
    """A rank failed in a phase every rank runs together (build, step, checkpoint); all stop."""

    def __init__(self, message: str, *, rank: int, what: str, error: str) -> None:
        super().__init__(message)
        #: The rank the failure came from.
        self.rank = rank
        #: The phase that failed (``"train_batch (step 3)"``).
        self.what = what
        #: The type name of the original exception.
        self.error = error


class ConnectionLostError(RankFailedError):
    """A rank lost its connection to another one that reported no error (crashed or killed)."""
