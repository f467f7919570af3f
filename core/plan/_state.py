"""Module state in a plan: what capture must leave alone, and which stage owns each buffer.

[Note: module state]
A model's state is its parameters, its buffers (running statistics, counters, masks) and the
Python attributes of its modules. The plan treats the buffers as it treats parameters:

- ``partition`` has no side effects. :class:`StateSnapshot` records, before any capture, every
  module's Python attributes, its parameter, buffer and child tables, each buffer's value and
  each module's train/eval flag, and puts all of them back afterwards, also when capture raises.
  A Python attribute that traced-through code changes (``self.calls += 1``) cannot be in a
  graph: the change would happen once, at capture, and never in training. So any such change is
  refused by name (:meth:`StateSnapshot.check_unchanged`); a leaf module's real forward runs at
  every call, which is the fix for the torch.fx path. A buffer whose value changed while tracing
  was updated outside what the capture records (``self._buffers[...]``), and is refused too.
- An in-place buffer update (``self.scale.mul_(0.9)``, BatchNorm's running statistics,
  ``num_batches_tracked``) is a node of the stage graph (the torch.fx tracer proxies buffers as
  it proxies parameters; torch.export records in-place ops on buffers), so it runs in training.
- Every buffer has at most one owner: the stage that writes it (:func:`analyze` finds reads and
  writes: in-place ops on the buffer or a view of it, ops whose schema writes an argument,
  ``batch_norm``/``instance_norm`` with batch statistics, a BatchNorm/InstanceNorm module called
  in train mode, and, conservatively, any other module called as one op that holds the buffer).
  A later stage that reads a buffer its owner writes gets the owner's value as a boundary
  value: the owner stage returns ``buffer_value(buffer)`` (a detached copy taken after its last
  write, at the end of the stage) and the reader's reads use it, so the reader holds no stale
  copy and the value crosses by the usual wire rules. Refused by name: two stages writing one
  buffer, a stage reading a buffer a later stage writes (it would see the previous micro-batch's
  value in the model), and a read inside a module called as one op (it cannot be handed a value)
  in another stage than the owner. Buffers nobody writes are constants: each stage that reads
  one holds it.

[Note: buffer assignment]
``self.running = 0.9 * self.running + 0.1 * mean`` replaces the module's tensor. Run while a
capture traces forward it would leave the capture's value (an fx Proxy, export's fake tensor)
on the model, and nothing in the stages; torch.export in non-strict mode drops it. Both
captures record it as an in-place copy into the buffer instead (:func:`assignments_in_place`),
the way torch.export applies a buffer assignment it keeps: torch.fx as
``buffer.copy_(assigned_value(value, buffer, name))``, torch.export as the ``copy_`` it records
when the copy runs on its fake buffer. So an assignment is an in-place update like any other
(it has an owner stage, later stages receive the value, recomputation replays it), with three
rules that keep it exact: the value must have the buffer's shape and dtype (checked at capture
by export, at every call on the fx path, :func:`assigned_value`); a buffer the model holds
under two names is refused (the model would then hold two tensors); and the reads before the
assignment get a clone of the buffer (:func:`isolate_earlier_reads`), since in the model they
hold the old tensor, which autograd may have saved.

Ownership is decided on both train and eval captures together ([Note: stage modes] in
``capture._modal``), so both modes send the same boundary values.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import operator
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.nn.modules.batchnorm import _NormBase

from ..errors import CaptureError

__all__: list[str] = []

logger = logging.getLogger(__name__)

#: ``nn.Module`` internals compared by their own rules, never as Python attributes.
_TABLES = ("_parameters", "_buffers", "_modules")
#: Module attributes that are not state of the model's function.
_NOT_STATE = frozenset({"training", "_non_persistent_buffers_set", *_TABLES})
#: Values a Python attribute change is reported with.
_SHOWN = (type(None), bool, int, float, str)

_INPLACE_OPERATORS = frozenset(
    {
        operator.setitem,
        operator.iadd,
        operator.isub,
        operator.imul,
        operator.itruediv,
        operator.ifloordiv,
        operator.imod,
        operator.ipow,
        operator.iand,
        operator.ior,
        operator.ixor,
        operator.ilshift,
        operator.irshift,
        operator.imatmul,
    }
)

#: Method, function and attribute names whose result may share storage with their first argument.
_VIEW_NAMES = frozenset(
    {
        "H",
        "T",
        "align_as",
        "as_strided",
        "bfloat16",
        "bool",
        "chunk",
        "contiguous",
        "cpu",
        "cuda",
        "data",
        "detach",
        "diagonal",
        "double",
        "expand",
        "expand_as",
        "flatten",
        "float",
        "getitem",
        "half",
        "imag",
        "int",
        "long",
        "mH",
        "mT",
        "movedim",
        "moveaxis",
        "narrow",
        "permute",
        "real",
        "reshape",
        "reshape_as",
        "select",
        "split",
        "squeeze",
        "swapaxes",
        "swapdims",
        "t",
        "tensor_split",
        "to",
        "transpose",
        "type",
        "type_as",
        "unbind",
        "unflatten",
        "unfold",
        "unsqueeze",
        "view",
        "view_as",
        "view_as_complex",
        "view_as_real",
    }
)

#: Norm functions that update running statistics in place when they use batch statistics:
#: ``(name, the argument that says so)``.
_NORM_FUNCTIONS = {"batch_norm": "training", "instance_norm": "use_input_stats"}


# -- partition() leaves the model as it found it ---------------------------------------------


def _container_copy(value: Any) -> Any:
    """A shallow copy of a list, dict or set attribute, to see whether forward mutated it."""
    if type(value) is list:
        return list(value)
    if type(value) is dict:
        return dict(value)
    if type(value) is set:
        return set(value)
    return None


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and a != a:
        return bool(b != b)
    if isinstance(a, (*_SHOWN, complex, bytes, torch.dtype, torch.device, torch.Size)):
        return bool(a == b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(v, b[k]) for k, v in a.items())
    if isinstance(a, (set, frozenset)):
        return bool(a == b)
    return False


def _same_contents(saved: Any, current: Any) -> bool:
    if saved is None:
        return True
    if isinstance(saved, dict):
        return list(saved) == list(current) and all(_same(v, current[k]) for k, v in saved.items())
    if isinstance(saved, set):
        return bool(saved == current)
    return len(saved) == len(current) and all(
        _same(x, y) for x, y in zip(saved, current, strict=True)
    )


def _shown(value: Any) -> str:
    if isinstance(value, _SHOWN):
        return repr(value)[:40]
    return f"a {type(value).__qualname__}"


class StateSnapshot:
    """Everything of a model's modules that capture could change, to check and restore.

    Taken before the first capture; :meth:`check_unchanged` after each one refuses a change
    forward made while it was traced; :meth:`restore` puts everything back (train/eval flags
    included). See [Note: module state].
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._modules = list(model.named_modules(remove_duplicate=True))
        self._attrs = [
            {k: (v, _container_copy(v)) for k, v in m.__dict__.items() if k not in _NOT_STATE}
            for _, m in self._modules
        ]
        self._tables = [tuple(dict(getattr(m, t)) for t in _TABLES) for _, m in self._modules]
        self._training = [m.training for _, m in self._modules]
        self._seen: CaptureError | None = None
        self._values: dict[int, torch.Tensor] = {}
        for _, m in self._modules:
            for buffer in m._buffers.values():
                if buffer is not None and not buffer.is_meta and id(buffer) not in self._values:
                    self._values[id(buffer)] = buffer.detach().clone()

    def watch(self, how: str) -> Callable[..., None]:
        """A forward hook for the model's root: it remembers the first change forward made
        (torch.export puts Python attributes back itself once it is done, so they must be
        looked at while forward has just returned). :meth:`check_unchanged` raises it."""

        def hook(*_: Any) -> None:
            if self._seen is None:
                try:
                    # export holds fake tensors in the tables while it runs: attributes only.
                    self.check_unchanged(how, tables=False)
                except CaptureError as exc:
                    self._seen = exc

        return hook

    def check_unchanged(self, how: str, ignore: Iterable[str] = (), tables: bool = True) -> None:
        """Refuse a Python attribute or a buffer that tracing changed (or that a
        :meth:`watch` hook saw changed).

        ``how`` names the capture ("torch.fx" or "torch.export", for the message); ``ignore``
        are root attributes the capture itself added (tensor constants); without ``tables`` only
        Python attributes are compared.

        Raises:
            CaptureError: naming the module path and the attribute or buffer.
        """
        if self._seen is not None:
            seen, self._seen = self._seen, None
            raise seen
        skipped = set(ignore)
        for (path, module), saved in zip(self._modules, self._attrs, strict=True):
            current = module.__dict__
            for key in current:
                if key in _NOT_STATE or (module is self._model and key in skipped):
                    continue
                if key not in saved:
                    self._refuse(how, path, module, key, "sets", f"to {_shown(current[key])}")
                value, contents = saved[key]
                if not _same(value, current[key]) or (
                    current[key] is value and not _same_contents(contents, value)
                ):
                    what = (
                        f"from {_shown(value)} to {_shown(current[key])}"
                        if current[key] is not value
                        else "in place"
                    )
                    self._refuse(how, path, module, key, "changes", what)
        if not tables:
            return
        for (path, module), saved_tables in zip(self._modules, self._tables, strict=True):
            for table_name, saved_table in zip(_TABLES, saved_tables, strict=True):
                live = getattr(module, table_name)
                for key in sorted(set(saved_table) | set(live)):
                    if module is self._model and key in skipped:
                        continue
                    if live.get(key) is not saved_table.get(key):
                        kind = table_name[1:-1] if table_name != "_modules" else "submodule"
                        where = repr(path) if path else "the model"
                        raise CaptureError(
                            f"the forward of {where} ({type(module).__name__}) replaces its "
                            f"{kind} {key!r} while {how} traced it; the stages would hold the "
                            "object it had at capture. Update the tensor in place "
                            f"(self.{key}.copy_(...)) instead of assigning a new one"
                        )
            for key, buffer in saved_tables[1].items():
                saved_value = None if buffer is None else self._values.get(id(buffer))
                if (
                    saved_value is not None
                    and buffer is not None
                    and not _equal(buffer, saved_value)
                ):
                    name = f"{path}.{key}" if path else key
                    raise CaptureError(
                        f"buffer {name!r} changed while {how} traced forward, outside what the "
                        "capture records (an update through module._buffers, .data, or a "
                        "tensor the model holds twice?): the stages would never repeat it. "
                        f"Update it in place on the attribute itself (self.{key}.mul_(...)) in "
                        "forward"
                    )

    def _refuse(
        self, how: str, path: str, module: nn.Module, key: str, verb: str, what: str
    ) -> None:
        where = repr(path) if path else "the model"
        buffer = (
            f"keep the value in a buffer updated in place (self.register_buffer({key!r}, ...) "
            f"and self.{key}.add_(...))"
        )
        if not path:
            fix = f"Move the update out of forward, or {buffer}"
        elif how == "torch.fx":
            fix = (
                f"Make {path!r} a leaf module (leaf_modules=[{path!r}]): a leaf module's real "
                f"forward runs at every call; or {buffer}"
            )
        else:
            fix = (
                f"{buffer[0].upper()}{buffer[1:]}, or partition without example_inputs (the "
                f"torch.fx capture) with leaf_modules=[{path!r}]: a leaf module's real forward "
                "runs at every call"
            )
        raise CaptureError(
            f"the forward of {where} ({type(module).__name__}) {verb} {key!r}"
            + (f" {what}" if what else "")
            + f" while {how} traced it. A Python attribute update cannot be part of a stage "
            f"graph: it would happen once, at capture, and never in training. {fix}"
        )

    def restore(self) -> None:
        """Put every attribute, table, buffer value and train/eval flag back."""
        for (_, module), saved, tables, training in zip(
            self._modules, self._attrs, self._tables, self._training, strict=True
        ):
            current = module.__dict__
            for key in [k for k in current if k not in _NOT_STATE and k not in saved]:
                del current[key]
            for key, (value, contents) in saved.items():
                current[key] = value
                if contents is not None and not _same_contents(contents, value):
                    value.clear()
                    if isinstance(value, list):
                        value.extend(contents)
                    else:
                        value.update(contents)
            for name, table in zip(_TABLES, tables, strict=True):
                live = getattr(module, name)
                live.clear()
                live.update(table)
            module.training = training
        # ``.data`` rather than a no_grad region: restoring may run inside a trace, which
        # would record the region ([Note: grad-mode regions] in ``capture._regions``).
        for _, module in self._modules:
            for buffer in module._buffers.values():
                if buffer is None:
                    continue
                saved_value = self._values.get(id(buffer))
                if saved_value is not None and not _equal(buffer, saved_value):
                    buffer.data.copy_(saved_value)


