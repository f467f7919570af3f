"""Module state across pipelined forwards and recomputation: what runs must see and leave.

A pipeline runs a stage's forward for several micro-batches before their backwards, and
activation recomputation runs a forward a second time during backward; the unsplit model does
neither. The helpers here keep buffers and plain Python attributes as one forward in the unsplit
model leaves them. :class:`UpdatedBuffers` serves every :class:`~pipedialect.StageWrapper`,
:func:`recompute_with_state` the ``partition(recompute=...)`` calls and DeepSpeed's
``activation_checkpoint_interval``, :func:`preserved_state` any run that must leave no trace
(the torch dialect's schedule set-up).

[Note: buffers updated in place]
A forward that updates a buffer in place (BatchNorm's running statistics, ``self.scale.mul_(0.9)``)
runs, in a pipeline, before the previous micro-batch's backward (1F1B and GPipe run several
forwards first). When an operation saved that buffer for backward (``h / self.scale``), the next
forward's update changes what the previous micro-batch saved, and autograd refuses ("modified by
an inplace operation"); the unsplit model, whose backward follows each forward, never sees it. So
each wrapper learns, from the tensor version counters, which of its buffers its forward updates
in place, and before each forward with gradients enabled puts a copy of each of them in its place
(the same value, a new tensor): the update goes to the copy and the previous micro-batch keeps
what it saved. Every forward still reads the value the previous one left, as in the unsplit
model; it costs one copy of each such buffer per micro-batch (a few floats per channel for
running statistics). The module's attribute always names the current tensor, so ``state_dict``
and checkpoints see the latest value. Every module attribute holding the same tensor gets the
same copy.

[Note: recomputation and module state]
Activation checkpointing runs a module's forward again during backward. Run as it is, the second
run updates running statistics, counters and other in-place-updated buffers a second time (a
BatchNorm would count 8 batches where the model counts 4), and it computes with the values the
first run left rather than those it saw. :func:`recompute_with_state` makes the recomputation
see, and leave, the module state exactly as one forward does: before the first run every buffer
the forward updates in place is replaced by a copy (the original keeps the value the forward
started from), and the recomputation runs on a fresh copy of those starting values, with the
module's plain Python attributes (counters, flags) as they were, after which the tensors and
attributes of the moment are put back. Which buffers a forward updates is learned at its first
call in each mode (training or evaluation), when every buffer is copied once and compared with
its copy afterwards: BatchNorm's kernel updates its running statistics without a version bump,
so version counters alone would miss them. A buffer a later call updates that an earlier
call did not cannot be recomputed exactly; its recomputation raises
:class:`~pipedialect.RecomputeError` instead of computing with another value.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import RecomputeError

__all__ = [
    "ModuleModes",
    "UpdatedBuffers",
    "apply_modes",
    "mode_table",
    "preserved_state",
    "recompute_with_state",
]


_Slot = tuple[nn.Module, str]

#: Submodules whose train/eval flag is not the one ``train(mode)`` gives the whole tree: their
#: path (relative to the module the table is for) and their flag in the training pattern and
#: in the evaluation pattern ([Note: per-module modes]).
ModuleModes = Mapping[str, tuple[bool, bool]]


def apply_modes(root: nn.Module, modes: ModuleModes, training: bool) -> None:
    """Put ``root`` in ``training`` mode, then give each submodule of ``modes`` its own flag.

    [Note: per-module modes]
    The unsplit model's submodules need not share one mode: ``model.train();
    model.backbone.bn.eval()`` freezes a BatchNorm while the rest trains, and a ``train()``
    override may keep the norms in eval. ``partition`` records each module's flag in the
    training pattern (a module trains when the model's own ``train()`` puts it in training
    and, for a model partitioned in train mode, it is in training then too: what the user or
    the override froze stays frozen) and in the evaluation pattern (what ``eval()`` gives),
    captures each mode with its pattern in place (torch.export writes the flags into the
    graphs; the torch.fx capture reads ``self.training`` of the modules it traces
    through), and every stage wrapper re-applies its stage's table whenever the engine
    switches it: ``train_batch`` and ``eval_batch`` see what the unsplit model would.
    Only flags that differ from the mode are kept; the flags are set directly, so nothing of a
    user's ``train()`` override runs again.
    """
    root.train(training)
    column = 0 if training else 1
    for path, flags in modes.items():
        root.get_submodule(path).training = flags[column]


def mode_table(model: nn.Module) -> dict[str, tuple[bool, bool]]:
    """Each module's flag (by its first path in ``model``) in the training pattern and the
    evaluation pattern ([Note: per-module modes]); the flags are left as they were."""
    modules = list(model.named_modules())
    flags = [m.training for _, m in modules]
    try:
        model.train(True)
        train = [m.training for _, m in modules]
        model.train(False)
        evaluated = [m.training for _, m in modules]
    finally:
        for (_, m), flag in zip(modules, flags, strict=True):
            m.training = flag
    if model.training:  # frozen by the user (bn.eval()) or by the override: frozen
        train = [a and b for a, b in zip(train, flags, strict=True)]
    return {
        name: (t, e)
        for (name, _), t, e in zip(modules, train, evaluated, strict=True)
        if (t, e) != (True, False)
    }


def _buffer_slots(modules: Iterable[nn.Module]) -> list[_Slot]:
    """Every registered buffer of ``modules`` and their submodules, each place once."""
    seen: set[int] = set()
    slots: list[_Slot] = []
    for root in modules:
        for owner in root.modules():
            if id(owner) in seen:
                continue
            seen.add(id(owner))
            slots.extend((owner, name) for name, b in owner._buffers.items() if b is not None)
    return slots


def _get(slot: _Slot) -> torch.Tensor | None:
    return slot[0]._buffers.get(slot[1])


def _copy_of(buf: torch.Tensor) -> torch.Tensor:
    """A new tensor with ``buf``'s value, layout and ``requires_grad``."""
    with torch.no_grad():
        copy = buf.clone()
    return copy.requires_grad_(buf.requires_grad) if buf.is_leaf else copy


