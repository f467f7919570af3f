"""Random models for the differential fuzzer: a spec as data, a model built from it.

A :class:`FuzzSpec` describes a model as data: blocks (``blocks.0``, ...), each returning a random
structure (nested dicts, lists and tuples of float tensors with and without a gradient, int and
bool tensors, None and Python floats, ints and bools); the values each block consumes from any
earlier block or input (skip connections over several stages, values used only several stages
later); what it does with them, as real Python in ``forward`` (arithmetic with boundary numbers,
``is None``, ``isinstance``, ``len``, dict membership, loops, comparisons, a recursive walk); ties
between blocks; split points; capture path (torch.fx, or torch.export with example inputs);
optimizer, gradient accumulation, dynamic shapes and the train/eval schedule; and the later
features, drawn last so older seeds keep their models: ``num_stages`` with a balance method,
recomputed blocks and dropout, a meta-device model filled per stage, calls inside ``trace``;
and bf16 (``"bf16": {"enabled": true}``) for one local spec in five (by its weight seed, so no
draw changes), compared with DeepSpeed's bf16 recipe written out on the unsplit model
(:func:`reference_run`: bf16 parameters, fp32 master weights, bf16 gradient accumulation).

Last come the dimensions of module state (:data:`DIMENSIONS`, drawn by
:func:`_draw_state` after everything else, so a seed drawn without them is the model it was at
445325a): ``buffers`` (BatchNorm, hand-written running statistics under ``if self.training:``,
non-persistent buffers), ``counter`` (``self.calls += 1``), ``cross_buffer`` (a buffer written
by one block and read before another, later or earlier, maybe in another stage), ``modes``
(``self.training`` branches, ``F.dropout(training=self.training)``), ``regions``
(``no_grad``, ``enable_grad``, autocast), ``inplace`` (``h.add_()`` or ``nn.ReLU(inplace=True)``
on a boundary tensor, ``self.scale.mul_()`` on a buffer saved for backward), ``frozen`` (frozen
parameters, a frozen first stage, parameterless blocks and stages) and ``bf16_export`` (bf16 on
the ``example_inputs=`` path). :class:`BlockState` says what each block's forward does. The
reference then also yields the buffers, compared copy by copy with every stage's, and
``partition()`` must leave the model's buffers and counters as they were.

:class:`FuzzModel` runs a spec. Its forward is generic code that fx and export really trace: the
control flow meets the boundary values as it would in user code. :func:`run_local` trains it on
the local dialect and compares every loss and every parameter with the unsplit model trained by a
plain loop (the independent reference). A refusal counts only when it is a named
:class:`pipedialect.PipeDialectError` raised before any batch ran; anything else fails.

A spec is drawn from a :class:`Source`: hypothesis (which shrinks a failing spec) or a seeded
``random.Random``, so that a case is reproducible by its seed::

    .venv/bin/python tests/_fuzz_models.py 17          # run seed 17 on the local dialect
    .venv/bin/python tests/_fuzz_models.py 0-300 -q    # sweep, print only what fails
    .venv/bin/python tests/_fuzz_models.py 0-300 -q --only buffers      # one dimension's state
    .venv/bin/python tests/_fuzz_models.py 0-300 -q --only none         # the 445325a models
    .venv/bin/python tests/_fuzz_models.py 4,9 --dialect torch --only inplace,frozen

``--only`` keeps some of the module-state dimensions (comma-separated) and removes the others'
state from the same seed's model (the draws are the same); ``--dialect deepspeed|torch`` runs
each seed in its own launch of two ranks; the end of the output counts the models that ran,
were refused and failed per dimension and feature. For a mutation study (put one bug back,
show the fuzzer finds it): sweep with ``--only <dimension> -q`` before and after, and give the
first failing seed with its replay command.
"""

from __future__ import annotations

import argparse
import random
import sys
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

T = TypeVar("T")

#: Relative tolerance for losses (fp32 on CPU) and the absolute floor near zero.
RTOL = 1e-6
ATOL = 1e-7
#: Relative tolerance for a model with a bf16 autocast region trained on several processes. A
#: tied weight's two gradients (or the replicas') are summed in another order than autograd
#: sums them in one process: an fp32 difference of one ulp, which the region's cast to bf16 can
#: turn into a bf16 ulp (4e-3 of that element) at the next step; seed 118 on deepspeed ends
#: 2e-5 away. Dropping the region (fp32 instead of bf16) moves results by about 1e-3.
AUTOCAST_RTOL = 1e-4

FLOAT_TENSORS = frozenset({"act", "act64", "nograd", "nograd64"})
INT_TENSORS = frozenset({"int", "int32"})
PY_VALUES = frozenset({"none", "pyfloat", "pyint", "pybool"})

#: Leaf kinds, repeated by weight (hypothesis shrinks towards the first).
_LEAF_KINDS = (
    ("act",) * 5
    + ("nograd",) * 3
    + ("none",) * 3
    + ("pyfloat", "pyint", "pybool") * 2
    + ("int", "bool", "act64", "nograd64", "int32", "boolrow")
)
_CONTAINERS = ("dict", "tuple", "list")
_KEY_POOL = ("h", "aux", "scale", "mask", "ids", "extra", "n", "flag", "state", "z")
_PY_FLOATS = (0.5, -0.75, 1.25, 0.1, 2.0)
_PY_INTS = (0, 1, 2, 3)
_CLASS_NAMES = ("dict", "list", "tuple", "seq", "float", "int", "bool", "number")
_CLASSES: dict[str, type | tuple[type, ...]] = {
    "dict": dict,
    "list": list,
    "tuple": tuple,
    "seq": (list, tuple),
    "float": float,
    "int": int,
    "bool": bool,
    "number": (int, float),
}

#: What a use may do with a value of each kind.
_OPS: dict[str, tuple[str, ...]] = {
    "act": ("add", "mul", "is_none", "isinstance", "walk"),
    "act64": ("add", "is_none", "walk"),
    "nograd": ("add", "mul", "is_none", "walk"),
    "nograd64": ("add", "walk"),
    "int": ("emb", "intadd", "is_none", "walk"),
    "int32": ("intadd", "emb"),
    "bool": ("mask", "walk"),
    "boolrow": ("rowmask",),
    "none": ("is_none", "isinstance", "walk"),
    "pyfloat": ("arith", "cmp", "isinstance", "is_none", "walk"),
    "pyint": ("arith", "cmp", "truth", "loop", "isinstance", "walk"),
    "pybool": ("arith", "truth", "isinstance", "walk"),
    "dict": ("contains", "isinstance", "len", "walk", "is_none"),
    "list": ("len", "isinstance", "walk"),
    "tuple": ("len", "isinstance", "walk"),
}

#: Value slots before the blocks: the two model inputs and the stem's output.
X, IDS, STEM = 0, 1, 2

Dialect = Literal["local", "deepspeed", "torch"]


# -- the spec ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Leaf:
    """One value of a block's output: a tensor made from the block's activation, or a constant."""

    kind: str
    #: The constant of a Python value; the variant of a tensor (how it is computed).
    arg: Any = None


@dataclass(frozen=True)
class Node:
    """A dict, list or tuple of values (dict keys in ``keys``, in insertion order)."""

    container: str
    items: tuple[Tree, ...]
    keys: tuple[str, ...] = ()

    def child(self, key: Any) -> Tree:
        """The item under ``key`` (a dict key or a position)."""
        return self.items[self.keys.index(key) if self.container == "dict" else key]


Tree = Leaf | Node


@dataclass(frozen=True)
class Ref:
    """A value: slot ``source`` (0 ``x``, 1 ``ids``, 2 stem, 3 + i block i) indexed by ``path``."""

    source: int
    path: tuple[str | int, ...] = ()


@dataclass(frozen=True)
class Use:
    """What a block (or the head) does with one value.

    ``where`` is ``top`` (the model's forward applies it to the block's input) or ``inside`` (the
    value is an argument of the block, whose forward applies it).
    """

    op: str
    ref: Ref
    target: Tree
    where: str = "top"
    arg: Any = None


@dataclass(frozen=True)
class BlockSpec:
    """A block: its input activation, the values it uses, the structure it returns."""

    main: Ref
    uses: tuple[Use, ...]
    out: Tree


#: The dimensions of module state, in the order they are drawn; ``--only`` (and
#: the ``dims`` of :func:`generate`) selects some. See :class:`BlockState` and :class:`FuzzSpec`.
DIMENSIONS = (
    "buffers",
    "counter",
    "cross_buffer",
    "modes",
    "regions",
    "inplace",
    "frozen",
    "bf16_export",
    "recompute_export",
    "around",
)
#: The dimensions whose gates are drawn together first (``around`` is drawn after everything,
#: so that older seeds keep their models).
_GATED_FIRST = DIMENSIONS[:-1]
#: At run time (drawn by :func:`_draw_runtime`, last, so that every older seed keeps its
#: model): randomness, parameters written in forward, trainability changed after build.
RUNTIME_DIMENSIONS = ("noise", "param_write", "retrain")
#: The module-state dimensions, whose gates :func:`_draw_state` draws.
STATE_DIMENSIONS = DIMENSIONS
DIMENSIONS = STATE_DIMENSIONS + RUNTIME_DIMENSIONS