@contextlib.contextmanager
def parameters_as(model: nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """Give the model's floating-point parameters ``dtype`` for a while, buffers keeping
    theirs, as the engines cast a model for bf16 ([Note: bf16 as DeepSpeed does it] in
    :mod:`pipedialect.engine.precision`); ``None`` changes nothing."""
    saved: list[tuple[nn.Parameter, torch.Tensor]] = []
    if dtype is not None:
        for param in model.parameters():
            if param.is_floating_point() and param.dtype != dtype:
                saved.append((param, param.data))
                param.data = param.data.to(dtype)
    try:
        yield
    finally:
        for param, data in saved:
            param.data = data


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a.detach(), b))


# -- ``self.buf = value``: a buffer assignment is an in-place copy ----------------------------

#: Decides one buffer assignment seen while a capture runs forward: ``(module, name, value)``
#: -> whether it recorded the assignment (else the module's own ``__setattr__`` runs).
AssignHandler = Callable[[nn.Module, str, Any], bool]


@contextlib.contextmanager
def assignments_in_place(handler: AssignHandler) -> Iterator[None]:
    """While active, ``module.name = value`` for a registered buffer ``name`` and a tensor (or a
    traced value) goes to ``handler`` first ([Note: buffer assignment]).

    A capture records the assignment as an in-place copy into the buffer (what torch.export
    itself does with ``self.buf = ...``) instead of letting forward replace the module's tensor
    at capture time, which would leave the capture's value (a Proxy, a fake tensor) on the
    model and no update in the stages.
    """
    original = nn.Module.__setattr__

    def assign(module: nn.Module, name: str, value: Any) -> None:
        buffers = module.__dict__.get("_buffers")
        if (
            buffers is not None
            and buffers.get(name) is not None
            and isinstance(value, (torch.Tensor, fx.Proxy))
            and not isinstance(value, nn.Parameter)
            and handler(module, name, value)
        ):
            return
        original(module, name, value)

    nn.Module.__setattr__ = assign  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.__setattr__ = original  # type: ignore[method-assign]