def _replace(slots: Sequence[_Slot], tensors: Mapping[int, torch.Tensor]) -> None:
    """Put ``tensors[id(old)]`` wherever a slot holds ``old`` (shared buffers stay shared)."""
    for owner, name in slots:
        current = owner._buffers.get(name)
        if current is not None and id(current) in tensors:
            owner._buffers[name] = tensors[id(current)]


class UpdatedBuffers:
    """The buffers of one stage its forward updates in place ([Note: buffers updated in place])."""

    def __init__(self, root: nn.Module, peer: nn.Module | None = None) -> None:
        # The peer (the partitioned model) may hold the same tensors in other modules: a copy
        # replaces a tensor in every slot that holds it, so the peer keeps seeing the state.
        self.slots = _buffer_slots([root] if peer is None else [root, peer])
        #: Indices of the slots whose tensor a forward updated in place.
        self.updated: set[int] = set()

    def fresh_copies(self) -> None:
        """Replace every buffer a forward updates in place by a copy of it."""
        if not self.updated:
            return
        copies: dict[int, torch.Tensor] = {}
        for i in self.updated:
            buf = _get(self.slots[i])
            if buf is not None and id(buf) not in copies:
                copies[id(buf)] = _copy_of(buf)
        _replace(self.slots, copies)

    def versions(self) -> list[tuple[torch.Tensor | None, int]]:
        """Each slot's tensor and its version counter."""
        out: list[tuple[torch.Tensor | None, int]] = []
        for slot in self.slots:
            buf = _get(slot)
            out.append((buf, -1 if buf is None else buf._version))
        return out

    def learn(self, before: Sequence[tuple[torch.Tensor | None, int]]) -> None:
        """Remember the slots whose tensor changed in place since ``before``."""
        for i, (buf, version) in enumerate(before):
            if buf is not None and _get(self.slots[i]) is buf and buf._version != version:
                self.updated.add(i)