@dataclass(frozen=True)
class BlockState:
    """The module state of one block; every field at its default: no state.

    What the block's forward does with each (in this order, before its linear map, except the
    regions, which wrap or follow it):
    """

    #: ``inplace``: ``add_`` (``h.add_(0.5)``) or ``relu`` (``nn.ReLU(inplace=True)``) on the
    #: block's input, which is the previous block's output and used by nothing else (the
    #: generator checks that no autograd node saved it); right after a split point it is the
    #: tensor the stage received.
    inplace: str | None = None
    #: ``counter``: ``self.calls += 1`` (a Python attribute), and ``h`` scaled by
    #: ``1 + (calls % 3) / 16``, so every forward's count shows in the loss.
    counter: bool = False
    #: ``modes``: ``branch`` (``h * 1.25 if self.training else h - 0.125``) or ``dropout``
    #: (``F.dropout(h, 0.25, training=self.training)``, local only: masks match in one process).
    mode: str | None = None
    #: ``buffers``: ``bn`` (``nn.BatchNorm1d``), ``bn_cumulative`` (momentum None: the average
    #: over ``num_batches_tracked``), ``stats`` (a hand-written running mean and variance
    #: updated in place under ``if self.training:``: ``h`` normalised by the batch's statistics
    #: in training, by the running ones in eval, where ``sqrt(self.running_var + 1)`` reads
    #: buffers only), ``stats_assign`` (the same, reassigning the buffers), ``stats_np``
    #: (``stats`` in non-persistent buffers), ``table`` (a non-persistent constant).
    buffer: str | None = None
    #: ``inplace`` on a buffer: ``self.scale.mul_(0.97)`` (``train``: under ``if
    #: self.training:``; ``always``), then ``h / self.scale``, which saves the buffer for backward.
    scale: str | None = None
    #: ``regions``: ``no_grad`` (``with torch.no_grad(): n = self.lin.weight.norm()``, then the
    #: output divided by ``1 + n``), ``enable_grad`` (a ``torch.enable_grad()`` region inside a
    #: ``torch.no_grad()`` one), ``autocast`` (the linear map under ``torch.autocast("cpu",
    #: dtype=torch.bfloat16)``).
    region: str | None = None
    #: ``frozen``: ``trainable``, ``frozen_bias``, ``frozen`` (``lin`` has
    #: ``requires_grad=False``) or ``none`` (no parameters: ``lin`` is a fixed function).
    params: str = "trainable"
    #: ``around`` (what holds around the graph): ``frozen_norm`` (a BatchNorm the block's
    #: ``train()`` override keeps in eval), ``function`` (a custom autograd Function, identity
    #: forward, backward scaled by 0.5, on the linear map's output; torch.fx only: torch.export
    #: refuses it), ``pre_hook`` (a forward pre-hook registered before partition scaling the
    #: input by 0.75), ``bwd_hook`` (a full backward hook halving the input's gradient; torch.fx
    #: only, which then calls the block as one op), ``loop_buffer`` (``h * (0.5 + self.temp)``,
    #: a buffer the training loop re-assigns before every call: :func:`set_between_calls`).
    around: str | None = None

    def dims(self) -> set[str]:
        """The :data:`DIMENSIONS` this block exercises."""
        found = set()
        if self.buffer:
            found.add("buffers")
        if self.counter:
            found.add("counter")
        if self.mode:
            found.add("modes")
        if self.region:
            found.add("regions")
        if self.inplace or self.scale:
            found.add("inplace")
        if self.params != "trainable":
            found.add("frozen")
        if self.around:
            found.add("around")
        return found

    def features(self) -> set[str]:
        """Tags ``dimension:variant`` for the per-dimension counts."""
        found = set()
        if self.buffer:
            found.add(f"buffers:{self.buffer}")
        if self.counter:
            found.add("counter")
        if self.mode:
            found.add(f"modes:{self.mode}")
        if self.region:
            found.add(f"regions:{self.region}")
        if self.inplace:
            found.add(f"inplace:{self.inplace}")
        if self.scale:
            found.add(f"inplace:scale_{self.scale}")
        if self.params != "trainable":
            found.add(f"frozen:{self.params}")
        if self.around:
            found.add(f"around:{self.around}")
        return found

    def describe(self, index: int, shared: Sequence[tuple[int, int, bool]] = ()) -> str:
        """This block's state in a few words (empty when it has none)."""
        parts = [f"inplace {self.inplace} on its input"] if self.inplace else []
        parts += ["calls += 1"] if self.counter else []
        parts += [f"mode {self.mode}"] if self.mode else []
        parts += [f"buffer {self.buffer}"] if self.buffer else []
        parts += [f"scale.mul_ ({self.scale})"] if self.scale else []
        parts += [f"region {self.region}"] if self.region else []
        parts += [f"params {self.params}"] if self.params != "trainable" else []
        parts += [f"around {self.around}"] if self.around else []
        for writer, reader, train_only in shared:
            if writer == index:
                when = " in training" if train_only else ""
                parts.append(f"memo = batch mean{when} (read by blocks.{reader})")
        return ", ".join(parts)


@dataclass(frozen=True)
class FuzzSpec:
    """One generated model and how to train it."""

    seed: int
    dim: int
    vocab: int
    batch: int
    blocks: tuple[BlockSpec, ...]
    final: Ref
    final_uses: tuple[Use, ...]
    #: ``tensor``, ``dict`` or ``tuple``: what the model returns around its logits.
    output: str
    #: ``(i, j)``: ``blocks.j.lin.weight`` is ``blocks.i.lin.weight``.
    ties: tuple[tuple[int, int], ...]
    #: ``head.weight`` is ``embed.weight``.
    tie_head: bool
    split_points: tuple[str, ...]
    capture: str = "fx"
    dynamic: bool = False
    vary_batch: bool = False
    optimizer: str = "sgd"
    gas: int = 2
    schedule: tuple[str, ...] = ("train", "eval", "train")
    #: The torch dialect's schedule (``1f1b``, ``interleaved_1f1b``, ...).
    pipe_schedule: str = "1f1b"
    #: ``partition(num_stages=..., balance=...)`` instead of ``split_points`` (local only).
    num_stages: int | None = None
    balance: str | None = None
    #: Blocks recomputed in backward (``recompute=``; with export capture the
    #: ``recompute_export`` dimension) and blocks with dropout.
    recompute: tuple[str, ...] = ()
    dropout: tuple[int, ...] = ()
    #: Build under ``torch.device("meta")`` and fill the stages from the reference's state.
    meta: bool = False
    #: Run the calls from this one on inside ``pipedialect.trace`` (local only).
    trace_from: int | None = None
    #: Train with ``"bf16": {"enabled": true}`` (local only): one fx spec in five by its weight
    #: seed, and export specs that draw the ``bf16_export`` dimension.
    bf16: bool = False
    #: Module state, one :class:`BlockState` per block; empty: no block has any.
    state: tuple[BlockState, ...] = ()
    #: ``(writer, reader, train_only)``: ``blocks.writer`` copies its output's batch mean into
    #: its buffer ``memo`` (only in training when ``train_only``), and the model's forward adds
    #: the buffer to ``blocks.reader``'s input (``h + self.blocks[writer].memo``). With
    #: ``writer > reader`` the reader sees the value the previous forward left (a later
    #: stage's buffer read by an earlier one).
    shared: tuple[tuple[int, int, bool], ...] = ()
    #: ``stem``, ``embed`` and the first ``frozen_prefix`` blocks are frozen (``requires_grad``
    #: False), as a LoRA-style frozen first stage.
    frozen_prefix: int | None = None
    #: Blocks whose forward adds ``0.05 * torch.randn_like(h)`` (in evaluation too) and
    #: ``F.dropout(h, 0.2, training=self.training)``: every dialect must draw what the unsplit
    #: model run under ``ReferenceStreams`` draws ([Note: random streams]).
    noise: tuple[int, ...] = ()
    #: Blocks holding a frozen ``nn.Parameter`` ``center`` that forward updates in place as
    #: running state (``center.mul_(0.5).add_(mean)``) and subtracts: the torch dialect's set-up
    #: run must put it back.
    param_write: tuple[int, ...] = ()
    #: ``(call, block)``: before that (training) call ``blocks.<block>.lin`` has its
    #: ``requires_grad`` flipped, the call must be refused by ``TrainabilityChangedError``; it
    #: is flipped back and the schedule goes on.
    retrain: tuple[int, int] | None = None
    #: The seed this spec was generated from, when a ``random.Random`` drew it.
    origin: int | None = field(default=None, compare=False)

    def dims(self) -> frozenset[str]:
        """The module-state dimensions (:data:`DIMENSIONS`) this spec exercises."""
        found = {d for st in self.state for d in st.dims()}
        if self.shared:
            found.add("cross_buffer")
        if self.frozen_prefix is not None:
            found.add("frozen")
        if self.bf16 and self.capture == "export":
            found.add("bf16_export")
        if self.recompute and self.capture == "export":
            found.add("recompute_export")
        found.update(
            d
            for d, drawn in (
                ("noise", self.noise),
                ("param_write", self.param_write),
                ("retrain", self.retrain),
            )
            if drawn
        )
        return frozenset(found)

    def features(self) -> frozenset[str]:
        """Finer tags than :meth:`dims` (``buffers:bn``, ``cross_buffer:backward``, ...)."""
        found = {f for st in self.state for f in st.features()}
        for writer, reader, _ in self.shared:
            found.add("cross_buffer:" + ("forward" if writer < reader else "backward"))
            stages = _block_stages(self)
            if stages is not None and stages[writer][-1] != stages[reader][0]:
                found.add("cross_buffer:across_stages")
        if self.frozen_prefix is not None:
            found.add("frozen:prefix")
        for i, st in enumerate(self.state):
            if st.inplace and f"blocks.{i - 1}" in self.split_points and not self.num_stages:
                found.add("inplace:after_split")
        if "bf16_export" in self.dims():
            found.add("bf16_export")
        return frozenset(found)

    def describe(self) -> str:
        """The model as readable pseudo-code, for failure reports and minimising."""
        lines = [
            f"FuzzSpec seed={self.seed} origin={self.origin} dim={self.dim} vocab={self.vocab} "
            f"batch={self.batch}{' (varying)' if self.vary_batch else ''} "
            f"capture={self.capture} dynamic={self.dynamic} optimizer={self.optimizer} "
            f"gas={self.gas} schedule={list(self.schedule)} split={list(self.split_points)}"
            + (f" pipe={self.pipe_schedule}" if self.pipe_schedule != "1f1b" else "")
            + (f" num_stages={self.num_stages} balance={self.balance}" if self.num_stages else "")
            + (f" checkpoint={list(self.recompute)}" if self.recompute else "")
            + (f" dropout={list(self.dropout)}" if self.dropout else "")
            + (" meta" if self.meta else "")
            + (" bf16" if self.bf16 else "")
            + (f" trace_from={self.trace_from}" if self.trace_from is not None else "")
            + (f" noise={list(self.noise)}" if self.noise else "")
            + (f" param_write={list(self.param_write)}" if self.param_write else "")
            + (f" retrain={self.retrain}" if self.retrain else ""),
            "  v0 = x, v1 = ids, v2 = tanh(stem(x)) + embed(ids)",
        ]
        for i, b in enumerate(self.blocks):
            for writer, reader, _ in self.shared:
                if reader == i:
                    lines.append(f"  (blocks.{i}'s input += blocks.{writer}.memo)")
            lines.append(f"  v{3 + i} = blocks.{i}({_ref(b.main)}) -> {_tree(b.out)}")
            lines.extend(f"      {_use(u)}" for u in b.uses)
            state = (self.state[i] if self.state else BlockState()).describe(i, self.shared)
            if state:
                lines.append(f"      state: {state}")
        lines.append(f"  out = head(softsign({_ref(self.final)})) as {self.output}")
        lines.extend(f"      {_use(u)}" for u in self.final_uses)
        if self.ties or self.tie_head:
            ties = [f"blocks.{j}.lin.weight is blocks.{i}.lin.weight" for i, j in self.ties]
            ties += ["head.weight is embed.weight"] if self.tie_head else []
            lines.append(f"  ties: {'; '.join(ties)}")
        if self.frozen_prefix is not None:
            lines.append(f"  frozen: stem, embed, blocks.0 to blocks.{self.frozen_prefix - 1}")
        return "\n".join(lines)