def assigned_value(value: Any, buffer: Any, name: str) -> Any:
    """``value`` of ``self.<name> = value``, checked against the buffer it is copied into
    ([Note: buffer assignment]); traced again, it records itself.

    Raises:
        CaptureError: ``value`` is not a tensor of the buffer's shape and dtype (a copy would
            broadcast or cast it where the model's buffer would change shape or dtype).
    """
    if isinstance(value, fx.Proxy) or isinstance(buffer, fx.Proxy):
        tracer = (value if isinstance(value, fx.Proxy) else buffer).tracer
        return tracer.create_proxy("call_function", assigned_value, (value, buffer, name), {})
    check_assignable(value, buffer, name)
    return value


def check_assignable(value: Any, buffer: torch.Tensor, name: str) -> None:
    """Refuse an assignment to buffer ``name`` that an in-place copy would not reproduce."""
    if (
        isinstance(value, torch.Tensor)
        and value.shape == buffer.shape
        and value.dtype == buffer.dtype
    ):
        return
    got = (
        f"a {value.dtype} tensor of shape {tuple(value.shape)}"
        if isinstance(value, torch.Tensor)
        else f"a {type(value).__name__}"
    )
    raise CaptureError(
        f"forward assigns buffer {name!r} {got}, but it holds a {buffer.dtype} tensor of shape "
        f"{tuple(buffer.shape)}. The stages apply `self.<buffer> = value` as an in-place copy "
        "into the buffer (as torch.export does), which keeps its shape and dtype: assign a "
        "value of the buffer's shape and dtype (e.g. .to(self.<buffer>.dtype)), or register a "
        "buffer of the shape it will hold"
    )


