"""The module that runs one pipeline stage inside a runtime.

A :class:`StageWrapper` receives what crosses into its stage, runs the stage's
``fx.GraphModule`` and returns what must cross to the next one. Runtimes chain the wrappers
(DeepSpeed's ``PipelineModule`` calls ``layer(x)`` for each), so every wrapper takes and returns
a tuple of tensors; the codec and the wire layout (:mod:`pipedialect.runtime.wire` [Note: wire
layout]) carry everything else.

Values are named as in the plan's top-level graph: a model input by its parameter name, the
output of stage ``k`` as ``submod_k``, and its ``i``-th item as ``submod_k.i`` when the stage
returns several values. A wrapper learns its stage's names from the plan's
:class:`~pipedialect.contracts.StageSpec` (:meth:`~pipedialect.PipelinePlan.stage_spec`): what
the stage receives (its own arguments, then values later stages need), its arguments in call
order, what it sends on, and the model's inputs in the order the data loader supplies them.

[Note: received tensors updated in place]
A runtime hands a stage the tensors it received as leaves that need a gradient (torch's
pipelining does; DeepSpeed clones them first), and autograd refuses an in-place operation on such
a leaf ("a leaf Variable that requires grad is being used in an in-place operation"), which the
unsplit model, where the same value is an intermediate result, runs: ``nn.ReLU(inplace=True)``
right after a split point, ``h.add_(...)``. A runtime's hook may also hand them over as views a
custom Function returned (FSDP2's, on a sharded stage), which autograd refuses to update in place
as well. So the decoder passes each such received tensor that needs a gradient on through an
identity autograd node (:func:`pass_through`): a new tensor on the same memory, neither a leaf
nor a view, so in-place operations are recorded on it as in the unsplit model and the gradient
still reaches the runtime's tensor. Nothing is copied. A value this stage forwards to a
later one is sent as the stage holds it, after its in-place updates, as the unsplit model would
use it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Self

import torch
import torch.utils.checkpoint
from torch import fx, nn

from ..contracts import StageSpec, TensorCodec
from ..errors import ConfigError, TieError, TrainabilityChangedError, WireError
from .agreement import agree_on_error
from .codec import decoded_by
from .module_state import UpdatedBuffers, apply_modes
from .randomness import StageRandomness
from .wire import WireDecoder, WireEncoder

__all__ = ["StageWrapper", "check_trainable", "record_trainable", "stage_root"]


class StageWrapper(nn.Module):
    """Run one stage of a partitioned model; subclassed by each dialect.

    Args:
        mod: the stage's GraphModule (parameters keep the original model's names).
        spec: what the stage receives, runs on and sends: ``plan.stage_spec(stage_id)``.
        codec: the codec for boundary values; a fresh :class:`~pipedialect.SchemaCodec`
            by default.
        dynamic_shapes: allow boundary structure and shapes to change between micro-batches
            (the receiver then reads the metadata every time).
        shares_state_with: a module whose submodules may hold this stage's buffer tensors
            (the partitioned model, whose buffers torch.export's stages share from other module
            objects): a buffer replaced by a fresh copy (:mod:`pipedialect.runtime.module_state`
            [Note: buffers updated in place]) is replaced there too, so it keeps seeing the
            stage's state.
        seed: the root of the stage's random streams (:mod:`pipedialect.runtime.randomness`
            [Note: random streams]); ``pipe_engine(seed=)``.

    Raises:
        ConfigError: the spec does not describe a stage: its id is outside its stages, the
            first stage receives other values than the model's inputs, or an argument of the
            stage is not among what it receives.
    """

    def __init__(
        self,
        mod: fx.GraphModule | nn.Module,
        spec: StageSpec,
        *,
        codec: TensorCodec | None = None,
        dynamic_shapes: bool = False,
        shares_state_with: nn.Module | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        stage_id, total_stages = spec.stage_id, spec.num_stages
        if not 0 <= stage_id < total_stages:
            raise ConfigError(f"stage_id {stage_id} is outside 0..{total_stages - 1}")
        self.mod = mod
        self.spec = spec
        self.stage_id = stage_id
        self.name = spec.name
        self.total_stages = total_stages
        self.last = stage_id == total_stages - 1
        self.dynamic_shapes = dynamic_shapes
        self.log_prefix = f"[Stage {stage_id}]"
        self.input_names: tuple[str, ...] = spec.input_names
        self.arg_names: tuple[str, ...] = spec.arg_names
        self.receives: tuple[str, ...] = spec.receives
        self.sends: tuple[str, ...] = () if self.last else spec.sends
        if stage_id == 0 and self.receives != self.input_names:
            raise ConfigError(
                f"{self.log_prefix} the first stage receives the model's inputs "
                f"{list(self.input_names)}, but the spec says {list(self.receives)}"
            )
        missing = [a for a in self.arg_names if a not in self.receives]
        if missing:
            raise ConfigError(
                f"{self.log_prefix} arguments {missing} are not among the values this stage "
                f"receives ({list(self.receives)}); the liveness does not match the stage"
            )
        self._arg_index = tuple(self.receives.index(a) for a in self.arg_names)
        if codec is None:
            from .codec import SchemaCodec

            codec = SchemaCodec()
        self.codec = codec
        frozen = not dynamic_shapes
        self._decoder = WireDecoder(codec, prefix=self.log_prefix, frozen=frozen)
        self._encoder = WireEncoder(codec, prefix=self.log_prefix, frozen=frozen)
        self._buffers_updated: UpdatedBuffers | None = None
        #: The stream the stage's forwards draw random numbers from ([Note: random streams]).
        self.random = StageRandomness(stage_id, seed)
        self._cuda_devices: tuple[torch.device, ...] | None = None
        self._trainable: dict[str, bool] | None = None
        self._state_peer: nn.Module | None
        # Not a submodule: the partitioned model, whose modules may hold this stage's buffer
        # tensors (torch.export's stages do), so that fresh copies reach it too.
        self.__dict__["_state_peer"] = shares_state_with

    def train(self, mode: bool = True) -> Self:
        """Switch the stage to train (``mode``) or eval mode, each of its submodules to the
        flag the unsplit model's has in that mode (:attr:`StageSpec.module_modes
        <pipedialect.contracts.StageSpec.module_modes>`, [Note: per-module modes] in
        :mod:`pipedialect.runtime.module_state`): every engine's ``train_batch`` and
        ``eval_batch`` come here, so the plan's check of what the loop changed on the model
        (:attr:`StageSpec.before_step <pipedialect.contracts.StageSpec.before_step>`) runs
        first."""
        if self.spec.before_step is not None:
            self.spec.before_step(mode)
        super().train(mode)
        apply_modes(self.mod, self.spec.module_modes, mode)
        return self

    def _trainability(self) -> dict[str, tuple[bool, int | None]]:
        """``requires_grad`` of every parameter of the model (the state peer, which every rank
        holds whole) and of this stage, by name, with this stage's id where it holds one."""
        found: dict[str, tuple[bool, int | None]] = {}
        if self._state_peer is not None:
            for n, p in self._state_peer.named_parameters(remove_duplicate=False):
                found[n] = (p.requires_grad, None)
        for n, p in self.mod.named_parameters(remove_duplicate=False):
            found[n] = (p.requires_grad, self.stage_id)
        return found

    def record_trainable(self) -> None:
        """Remember which parameters are trainable now: when the engine's optimizer is built
        ([Note: trainability fixed at build])."""
        self._trainable = {n: flag for n, (flag, _) in self._trainability().items()}

    def check_trainable(self, step: int) -> None:
        """Refuse a step after a parameter's ``requires_grad`` changed since
        :meth:`record_trainable` ([Note: trainability fixed at build]).

        Raises:
            TrainabilityChangedError: naming the parameter, its stage and what to do.
        """
        if self._trainable is None:  # an engine built without runtime_engine: from now on
            self.record_trainable()
            return
        for name, (now, stage) in self._trainability().items():
            before = self._trainable.get(name)
            if before is None or before == now:
                continue
            change, effect = (
                ("unfrozen", "never step it")
                if now
                else ("frozen", "go on stepping it with its momentum and weight decay")
            )
            where = f"of stage {stage}" if stage is not None else "of the model"
            raise TrainabilityChangedError(
                f"{self.log_prefix} parameter {name!r} ({where}) was {change} (requires_grad "
                f"set to {now}) after the engine was built, before step {step}: the optimizer "
                f"was built over the parameters trainable then and would {effect}, unlike the "
                "unsplit model with an optimizer built now. Set requires_grad before "
                "runtime_engine(), or build the engine again (pipe_engine, then "
                "runtime_engine) after changing it; to go on with this engine, set it back "
                f"with requires_grad_({before})",
                stage=self.stage_id if stage is None else stage,
                parameter=name,
            )

    def reset_wire_state(self) -> None:
        """Forget the frozen wire layout and shapes of both boundaries of this stage.

        The next training micro-batch fixes them anew, so a new sequence length (or structure)
        is accepted once. Both ends of a boundary must be reset together: engines do it for
        every stage in ``reset_activation_shape()``, which every rank calls.
        """
        self._encoder.reset()
        self._decoder.reset()

    # -- the three steps of a stage ------------------------------------------------------

    def receive(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[Any]:
        """Turn what the runtime passed in into the values of :attr:`receives`, in order."""
        if len(args) == 1 and isinstance(args[0], (tuple, list)):
            args = tuple(args[0])
        if self.stage_id == 0:
            return self._receive_inputs(args, kwargs)
        if kwargs:
            raise WireError(
                f"{self.log_prefix} got keyword arguments {sorted(kwargs)}; only the first "
                "stage takes named inputs"
            )
        values = self._decoder.decode(args)
        if not isinstance(values, list) or len(values) != len(self.receives):
            raise WireError(
                f"{self.log_prefix} expected {len(self.receives)} values "
                f"{list(self.receives)}, decoded {type(values).__name__} of length "
                f"{len(values) if isinstance(values, (list, tuple)) else 'n/a'}"
            )
        return values

    def _receive_inputs(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[Any]:
        names = self.input_names
        if len(args) > len(names):
            raise WireError(
                f"{self.log_prefix} got {len(args)} inputs but the model takes {len(names)} "
                f"({list(names)}); the data loader must yield them in this order"
            )
        values: list[Any] = list(args)
        defaults = self.spec.input_defaults
        for name in names[len(args) :]:
            if name in kwargs:
                values.append(kwargs[name])
            elif name in defaults:  # forward's own default, as the unsplit model takes it
                values.append(defaults[name])
            else:
                raise WireError(
                    f"{self.log_prefix} missing model input {name!r}; expected inputs "
                    f"{list(names)} in this order. An input the data does not supply must "
                    "have a number default in forward, or be fixed when partitioning: "
                    f"partition(..., concrete_args={{{name!r}: value}}) takes it out of the "
                    "plan's inputs"
                )
        extra = set(kwargs) - set(names[len(args) :])
        if extra:
            raise WireError(f"{self.log_prefix} unexpected inputs {sorted(extra)}")
        # Model inputs are data: a runtime may hand them over with requires_grad set (DeepSpeed
        # does for floats under reentrant checkpointing); the unsplit model never sees that.
        return [v.detach() if isinstance(v, torch.Tensor) else v for v in values]

    def run(self, received: Sequence[Any]) -> Any:
        """Call the stage's module on its arguments, picked out of ``received``.

        Values after the first stage came through :attr:`codec`, and the module's split-point
        guards judge them as it decodes them ([Note: split-point outputs] in ``capture._guards``).
        Buffers the forward updates in place get a fresh copy first when gradients are enabled
        (:mod:`pipedialect.runtime.module_state` [Note: buffers updated in place]). Random
        numbers come from the stage's stream for this micro-batch
        (:mod:`pipedialect.runtime.randomness` [Note: random streams]).
        """
        if self._buffers_updated is None:
            self._buffers_updated = UpdatedBuffers(self.mod, self._state_peer)
        tracker = self._buffers_updated
        if torch.is_grad_enabled():
            tracker.fresh_copies()
        before = tracker.versions()
        tied = self._tied_versions()
        args = [received[i] for i in self._arg_index]
        with (
            self.random.forward(self._devices_drawing(args)),
            decoded_by(self.codec if self.stage_id > 0 else None),
        ):
            out = self.mod(*args)
        tracker.learn(before)
        self._check_tied_unwritten(tied)
        return out

    def _tied_versions(self) -> list[tuple[str, nn.Parameter, int]]:
        """The version counters of this stage's tied parameters before a forward."""
        if not self.spec.tied_parameters:
            return []
        params = dict(self.mod.named_parameters(remove_duplicate=False))
        return [
            (name, params[name], params[name]._version)
            for name in self.spec.tied_parameters
            if name in params
        ]

    def _check_tied_unwritten(self, tied: list[tuple[str, nn.Parameter, int]]) -> None:
        """Refuse a forward that wrote a tied parameter in place.

        [Note: tied parameters written in forward]
        A tie shared by stages on different ranks is one copy per rank, kept equal by
        starting equal and summing their gradients before every step. A forward that writes
        the parameter in place (``nn.Embedding(max_norm=...)`` renormalising its rows, running
        state kept in a frozen ``nn.Parameter``) changes this copy only: the others drift
        apart from it, and the stages that read them compute with the old values. The stage
        refuses that forward by name on every dialect (where the copies are one object as well,
        so that a model that trains locally trains everywhere), before the optimizer steps.
        """
        for name, param, version in tied:
            if param._version != version:
                raise TieError(
                    f"{self.log_prefix} forward wrote the tied parameter {name!r} in place "
                    "(nn.Embedding(max_norm=...) renormalising it, or running state kept in an "
                    "nn.Parameter); the stages sharing it would each keep their own copy and "
                    "drift apart. Untie it (give the other stage its own parameter), keep "
                    "running state in a buffer (register_buffer), renormalise outside forward "
                    "(with torch.no_grad() between steps), or choose split points that keep "
                    "every user of the parameter on one stage"
                )

    def _devices_drawing(self, args: Sequence[Any]) -> tuple[torch.device, ...]:
        """The CUDA devices whose generators the stage's forward may draw from: those of its
        parameters, buffers and tensor arguments (worked out once)."""
        if self._cuda_devices is None:
            tensors = [*self.mod.parameters(), *self.mod.buffers()]
            tensors += [a for a in args if isinstance(a, torch.Tensor)]
            found = {t.device for t in tensors if t.device.type == "cuda"}
            self._cuda_devices = tuple(sorted(found, key=str))
        return self._cuda_devices

    def send(self, received: Sequence[Any], out: Any) -> tuple[torch.Tensor, ...]:
        """Collect the values of :attr:`sends` and encode them as wire tensors."""
        named = dict(zip(self.receives, received, strict=True))
        named[self.name] = out
        if isinstance(out, tuple):
            for i, item in enumerate(out):
                named[f"{self.name}.{i}"] = item
        try:
            payload = [named[n] for n in self.sends]
        except KeyError as exc:
            raise WireError(
                f"{self.log_prefix} the next stage needs {exc.args[0]!r}, which this stage "
                f"neither received nor produced (it has {sorted(named)})"
            ) from None
        return self._encoder.encode(payload, _device_of(out, received, self.mod))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Receive, run, send; the last stage returns the model's output for the loss."""
        if self.last:
            received = self.receive(args, kwargs)
            return self.after_run(received, self.run(received))
        if not torch.is_grad_enabled() and self._encoder.layout is None and not self.dynamic_shapes:
            # The wire layout depends on which values need a gradient, which only shows with
            # grad enabled. Work it out once, so evaluation sends exactly what training will.
            with torch.enable_grad():
                wire = self._forward_and_send(args, kwargs)
            return tuple(t.detach() for t in wire)
        return self._forward_and_send(args, kwargs)

    def _forward_and_send(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        received = self.receive(args, kwargs)
        return self.send(received, self.after_run(received, self.run(received)))

    def after_run(self, received: Sequence[Any], out: Any) -> Any:
        """Hook between running the stage and sending its values; returns ``out`` unchanged.

        Dialects override it to adapt the output to their runtime's rules.
        """
        del received
        return out

    def extra_repr(self) -> str:
        return f"stage_id={self.stage_id}, name={self.name!r}, total_stages={self.total_stages}"


def record_trainable(modules: Any) -> None:
    """:meth:`StageWrapper.record_trainable` on every stage wrapper among ``modules``."""
    for module in modules:
        if isinstance(module, StageWrapper):
            module.record_trainable()


def check_trainable(modules: Any, step: int, device: torch.device | None = None) -> None:
    """:meth:`StageWrapper.check_trainable` on every stage wrapper among ``modules``; an engine
    calls it before each training step, inside the phase whose errors every rank raises, on
    every rank together: the verdict is agreed by one collective (``device``: where its
    integer lives), so every rank raises the same error and the process group stays usable.

    [Note: trainability fixed at build]
    Every engine builds its optimizer over the parameters that need a gradient when
    ``runtime_engine`` runs (DeepSpeed's too, and its flat buffers, ZeRO partitions and
    parameter groups cannot take a new parameter). A parameter unfrozen afterwards would get
    gradients that no optimizer applies; one frozen afterwards would still be stepped by
    optimizers that decay or carry momentum. The unsplit model's loop would rebuild its
    optimizer, so the engines refuse the step instead, by name, before any forward: rebuilding
    the engine is what the user's unsplit loop does too. Each wrapper checks the whole model it
    was partitioned from (every rank holds it, on the meta device where it builds only its
    stages), not only its stage: a change the training script makes on every rank is then
    seen by every rank at once. The ranks still agree on the verdict with one collective
    (:func:`~pipedialect.runtime.agreement.agree_on_error`) rather than each raising on its own:
    a rank that reaches the check late (a loaded machine) would otherwise miss the short window
    in which the phase's error agreement waits for its peers, and the process group would be
    shut down for an error the user can undo (set the flag back and go on); and a change made
    on one rank only reaches the others the same way.
    """
    error: TrainabilityChangedError | None = None
    try:
        for module in modules:
            if isinstance(module, StageWrapper):
                module.check_trainable(step)
    except TrainabilityChangedError as exc:
        error = exc
    agree_on_error(error, device=device or torch.device("cpu"), what=f"train_batch (step {step})")


def _device_of(out: Any, received: Sequence[Any], mod: nn.Module) -> torch.device:
    if isinstance(out, torch.Tensor):
        return out.device
    for v in (*(out if isinstance(out, (tuple, list)) else ()), *received):
        if isinstance(v, torch.Tensor):
            return v.device
    for p in mod.parameters():
        return p.device
    return torch.device("cpu")


# -- module state: buffers updated in place, recomputation ------------------------------------

#: A buffer's place: the module that registers it and its name there.


def stage_root(stage: nn.Module) -> nn.Module:
    """The module that holds ``stage``'s parameters under the unsplit model's names.

    A :class:`StageWrapper` runs its stage module (``.mod``), whose parameter and buffer names
    are the original model's; any other module (a stage not wrapped yet, a runtime's own layer)
    is its own root. Checkpoints, ties and weight loading read names from here, never from the
    wrapper, whose names carry a ``mod.`` prefix.
    """
    return stage.mod if isinstance(stage, StageWrapper) else stage