def _ref(r: Ref) -> str:
    return f"v{r.source}" + "".join(f"[{k!r}]" for k in r.path)


def _tree(t: Tree) -> str:
    if isinstance(t, Leaf):
        return repr(t.arg) if t.kind in PY_VALUES else f"<{t.kind}>"
    inner = [_tree(i) for i in t.items]
    if t.container == "dict":
        return "{" + ", ".join(f"{k!r}: {v}" for k, v in zip(t.keys, inner, strict=True)) + "}"
    if t.container == "list":
        return "[" + ", ".join(inner) + "]"
    return "(" + ", ".join(inner) + ("," if len(inner) == 1 else "") + ")"


def _use(u: Use) -> str:
    arg = "" if u.arg is None else f" {u.arg!r}"
    return f"{u.where}: {u.op}{arg} {_ref(u.ref)}"


# -- drawing a spec ---------------------------------------------------------------------------


class Source(Protocol):
    """Where random choices come from."""

    def integer(self, lo: int, hi: int) -> int:
        """An integer in ``[lo, hi]``."""

    def choice(self, options: Sequence[T]) -> T:
        """One of ``options`` (the first is the simplest)."""

    def chance(self, percent: int) -> bool:
        """True with about ``percent`` % probability (False is the simpler answer)."""