def shared_buffer_slots(model: nn.Module) -> dict[tuple[int, str], list[str]]:
    """``(id(module), attribute)`` of every buffer slot whose tensor the model holds under
    several names, with those names."""
    names: dict[int, list[str]] = {}
    for name, buffer in model.named_buffers(remove_duplicate=False):
        names.setdefault(id(buffer), []).append(name)
    slots: dict[tuple[int, str], list[str]] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for attr, buffer in module._buffers.items():
            if buffer is not None and len(names.get(id(buffer), ())) > 1:
                slots[(id(module), attr)] = names[id(buffer)]
    return slots


def refuse_shared_assignment(names: Sequence[str]) -> None:
    """A buffer held under several names cannot be assigned: the model would leave the old
    tensor under the other names, an in-place copy would change it there too.

    Raises:
        CaptureError: always, naming the holders.
    """
    raise CaptureError(
        f"forward assigns a new tensor to buffer {names[0]!r}, which the model also holds as "
        f"{', '.join(repr(n) for n in names[1:])}: the model then holds two tensors there, which "
        "the stages (updating buffers in place) cannot reproduce. Update it in place "
        f"(self.<buffer>.copy_(...)), or hold it once"
    )


def isolate_earlier_reads(graph: fx.Graph, copies: Iterable[fx.Node]) -> None:
    """Give the reads of a buffer before an assignment's copy a clone of it.

    In the model those reads hold the old tensor, which the assignment leaves alone (autograd
    may have saved it for backward); the copy writes the buffer itself, so they get a copy of
    its value taken where they first read it ([Note: buffer assignment]).
    """
    for copy in copies:
        old = copy.args[0]
        if not isinstance(old, fx.Node):
            continue
        order = {node: i for i, node in enumerate(graph.nodes)}
        earlier = [u for u in old.users if u is not copy and order[u] < order[copy]]
        if not earlier:
            continue
        first = min(earlier, key=order.__getitem__)
        with graph.inserting_before(first):
            clone = graph.call_method("clone", (old,))
        clone.meta = {k: v for k, v in old.meta.items() if k == "val"}
        if "nn_module_stack" in first.meta:
            clone.meta["nn_module_stack"] = first.meta["nn_module_stack"]
        for user in earlier:
            user.replace_input_with(old, clone)


# -- which stage reads and writes each buffer ------------------------------------------------


@dataclass
class BufferUse:
    """The reads and writes of the model's buffers in one mode's flat graph, by stage."""

    #: Canonical buffer name -> stages that read it (any node using it or a view of it).
    reads: dict[str, set[int]] = field(default_factory=dict)
    #: Canonical buffer name -> stages that write it.
    writes: dict[str, set[int]] = field(default_factory=dict)
    #: Canonical buffer name -> ``(stage, module path)`` of modules called as one op that use it.
    module_uses: dict[str, set[tuple[int, str]]] = field(default_factory=dict)

    def add(self, table: dict[str, set[Any]], names: Iterable[str], item: Any) -> None:
        """Record ``item`` for every buffer in ``names``."""
        for name in names:
            table.setdefault(name, set()).add(item)


