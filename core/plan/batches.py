"""Micro-batches by position or by name, checked against what the plan knows of its inputs.

[Note: inputs by name]
Every dialect reads the same micro-batches. A micro-batch is either

- an ``(inputs, labels)`` pair: ``inputs`` are the model's inputs *by position*, in the order of
  its ``forward`` (:attr:`~pipedialect.PipelinePlan.input_names`), as DeepSpeed reads them
  (one input may be given bare); or
- a dict keyed by the model's input names, with the labels under :data:`LABELS_KEY`
  (``"labels"``), as Hugging Face's data collators produce: ``{"input_ids": ...,
  "attention_mask": ..., "labels": ...}``. Its inputs are put in ``forward``'s order by name;
  a name the model does not take, or one it takes that is missing, is a
  :class:`~pipedialect.DataError` naming the key and the expected names. A ``"labels"`` key
  that is also an input name goes to the model and to ``loss_fn`` both.

:meth:`InputSpec.pair` turns either into the pair the engines run, once per micro-batch, where
each engine pulls its step's micro-batches (before any of them is computed), so the rules and
the messages are the same on every dialect.

Position is where a silent mistake hides: ``(mask, ids)`` for ``forward(ids, mask)`` trains
without a word when both fit where they land. So each input is also checked against what the
plan knows of it from stage 0's graph: with ``example_inputs`` (``torch.export``) its exact dtype
and shape (the guard stage 0 would raise later, in the step); otherwise, when it goes straight
into an embedding, that it is an integer tensor, and when it goes straight into a linear,
convolution or normalisation layer, that it is a floating-point one. A mismatch is refused by
name before the first step, and when swapping two inputs would make both fit, the message says
so. Two inputs of one dtype and shape, used alike (an int64 mask for int64 ids), cannot be told
apart: pass dicts by name.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from ..errors import ConfigError, DataError
from ..runtime.micro_batches import check_inputs
from ._export import check_input
from ._state import StateSnapshot

__all__ = ["LABELS_KEY", "InputSpec", "check_loss_fn", "input_spec"]

#: The key of a dict micro-batch that holds the labels ``loss_fn`` takes (Hugging Face's name).
LABELS_KEY = "labels"

_INTEGER = "an integer"
_FLOATING = "a floating-point"

#: Modules whose first argument must be integer indices.
_INDEX_MODULES: tuple[type[nn.Module], ...] = (nn.Embedding, nn.EmbeddingBag)
#: Modules whose first argument must be floating point.
_FLOAT_MODULES: tuple[type[nn.Module], ...] = (
    nn.Linear,
    nn.Bilinear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
)
#: Functions, and the position of their argument whose kind they fix.
_KIND_FUNCTIONS: dict[Any, tuple[int, str]] = {
    torch.nn.functional.embedding: (0, _INTEGER),
    torch.ops.aten.embedding.default: (1, _INTEGER),
    torch.nn.functional.linear: (0, _FLOATING),
    torch.ops.aten.linear.default: (0, _FLOATING),
    torch.nn.functional.layer_norm: (0, _FLOATING),
    torch.ops.aten.layer_norm.default: (0, _FLOATING),
}


@dataclass(frozen=True)
class _Expected:
    """What stage 0's graph says one input must be."""

    #: The exact dtype and shape of a ``torch.export`` capture's example input.
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] | None = None
    #: ``_INTEGER`` or ``_FLOATING``, from the layer the input goes into.
    kind: str | None = None
    #: Why: the example input, or the layer.
    reason: str = ""

    def misfit(self, value: Any) -> str | None:
        """What is wrong with ``value`` here, or None when it fits."""
        if self.dtype is not None and self.shape is not None:
            if not isinstance(value, torch.Tensor):
                return f"must be a {self.dtype} tensor of shape {list(self.shape)} ({self.reason})"
            if value.dtype != self.dtype or tuple(value.shape) != self.shape:
                return f"must be a {self.dtype} tensor of shape {list(self.shape)} ({self.reason})"
            return None
        if self.kind is None or not isinstance(value, torch.Tensor):
            return None
        floating = value.is_floating_point() or value.is_complex()
        if floating == (self.kind == _FLOATING):
            return None
        return f"must be {self.kind} tensor ({self.reason})"


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    return f"a {type(value).__name__}"


