"""What the training loop may change on the model between steps, checked before each step.

[Note: values the loop sets]
A training loop changes the model between steps: ``model.temp = 1 / (1 + step)`` (annealing),
``model.scale = torch.tensor(...)`` (a buffer re-assigned), ``model.drop.p = 0.2``, a hook
added after ``partition``. The unsplit model reads each change at its next forward. The stages
read some of them at every step and some never:

- a buffer is a value of the stage graphs, read at every step: updated in place
  (``model.scale.fill_(v)``) it reaches the stages as it is, and re-assigned (a new tensor in
  the model's slot) the new value is copied into the tensor the stages hold, which then takes
  the model's slot again, before the next step (a new shape or dtype is refused: the stages'
  shapes and wire layout were fixed with the old one);
- a plain Python value (a number, a flag, a string) that a module's forward read while it was
  captured became a constant of the graph: a later change would be ignored. The capture
  records every such read (``reading_attributes``), and a change is refused with
  :class:`~pipedialect.ModelChangedError` naming the attribute. A module called as one op in a
  stage (torch.fx's leaves: ``torch.nn`` layers, ``leaf_modules``, split points) runs its real
  forward at every call and reads its attributes then (so does a module the torch.fx path
  recomputes): ``nn.Dropout.p`` on the torch.fx path is followed, on the torch.export path
  (which inlines every module) refused. Hugging Face's ``gradient_checkpointing`` flag and the
  hook its Trainer puts on the input embeddings change how forward computes, not what, and are
  let through (the stages recompute with ``partition(recompute=...)``);
- a forward, pre-forward or backward hook added to (or removed from) a module whose code was
  captured into the graphs would never run: refused by name. Hooks of modules called as one op
  run at every call and are followed; tensor hooks on parameters are too (the stages hold the
  model's parameters).

[Note: hooks]
Hooks registered before ``partition`` run as in the unsplit model: torch.fx traces a module's
call with its forward and pre-forward hooks (their code joins the graph), torch.export records
them too, and a parameter's tensor hooks stay on the parameter the stages hold. A backward hook
(``register_full_backward_hook``) needs the module's real call: the torch.fx capture calls every
module with one as a single op (as a leaf), and torch.export, which inlines every module, is
refused by name, as is a backward hook on the model's root, whose call no stage runs.

Every stage wrapper calls :meth:`ModelWatch.check` when its engine switches it to train or eval
mode, which every engine does at the start of every ``train_batch`` and ``eval_batch`` on every
rank, before any forward; every rank holds the whole model object and runs the same loop, so
every rank sees the same change and raises the same error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import fx, nn

from ..errors import ModelChangedError
from .capture import _modal

__all__: list[str] = []

#: The Python value types a capture writes into a graph as constants.
_SCALARS = (bool, int, float, complex, str, type(None))

#: The hook tables of a module whose entries the stages would not run if it was captured.
_HOOK_TABLES = (
    ("_forward_hooks", "forward hook"),
    ("_forward_pre_hooks", "forward pre-hook"),
    ("_backward_hooks", "backward hook"),
    ("_backward_pre_hooks", "backward pre-hook"),
)

_Reads = dict[tuple[int, str], tuple[nn.Module, Any]]

#: Attributes that choose how forward computes, not what: Hugging Face's
#: ``gradient_checkpointing``, which its Trainer sets after the model was partitioned and which
#: the stages honour as ``partition(recompute=...)`` instead.
_HOW_NOT_WHAT = frozenset({"gradient_checkpointing"})

#: Hooks that change no value: the one Hugging Face's gradient checkpointing puts on the input
#: embeddings (``output.requires_grad_(True)``, for reentrant checkpointing).
_NEUTRAL_HOOKS = frozenset({"make_inputs_require_grads"})


def _hook_keys(table: dict[int, Any]) -> frozenset[int]:
    """The keys of a hook table, but for hooks that change no value (``_NEUTRAL_HOOKS``)."""
    return frozenset(
        k for k, fn in table.items() if getattr(fn, "__name__", None) not in _NEUTRAL_HOOKS
    )


@contextlib.contextmanager
def reading_attributes(reads: _Reads) -> Iterator[None]:
    """While active, record in ``reads`` every plain Python attribute of a module that code
    reads (by module and name, with the value read first): what a capture may write into the
    graphs as a constant ([Note: values the loop sets])."""
    original = nn.Module.__dict__.get("__getattribute__")

    def getattribute(module: nn.Module, name: str) -> Any:
        value = object.__getattribute__(module, name)
        if (
            isinstance(value, _SCALARS)
            and not name.startswith("_")
            and name != "training"
            and name not in _HOW_NOT_WHAT
            and name in object.__getattribute__(module, "__dict__")
        ):
            reads.setdefault((id(module), name), (module, value))
        return value

    nn.Module.__getattribute__ = getattribute  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        if original is None:
            del nn.Module.__getattribute__
        else:
            nn.Module.__getattribute__ = original  # type: ignore[method-assign]


def _live_modules(stages: Sequence[fx.GraphModule]) -> set[int]:
    """The ids of every module a stage calls as one op, and of their submodules: they run
    their real forward (and hooks) at every call."""
    live: set[int] = set()
    for stage in stages:
        for graph in _modal.stage_graphs(stage):
            for node in graph.nodes:
                if node.op == "call_module":
                    live.update(id(m) for m in stage.get_submodule(str(node.target)).modules())
    return live


class ModelWatch:
    """The model's values and hooks the stages cannot follow, and its buffers they share,
    as ``partition`` left them; :meth:`check` compares them before each step ([Note: values
    the loop sets])."""

    def __init__(
        self,
        model: nn.Module,
        stages: Sequence[fx.GraphModule],
        reads: _Reads,
        live_paths: Sequence[str] = (),
    ) -> None:
        """``live_paths``: modules the stages call for real although no ``call_module`` node
        names them (the torch.fx path's recomputed modules)."""
        path_of = {id(m): name for name, m in model.named_modules()}
        live = _live_modules(stages)
        for path in live_paths:
            live.update(id(m) for m in model.get_submodule(path).modules())
        #: (module, its path, attribute, the value the capture read).
        self._values = [
            (module, path_of[key[0]], key[1], value)
            for key, (module, value) in reads.items()
            if key[0] in path_of and key[0] not in live
        ]
        #: (module, its path, table, kind, the hook ids it held).
        self._hooks = [
            (module, path, table, kind, _hook_keys(getattr(module, table)))
            for path, module in model.named_modules()
            if id(module) not in live
            for table, kind in _HOOK_TABLES
        ]
        held: dict[int, list[tuple[nn.Module, str]]] = {}
        for stage in stages:
            for owner in stage.modules():
                for name, buffer in owner._buffers.items():
                    if buffer is not None:
                        held.setdefault(id(buffer), []).append((owner, name))
        #: (model's module, its path, buffer name, the stages' slots of the same tensor).
        self._buffers: list[tuple[nn.Module, str, str, list[tuple[nn.Module, str]]]] = []
        for path, module in model.named_modules():
            for name, buffer in module._buffers.items():
                slots = [s for s in held.get(id(buffer), []) if s[0] is not module]
                if buffer is not None and slots:
                    self._buffers.append((module, path, name, slots))
        #: Whether the model's slot held the stages' tensor at the last check.
        self._same = self._sharing()

    def _sharing(self) -> list[bool]:
        return [
            module._buffers.get(name) is slots[0][0]._buffers.get(slots[0][1])
            for module, _, name, slots in self._buffers
        ]

    def check(self, training: bool) -> None:
        """Follow re-assigned buffers; raise :class:`ModelChangedError` for a captured value
        or a hook table that changed since ``partition``."""
        del training
        for module, path, name, value in self._values:
            now = module.__dict__.get(name, value)
            if type(now) is not type(value) or now != value:
                where = f"{path}.{name}" if path else name
                raise ModelChangedError(
                    f"{where} is {now!r} now, but the stages were captured when it was "
                    f"{value!r}: forward read it while partition traced it, so the stage graphs "
                    "hold the old value as a constant. Keep a value that changes between steps "
                    f"in a buffer ({path or 'model'}.register_buffer({name!r}, "
                    "torch.tensor(...)), changed in place with .fill_()/.copy_() or "
                    "re-assigned): the stages read buffers at every step"
                    + (
                        f"; or, with the torch.fx capture, make {path!r} a leaf module "
                        "(leaf_modules=[...]), whose forward runs for real"
                        if path
                        else ""
                    ),
                    path=where,
                )
        for module, path, table, kind, ids in self._hooks:
            if _hook_keys(getattr(module, table)) != ids:
                where = repr(path) if path else "the model's root"
                raise ModelChangedError(
                    f"a {kind} of {where} ({type(module).__name__}) was added or removed after "
                    "partition: the stages run this module's captured code, not its hooks, so "
                    "the change would be ignored. Register hooks before partition, or keep "
                    f"{where} whole (torch.fx capture: leaf_modules=[{path!r}]), whose hooks "
                    "run at every call",
                    path=path,
                )
        self._follow_buffers()

    def _follow_buffers(self) -> None:
        same = self._sharing()
        for i, (module, path, name, slots) in enumerate(self._buffers):
            if same[i] or not self._same[i]:
                continue
            new = module._buffers.get(name)
            held = slots[0][0]._buffers.get(slots[0][1])
            where = f"{path}.{name}" if path else name
            if new is not None and held is not None and (new.is_meta or held.is_meta):
                # Materialised per rank (pipedialect.plan.weights), not the loop's: keep
                # watching for the loop's own re-assignment.
                same[i] = True
                continue
            if new is None or held is None or new.shape != held.shape or new.dtype != held.dtype:
                shown = "None" if new is None else f"{new.dtype} {list(new.shape)}"
                raise ModelChangedError(
                    f"buffer {where} was re-assigned with a {shown} tensor after partition; "
                    "the stages hold it as a "
                    + ("None" if held is None else f"{held.dtype} {list(held.shape)}")
                    + " tensor, and their graphs and wire layout were fixed with it. Re-assign "
                    "values of the same shape and dtype, or partition again",
                    path=where,
                )
            with torch.no_grad():
                held.copy_(new.to(held.device))
            module._buffers[name] = held
            same[i] = True
        self._same = same