class BufferNames:
    """The model's buffers by canonical name (the first of ``named_buffers``), and how to find
    them from a graph target."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.by_id: dict[int, str] = {}
        self.tensors: dict[str, torch.Tensor] = {}
        for name, buffer in model.named_buffers(remove_duplicate=False):
            if id(buffer) not in self.by_id:
                self.by_id[id(buffer)] = name
                self.tensors[name] = buffer
        self.persistent = {name: not _non_persistent(model, name) for name in self.tensors}

    def of_target(self, target: str) -> str | None:
        """The canonical name of the buffer a ``get_attr`` target names, or None."""
        owner_path, _, attr = target.rpartition(".")
        try:
            owner = self.model.get_submodule(owner_path)
        except AttributeError:
            return None
        buffer = owner._buffers.get(attr)
        return None if buffer is None else self.by_id.get(id(buffer))

    def of_module(self, module: nn.Module) -> list[str]:
        """The canonical names of the buffers ``module`` holds (recursively)."""
        return [self.by_id[id(b)] for b in module.buffers() if id(b) in self.by_id]


def _non_persistent(model: nn.Module, name: str) -> bool:
    owner_path, _, attr = name.rpartition(".")
    return attr in model.get_submodule(owner_path)._non_persistent_buffers_set


def module_writes(module: nn.Module, names: BufferNames, training: bool) -> list[str]:
    """The buffers a module called as one op may write.

    A BatchNorm or InstanceNorm module tracking running statistics writes them in train mode;
    other ``torch.nn`` layers write none; any other module (a user's, a parametrization, a
    layer with hooks) may write every buffer it holds directly: its code is not in the graph
    to say otherwise.
    """
    written: list[str] = []
    for sub in module.modules():
        held = [
            names.by_id[id(b)]
            for b in sub._buffers.values()
            if b is not None and id(b) in names.by_id
        ]
        if isinstance(sub, _NormBase) and not (sub._forward_pre_hooks or sub._forward_hooks):
            # The module's own flag: a frozen BatchNorm stays in eval while the model trains
            # ([Note: per-module modes] in ``runtime.module_state``).
            if training and sub.training and sub.track_running_stats:
                written.extend(held)
        elif not _pure_builtin(sub):
            written.extend(held)
    return written


def _pure_builtin(module: nn.Module) -> bool:
    """A ``torch.nn`` layer without hooks: its forward writes none of its buffers."""
    return type(module).__module__.startswith("torch.nn.modules.") and not (
        module._forward_pre_hooks or module._forward_hooks
    )


def written_buffers(graph: fx.Graph, root: nn.Module, training: bool) -> frozenset[int]:
    """The ids of ``root``'s buffers that ``graph`` (a trace of ``root``'s forward) writes."""
    names = BufferNames(root)
    aliases = alias_table(graph, names, root)
    written: set[str] = set()
    for node in graph.nodes:
        for target in _mutated(node, root, aliases):
            written.update(aliases.get(target, ()))
        if node.op == "call_module":
            written.update(module_writes(root.get_submodule(str(node.target)), names, training))
    return frozenset(id(names.tensors[n]) for n in written)


def analyze(
    graph: fx.Graph,
    stage_of: Mapping[fx.Node, int],
    names: BufferNames,
    training: bool,
    last_stage: int,
    known: Mapping[fx.Node, frozenset[int]] | None = None,
) -> BufferUse:
    """Which stage reads and writes which buffer in ``graph`` ([Note: module state]).

    ``known`` gives the buffers (by id) a module call writes when its code was traced by
    itself (a split point's); other calls are judged by :func:`module_writes`.
    """
    use = BufferUse()
    aliases = alias_table(graph, names, names.model)
    for node in graph.nodes:
        if node.op == "placeholder" or node.op == "get_attr":
            continue
        stage = last_stage if node.op == "output" else stage_of[node]
        for src in node.all_input_nodes:
            use.add(use.reads, aliases.get(src, ()), stage)
        for target in _mutated(node, names.model, aliases):
            use.add(use.writes, aliases.get(target, ()), stage)
        if node.op == "call_module":
            module = names.model.get_submodule(str(node.target))
            held = names.of_module(module)
            use.add(use.reads, held, stage)
            use.add(use.module_uses, held, (stage, str(node.target)))
            traced = None if known is None else known.get(node)
            written = (
                module_writes(module, names, training)
                if traced is None
                else [names.by_id[i] for i in traced if i in names.by_id]
            )
            use.add(use.writes, written, stage)
    return use


def alias_table(
    graph: fx.Graph, names: BufferNames, root: nn.Module
) -> dict[fx.Node, frozenset[str]]:
    """For every node of ``graph`` whose value may share storage with buffers, their canonical
    names."""
    table: dict[fx.Node, frozenset[str]] = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            name = names.of_target(str(node.target))
            if name is not None:
                table[node] = frozenset({name})
            continue
        found: set[str] = set()
        for src in _alias_sources(node, root):
            found.update(table.get(src, ()))
        if found:
            table[node] = frozenset(found)
    return table


def _name_of(target: Any) -> str:
    return str(getattr(target, "__name__", "") or "")


def _alias_sources(node: fx.Node, root: nn.Module) -> list[fx.Node]:
    """The inputs of ``node`` whose storage its result may share."""
    args = [a for a in node.args if isinstance(a, fx.Node)]
    if not args:
        return []
    first = node.args[0] if isinstance(node.args[0], fx.Node) else None
    if node.op == "call_method":
        name = str(node.target)
        return [first] if first is not None and (name in _VIEW_NAMES or _is_inplace(name)) else []
    if node.op != "call_function":
        return []
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        returns = [r.alias_info for r in target._schema.returns if r.alias_info is not None]
        if not returns:
            return []
        sets = set().union(*(r.before_set for r in returns))
        bound = _bound_schema(target, node)
        return [
            value
            for arg in target._schema.arguments
            if arg.alias_info is not None and arg.alias_info.before_set & sets
            for value in _nodes_in(bound.get(arg.name))
        ]
    if isinstance(target, torch._ops.HigherOrderOperator):
        return args
    if target is getattr:
        return [args[0]] if len(node.args) > 1 and node.args[1] in _VIEW_NAMES else []
    name = _name_of(target)
    if first is not None and (name in _VIEW_NAMES or _is_inplace(name)):
        return [first]
    return []


def _is_inplace(name: str) -> bool:
    return name.endswith("_") and not name.startswith("_")


def _nodes_in(value: Any) -> list[fx.Node]:
    found: list[fx.Node] = []

    def collect(node: fx.Node) -> fx.Node:
        found.append(node)
        return node

    fx.node.map_arg(value, collect)
    return found


def _bound_schema(op: torch._ops.OpOverload, node: fx.Node) -> dict[str, Any]:
    bound: dict[str, Any] = {}
    for arg, value in zip(op._schema.arguments, node.args, strict=False):
        bound[arg.name] = value
    bound.update(node.kwargs)
    return bound


def _bound_call(node: fx.Node) -> dict[str, Any] | None:
    """``node``'s arguments by parameter name, when the callee says how (else None)."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return _bound_schema(target, node)
    name = _name_of(target)
    if target in (torch.batch_norm, torch.instance_norm):
        return _bound_schema(getattr(torch.ops.aten, name).default, node)
    try:
        signature = inspect.signature(target)  # type: ignore[arg-type]
        return dict(signature.bind(*node.args, **node.kwargs).arguments)
    except (TypeError, ValueError):
        return None


def _mutated(node: fx.Node, root: nn.Module, aliases: Container[fx.Node]) -> list[fx.Node]:
    """The input nodes whose tensors ``node`` writes in place."""
    first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    if node.op == "call_method":
        return [first] if first is not None and _is_inplace(str(node.target)) else []
    if node.op != "call_function":
        return []
    target = node.target
    if target in _INPLACE_OPERATORS:
        return [first] if first is not None else []
    if isinstance(target, torch._ops.HigherOrderOperator):
        return _mutated_by_subgraph(node, root, aliases)
    written: list[fx.Node] = []
    if isinstance(target, torch._ops.OpOverload):
        name = target._schema.name.rpartition("::")[2]
        bound = _bound_schema(target, node)
        for arg in target._schema.arguments:
            if arg.alias_info is not None and arg.alias_info.is_write:
                written.extend(_nodes_in(bound.get(arg.name)))
    else:
        name = _name_of(target)
        if first is not None and (_is_inplace(name) or node.kwargs.get("inplace") is True):
            written.append(first)
        written.extend(_nodes_in(node.kwargs.get("out")))
    for norm, flag in _NORM_FUNCTIONS.items():
        if norm not in name or "functional" in name:
            continue
        call = _bound_call(node)
        if call is not None and call.get(flag, norm == "instance_norm") is not False:
            for key in ("running_mean", "running_var"):
                written.extend(_nodes_in(call.get(key)))
    return written


def _mutated_by_subgraph(
    node: fx.Node, root: nn.Module, aliases: Container[fx.Node]
) -> list[fx.Node]:
    """The operands a higher-order op's subgraph writes; every operand if it has none to read.

    torch.export wraps ``no_grad``/autocast regions as ``wrap_with_set_grad_enabled(mode,
    subgraph, *operands)`` and ``wrap_with_autocast(..., subgraph, *operands)``: the subgraph's
    placeholders are the operands, in order.
    """
    for i, arg in enumerate(node.args):
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            sub = _get(root, str(arg.target))
            if isinstance(sub, fx.GraphModule):
                operands = list(node.args[i + 1 :])
                placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
                return [
                    operand
                    for operand, ph in zip(operands, placeholders, strict=False)
                    if isinstance(operand, fx.Node) and _writes_placeholder(sub, ph)
                ]
    return [a for a in node.args if isinstance(a, fx.Node) and a in aliases]


def _get(root: nn.Module, target: str) -> Any:
    value: Any = root
    for atom in target.split("."):
        value = getattr(value, atom, None)
        if value is None:
            return None
    return value


def _writes_placeholder(sub: fx.GraphModule, placeholder: fx.Node) -> bool:
    """Whether ``sub`` writes ``placeholder``'s tensor (or a view of it) in place."""
    reach = {placeholder}
    for node in sub.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        if any(t in reach for t in _mutated(node, sub, reach)):
            return True
        if any(src in reach for src in _alias_sources(node, sub)):
            reach.add(node)
    return False


@dataclass(frozen=True)
class BufferPlan:
    """Which stage owns each buffer the stages use, decided on both modes' graphs."""

    #: Canonical name -> owner stage (None: no stage writes it).
    owner: dict[str, int | None]
    #: Canonical name -> the stages other than the owner that read it.
    readers: dict[str, tuple[int, ...]]
    #: The buffers an owner sends on: ``(name, owner)`` in name order.
    sent: tuple[tuple[str, int], ...]


def plan_buffers(uses: Sequence[BufferUse], split_points: Sequence[str]) -> BufferPlan:
    """Decide owners and readers from every mode's :class:`BufferUse`; refuse what the plan
    cannot keep ([Note: module state]).

    Raises:
        CaptureError: two stages write a buffer, a stage reads a buffer a later stage writes,
            or a module called as one op uses a buffer another stage writes.
    """
    writes: dict[str, set[int]] = {}
    reads: dict[str, set[int]] = {}
    module_uses: dict[str, set[tuple[int, str]]] = {}
    for use in uses:
        for name, stages in use.writes.items():
            writes.setdefault(name, set()).update(stages)
        for name, stages in use.reads.items():
            reads.setdefault(name, set()).update(stages)
        for name, calls in use.module_uses.items():
            module_uses.setdefault(name, set()).update(calls)
    owner: dict[str, int | None] = {}
    readers: dict[str, tuple[int, ...]] = {}
    sent: list[tuple[str, int]] = []
    for name in sorted(set(reads) | set(writes)):
        writers = sorted(writes.get(name, ()))
        if len(writers) > 1:
            raise CaptureError(
                f"buffer {name!r} is written by stages {writers}: each stage holds its own copy "
                "on its rank, so the copies would drift apart. A buffer must be written by one "
                "stage; choose split points that keep its writers in one stage"
                + _module_hint(module_uses.get(name, ()))
            )
        written_by = writers[0] if writers else None
        others = tuple(sorted(s for s in reads.get(name, ()) if s != written_by))
        owner[name] = written_by
        readers[name] = others
        if written_by is None or not others:
            continue
        early = [s for s in others if s < written_by]
        if early:
            raise CaptureError(
                f"buffer {name!r} is read by stage {early[0]} and written by the later stage "
                f"{written_by}: in the model that read sees the value the previous micro-batch "
                "wrote, which a pipeline cannot send backwards. Choose split points that put "
                f"the read and the write in one stage (stage {written_by} ends after "
                f"{_after(split_points, written_by)})"
            )
        inside = sorted((s, path) for s, path in module_uses.get(name, ()) if s != written_by)
        if inside:
            stage, path = inside[0]
            raise CaptureError(
                f"buffer {name!r} is written by stage {written_by} and read by stage {stage} "
                f"inside {path!r}, which runs as one call and cannot be handed the written "
                f"value. Put {path!r} in stage {written_by} (choose other split points), or "
                "let the model read the buffer outside that module"
            )
        sent.append((name, written_by))
    return BufferPlan(owner=owner, readers=readers, sent=tuple(sent))


def _after(split_points: Sequence[str], stage: int) -> str:
    return repr(split_points[stage]) if stage < len(split_points) else "the model's output"


def _module_hint(calls: Iterable[tuple[int, str]]) -> str:
    shown = sorted(calls)
    if not shown:
        return ""
    return (
        " (modules called as one op that hold it: "
        + ", ".join(f"{path!r} in stage {s}" for s, path in shown)
        + ")"
    )


def buffer_value(buffer: Any, name: str) -> Any:
    """What the owner stage sends of buffer ``name``: a detached copy, taken at the end of the
    stage ([Note: module state]). Traced again (fx re-traces a GraphModule it unpickles), it
    records itself.

    Raises:
        CaptureError: the buffer carries a gradient (it was written from a value that needs
            one), which a later stage could not receive.
    """
    if isinstance(buffer, fx.Proxy):
        return buffer.tracer.create_proxy("call_function", buffer_value, (buffer, name), {})
    if isinstance(buffer, torch.Tensor) and buffer.requires_grad:
        raise CaptureError(
            f"buffer {name!r} carries a gradient (forward wrote it from a value that needs "
            "one), and a later stage reads it, which only receives its value. Write it under "
            "torch.no_grad() or from a detached value"
        )
    return buffer.detach().clone() if isinstance(buffer, torch.Tensor) else buffer


def insert_buffer_values(
    graph: fx.Graph,
    stage_of: dict[fx.Node, int],
    split_nodes: Sequence[fx.Node],
    plan: BufferPlan,
    names: BufferNames,
    last_stage: int,
) -> None:
    """Make each owner stage send the buffers later stages read, and those reads use it."""
    anchors = {k: node for k, node in enumerate(split_nodes)}
    for name, owner in plan.sent:
        previous = anchors[owner]
        with graph.inserting_after(previous):
            fetched = graph.get_attr(name)
        with graph.inserting_after(fetched):
            value = graph.call_function(buffer_value, (fetched, name))
        anchors[owner] = value
        stage_of[value] = owner
        whole = _whole_tensors(graph, _buffer_seeds(graph, names), names.model)
        for node in list(graph.nodes):
            if node is fetched or node is value or whole.get(node) != name:
                continue
            for user in list(node.users):
                stage = last_stage if user.op == "output" else stage_of[user]
                if stage > owner:
                    user.replace_input_with(node, value)
        if not value.users:  # this mode reads it only through a value that crosses anyway
            graph.erase_node(value)
            graph.erase_node(fetched)
            del stage_of[value]
            anchors[owner] = previous


def _buffer_seeds(graph: fx.Graph, names: BufferNames) -> dict[fx.Node, Any]:
    seeds: dict[fx.Node, Any] = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            name = names.of_target(str(node.target))
            if name is not None:
                seeds[node] = name
    return seeds


def _whole_tensors(
    graph: fx.Graph, seeds: Mapping[fx.Node, Any], root: nn.Module
) -> dict[fx.Node, Any]:
    """The nodes whose value is exactly the tensor of a seed (an in-place op's result, a
    detached view, a subgraph passing it through), mapped to that seed's key."""
    same: dict[fx.Node, Any] = dict(seeds)
    for node in graph.nodes:
        if node in same or node.op not in ("call_method", "call_function"):
            continue
        first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        target = node.target
        if node.op == "call_method":
            name = str(target)
            if first in same and (_is_inplace(name) or name == "detach"):
                same[node] = same[first]
        elif target is getattr:
            if first in same and node.args[1] == "data":
                same[node] = same[first]
        elif target is operator.getitem and isinstance(first, fx.Node):
            key = _passed_through(first, node.args[1], same, root)
            if key is not None:
                same[node] = key
        elif isinstance(target, torch._ops.OpOverload) and first in same:
            returns = target._schema.returns
            arguments = target._schema.arguments
            if (
                returns
                and arguments
                and returns[0].alias_info is not None
                and arguments[0].alias_info is not None
                and returns[0].alias_info.before_set == arguments[0].alias_info.before_set
                and (returns[0].alias_info.is_write or _same_view(first, node))
            ):
                same[node] = same[first]
    return same


def _same_view(source: fx.Node, view: fx.Node) -> bool:
    """Whether a view op's result is its input as it is (``x.to(x.dtype)``, ``x.detach()``):
    the same shape, strides, offset and dtype, where the capture recorded them."""
    a, b = source.meta.get("val"), view.meta.get("val")
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and a.stride() == b.stride()
        and a.storage_offset() == b.storage_offset()
    )