class RandomSource:
    """Choices from a seeded ``random.Random``: the same seed, the same spec."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def choice(self, options: Sequence[T]) -> T:
        return options[self.rng.randrange(len(options))]

    def chance(self, percent: int) -> bool:
        return self.rng.randrange(100) < percent


class HypothesisSource:
    """Choices drawn by hypothesis (inside ``st.composite``), so failing specs shrink."""

    def __init__(self, draw: Callable[[Any], Any]) -> None:
        from hypothesis import strategies as st

        self.draw = draw
        self.st = st

    def integer(self, lo: int, hi: int) -> int:
        return int(self.draw(self.st.integers(lo, hi)))

    def choice(self, options: Sequence[T]) -> T:
        return options[self.integer(0, len(options) - 1)]

    def chance(self, percent: int) -> bool:
        return self.integer(0, 99) >= 100 - percent


Path = tuple[str | int, ...]


def _catalog(tree: Tree, path: Path = ()) -> list[tuple[Path, Tree]]:
    """Every value inside ``tree`` (containers too) with its path."""
    found: list[tuple[Path, Tree]] = [(path, tree)]
    if isinstance(tree, Node):
        keys: Sequence[str | int] = (
            tree.keys if tree.container == "dict" else range(len(tree.items))
        )
        for key, item in zip(keys, tree.items, strict=True):
            found.extend(_catalog(item, (*path, key)))
    return found


def _kind(tree: Tree) -> str:
    return tree.kind if isinstance(tree, Leaf) else tree.container


def _draw_leaf(src: Source) -> Leaf:
    kind = src.choice(_LEAF_KINDS)
    if kind == "pyfloat":
        return Leaf(kind, src.choice(_PY_FLOATS))
    if kind == "pyint":
        return Leaf(kind, src.choice(_PY_INTS))
    if kind == "pybool":
        return Leaf(kind, src.chance(50))
    if kind == "act":
        return Leaf(kind, src.choice(("id", "sin", "half")))
    if kind == "nograd":
        return Leaf(kind, src.choice(("half", "cos")))
    return Leaf(kind)


def _draw_tree(src: Source, depth: int) -> Tree:
    if depth >= 3 or not src.chance(45 if depth else 80):
        return _draw_leaf(src)
    container = src.choice(_CONTAINERS)
    count = src.integer(0, 3)
    items = tuple(_draw_tree(src, depth + 1) for _ in range(count))
    if container != "dict":
        return Node(container, items)
    start = src.integer(0, len(_KEY_POOL) - 1)
    keys = tuple(_KEY_POOL[(start + 3 * i) % len(_KEY_POOL)] for i in range(count))
    return Node(container, items, keys)


def _draw_block_output(src: Source) -> Tree:
    """A random structure holding at least one activation (so later blocks have an input)."""
    tree = _draw_tree(src, 0)
    act = Leaf("act", src.choice(("id", "sin", "half")))
    if isinstance(tree, Leaf):
        return act if tree.kind != "act" else tree
    if any(isinstance(t, Leaf) and t.kind == "act" for _, t in _catalog(tree)):
        return tree
    at = src.integer(0, len(tree.items))
    items = (*tree.items[:at], act, *tree.items[at:])
    if tree.container != "dict":
        return Node(tree.container, items)
    spare = next(k for k in _KEY_POOL if k not in tree.keys)
    return Node("dict", items, (*tree.keys[:at], spare, *tree.keys[at:]))


def _draw_use(src: Source, values: Sequence[Tree], top_only: bool) -> Use:
    entries = [(Ref(s, path), sub) for s, tree in enumerate(values) for path, sub in _catalog(tree)]
    # Favour the values of blocks (the ones that cross boundaries with structure).
    if len(values) > STEM + 1 and src.chance(70):
        entries = [e for e in entries if e[0].source > STEM] or entries
    ref, target = src.choice(entries)
    op = src.choice(_OPS[_kind(target)])
    where = "top" if top_only or op == "emb" or not src.chance(40) else "inside"
    arg: Any = None
    if op == "isinstance":
        arg = src.choice(_CLASS_NAMES)
    elif op == "contains":
        assert isinstance(target, Node)
        absent = [k for k in _KEY_POOL if k not in target.keys]
        arg = src.choice((*target.keys, absent[0])) if target.keys else absent[0]
    elif op == "cmp":
        arg = src.choice((0.0, 0.6) if _kind(target) == "pyfloat" else (1, 2))
    return Use(op, ref, target, where, arg)


def _act_refs(values: Sequence[Tree], source: int) -> list[Ref]:
    return [
        Ref(source, path)
        for path, t in _catalog(values[source])
        if isinstance(t, Leaf) and t.kind == "act"
    ]


def generate(
    src: Source,
    dialect: Dialect = "local",
    origin: int | None = None,
    dims: Sequence[str] = DIMENSIONS,
) -> FuzzSpec:
    """Draw one spec that ``dialect`` can run (two ranks for the distributed ones).

    ``dims``: the module-state dimensions kept (:func:`restrict`); every one is drawn all the
    same, so a seed's model with fewer dimensions is its full model with some state removed.
    """
    dim = src.integer(4, 8)
    vocab = dim + src.integer(0, 3)
    num_blocks = src.integer(2, 6)
    values: list[Tree] = [Leaf("nograd"), Leaf("int"), Leaf("act", "id")]
    blocks: list[BlockSpec] = []
    for i in range(num_blocks):
        source = STEM + i if src.chance(60) else src.integer(STEM, STEM + i)
        main = src.choice(_act_refs(values, source))
        uses = tuple(_draw_use(src, values, top_only=False) for _ in range(src.integer(0, 3)))
        out = _draw_block_output(src)
        blocks.append(BlockSpec(main, uses, out))
        values.append(out)
    final = src.choice(_act_refs(values, len(values) - 1))
    final_uses = tuple(_draw_use(src, values, top_only=True) for _ in range(src.integer(0, 2)))
    ties: list[tuple[int, int]] = []
    for _ in range(src.integer(0, 2)):
        i, j = src.integer(0, num_blocks - 1), src.integer(0, num_blocks - 1)
        if i != j and (min(i, j), max(i, j)) not in ties:
            ties.append((min(i, j), max(i, j)))
    candidates = ["stem", "embed"] if src.chance(20) else []
    for i in range(num_blocks):
        candidates.append(f"blocks.{i}.lin" if src.chance(15) else f"blocks.{i}")
    pipe_schedule = "1f1b"
    gas = src.integer(1, 3)
    if dialect == "local":
        num_splits = src.integer(1, min(4, len(candidates)))
    elif dialect == "deepspeed":
        num_splits = 1
        gas = src.integer(2, 3)
    else:
        pipe_schedule = src.choice(
            (
                "1f1b",
                "gpipe",
                "interleaved_1f1b",
                "looped_bfs",
                "zbv_zero_bubble",
                "interleaved_zero_bubble",
                "dualpipev",
            )
        )
        num_splits = 1 if pipe_schedule in ("1f1b", "gpipe") else 3
        if num_splits > len(candidates):  # two blocks and no stem: too few for four stages
            pipe_schedule, num_splits = "1f1b", 1
        gas = 4
    remaining = list(candidates)
    picked = [remaining.pop(src.integer(0, len(remaining) - 1)) for _ in range(num_splits)]
    split_points = tuple(c for c in candidates if c in picked)
    capture = "export" if src.chance(12) else "fx"
    dynamic = dialect != "torch" and src.chance(40)
    vary_batch = dynamic and capture == "fx" and src.chance(50)
    schedule = src.choice(
        (
            ("train", "eval", "train"),
            ("eval", "train", "eval", "train"),
            ("train", "train", "eval"),
            ("train", "eval", "eval", "train"),
        )
    )
    spec = FuzzSpec(
        seed=src.integer(0, 2**16),
        dim=dim,
        vocab=vocab,
        batch=src.integer(2, 4),
        blocks=tuple(blocks),
        final=final,
        final_uses=final_uses,
        output=src.choice(("tensor", "dict", "tuple")),
        ties=tuple(ties),
        tie_head=src.chance(30),
        split_points=split_points,
        capture=capture,
        dynamic=dynamic,
        vary_batch=vary_batch,
        optimizer=src.choice(("sgd", "adam", "sgd_momentum")),
        gas=gas,
        schedule=schedule,
        pipe_schedule=pipe_schedule,
        origin=origin,
    )
    drawn = _draw_state(src, _draw_features(src, spec, dialect, candidates), dialect)
    return restrict(_draw_runtime(src, _draw_export_recompute(src, drawn)), dims)


def _draw_runtime(src: Source, spec: FuzzSpec) -> FuzzSpec:
    """What happens around the graph, drawn last (older seeds keep their models): noise and
    dropout in blocks, a frozen parameter written in forward, a trainability flip."""
    n = len(spec.blocks)
    noise = tuple(i for i in range(n) if src.chance(40)) if src.chance(DIM_CHANCE["noise"]) else ()
    states = spec.state or tuple(BlockState() for _ in spec.blocks)
    recomputed = set(spec.recompute)
    # Not recomputed (recomputation would write it twice) and fx only (export refuses
    # parameter mutation).
    writable = [i for i in range(n) if f"blocks.{i}" not in recomputed]
    param_write: tuple[int, ...] = ()
    if spec.capture == "fx" and writable and src.chance(DIM_CHANCE["param_write"]):
        param_write = (src.choice(writable),)
    retrain = None
    trains = [k for k, op in enumerate(spec.schedule) if op == "train"]
    with_lin = [i for i in range(n) if states[i].params != "none"]
    if len(trains) > 1 and with_lin and src.chance(DIM_CHANCE["retrain"]):
        retrain = (trains[-1], src.choice(with_lin))
    return replace(spec, noise=noise, param_write=param_write, retrain=retrain)


def _draw_export_recompute(src: Source, spec: FuzzSpec) -> FuzzSpec:
    """Blocks of an export-captured spec recomputed in backward (the export
    route's recomputed regions), drawn last (older seeds keep their models). A block whose
    forward writes a buffer or its input in place is not drawn: the capture refuses it."""
    if not (src.chance(DIM_CHANCE["recompute_export"]) and spec.capture == "export"):
        return spec
    states = spec.state or tuple(BlockState() for _ in spec.blocks)
    writes = {None, "table"}

    def quiet(i: int) -> bool:
        st = states[i]
        return st.buffer in writes and st.scale is None and not st.counter and not st.inplace

    free = [
        i
        for i in range(len(spec.blocks))
        if f"blocks.{i}.lin" not in spec.split_points
        and quiet(i)
        and (i + 1 == len(spec.blocks) or not states[i + 1].inplace)
        and not any(w == i or r == i for w, r, _ in spec.shared)
    ]
    chosen = tuple(f"blocks.{i}" for i in free if src.chance(70))
    return replace(spec, recompute=chosen) if chosen else spec


#: Whether a recomputed block may return a structure (containers, None, Python numbers). The
#: code after an opaque recomputed call could not see those (a silent wrong loss this fuzzer
#: found), so the capture refuses such a block with RecomputeError; with this True
#: most checkpoint cases would be refusals, so recomputed blocks return one tensor and
#: ``test_fuzz.py`` checks the refusal on seed 15's model.
CHECKPOINT_STRUCTURES = False


#: One local spec in this many trains in bf16 (chosen by ``spec.seed``: no extra draw).
BF16_EVERY = 5


def _draw_features(
    src: Source, spec: FuzzSpec, dialect: Dialect, candidates: list[str]
) -> FuzzSpec:
    """The later features, drawn after the rest so that older seeds keep their models."""
    num_stages = balance = None
    if dialect == "local" and src.chance(25):
        num_stages = src.integer(2, min(4, len(candidates) + 1))
        balance = src.choice(("parameters", "flops", "memory"))
    recompute: tuple[str, ...] = ()
    dropout: tuple[int, ...] = ()
    if spec.capture == "fx" and src.chance(40):
        free = [
            i
            for i in range(len(spec.blocks))
            if f"blocks.{i}" not in spec.split_points
            and f"blocks.{i}.lin" not in spec.split_points
            and (CHECKPOINT_STRUCTURES or isinstance(spec.blocks[i].out, Leaf))
        ]
        recompute = tuple(f"blocks.{i}" for i in free if src.chance(70))
        # Dropout masks must match the unsplit model's, drawn in the same order: one process,
        # so local only (recomputation must replay them).
        if dialect == "local" and src.chance(60):
            dropout = tuple(i for i in range(len(spec.blocks)) if src.chance(50))
    meta = src.chance(25)
    trace_from = (
        src.integer(0, len(spec.schedule) - 1) if dialect == "local" and src.chance(20) else None
    )
    return replace(
        spec,
        num_stages=num_stages,
        balance=balance,
        split_points=() if num_stages else spec.split_points,
        recompute=recompute,
        dropout=dropout,
        meta=meta,
        trace_from=trace_from,
        bf16=dialect == "local" and spec.capture == "fx" and spec.seed % BF16_EVERY == 0,
    )


#: How often a spec draws each of :data:`DIMENSIONS` (percent); ``bf16_export`` applies to
#: local export specs only.
DIM_CHANCE = {
    "buffers": 40,
    "counter": 20,
    "cross_buffer": 25,
    "modes": 30,
    "regions": 30,
    "inplace": 45,
    "frozen": 30,
    "bf16_export": 60,
    "recompute_export": 40,
    "around": 40,
    "noise": 30,
    "param_write": 20,
    "retrain": 15,
}
_BUFFER_KINDS = ("bn", "bn_cumulative", "stats", "stats_assign", "stats_np", "table")


def _block_stages(spec: FuzzSpec) -> list[tuple[int, ...]] | None:
    """For each block, the stages its code runs in (two when split at its ``lin``), when the
    spec names its split points; None under ``num_stages`` (the balancer chooses them)."""
    if spec.num_stages:
        return None
    cuts = []
    for point in spec.split_points:
        if point in ("stem", "embed"):
            cuts.append(0.0 if point == "stem" else 1.0)
        else:
            index = int(point.split(".")[1])
            cuts.append(2 + index + (0.2 if point.endswith(".lin") else 0.5))

    def stage(position: float) -> int:
        return sum(c < position for c in cuts)

    return [
        tuple(sorted({stage(2 + i + 0.1), stage(2 + i + 0.3)})) for i in range(len(spec.blocks))
    ]


def _all_refs(spec: FuzzSpec) -> list[tuple[str, Ref]]:
    """Every reference to a value (``("main", ref)`` or ``("use", ref)``) in the model."""
    refs = [("main", spec.final)] + [("use", u.ref) for u in spec.final_uses]
    for b in spec.blocks:
        refs += [("main", b.main)] + [("use", u.ref) for u in b.uses]
    return refs


def _inplace_candidates(spec: FuzzSpec) -> list[int]:
    """Blocks whose input may be changed in place with the unsplit model still right.

    Block ``j``'s input must be the previous block's output, read by nothing else (a later read
    would see the change: legal, but then the pipeline's copies decide what it sees), and not
    saved for backward before block ``j`` runs: the previous block computes ``sin`` of its
    output only for a ``sin`` leaf, so none may be in its structure.
    """
    found = []
    for j in range(1, len(spec.blocks)):
        source = STEM + j  # the slot of block j - 1's output
        if spec.blocks[j].main.source != source:
            continue
        readers = [r for _, r in _all_refs(spec) if r.source == source]
        sins = [
            t
            for _, t in _catalog(spec.blocks[j - 1].out)
            if isinstance(t, Leaf) and t.kind == "act" and t.arg == "sin"
        ]
        if len(readers) == 1 and not sins:
            found.append(j)
    return found


def _draw_state(src: Source, spec: FuzzSpec, dialect: Dialect) -> FuzzSpec:
    """Every module-state dimension, drawn after all else (older seeds keep their models).

    The draws do not depend on which dimensions are kept: :func:`restrict` removes them after.
    """
    n = len(spec.blocks)
    gates = {d: src.chance(DIM_CHANCE[d]) for d in _GATED_FIRST}
    states = [BlockState() for _ in range(n)]

    def put(i: int, **changes: Any) -> None:
        states[i] = replace(states[i], **changes)

    bf16 = spec.bf16 or (gates["bf16_export"] and dialect == "local" and spec.capture == "export")
    for i in range(n):
        if src.chance(45):
            kind = src.choice(_BUFFER_KINDS)
            if gates["buffers"]:
                # DeepSpeed keeps buffers fp32 and casts parameters to bf16: BatchNorm's CPU
                # kernel refuses that mix in the unsplit model itself.
                put(i, buffer="stats" if bf16 and kind.startswith("bn") else kind)
    counted = src.integer(0, n - 1)
    # Half the counters in a split-point block, which runs as one call (its Python runs on every
    # forward); in traced-through code a counter may be refused by name.
    eager = [i for i in range(n) if f"blocks.{i}" in spec.split_points]
    if eager and src.chance(50):
        counted = src.choice(eager)
    # Traced through by torch.fx, a counter needs its block as a leaf module (partition refuses
    # it by design otherwise, naming leaf_modules=; :func:`counter_leaves`), and a leaf must
    # return one tensor: a counter drawn on a block returning a structure moves to one that
    # can count (no draw: older models keep theirs). torch.export refuses every traced counter.
    countable = [
        i
        for i in range(n)
        if i in eager
        or (isinstance(spec.blocks[i].out, Leaf) and f"blocks.{i}.lin" not in spec.split_points)
    ]
    if spec.capture == "fx" and counted not in countable and countable:
        counted = countable[counted % len(countable)]
    if gates["counter"]:
        put(counted, counter=True)
    writer, reader = src.integer(0, n - 1), src.integer(0, n - 2)
    reader += reader >= writer
    forward, train_only = src.chance(80), src.chance(50)
    if forward != (writer < reader):
        writer, reader = reader, writer
    shared = ((writer, reader, train_only),) if gates["cross_buffer"] else ()
    for i in range(n):
        if src.chance(40):
            mode = src.choice(("branch", "dropout"))
            if gates["modes"]:
                put(i, mode=mode if dialect == "local" else "branch")
    for i in range(n):
        if src.chance(40):
            region = src.choice(("no_grad", "enable_grad", "autocast"))
            if gates["regions"]:
                put(i, region=region)
    candidates = _inplace_candidates(spec)
    stages = _block_stages(spec)
    after = [
        j
        for j in candidates
        if f"blocks.{j - 1}" in spec.split_points and stages is not None and not spec.blocks[j].uses
    ]
    kind = src.choice(("add_", "relu"))
    target = None
    if candidates:
        target = src.choice(after) if after and src.chance(90) else src.choice(candidates)
    scaled, variant = src.integer(0, n - 1), src.choice(("train", "always"))
    with_scale = src.chance(50) or target is None
    if gates["inplace"]:
        if target is not None:
            put(target, inplace=kind)
        if with_scale:
            put(scaled, scale=variant)
    # A block without parameters has no ``lin``: not for a tie or a split point inside it.
    tied = {i for pair in spec.ties for i in pair}
    tied |= {i for i in range(n) if f"blocks.{i}.lin" in spec.split_points}
    for i in range(n):
        if src.chance(35):
            params = src.choice(("frozen_bias", "frozen", "none"))
            if gates["frozen"]:
                put(i, params="frozen" if params == "none" and i in tied else params)
    prefix = src.integer(1, n) if src.chance(40) else None
    # A parameterless middle stage: every block of one stage between two split points.
    whole = src.chance(50)
    middle = sorted({s for st in stages or [] for s in st} - {0, len(spec.split_points)})
    if middle:
        chosen = src.choice(middle)
        if gates["frozen"] and whole:
            assert stages is not None
            for i, st in enumerate(stages):
                if chosen in st:
                    put(i, params="frozen" if i in tied else "none")
    _draw_around(src, spec, bf16, put, n)
    return replace(
        spec,
        bf16=bf16,
        state=tuple(states),
        shared=shared,
        frozen_prefix=prefix if gates["frozen"] else None,
    )


def _draw_around(src: Source, spec: FuzzSpec, bf16: bool, put: Callable[..., None], n: int) -> None:
    """The ``around`` dimension, drawn last ([Note: values the loop sets] and its neighbours:
    per-module modes, autograd Functions, hooks)."""
    gate = src.chance(DIM_CHANCE["around"])
    for i in range(n):
        if not src.chance(35):
            continue
        kind = src.choice(("frozen_norm", "function", "pre_hook", "bwd_hook", "loop_buffer"))
        whole = isinstance(spec.blocks[i].out, Leaf) and not any(
            p.startswith(f"blocks.{i}.") for p in spec.split_points
        )
        if kind in ("function", "bwd_hook") and spec.capture != "fx":
            kind = "pre_hook"
        if kind == "bwd_hook" and not whole:
            kind = "function"
        if kind == "frozen_norm" and bf16:
            kind = "pre_hook"
        if gate:
            put(i, around=kind)


def restrict(spec: FuzzSpec, dims: Sequence[str]) -> FuzzSpec:
    """``spec`` with only the module-state dimensions in ``dims`` (the others' state removed)."""
    unknown = set(dims) - set(DIMENSIONS)
    if unknown:
        raise ValueError(f"unknown dimensions {sorted(unknown)}; choose from {DIMENSIONS}")
    keep = set(dims)
    fields = {
        "buffers": {"buffer": None},
        "counter": {"counter": False},
        "modes": {"mode": None},
        "regions": {"region": None},
        "inplace": {"inplace": None, "scale": None},
        "frozen": {"params": "trainable"},
        "around": {"around": None},
    }
    cleared = {k: v for d, f in fields.items() if d not in keep for k, v in f.items()}
    if "recompute_export" not in keep and spec.capture == "export":
        spec = replace(spec, recompute=())
    states = tuple(replace(st, **cleared) for st in spec.state)
    shared = spec.shared if "cross_buffer" in keep else ()
    if all(st == BlockState() for st in states) and not shared:
        states = ()
    return replace(
        spec,
        state=states,
        shared=shared,
        noise=spec.noise if "noise" in keep else (),
        param_write=spec.param_write if "param_write" in keep else (),
        retrain=spec.retrain if "retrain" in keep else None,
        frozen_prefix=spec.frozen_prefix if "frozen" in keep else None,
        bf16=spec.bf16 and ("bf16_export" in keep or spec.capture == "fx"),
    )


def spec_from_seed(
    seed: int, dialect: Dialect = "local", dims: Sequence[str] = DIMENSIONS
) -> FuzzSpec:
    """The spec seed ``seed`` draws for ``dialect`` (with the module-state dimensions ``dims``)."""
    return generate(RandomSource(seed), dialect, origin=seed, dims=dims)


def fuzz_specs(dialect: Dialect = "local", dims: Sequence[str] = DIMENSIONS) -> Any:
    """A hypothesis strategy of specs for ``dialect``."""
    from hypothesis import strategies as st

    @st.composite
    def specs(draw: Callable[[Any], Any]) -> FuzzSpec:
        return generate(HypothesisSource(draw), dialect, dims=dims)

    return specs()


# -- the model --------------------------------------------------------------------------------


def _fetch(values: Sequence[Any], ref: Ref) -> Any:
    v = values[ref.source]
    for key in ref.path:
        v = v[key]
    return v


def _walk(h: torch.Tensor, v: Any, tree: Tree) -> torch.Tensor:
    """Fold every value of ``v`` into ``h``, dispatching on what ``v`` is, as user code does."""
    if isinstance(v, dict):
        for key in v:
            h = _walk(h, v[key], tree.child(key) if isinstance(tree, Node) else tree)
        return h * 1.0625
    if isinstance(v, (list, tuple)):
        for i, item in enumerate(v):
            h = _walk(h, item, tree.child(i) if isinstance(tree, Node) else tree)
        return h * 0.9375
    if v is None:
        return h + 0.375
    if isinstance(v, bool):
        return h * (1.5 if v else 0.75)
    if isinstance(v, (int, float)):
        return h + 0.01 * v
    kind = _kind(tree)
    if kind in FLOAT_TENSORS:
        return h + 0.1 * v.float()
    if kind in INT_TENSORS:
        return h + 0.01 * v.unsqueeze(-1).float()
    if kind == "bool":
        return torch.where(v, h, 0.875 * h)
    if kind == "boolrow":
        return torch.where(v.unsqueeze(-1), h, 0.875 * h)
    # The spec says a container or a Python value, and what arrived is neither: a stand-in.
    return h - 0.03125


def apply_use(h: torch.Tensor, v: Any, use: Use, model: nn.Module | None) -> torch.Tensor:
    """``h`` changed by ``v`` as ``use`` says: arithmetic or Python control flow on ``v``."""
    op = use.op
    if op == "add":
        return h + v.float()
    if op == "mul":
        return h * torch.tanh(v.float())
    if op == "emb":
        assert model is not None
        return h + F.embedding(v.long(), model.embed.weight)
    if op == "intadd":
        return h + 0.1 * v.unsqueeze(-1).float()
    if op == "mask":
        return torch.where(v, h, 0.5 * h)
    if op == "rowmask":
        return torch.where(v.unsqueeze(-1), h, -h)
    if op == "is_none":
        return h * 0.5 if v is None else h + 0.25
    if op == "isinstance":
        return h * 0.75 if isinstance(v, _CLASSES[use.arg]) else h - 0.125
    if op == "len":
        return h * (1.0 + 0.1 * len(v))
    if op == "contains":
        return h * 1.25 if use.arg in v else h + 0.5
    if op == "walk":
        return _walk(h, v, use.target)
    if op == "arith":
        kind = _kind(use.target)
        if kind == "pyfloat":
            return h * v
        if kind == "pyint":
            return h + 0.1 * v
        return h * (1 + v)
    if op == "cmp":
        return h * 1.125 if v > use.arg else h * 0.875
    if op == "truth":
        return torch.tanh(h) if v else h * 1.5
    if op == "loop":
        for _ in range(v):
            h = 0.875 * h + 0.0625
        return h
    raise ValueError(f"unknown use {op!r}")


def _realise(a: torch.Tensor, tree: Tree) -> Any:
    """Build the structure ``tree`` describes out of the activation ``a``."""
    if isinstance(tree, Node):
        items = [_realise(a, t) for t in tree.items]
        if tree.container == "dict":
            return dict(zip(tree.keys, items, strict=True))
        return items if tree.container == "list" else tuple(items)
    kind, arg = tree.kind, tree.arg
    if kind in PY_VALUES:
        return arg
    if kind == "act":
        return a if arg == "id" else torch.sin(a) if arg == "sin" else a * 0.5
    if kind == "act64":
        return a.double() * 1.5
    if kind == "nograd":
        return a.detach() * 0.5 if arg == "half" else torch.cos(a.detach())
    if kind == "nograd64":
        return a.detach().double()
    if kind == "int":
        return torch.argmax(a, dim=-1)
    if kind == "int32":
        return torch.argmax(a, dim=-1).to(torch.int32)
    if kind == "bool":
        return a > 0
    if kind == "boolrow":
        return a.sum(-1) > 0
    raise ValueError(f"unknown leaf kind {kind!r}")


class _HalfGrad(torch.autograd.Function):
    """Identity forward, backward scaled by 0.5: lost with its backward, every earlier
    gradient doubles."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 0.5


def set_between_calls(model: nn.Module, call: int) -> None:
    """What the training loop sets before call ``call`` (both the reference and the pipeline):
    every ``loop_buffer`` block's ``temp`` re-assigned, ``1 / (2 + call)``."""
    for module in model.modules():
        if isinstance(module, FuzzBlock) and module.st.around == "loop_buffer":
            module.temp = torch.tensor(1.0 / (2 + call))


def _scale_input(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (args[0] * 0.75, *args[1:])


def _halve_grad_input(module: nn.Module, grad_input: Any, grad_output: Any) -> Any:
    return tuple(None if g is None else g * 0.5 for g in grad_input)


class FuzzBlock(nn.Module):
    """Block ``index`` of a spec: uses its argument values, then returns its structure.

    With a :class:`BlockState`, its forward is ordinary stateful user code (buffers, a Python
    counter, ``self.training`` branches, grad-mode and autocast regions, in-place updates) that
    fx and export trace through unless the block is a split point.
    """

    def __init__(self, spec: FuzzSpec, index: int) -> None:
        super().__init__()
        self.st = st = spec.state[index] if spec.state else BlockState()
        if st.params != "none":
            self.lin = nn.Linear(spec.dim, spec.dim)
        self.block = spec.blocks[index]
        self.drop = nn.Dropout(0.25) if index in spec.dropout else nn.Identity()
        self.bf16 = spec.bf16
        if st.inplace == "relu":
            self.relu = nn.ReLU(inplace=True)
        if st.counter:
            self.calls = 0
        if st.buffer in ("bn", "bn_cumulative"):
            self.norm = nn.BatchNorm1d(spec.dim, momentum=0.1 if st.buffer == "bn" else None)
        elif st.buffer in ("stats", "stats_assign", "stats_np"):
            self.register_buffer("running", torch.zeros(spec.dim), st.buffer != "stats_np")
            self.register_buffer("running_var", torch.ones(spec.dim), st.buffer != "stats_np")
        elif st.buffer == "table":
            self.register_buffer("table", torch.linspace(0.75, 1.25, spec.dim), persistent=False)
        if st.scale:
            self.register_buffer("scale", torch.ones(spec.dim))
        if st.around == "frozen_norm":
            self.frozen_norm = nn.BatchNorm1d(spec.dim)
        elif st.around == "pre_hook":
            self.register_forward_pre_hook(_scale_input)
        elif st.around == "bwd_hook":
            self.register_full_backward_hook(_halve_grad_input)
        elif st.around == "loop_buffer":
            self.register_buffer("temp", torch.ones(()))
        self.noisy = index in spec.noise
        if index in spec.param_write:
            self.center = nn.Parameter(torch.zeros(spec.dim), requires_grad=False)
        self.memo_train_only: bool | None = None
        for writer, _, train_only in spec.shared:
            if writer == index:
                self.register_buffer("memo", torch.zeros(spec.dim))
                self.memo_train_only = train_only

    def _keep(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """bf16: a result mixed with an fp32 buffer goes back to the activation's dtype."""
        return t.to(dtype) if self.bf16 else t

    def _state(self, h: torch.Tensor) -> torch.Tensor:
        """The counter, the mode branch, the buffer and the in-place scale, applied to ``h``."""
        st, dtype = self.st, h.dtype
        if st.counter:
            self.calls += 1
            h = h * (1.0 + 0.0625 * (self.calls % 3))
        if st.mode == "branch":
            h = h * 1.25 if self.training else h - 0.125
        elif st.mode == "dropout":
            h = F.dropout(h, 0.25, training=self.training)
        if st.buffer in ("bn", "bn_cumulative"):
            h = self.norm(h)
        elif st.buffer in ("stats", "stats_assign", "stats_np"):
            if self.training:
                mean, var = h.mean(0).detach(), h.var(0, unbiased=False).detach()
                if st.buffer == "stats_assign":
                    self.running = 0.9 * self.running + 0.1 * mean
                    self.running_var = 0.9 * self.running_var + 0.1 * var
                else:
                    self.running.mul_(0.9).add_(0.1 * mean)
                    self.running_var.mul_(0.9).add_(0.1 * var)
                h = (h - mean) / torch.sqrt(var + 1.0)
            else:
                h = self._keep((h - self.running) / torch.sqrt(self.running_var + 1.0), dtype)
        elif st.buffer == "table":
            h = self._keep(h * self.table, dtype)
        if st.scale == "always" or (st.scale == "train" and self.training):
            self.scale.mul_(0.97)
        if st.scale:
            h = self._keep(h / self.scale, dtype)
        if st.around == "frozen_norm":
            h = self.frozen_norm(h)
        elif st.around == "loop_buffer":
            h = self._keep(h * (0.5 + self.temp), dtype)
        return h

    def train(self, mode: bool = True) -> FuzzBlock:
        """``frozen_norm``: the override keeps the block's BatchNorm in eval (frozen)."""
        super().train(mode)
        if self.st.around == "frozen_norm":
            self.frozen_norm.eval()
        return self

    def _around(self, h: torch.Tensor) -> torch.Tensor:
        """Noise and dropout (``spec.noise``); the running ``center`` (``spec.param_write``)."""
        if self.noisy:
            h = F.dropout(h, 0.2, training=self.training)
            h = h + (0.05 * torch.randn_like(h)).to(h.dtype)
        if hasattr(self, "center"):
            with torch.no_grad():
                self.center.mul_(0.5).add_(h.detach().float().mean(0).to(self.center.dtype))
            h = h - self.center.to(h.dtype)
        return h

    def _mix(self, h: torch.Tensor) -> torch.Tensor:
        """The block's linear map (a fixed function when it has no parameters)."""
        if self.st.params == "none":
            return 0.5 * h + 0.1 * torch.matmul(h, h.transpose(0, 1)).mean(-1, keepdim=True)
        # bf16: boundary values mixed with fp32 ones are fp32; the matmul takes the weights'.
        return self.lin(h.to(self.lin.weight.dtype) if self.bf16 else h)

    def forward(self, h: torch.Tensor, *extras: Any) -> Any:
        st = self.st
        if st.inplace == "add_":
            h.add_(0.5)
        elif st.inplace == "relu":
            h = self.relu(h)
        inside = [u for u in self.block.uses if u.where == "inside"]
        for use, v in zip(inside, extras, strict=True):
            h = apply_use(h, v, use, None)
        h = self._state(h)
        h = self._around(h)
        if st.region == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                z = self._mix(h)
            z = z.to(h.dtype)
        else:
            z = self._mix(h)
        if st.around == "function":
            z = _HalfGrad.apply(z)
        a = h + torch.tanh(self.drop(z))
        if st.region == "no_grad":
            with torch.no_grad():
                n = self.lin.weight.norm() if st.params != "none" else h.norm()
            a = a / (1 + n)
        elif st.region == "enable_grad":
            with torch.no_grad():
                spread = h.abs().mean()
                with torch.enable_grad():
                    g = torch.tanh(h).mean()
            a = a * (1 + 0.1 * spread) + 0.1 * g
        if self.memo_train_only is not None and (self.training or not self.memo_train_only):
            self.memo.copy_(a.mean(0).detach())
        return _realise(a, self.block.out)


class FuzzModel(nn.Module):
    """The model a :class:`FuzzSpec` describes (weights depend only on ``spec.seed``)."""

    def __init__(self, spec: FuzzSpec) -> None:
        super().__init__()
        from pipedialect.models import seeded_init

        self.spec = spec
        self.stem = nn.Linear(spec.dim, spec.dim)
        self.embed = nn.Embedding(spec.vocab, spec.dim)
        self.blocks = nn.ModuleList(FuzzBlock(spec, i) for i in range(len(spec.blocks)))
        self.head = nn.Linear(spec.dim, spec.vocab)
        seeded_init(self, spec.seed)
        for i, j in spec.ties:
            self.blocks[j].lin.weight = self.blocks[i].lin.weight
        if spec.tie_head:
            self.head.weight = self.embed.weight
        for block in self.blocks:
            if block.st.params in ("frozen", "frozen_bias"):
                block.lin.bias.requires_grad_(False)
            if block.st.params == "frozen":
                block.lin.weight.requires_grad_(False)
            if hasattr(block, "norm"):  # around 1, as BatchNorm starts (seeded_init: +-0.1)
                with torch.no_grad():
                    block.norm.weight.add_(1.0)
        if spec.frozen_prefix is not None:
            for module in [self.stem, self.embed, *self.blocks[: spec.frozen_prefix]]:
                module.requires_grad_(False)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> Any:
        if self.spec.bf16:  # float inputs follow the weights (fp32 when partitioned)
            x = x.to(self.stem.weight.dtype)
        values: list[Any] = [x, ids, torch.tanh(self.stem(x)) + self.embed(ids)]
        for index, (block, b) in enumerate(zip(self.blocks, self.spec.blocks, strict=True)):
            h = _fetch(values, b.main)
            extras = []
            for use in b.uses:
                v = _fetch(values, use.ref)
                if use.where == "top":
                    h = apply_use(h, v, use, self)
                else:
                    extras.append(v)
            for writer, reader, _ in self.spec.shared:
                if reader == index:
                    memo = self.blocks[writer].memo
                    h = (h + memo).to(h.dtype) if self.spec.bf16 else h + memo
            values.append(block(h, *extras))
        h = _fetch(values, self.spec.final)
        for use in self.spec.final_uses:
            h = apply_use(h, _fetch(values, use.ref), use, self)
        squashed = h / (1 + h.abs())
        if self.spec.bf16:
            squashed = squashed.to(self.head.weight.dtype)
        logits = self.head(squashed)
        if self.spec.output == "dict":
            return {"extra": None, "logits": logits, "count": 3}
        if self.spec.output == "tuple":
            return (logits, None, h)
        return logits


def fuzz_loss(outputs: Any, labels: torch.Tensor) -> torch.Tensor:
    """Mean squared error of the logits, wherever the model's output holds them."""
    if isinstance(outputs, dict):
        outputs = outputs["logits"]
    elif isinstance(outputs, (tuple, list)):
        outputs = outputs[0]
    return F.mse_loss(outputs, labels.to(outputs.dtype))


Batch = tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]


def micro_batches(spec: FuzzSpec) -> list[Batch]:
    """Every micro-batch the schedule consumes, in order (each call its own ``gas`` of them)."""
    gen = torch.Generator().manual_seed(spec.seed + 7)
    out: list[Batch] = []
    for i in range(len(spec.schedule) * spec.gas):
        size = spec.batch + (i % 2 if spec.vary_batch else 0)
        x = torch.randn(size, spec.dim, generator=gen)
        ids = torch.randint(0, spec.vocab, (size,), generator=gen)
        y = torch.randn(size, spec.vocab, generator=gen)
        out.append(((x, ids), y))
    return out


def chunks(spec: FuzzSpec, batches: Sequence[Batch]) -> list[list[Batch]]:
    """The micro-batches of each schedule call."""
    g = spec.gas
    return [list(batches[k * g : (k + 1) * g]) for k in range(len(spec.schedule))]


def ds_config(spec: FuzzSpec) -> dict[str, Any]:
    """The DeepSpeed config of ``spec``: exact-comparison settings (no clipping, plain Adam)."""
    if spec.optimizer == "adam":
        opt = {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True, "adam_w_mode": False}}
    elif spec.optimizer == "sgd_momentum":
        opt = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
    else:
        opt = {"type": "SGD", "params": {"lr": 0.05}}
    config: dict[str, Any] = {
        "train_batch_size": spec.batch * spec.gas,
        "train_micro_batch_size_per_gpu": spec.batch,
        "gradient_accumulation_steps": spec.gas,
        "optimizer": opt,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }
    if spec.bf16:
        config["bf16"] = {"enabled": True}
    return config


def reference_optimizer(spec: FuzzSpec, params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
    """The torch optimizer the config of ``spec`` means, built explicitly."""
    if spec.optimizer == "adam":
        return torch.optim.Adam(params, lr=0.01)
    if spec.optimizer == "sgd_momentum":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.SGD(params, lr=0.05)


def reference_run(
    spec: FuzzSpec,
    model: nn.Module,
    batches: Sequence[Batch],
    split_points: Sequence[str] = (),
) -> list[float]:
    """Run the schedule on the unsplit model by hand; return each call's mean loss.

    Random numbers (dropout, noise) come from ``ReferenceStreams`` of the plan's
    ``split_points`` and the engines' default seed ([Note: random streams]): the reference
    draws what each stage of that plan draws.

    The model keeps its own semantics: ``model.train()`` before a train call (its buffers and
    counters update as its forward says, once per micro-batch), ``model.eval()`` under
    ``torch.no_grad()`` for an eval call; frozen parameters get no gradient and the optimizer
    leaves them alone. The model's buffers after the run are the expected ones.

    With ``spec.bf16``, DeepSpeed's bf16 recipe written out here: parameters cast to bf16 (the
    floating buffers stay fp32, as DeepSpeed 0.19.8's ``_cast_module_mixed_precision`` leaves
    them), the optimizer on fp32 copies of the trainable ones (``BF16_Optimizer`` keeps only
    parameters that require a gradient), each micro-batch's bf16 gradient added into a bf16
    buffer, the buffers as the copies' gradients, the copies rounded back into the model; a
    call's loss is summed and divided in bf16.
    """
    streams = _streams(model, split_points)
    if spec.bf16:
        return _reference_run_bf16(spec, model, batches, streams)
    opt = reference_optimizer(spec, list(model.parameters()))
    results = []
    steps = 0
    for k, (op, chunk) in enumerate(zip(spec.schedule, chunks(spec, batches), strict=True)):
        set_between_calls(model, k)
        losses = []
        if op == "train":
            model.train()
            for m, ((x, ids), y) in enumerate(chunk):
                with streams.micro_batch("train", steps + 1, m):
                    loss = fuzz_loss(model(x, ids), y)
                (loss / spec.gas).backward()
                losses.append(float(loss.detach()))
            opt.step()
            opt.zero_grad()
            steps += 1
        else:
            model.eval()
            with torch.no_grad():
                for m, ((x, ids), y) in enumerate(chunk):
                    with streams.micro_batch("eval", steps, m):
                        losses.append(float(fuzz_loss(model(x, ids), y)))
        results.append(sum(losses) / len(losses))
    return results


def refuses_retrain(spec: FuzzSpec, call: int, model: nn.Module, run: Any, chunk: Any) -> str:
    """Before ``call`` of a ``spec.retrain`` spec: flip the block's ``requires_grad``, check
    that the call is refused by name (and trained nothing), flip it back; ``""`` when so (or
    when there is nothing to flip), else what went wrong."""
    if spec.retrain is None or spec.retrain[0] != call:
        return ""
    from pipedialect import TrainabilityChangedError

    lin = model.blocks[spec.retrain[1]].lin  # type: ignore[index,union-attr]
    flags = [p.requires_grad for p in lin.parameters()]
    for p, flag in zip(lin.parameters(), flags, strict=True):
        p.requires_grad_(not flag)
    try:
        run(iter(chunk))
        return f"call {call} trained after blocks.{spec.retrain[1]}.lin's requires_grad changed"
    except TrainabilityChangedError as exc:
        flipped = {id(p) for p in lin.parameters()}  # a tied weight has other names too
        names = {n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in flipped}
        if exc.parameter not in names or repr(exc.parameter) not in str(exc):
            return f"call {call} refused the flip without naming the parameter: {exc}"
        return ""
    finally:
        for p, flag in zip(lin.parameters(), flags, strict=True):
            p.requires_grad_(flag)


def _streams(model: nn.Module, split_points: Sequence[str]) -> Any:
    from pipedialect.runtime import ReferenceStreams

    return ReferenceStreams(model, list(split_points))


def _reference_run_bf16(
    spec: FuzzSpec, model: nn.Module, batches: Sequence[Batch], streams: Any
) -> list[float]:
    with torch.no_grad():
        for p in dict.fromkeys(model.parameters()):
            p.data = p.data.to(torch.bfloat16)
    params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    buffers = [torch.zeros_like(p) for p in params]
    opt = reference_optimizer(spec, masters)
    results = []
    steps = 0
    for k, (op, chunk) in enumerate(zip(spec.schedule, chunks(spec, batches), strict=True)):
        set_between_calls(model, k)
        losses = []
        model.train(op == "train")
        kind, step = ("train", steps + 1) if op == "train" else ("eval", steps)
        steps += op == "train"
        with torch.set_grad_enabled(op == "train"):
            for m, ((x, ids), y) in enumerate(chunk):
                with streams.micro_batch(kind, step, m):
                    loss = fuzz_loss(model(x, ids), y)
                if op == "train":
                    (loss / spec.gas).backward()
                    with torch.no_grad():
                        for p, b in zip(params, buffers, strict=True):
                            if p.grad is not None:
                                b += p.grad
                                p.grad = None
                losses.append(loss.detach())
        if op == "train":
            with torch.no_grad():
                for m, b in zip(masters, buffers, strict=True):
                    m.grad = b.float()
                opt.step()
                for p, m, b in zip(params, masters, buffers, strict=True):
                    p.copy_(m)
                    b.zero_()
        total = losses[0].clone()
        for extra in losses[1:]:
            total += extra
        results.append(float((total / len(losses)).float()))
    return results


def partition_spec(model: nn.Module, spec: FuzzSpec, batches: Sequence[Batch]) -> Any:
    """Partition ``model`` as ``spec`` says (torch.fx, or torch.export on the first batch)."""
    from pipedialect import partition

    (x, ids), _ = batches[0]
    kwargs: dict[str, Any] = {}
    if spec.num_stages:
        kwargs.update(num_stages=spec.num_stages, balance=spec.balance)
        if spec.balance != "parameters":
            kwargs["balance_inputs"] = {"x": x, "ids": ids}
    if spec.recompute:
        kwargs["recompute"] = list(spec.recompute)
    points = list(spec.split_points) if spec.split_points else None
    if spec.capture == "export":
        if spec.meta:  # a meta model is exported on meta inputs (and checked on structure)
            x, ids = x.to("meta"), ids.to("meta")
        if spec.bf16:  # export writes dtypes into the graphs: capture in the training dtype
            kwargs["dtype"] = torch.bfloat16
        return partition(model, points, example_inputs={"x": x, "ids": ids}, **kwargs)
    leaves = counter_leaves(spec)
    if leaves:
        kwargs["leaf_modules"] = leaves
    return partition(model, points, **kwargs)


def counter_leaves(spec: FuzzSpec) -> list[str]:
    """The blocks whose Python counter (``self.calls += 1``) torch.fx would trace through:
    ``partition`` refuses those by design, naming ``leaf_modules=`` (a leaf's forward runs at
    every call), so the fuzzer passes them as leaves. Not a split point (already one call),
    nor a block split at its ``lin`` (a leaf cannot hold a split point); a leaf returns one
    tensor (the code after a leaf sees its output as one traced value, as after a recomputed
    block, so the generator keeps counters off blocks returning structures)."""
    if spec.capture != "fx":
        return []
    return [
        f"blocks.{i}"
        for i, st in enumerate(spec.state)
        if st.counter
        and f"blocks.{i}" not in spec.split_points
        and f"blocks.{i}.lin" not in spec.split_points
        and isinstance(spec.blocks[i].out, Leaf)
    ]


def build_model(spec: FuzzSpec) -> nn.Module:
    """The spec's model: real weights, or on the meta device when ``spec.meta``."""
    if not spec.meta:
        return FuzzModel(spec)
    with torch.device("meta"):
        return FuzzModel(spec)


def init_weights(spec: FuzzSpec, plan: Any) -> Callable[[nn.Module], None] | None:
    """For a meta model, the loader filling each local stage from a normally built model (its
    non-persistent buffers given as ``buffers=``, as they are in no state dict)."""
    if not spec.meta:
        return None
    from pipedialect.plan.weights import from_state_dict

    model = FuzzModel(spec)
    state = model.state_dict()
    extra = {n: b for n, b in model.named_buffers(remove_duplicate=False) if n not in state}
    return from_state_dict(state, plan=plan, buffers=extra)


def buffer_values(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every buffer of ``model`` by name (copies), for comparing state."""
    return {n: b.detach().clone() for n, b in model.named_buffers(remove_duplicate=False)}


def stage_buffers(stages: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
    """The buffers each stage holds, as ``"name (stage k)"``: every copy must be right."""
    return {
        f"{n} (stage {k})": b.detach().cpu().clone()
        for k, stage in enumerate(stages)
        for n, b in stage.named_buffers(remove_duplicate=False)
    }


def counters(model: nn.Module) -> dict[str, int]:
    """The Python counters (``calls``) of ``model``'s blocks, by module path."""
    return {f"{n}.calls": m.calls for n, m in model.named_modules() if hasattr(m, "calls")}


def side_effects(spec: FuzzSpec, model: nn.Module, initial: dict[str, torch.Tensor]) -> list[str]:
    """How ``model`` differs from a freshly built one (``initial``: its buffers): what
    ``partition`` left on it (it must change nothing)."""
    problems = [
        f"partition() changed the Python attribute {name} to {value} (it was 0)"
        for name, value in counters(model).items()
        if value != 0
    ]
    if spec.meta:
        return problems
    now = dict(model.named_buffers(remove_duplicate=False))
    for name, value in initial.items():
        if name not in now:
            problems.append(f"partition() removed the buffer {name}")
        elif type(now[name]) is not type(value):
            problems.append(f"partition() replaced the buffer {name} by a {type(now[name])}")
        elif now[name].dtype != value.dtype or not torch.equal(now[name], value):
            problems.append(f"partition() changed the buffer {name}")
    return problems


# -- running and comparing --------------------------------------------------------------------


class FuzzFailure(AssertionError):
    """A generated model whose pipeline run disagrees with the unsplit model, or that crashed."""


@dataclass
class Outcome:
    """What became of one spec: it ran and matched, or it was refused with a named error."""

    spec: FuzzSpec
    refused: str | None = None
    phase: str | None = None
    #: Stages of the plan with no parameter that requires a gradient (frozen or parameterless).
    untrained_stages: int = 0

    @property
    def ran(self) -> bool:
        """It trained and matched the reference."""
        return self.refused is None


def losses_match(ours: float, theirs: float, rtol: float = RTOL) -> bool:
    """Equal within ``rtol`` relative (:data:`ATOL` near zero); NaN never matches."""
    return abs(ours - theirs) <= rtol * abs(theirs) + ATOL


def assert_tensor_close(
    actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float = RTOL
) -> None:
    """As ``tests/_compare.py``: within ``rtol`` relative, measured on the whole tensor."""
    from _compare import assert_tensor_close as compare

    compare(actual, expected, what, rtol)


def tolerance(spec: FuzzSpec, processes: int) -> float:
    """The relative tolerance for ``spec`` on ``processes`` ranks (:data:`AUTOCAST_RTOL`)."""
    autocast = any(st.region == "autocast" for st in spec.state)
    return AUTOCAST_RTOL if autocast and processes > 1 else RTOL


def compare_results(
    spec: FuzzSpec,
    losses: Sequence[float],
    expected: Sequence[float],
    params: dict[str, torch.Tensor],
    ref_params: dict[str, torch.Tensor],
    where: str = "",
    buffers: dict[str, torch.Tensor] | None = None,
    ref_buffers: dict[str, torch.Tensor] | None = None,
    rtol: float = RTOL,
) -> list[str]:
    """Every disagreement between a pipeline run and the reference, as messages.

    ``buffers`` are the stages' copies (:func:`stage_buffers`), each compared with the unsplit
    model's buffer of that name (dtype included: floating buffers stay fp32 under bf16); names
    the model does not have (constants a capture added) are not compared.
    """
    problems = []
    for k, (op, ours, theirs) in enumerate(zip(spec.schedule, losses, expected, strict=True)):
        if not losses_match(ours, theirs, rtol):
            problems.append(f"{where}call {k} ({op}): loss {ours!r} != unsplit {theirs!r}")
    for name, value in params.items():
        try:
            assert_tensor_close(value, ref_params[name].detach(), f"{where}parameter {name}", rtol)
        except AssertionError as exc:
            problems.append(str(exc))
    for key, value in (buffers or {}).items():
        name = key.split(" (stage")[0]
        expected_value = (ref_buffers or {}).get(name)
        if expected_value is None:
            continue
        if value.dtype != expected_value.dtype:
            problems.append(
                f"{where}buffer {key}: dtype {value.dtype}, unsplit {expected_value.dtype}"
            )
            continue
        try:
            assert_tensor_close(value, expected_value.detach(), f"{where}buffer {key}", rtol)
        except AssertionError as exc:
            problems.append(str(exc))
    return problems


def unheld_buffers(
    held: set[str], initial: dict[str, torch.Tensor], final: dict[str, torch.Tensor]
) -> list[str]:
    """Buffers the unsplit model changed that no stage holds (``held``: their names)."""
    changed = [n for n, v in final.items() if not torch.equal(v, initial[n])]
    return [
        f"buffer {n} changed in the unsplit model and no stage holds it"
        for n in changed
        if n not in held
    ]


def failure(spec: FuzzSpec, what: str) -> FuzzFailure:
    """A :class:`FuzzFailure` whose message carries the spec, readable and replayable."""
    seed = f"seed {spec.origin} " if spec.origin is not None else ""
    return FuzzFailure(f"{seed}{what}\n{spec.describe()}\nreplay: {spec!r}")


def run_local(spec: FuzzSpec) -> Outcome:
    """Train ``spec`` on the local dialect and compare with the unsplit model.

    Raises:
        FuzzFailure: a loss or parameter differs, or something other than a named pipedialect
            error was raised, or a named error came after a batch had run.
    """
    import pipedialect
    from pipedialect import PipeDialectError

    reference = FuzzModel(spec)
    model = build_model(spec)  # the stages share Parameter objects with it (unless on meta)
    batches = micro_batches(spec)
    initial = buffer_values(reference)
    phase = "partition"
    changed: list[str] = []  # what partition() left on the model (it must leave nothing)
    try:
        plan = partition_spec(model, spec, batches)
        changed = side_effects(spec, model, initial)
        try:
            expected = reference_run(spec, reference, batches, plan.split_points)
        except Exception as exc:  # the generator built a model that does not run: a harness bug
            raise failure(spec, f"the unsplit model itself fails: {exc!r}") from exc
        phase = "build"
        dialect = pipedialect.get_dialect("local")
        config = ds_config(spec)
        module = dialect.pipe_engine(
            plan,
            config=config,
            loss_fn=fuzz_loss,
            dynamic_shapes=spec.dynamic,
            init_weights=init_weights(spec, plan),
        )
        engine = dialect.runtime_engine(module, config=config)
        losses: list[float] = []
        for k, (op, chunk) in enumerate(zip(spec.schedule, chunks(spec, batches), strict=True)):
            phase = f"call {k} ({op})"
            set_between_calls(model, k)
            call = engine.train_batch if op == "train" else engine.eval_batch
            problem = refuses_retrain(spec, k, model, call, chunk)
            if problem:
                raise failure(spec, problem)
            if spec.trace_from is not None and k >= spec.trace_from:
                with pipedialect.trace(engine, png=False):
                    losses.append(float(call(iter(chunk))))
            else:
                losses.append(float(call(iter(chunk))))
    except PipeDialectError as exc:
        if phase.startswith("call") and not phase.startswith("call 0"):
            raise failure(
                spec, f"{phase} raised after earlier calls ran: {type(exc).__name__}: {exc}"
            ) from exc
        if phase != "partition" and changed:  # refused, but the model is no longer the same
            raise failure(spec, f"{phase} refused, after " + "; ".join(changed)) from exc
        return Outcome(spec, f"{type(exc).__name__}: {exc}", phase)
    except Exception as exc:
        after = f" (after {'; '.join(changed)})" if phase != "partition" and changed else ""
        raise failure(
            spec,
            f"{phase} raised {type(exc).__name__} (not a named pipedialect error){after}: {exc}",
        ) from exc
    params = {
        n: p.detach().float()
        for stage in plan.stages
        for n, p in stage.named_parameters(remove_duplicate=False)
    }
    ref_params = {
        n: p.detach().float() for n, p in reference.named_parameters(remove_duplicate=False)
    }
    buffers = stage_buffers(plan.stages)
    ref_buffers = buffer_values(reference)
    problems = changed + compare_results(
        spec, losses, expected, params, ref_params, buffers=buffers, ref_buffers=ref_buffers
    )
    moved = {n for n in ref_params if n not in params}
    if moved:
        problems.append(f"parameters held by no stage: {sorted(moved)}")
    held = {key.split(" (stage")[0] for key in buffers}
    problems += unheld_buffers(held, initial, ref_buffers)
    if problems:
        raise failure(
            spec, "the pipeline disagrees with the unsplit model:\n" + "\n".join(problems)
        )
    untrained = sum(not any(p.requires_grad for p in stage.parameters()) for stage in plan.stages)
    return Outcome(spec, untrained_stages=untrained)


# -- finding out which feature a failure needs ------------------------------------------------


def _variants(spec: FuzzSpec) -> dict[str, FuzzSpec]:
    """The same model with one knob turned off, to tell bug classes apart."""
    out = {}
    if spec.capture == "fx":
        out["export capture"] = replace(spec, capture="export", vary_batch=False)
    if spec.dynamic:
        out["static shapes"] = replace(spec, dynamic=False, vary_batch=False)
    if "eval" in spec.schedule:
        out["no eval"] = replace(spec, schedule=tuple(s for s in spec.schedule if s == "train"))
    present = spec.dims()
    for dim in sorted(present):
        out[f"no {dim}"] = restrict(spec, [d for d in DIMENSIONS if d in present and d != dim])
    if present:
        out["no state"] = restrict(spec, ())
    return out


def diagnose(spec: FuzzSpec) -> list[str]:
    """Which single change makes a failing spec pass."""
    notes = []
    for name, variant in _variants(spec).items():
        try:
            run_local(variant)
        except FuzzFailure:
            continue
        notes.append(f"passes with {name}")
    return notes


def _seeds(text: str) -> list[int]:
    seeds: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds.extend(range(int(lo), int(hi or lo) + 1))
    return seeds


def run_distributed(spec: FuzzSpec, dialect: Dialect, timeout: float = 240.0) -> Outcome:
    """Train ``spec`` on ``dialect`` in one launch of two ranks and compare (as the tests do).

    Raises:
        FuzzFailure: as :func:`run_local`, or the launch failed (a rank crashed or hung).
    """
    import _fuzz_workers as workers

    from pipedialect.runtime.launch import launch

    try:
        launched = launch(workers.run_specs, 2, dialect, [spec], timeout=timeout)
    except Exception as exc:
        text = str(exc)
        raise failure(spec, f"the {dialect} launch failed: {text[-3000:]}") from exc
    results = [r[0] for r in launched]
    if workers.compare(spec, results):
        return Outcome(spec)
    return Outcome(spec, results[0]["refused"], results[0].get("phase"))


def dimension_counts(outcomes: Sequence[tuple[FuzzSpec, str]]) -> dict[str, Counter[str]]:
    """``{dimension or feature: Counter(ran=..., refused=..., failed=...)}`` over ``outcomes``
    (each a spec and ``"ran"``, ``"refused"`` or ``"failed"``)."""
    table: dict[str, Counter[str]] = {}
    for spec, status in outcomes:
        for name in sorted(spec.dims() | spec.features()):
            table.setdefault(name, Counter())[status] += 1
    return dict(sorted(table.items()))


def format_counts(table: dict[str, Counter[str]]) -> str:
    """The table of :func:`dimension_counts`, one line per dimension or feature."""
    return "\n".join(
        f"  {name:28} ran {c['ran']:4}  refused {c['refused']:4}  failed {c['failed']:4}"
        for name, c in table.items()
    )


def _dims(text: str) -> list[str]:
    if text in ("none", ""):
        return []
    dims = [d.strip() for d in text.split(",")]
    unknown = set(dims) - set(DIMENSIONS)
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown dimensions {sorted(unknown)}; choose from {', '.join(DIMENSIONS)}"
        )
    return dims


def main(argv: Sequence[str] | None = None) -> int:
    """Run seeds on a dialect; print what fails (and which change makes it pass)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("seeds", help="a seed, a range 0-99, or a list 1,5,9-12")
    parser.add_argument("-q", "--quiet", action="store_true", help="print only failures")
    parser.add_argument("-d", "--describe", action="store_true", help="print every spec")
    parser.add_argument(
        "--only",
        type=_dims,
        default=list(DIMENSIONS),
        help=f"comma-separated module-state dimensions to keep ({', '.join(DIMENSIONS)}), "
        "or 'none' for the models of 445325a; default: all",
    )
    parser.add_argument(
        "--dialect",
        choices=("local", "deepspeed", "torch"),
        default="local",
        help="deepspeed and torch: one launch of two ranks per seed",
    )
    parser.add_argument(
        "--no-diagnose", action="store_true", help="skip the variants run on each failure"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results: list[tuple[FuzzSpec, str]] = []
    for seed in _seeds(args.seeds):
        spec = spec_from_seed(seed, args.dialect, dims=args.only)
        if args.describe:
            print(spec.describe())
        try:
            if args.dialect == "local":
                outcome = run_local(spec)
            else:
                outcome = run_distributed(spec, args.dialect)
        except FuzzFailure as exc:
            results.append((spec, "failed"))
            lines = str(exc).splitlines()
            summary = " | ".join(lines[:2] if lines[0].endswith(":") else lines[:1])
            print(f"FAIL {summary[:300]}")
            if args.dialect == "local" and not args.no_diagnose:
                print(f"     diagnosis: {diagnose(spec) or ['no single change makes it pass']}")
            if not args.quiet:
                print("\n".join(lines[1:]))
                if exc.__cause__ is not None:
                    traceback.print_exception(exc.__cause__, limit=-3)
            continue
        results.append((spec, "refused" if outcome.refused else "ran"))
        if not args.quiet:
            status = f"refused at {outcome.phase}: {outcome.refused}" if outcome.refused else "ok"
            print(f"seed {seed}: {status[:200]}")
    total = len(results)
    failed = sum(status == "failed" for _, status in results)
    refused = sum(status == "refused" for _, status in results)
    print(f"{total} specs: {failed} failed, {refused} refused, {total - failed - refused} ran")
    table = dimension_counts(results)
    if table:
        print("by module-state dimension and feature:\n" + format_counts(table))
    return 1 if failed else 0


if __name__ == "__main__":
    # Run as the importable module, so specs sent to spawned ranks are _fuzz_models.FuzzSpec.
    import _fuzz_models

    sys.exit(_fuzz_models.main())