class InputSpec:
    """The model's inputs, by name and position, with what stage 0 expects of each; see
    [Note: inputs by name]. Build it with :func:`input_spec`."""

    def __init__(self, names: Sequence[str], expected: Mapping[str, _Expected]) -> None:
        #: The model's inputs in ``forward``'s order.
        self.names: tuple[str, ...] = tuple(names)
        self._expected = dict(expected)

    def pair(self, batch: Any, index: int) -> tuple[Any, Any]:
        """``batch`` (micro-batch ``index`` of a step) as the ``(inputs, labels)`` pair to run.

        A pair is returned as it is, a dict as ``(inputs in forward's order, labels)``.

        Raises:
            DataError: ``batch`` is neither, a dict's keys are not the model's inputs and
                ``"labels"``, or an input does not fit what the plan knows of it.
        """
        if isinstance(batch, Mapping):
            inputs, labels = self._by_name(batch, index)
            self._check_values(inputs, index, by_name=True)
            return inputs, labels
        if not isinstance(batch, tuple | list) or len(batch) != 2:
            raise DataError(
                f"data_iter must yield (inputs, labels) pairs, or dicts keyed by the model's "
                f"input names {list(self.names)} and {LABELS_KEY!r}, one per micro-batch; "
                f"micro-batch {index} is {type(batch).__name__}"
                + (f" of length {len(batch)}" if isinstance(batch, tuple | list) else "")
            )
        inputs, labels = batch[0], batch[1]
        check_inputs(inputs, self.names, index)
        values = tuple(inputs) if isinstance(inputs, tuple | list) else (inputs,)
        self._check_values(values, index, by_name=False)
        return inputs, labels

    def _by_name(self, batch: Mapping[Any, Any], index: int) -> tuple[tuple[Any, ...], Any]:
        expected = [*self.names, *([] if LABELS_KEY in self.names else [LABELS_KEY])]
        unknown = [str(k) for k in batch if k not in expected]
        missing = [k for k in expected if k not in batch]
        if unknown or missing:
            problems = []
            for key in unknown:
                close = difflib.get_close_matches(key, expected, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                problems.append(f"the model takes no input {key!r}{hint}")
            if missing:
                problems.append(f"it lacks {', '.join(repr(k) for k in missing)}")
            raise DataError(
                f"micro-batch {index}: a dict micro-batch holds the model's inputs by name and "
                f"the labels under {LABELS_KEY!r}, and this one does not fit: "
                f"{'; '.join(problems)}. Expected exactly the keys {expected} (the plan's "
                f"input_names and {LABELS_KEY!r}): drop the other keys (or partition with them "
                "among the example inputs) and add the missing ones"
            )
        return tuple(batch[name] for name in self.names), batch[LABELS_KEY]

    def _check_values(self, values: Sequence[Any], index: int, *, by_name: bool) -> None:
        misfits = {i: self._misfit(i, v) for i, v in enumerate(values)}
        bad = next((i for i, text in misfits.items() if text is not None), None)
        if bad is None:
            return
        name = self.names[bad]
        given = f"key {name!r}" if by_name else f"position {bad} of {list(self.names)}"
        text = (
            f"micro-batch {index}: input {name!r} ({given}) is {_describe(values[bad])}, but it "
            f"{misfits[bad]}"
        )
        swap = next(
            (
                j
                for j in range(len(values))
                if j != bad
                and self._expected.get(self.names[j]) is not None
                and self._misfit(j, values[bad]) is None
                and self._misfit(bad, values[j]) is None
            ),
            None,
        )
        if swap is not None:
            text += (
                f"; it fits {self.names[swap]!r} and {self.names[swap]!r}'s value fits "
                f"{name!r}: are they swapped?"
            )
        if by_name:
            text += ". Check the values under these keys"
        else:
            text += (
                f". A tuple gives the inputs by position, in forward's order {list(self.names)}"
                f"; yield a dict keyed by name (and {LABELS_KEY!r}) to pass them by name"
            )
        raise DataError(text)

    def _misfit(self, position: int, value: Any) -> str | None:
        expected = self._expected.get(self.names[position]) if position < len(self.names) else None
        return None if expected is None else expected.misfit(value)


_SPECS: weakref.WeakKeyDictionary[nn.Module, InputSpec] = weakref.WeakKeyDictionary()


def input_spec(input_names: Sequence[str], first_stage: nn.Module | None = None) -> InputSpec:
    """The :class:`InputSpec` of a model with ``input_names`` whose stage 0 is ``first_stage``
    (its GraphModule, read once and remembered; without one, inputs are matched by name and
    position only)."""
    names = tuple(input_names)
    if first_stage is None:
        return InputSpec(names, {})
    spec = _SPECS.get(first_stage)
    if spec is None or spec.names != names:
        graph = getattr(first_stage, "graph", None)
        expected = _expectations(first_stage, graph) if isinstance(graph, fx.Graph) else {}
        spec = InputSpec(names, expected)
        _SPECS[first_stage] = spec
    return spec


def _expectations(module: nn.Module, graph: fx.Graph) -> dict[str, _Expected]:
    """What stage 0's graph says of each of its placeholders, by name."""
    exact: dict[str, _Expected] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is check_input and len(node.args) >= 4:
            name, shape, dtype = node.args[1], node.args[2], node.args[3]
            if isinstance(name, str) and isinstance(dtype, torch.dtype):
                reason = "the plan was captured with an example input like that"
                exact[name] = _Expected(dtype=dtype, shape=tuple(shape), reason=reason)
    expected = dict(exact)
    for name, found in _kinds(module, graph, "", _TRACE_DEPTH).items():
        if name in expected or len({kind for kind, _ in found}) != 1:
            continue  # the example input says more; or used both ways: nothing to say
        kind, what = sorted(found)[0]
        expected[name] = _Expected(kind=kind, reason=f"stage 0 passes it to {what}")
    return expected


#: How many levels of submodules stage 0's inputs are followed into (each is traced with fx).
_TRACE_DEPTH = 3


def _kinds(
    module: nn.Module, graph: fx.Graph, prefix: str, depth: int
) -> dict[str, set[tuple[str, str]]]:
    """For each placeholder of ``graph``: the kinds (integer or floating point) that the
    layers it goes straight into need, each with the layer's description."""
    placeholders = {node: str(node.target) for node in graph.nodes if node.op == "placeholder"}
    kinds: dict[str, set[tuple[str, str]]] = {}
    for node in graph.nodes:
        found = _kind_of(module, node, prefix)
        if found is not None:
            position, kind, what = found
            if position < len(node.args) and node.args[position] in placeholders:
                name = placeholders[node.args[position]]
                kinds.setdefault(name, set()).add((kind, what))
        elif node.op == "call_module" and depth > 0:
            inner = _kinds_of_submodule(module, node, prefix, depth - 1)
            for position, arg in enumerate(node.args):
                if arg in placeholders and position in inner:
                    kinds.setdefault(placeholders[arg], set()).update(inner[position])
    return kinds


def _kinds_of_submodule(
    module: nn.Module, node: fx.Node, prefix: str, depth: int
) -> dict[int, set[tuple[str, str]]]:
    """What a submodule called by ``node`` needs of its positional arguments, by position."""
    try:
        sub = module.get_submodule(str(node.target))
    except AttributeError:
        return {}
    snapshot = StateSnapshot(sub)  # tracing runs the module's Python: leave it as it was
    try:
        traced = fx.symbolic_trace(sub)
    except Exception:  # a module fx cannot trace on its own: nothing to learn from it
        return {}
    finally:
        snapshot.restore()
    order = [str(n.target) for n in traced.graph.nodes if n.op == "placeholder"]
    inner = _kinds(traced, traced.graph, f"{prefix}{node.target}.", depth)
    return {i: inner[name] for i, name in enumerate(order) if name in inner}


def _kind_of(module: nn.Module, node: fx.Node, prefix: str) -> tuple[int, str, str] | None:
    """For a node whose argument must be integer or floating point: (position, kind, what)."""
    if node.op == "call_module":
        try:
            sub = module.get_submodule(str(node.target))
        except AttributeError:
            return None
        what = f"{type(sub).__name__} {prefix + str(node.target)!r}"
        if isinstance(sub, _INDEX_MODULES):
            return 0, _INTEGER, what
        if isinstance(sub, _FLOAT_MODULES):
            return 0, _FLOATING, what
        return None
    if node.op == "call_function" and node.target in _KIND_FUNCTIONS:
        position, kind = _KIND_FUNCTIONS[node.target]
        return position, kind, getattr(node.target, "__name__", str(node.target))
    return None


def _callable_name(fn: Any) -> str:
    if isinstance(fn, functools.partial):
        return f"functools.partial({_callable_name(fn.func)}, ...)"
    if inspect.isfunction(fn) or inspect.ismethod(fn) or inspect.isbuiltin(fn):
        return str(fn.__qualname__)
    return type(fn).__qualname__  # a module or another callable object: its class


def check_loss_fn(loss_fn: Any) -> None:
    """Refuse a ``loss_fn`` that cannot be called as ``loss_fn(outputs, labels)``.

    Every dialect calls it so, with the last stage's output and the micro-batch's labels; a
    function that takes other arguments would fail only at the first step, after the whole
    start-up. Defaults, ``*args``, :func:`functools.partial` and ``nn.Module`` losses (their
    ``forward``) are understood; a callable whose signature cannot be read is accepted.

    Raises:
        ConfigError: ``loss_fn`` is not callable, or its signature does not take two arguments.
    """
    if not callable(loss_fn):
        raise ConfigError(f"loss_fn must be callable(outputs, labels), got {loss_fn!r}")
    target = loss_fn.forward if isinstance(loss_fn, nn.Module) else loss_fn
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(None, None)
    except TypeError as exc:
        empty = inspect.Parameter.empty
        shown = signature.replace(
            parameters=[p.replace(annotation=empty) for p in signature.parameters.values()],
            return_annotation=empty,
        )
        raise ConfigError(
            f"loss_fn {_callable_name(loss_fn)}{shown} cannot be called as "
            f"loss_fn(outputs, labels) ({exc}); every dialect calls it with two positional "
            "arguments, the last stage's output and the micro-batch's labels: give it that "
            "signature (extra parameters need defaults, or bind them with functools.partial)"
        ) from None