def _passed_through(call: fx.Node, index: Any, same: Mapping[fx.Node, Any], root: nn.Module) -> Any:
    """The key of the operand a higher-order op's subgraph returns as its output ``index``."""
    if call.op != "call_function" or not isinstance(call.target, torch._ops.HigherOrderOperator):
        return None
    for i, arg in enumerate(call.args):
        sub = (
            _get(root, str(arg.target))
            if isinstance(arg, fx.Node) and arg.op == "get_attr"
            else None
        )
        if not isinstance(sub, fx.GraphModule):
            continue
        operands = list(call.args[i + 1 :])
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        inner = _whole_tensors(sub.graph, {ph: j for j, ph in enumerate(placeholders)}, sub)
        returned = sub.graph.output_node().args[0]
        if not isinstance(returned, (tuple, list)) or not isinstance(index, int):
            return None
        chosen = returned[index] if 0 <= index < len(returned) else None
        if not isinstance(chosen, fx.Node) or chosen not in inner:
            return None
        operand = operands[inner[chosen]]
        return same.get(operand) if isinstance(operand, fx.Node) else None
    return None


def mutated_inputs(node: fx.Node, root: nn.Module) -> list[fx.Node]:
    """The input nodes whose tensors ``node`` writes in place (``root``: the graph's module)."""
    return _mutated(node, root, ())


def is_buffer_value(node: fx.Node) -> bool:
    """Whether ``node`` is an owner's :func:`buffer_value` of a buffer."""
    return node.op == "call_function" and node.target is buffer_value


def describe_value(node: fx.Node) -> str:
    """How a boundary value reads in a message."""
    if is_buffer_value(node):
        return f"buffer {node.args[1]!r}"
    return node.name