#: Python attribute types restored around a recomputation (immutable, so kept by reference).
_SCALARS = (bool, int, float, str, type(None))


def _scalar_attributes(modules: Iterable[nn.Module]) -> dict[tuple[int, str], Any]:
    """Every plain Python attribute (numbers, strings, flags, None) of ``modules``' submodules."""
    out: dict[tuple[int, str], Any] = {}
    for root in modules:
        for module in root.modules():
            for name, value in vars(module).items():
                if isinstance(value, _SCALARS):
                    out[(id(module), name)] = value
    return out


def _modules_by_id(modules: Iterable[nn.Module]) -> dict[int, nn.Module]:
    return {id(m): m for root in modules for m in root.modules()}


def _storage_key(tensor: torch.Tensor) -> int | None:
    """The address of a plain tensor's storage (None for a tensor subclass without one)."""
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class _SavedBeforeWrite(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Copy a parameter right before an operation first writes its storage in place.

    [Note: parameters written in a set-up run]
    A forward may write a parameter in place (``nn.Embedding(max_norm=...)`` renormalises the
    rows it looks up; running state kept in a frozen ``nn.Parameter``). A run that must leave no
    trace puts those parameters back afterwards; copying every parameter up front would double
    the stage's memory, so each one is copied only when an operation whose schema writes an
    argument is about to write its storage.
    """

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.params: dict[int, nn.Parameter] = {}
        for p in params:
            key = _storage_key(p)
            if key is not None:
                self.params.setdefault(key, p)
        self.saved: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for i, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            if not isinstance(value, torch.Tensor):
                continue
            key = _storage_key(value)
            if key in self.params and key not in self.saved:
                param = self.params[key]
                self.saved[key] = (param, param.detach().clone())
        return func(*args, **kwargs)

    def restore(self) -> None:
        """Write every saved parameter's value back (the same tensor object, in place)."""
        with torch.no_grad():
            for param, value in self.saved.values():
                param.copy_(value)


@contextlib.contextmanager
def preserved_state(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Run the block on copies of every buffer of ``modules``; afterwards put the original
    tensors, plain Python attributes and the values of parameters the block wrote in place
    back ([Note: parameters written in a set-up run]), so that the block leaves the module
    state as it was (used where a runtime runs a stage once to learn its shapes)."""
    params = [p for m in modules for p in m.parameters()]
    slots = _buffer_slots(modules)
    originals = [_get(slot) for slot in slots]
    copies = {id(b): _copy_of(b) for b in originals if b is not None}
    attrs = _scalar_attributes(modules)
    by_id = _modules_by_id(modules)
    _replace(slots, copies)
    writes = _SavedBeforeWrite(params)
    try:
        with writes:
            yield
    finally:
        writes.restore()
        for (owner, name), buf in zip(slots, originals, strict=True):
            owner._buffers[name] = buf
        for (module_id, name), value in attrs.items():
            setattr(by_id[module_id], name, value)


#: Per recomputed module (the ``key`` of :func:`recompute_with_state`) and mode (training or
#: not): the indices of its buffer slots a forward changed so far.
_LEARNED: weakref.WeakKeyDictionary[nn.Module, dict[bool, set[int]]] = weakref.WeakKeyDictionary()


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether two buffers hold the same value (NaN equal to NaN)."""
    if a is None or b is None:
        return a is b
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and bool(
            torch.equal(a, b)
            or (
                a.is_floating_point()
                and torch.equal(a.isnan(), b.isnan())
                and torch.equal(a.nan_to_num(), b.nan_to_num())
            )
        )
    )


class _Replay:
    """One recomputed call: the first run, then recomputations that see and leave the state
    as that run did ([Note: recomputation and module state])."""

    def __init__(
        self, function: Callable[..., Any], modules: Sequence[nn.Module], key: nn.Module
    ) -> None:
        self.function = function
        self.modules = tuple(modules)
        self.key = key
        self.slots = _buffer_slots(self.modules)
        # Learned per mode: a module updates its running statistics in training only.
        learned = _LEARNED.setdefault(key, {})
        self.mode = key.training
        known = learned.get(self.mode)
        self.learning = known is None
        indices = range(len(self.slots)) if known is None else sorted(known)
        #: The tensors the first run starts from, by slot, for those it may change.
        self.start: dict[int, torch.Tensor] = {}
        for i in indices:
            buf = _get(self.slots[i])
            if buf is not None:
                self.start[i] = buf
        _replace(self.slots, {id(b): _copy_of(b) for b in self.start.values()})
        self.before = [(b, -1 if b is None else b._version) for b in map(_get, self.slots)]
        self.attrs = _scalar_attributes(self.modules)
        self.changed: list[int] = []
        self.changed_attrs: dict[tuple[int, str], Any] = {}
        self.unknown: list[int] = []
        self.calls = 0
        self.params = [
            (n, p, p._version)
            for m in self.modules
            for n, p in m.named_parameters(remove_duplicate=False)
        ]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            try:
                out = self.function(*args, **kwargs)
            finally:
                self._learn()
            self._refuse_written_parameters()
            return out
        return self._recompute(*args, **kwargs)

    def _refuse_written_parameters(self) -> None:
        """A recomputed forward that writes a parameter in place (running state kept in an
        ``nn.Parameter``, ``nn.Embedding(max_norm=...)``) would write it again in backward:
        refused by name before any backward runs."""
        for name, param, version in self.params:
            if param._version != version:
                raise RecomputeError(
                    f"parameter {name!r} of {type(self.key).__name__} is written in place by "
                    "a recomputed forward, so its recomputation in backward would write it a "
                    "second time. Keep running state in a buffer (register_buffer), or do not "
                    "recompute this module (leave it out of partition(recompute=...))"
                )

    def _learn(self) -> None:
        changed: list[int] = []
        for i, (buf, version) in enumerate(self.before):
            now = _get(self.slots[i])
            if now is not buf or (buf is not None and buf._version != version):
                changed.append(i)
            elif i in self.start and (not self.learning or not _same(now, self.start[i])):
                # Kernels update running statistics without a version bump: compare values.
                changed.append(i)
        # A copy the forward left alone goes back to the original tensor.
        untouched = {
            id(_get(self.slots[i])): self.start[i] for i in self.start if i not in set(changed)
        }
        _replace(self.slots, untouched)
        self.changed = changed
        # Changed in place without a copy to start from: not recomputable exactly.
        self.unknown = [
            i
            for i in changed
            if i not in self.start
            and (buf := self.before[i][0]) is not None
            and buf._version != self.before[i][1]
        ]
        _LEARNED[self.key].setdefault(self.mode, set()).update(changed)
        # Hold only what the recomputation replays: a buffer the forward left alone needs no
        # snapshot, and its copy (taken while learning) would otherwise live until this
        # micro-batch's backward.
        keep = set(changed)
        self.before = [entry if i in keep else (None, -1) for i, entry in enumerate(self.before)]
        self.start = {i: t for i, t in self.start.items() if i in keep}
        after = _scalar_attributes(self.modules)
        self.changed_attrs = {
            k: v for k, v in self.attrs.items() if k in after and after[k] is not v
        }

    def _recompute(self, *args: Any, **kwargs: Any) -> Any:
        if self.unknown:
            owner, name = self.slots[self.unknown[0]]
            raise RecomputeError(
                f"buffer {name!r} of {type(owner).__name__} is updated in place by a "
                "recomputed forward that did not update it the first time it ran, so its "
                "recomputation cannot start from the value the forward saw. Update it on "
                "every call, or do not recompute this module"
            )
        slots = [self.slots[i] for i in self.changed]
        current = [_get(slot) for slot in slots]
        by_id = _modules_by_id(self.modules)
        attrs_now = {k: getattr(by_id[k[0]], k[1]) for k in self.changed_attrs}
        for slot, i in zip(slots, self.changed, strict=True):
            start = self.start.get(i, self.before[i][0])
            if start is None:
                slot[0]._buffers[slot[1]] = None
            else:
                slot[0]._buffers[slot[1]] = _copy_of(start)
        for (module_id, name), value in self.changed_attrs.items():
            setattr(by_id[module_id], name, value)
        try:
            return self.function(*args, **kwargs)
        finally:
            for (owner, name), buf in zip(slots, current, strict=True):
                owner._buffers[name] = buf
            for (module_id, name), value in attrs_now.items():
                setattr(by_id[module_id], name, value)


def recompute_with_state(
    function: Callable[..., Any],
    modules: Sequence[nn.Module],
    *args: Any,
    key: nn.Module | None = None,
    **kwargs: Any,
) -> Any:
    """``function(*args, **kwargs)`` under non-reentrant ``torch.utils.checkpoint`` (the RNG
    state replayed), whose recomputation sees and leaves the state of ``modules`` as the first
    run did ([Note: recomputation and module state]).

    ``key`` (default: the first module) names the call across micro-batches: what it learned
    about which buffers the forward updates is kept per key. Without gradients the function
    simply runs.
    """
    if not torch.is_grad_enabled() or not modules:
        return function(*args, **kwargs)
    key = modules[0] if key is None else key
    replay = _Replay(function, modules, key)
    known = _WRITES_INPUTS.setdefault(key, {}).get(key.training)
    private = [
        i
        for i, arg in enumerate(args)
        if isinstance(arg, torch.Tensor) and (known is None or i in known)
    ]
    if not private:
        return torch.utils.checkpoint.checkpoint(
            replay, *args, use_reentrant=False, preserve_rng_state=True, **kwargs
        )
    return _checkpoint_writing_inputs(replay, key, private, args, kwargs)


#: Per recomputed call (its ``key``) and mode: the positions of the tensor arguments its
#: forward changes in place ([Note: recomputed inputs updated in place]).
_WRITES_INPUTS: weakref.WeakKeyDictionary[nn.Module, dict[bool, frozenset[int]]] = (
    weakref.WeakKeyDictionary()
)


def _checkpoint_writing_inputs(
    replay: _Replay,
    key: nn.Module,
    private: Sequence[int],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> Any:
    """Checkpoint ``replay`` on ``args`` whose tensors at ``private`` it may change in place.

    [Note: recomputed inputs updated in place]
    Checkpointing saves a call's inputs to run it again in backward; a forward that changes an
    input in place (``nn.ReLU(inplace=True)`` first thing) would change what was saved, and the
    recomputation fails ("modified by an inplace operation"), where the unsplit model is fine.
    So each such input is saved as a copy (a differentiable clone), every run of the forward
    works on a fresh copy of it, and the first run's copy is then written into the caller's
    tensor, which the model changed in place too. Which inputs a forward changes is learned
    at its first call in each mode (every tensor input gets the copies once); later calls
    copy only those.
    """
    changed: list[int] = []
    runs: list[None] = []

    def run(*inputs: Any) -> Any:
        own = list(inputs)
        for i in private:
            own[i] = inputs[i].clone()
        versions = [own[i]._version for i in private]
        out = replay(*own, **kwargs)
        if not runs:  # the first run; a recomputation changes the same
            runs.append(None)
            changed.extend(
                i for i, v in zip(private, versions, strict=True) if own[i]._version != v
            )
        return out, tuple(own[i] for i in private)

    saved = list(args)
    for i in private:
        saved[i] = args[i].clone()
    out, written = torch.utils.checkpoint.checkpoint(
        run, *saved, use_reentrant=False, preserve_rng_state=True
    )
    learned = _WRITES_INPUTS[key]
    if key.training not in learned:
        learned[key.training] = frozenset(changed)
    for i, value in zip(private, written, strict=True):
        if i in changed:
            args[i].copy_(value)
    return out
