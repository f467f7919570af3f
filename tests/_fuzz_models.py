"""Random models for the differential fuzzer (issue #12): a spec as data, a model built from it.

A :class:`FuzzSpec` describes a model as data: blocks (``blocks.0``, ...), each returning a random
structure (nested dicts, lists and tuples of float tensors with and without a gradient, int and
bool tensors, None and Python floats, ints and bools); the values each block consumes from any
earlier block or input (skip connections over several stages, values used only several stages
later); what it does with them, as real Python in ``forward`` (arithmetic with boundary numbers,
``is None``, ``isinstance``, ``len``, dict membership, loops, comparisons, a recursive walk); ties
between blocks; split points; capture path (torch.fx, or torch.export with example inputs);
optimizer, gradient accumulation, dynamic shapes and the train/eval schedule; and the later
features, drawn last so older seeds keep their models: ``num_stages`` with a balance method,
checkpointed blocks and dropout, a meta-device model filled per stage, calls inside ``trace``;
and bf16 (``"bf16": {"enabled": true}``) for one local spec in five (by its weight seed, so no
draw changes), compared with DeepSpeed's bf16 recipe written out on the unsplit model
(:func:`reference_run`: bf16 parameters, fp32 master weights, bf16 gradient accumulation).

:class:`FuzzModel` runs a spec. Its forward is generic code that fx and export really trace: the
control flow meets the boundary values as it would in user code. :func:`run_local` trains it on
the local dialect and compares every loss and every parameter with the unsplit model trained by a
plain loop (the independent reference). A refusal counts only when it is a named
:class:`pipedialect.PipeDialectError` raised before any batch ran; anything else fails.

A spec is drawn from a :class:`Source`: hypothesis (which shrinks a failing spec) or a seeded
``random.Random``, so that a case is reproducible by its seed::

    .venv/bin/python tests/_fuzz_models.py 17          # run seed 17 on the local dialect
    .venv/bin/python tests/_fuzz_models.py 0-300 -q    # sweep, print only what fails
"""

from __future__ import annotations

import argparse
import random
import sys
import traceback
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
    #: Blocks recomputed in backward (``checkpoint=``, fx only) and blocks with dropout.
    checkpoint: tuple[str, ...] = ()
    dropout: tuple[int, ...] = ()
    #: Build under ``torch.device("meta")`` and fill the stages from the reference's state.
    meta: bool = False
    #: Run the calls from this one on inside ``pipedialect.trace`` (local only).
    trace_from: int | None = None
    #: Train with ``"bf16": {"enabled": true}`` (local, fx capture only: an exported graph
    #: fixes the dtypes it was captured with).
    bf16: bool = False
    #: The seed this spec was generated from, when a ``random.Random`` drew it.
    origin: int | None = field(default=None, compare=False)

    def describe(self) -> str:
        """The model as readable pseudo-code, for failure reports and minimising."""
        lines = [
            f"FuzzSpec seed={self.seed} origin={self.origin} dim={self.dim} vocab={self.vocab} "
            f"batch={self.batch}{' (varying)' if self.vary_batch else ''} "
            f"capture={self.capture} dynamic={self.dynamic} optimizer={self.optimizer} "
            f"gas={self.gas} schedule={list(self.schedule)} split={list(self.split_points)}"
            + (f" pipe={self.pipe_schedule}" if self.pipe_schedule != "1f1b" else "")
            + (f" num_stages={self.num_stages} balance={self.balance}" if self.num_stages else "")
            + (f" checkpoint={list(self.checkpoint)}" if self.checkpoint else "")
            + (f" dropout={list(self.dropout)}" if self.dropout else "")
            + (" meta" if self.meta else "")
            + (" bf16" if self.bf16 else "")
            + (f" trace_from={self.trace_from}" if self.trace_from is not None else ""),
            "  v0 = x, v1 = ids, v2 = tanh(stem(x)) + embed(ids)",
        ]
        for i, b in enumerate(self.blocks):
            lines.append(f"  v{3 + i} = blocks.{i}({_ref(b.main)}) -> {_tree(b.out)}")
            lines.extend(f"      {_use(u)}" for u in b.uses)
        lines.append(f"  out = head(softsign({_ref(self.final)})) as {self.output}")
        lines.extend(f"      {_use(u)}" for u in self.final_uses)
        if self.ties or self.tie_head:
            ties = [f"blocks.{j}.lin.weight is blocks.{i}.lin.weight" for i, j in self.ties]
            ties += ["head.weight is embed.weight"] if self.tie_head else []
            lines.append(f"  ties: {'; '.join(ties)}")
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


def generate(src: Source, dialect: Dialect = "local", origin: int | None = None) -> FuzzSpec:
    """Draw one spec that ``dialect`` can run (two ranks for the distributed ones)."""
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
    return _draw_features(src, spec, dialect, candidates)


#: Whether a checkpointed block may return a structure (containers, None, Python numbers). The
#: code after an opaque checkpointed call could not see those (a silent wrong loss this fuzzer
#: found), so the capture refuses such a block with ActivationCheckpointError; with this True
#: most checkpoint cases would be refusals, so checkpointed blocks return one tensor and
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
    checkpoint: tuple[str, ...] = ()
    dropout: tuple[int, ...] = ()
    if spec.capture == "fx" and src.chance(40):
        free = [
            i
            for i in range(len(spec.blocks))
            if f"blocks.{i}" not in spec.split_points
            and f"blocks.{i}.lin" not in spec.split_points
            and (CHECKPOINT_STRUCTURES or isinstance(spec.blocks[i].out, Leaf))
        ]
        checkpoint = tuple(f"blocks.{i}" for i in free if src.chance(70))
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
        checkpoint=checkpoint,
        dropout=dropout,
        meta=meta,
        trace_from=trace_from,
        bf16=dialect == "local" and spec.capture == "fx" and spec.seed % BF16_EVERY == 0,
    )


def spec_from_seed(seed: int, dialect: Dialect = "local") -> FuzzSpec:
    """The spec seed ``seed`` draws for ``dialect``."""
    return generate(RandomSource(seed), dialect, origin=seed)


def fuzz_specs(dialect: Dialect = "local") -> Any:
    """A hypothesis strategy of specs for ``dialect``."""
    from hypothesis import strategies as st

    @st.composite
    def specs(draw: Callable[[Any], Any]) -> FuzzSpec:
        return generate(HypothesisSource(draw), dialect)

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


class FuzzBlock(nn.Module):
    """Block ``index`` of a spec: uses its argument values, then returns its structure."""

    def __init__(self, spec: FuzzSpec, index: int) -> None:
        super().__init__()
        self.lin = nn.Linear(spec.dim, spec.dim)
        self.block = spec.blocks[index]
        self.drop = nn.Dropout(0.25) if index in spec.dropout else nn.Identity()
        self.bf16 = spec.bf16

    def forward(self, h: torch.Tensor, *extras: Any) -> Any:
        inside = [u for u in self.block.uses if u.where == "inside"]
        for use, v in zip(inside, extras, strict=True):
            h = apply_use(h, v, use, None)
        # bf16: boundary values mixed with fp32 ones are fp32; the matmul takes the weights'.
        lin_in = h.to(self.lin.weight.dtype) if self.bf16 else h
        a = h + torch.tanh(self.drop(self.lin(lin_in)))
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

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> Any:
        if self.spec.bf16:  # float inputs follow the weights (fp32 when partitioned)
            x = x.to(self.stem.weight.dtype)
        values: list[Any] = [x, ids, torch.tanh(self.stem(x)) + self.embed(ids)]
        for block, b in zip(self.blocks, self.spec.blocks, strict=True):
            h = _fetch(values, b.main)
            extras = []
            for use in b.uses:
                v = _fetch(values, use.ref)
                if use.where == "top":
                    h = apply_use(h, v, use, self)
                else:
                    extras.append(v)
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


def reference_run(spec: FuzzSpec, model: nn.Module, batches: Sequence[Batch]) -> list[float]:
    """Run the schedule on the unsplit model by hand; return each call's mean loss.

    With ``spec.bf16``, DeepSpeed's bf16 recipe written out here: parameters cast to bf16, the
    optimizer on fp32 copies, each micro-batch's bf16 gradient added into a bf16 buffer, the
    buffers as the copies' gradients, the copies rounded back into the model; a call's loss is
    summed and divided in bf16.
    """
    if spec.bf16:
        return _reference_run_bf16(spec, model, batches)
    opt = reference_optimizer(spec, list(model.parameters()))
    torch.manual_seed(spec.seed)  # dropout masks: the pipeline seeds alike before its calls
    results = []
    for op, chunk in zip(spec.schedule, chunks(spec, batches), strict=True):
        losses = []
        if op == "train":
            model.train()
            for (x, ids), y in chunk:
                loss = fuzz_loss(model(x, ids), y)
                (loss / spec.gas).backward()
                losses.append(float(loss.detach()))
            opt.step()
            opt.zero_grad()
        else:
            model.eval()
            with torch.no_grad():
                losses = [float(fuzz_loss(model(x, ids), y)) for (x, ids), y in chunk]
        results.append(sum(losses) / len(losses))
    return results


def _reference_run_bf16(spec: FuzzSpec, model: nn.Module, batches: Sequence[Batch]) -> list[float]:
    params = list(dict.fromkeys(model.parameters()))
    with torch.no_grad():
        for p in params:
            p.data = p.data.to(torch.bfloat16)
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    buffers = [torch.zeros_like(p) for p in params]
    opt = reference_optimizer(spec, masters)
    torch.manual_seed(spec.seed)
    results = []
    for op, chunk in zip(spec.schedule, chunks(spec, batches), strict=True):
        losses = []
        model.train(op == "train")
        with torch.set_grad_enabled(op == "train"):
            for (x, ids), y in chunk:
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
    if spec.checkpoint:
        kwargs["checkpoint"] = list(spec.checkpoint)
    points = list(spec.split_points) if spec.split_points else None
    if spec.capture == "export":
        return partition(model, points, example_inputs={"x": x, "ids": ids}, **kwargs)
    return partition(model, points, **kwargs)


def build_model(spec: FuzzSpec) -> nn.Module:
    """The spec's model: real weights, or on the meta device when ``spec.meta``."""
    if not spec.meta:
        return FuzzModel(spec)
    with torch.device("meta"):
        return FuzzModel(spec)


def init_weights(spec: FuzzSpec, plan: Any) -> Callable[[nn.Module], None] | None:
    """For a meta model, the loader filling each local stage from a normally built model."""
    if not spec.meta:
        return None
    from pipedialect.weights import from_state_dict

    return from_state_dict(FuzzModel(spec).state_dict(), plan=plan)


# -- running and comparing --------------------------------------------------------------------


class FuzzFailure(AssertionError):
    """A generated model whose pipeline run disagrees with the unsplit model, or that crashed."""


@dataclass
class Outcome:
    """What became of one spec: it ran and matched, or it was refused with a named error."""

    spec: FuzzSpec
    refused: str | None = None
    phase: str | None = None

    @property
    def ran(self) -> bool:
        """It trained and matched the reference."""
        return self.refused is None


def losses_match(ours: float, theirs: float) -> bool:
    """Equal within :data:`RTOL` relative (:data:`ATOL` near zero); NaN never matches."""
    return abs(ours - theirs) <= RTOL * abs(theirs) + ATOL


def assert_tensor_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """As ``tests/_compare.py``: within 1e-6 relative, measured on the whole tensor."""
    from _compare import assert_tensor_close as compare

    compare(actual, expected, what)


def compare_results(
    spec: FuzzSpec,
    losses: Sequence[float],
    expected: Sequence[float],
    params: dict[str, torch.Tensor],
    ref_params: dict[str, torch.Tensor],
    where: str = "",
) -> list[str]:
    """Every disagreement between a pipeline run and the reference, as messages."""
    problems = []
    for k, (op, ours, theirs) in enumerate(zip(spec.schedule, losses, expected, strict=True)):
        if not losses_match(ours, theirs):
            problems.append(f"{where}call {k} ({op}): loss {ours!r} != unsplit {theirs!r}")
    for name, value in params.items():
        try:
            assert_tensor_close(value, ref_params[name].detach(), f"{where}parameter {name}")
        except AssertionError as exc:
            problems.append(str(exc))
    return problems


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
    try:
        expected = reference_run(spec, reference, batches)
    except Exception as exc:  # the generator built a model that does not run: a harness bug
        raise failure(spec, f"the unsplit model itself fails: {exc!r}") from exc
    phase = "partition"
    try:
        plan = partition_spec(model, spec, batches)
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
        torch.manual_seed(spec.seed)
        for k, (op, chunk) in enumerate(zip(spec.schedule, chunks(spec, batches), strict=True)):
            phase = f"call {k} ({op})"
            call = engine.train_batch if op == "train" else engine.eval_batch
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
        return Outcome(spec, f"{type(exc).__name__}: {exc}", phase)
    except Exception as exc:
        raise failure(
            spec, f"{phase} raised {type(exc).__name__} (not a named pipedialect error): {exc}"
        ) from exc
    params = {
        n: p.detach().float()
        for stage in plan.stages
        for n, p in stage.named_parameters(remove_duplicate=False)
    }
    ref_params = {
        n: p.detach().float() for n, p in reference.named_parameters(remove_duplicate=False)
    }
    problems = compare_results(spec, losses, expected, params, ref_params)
    moved = {n for n in ref_params if n not in params}
    if moved:
        problems.append(f"parameters held by no stage: {sorted(moved)}")
    if problems:
        raise failure(
            spec, "the pipeline disagrees with the unsplit model:\n" + "\n".join(problems)
        )
    return Outcome(spec)


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


def main(argv: Sequence[str] | None = None) -> int:
    """Run seeds on the local dialect; print what fails (and which change makes it pass)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("seeds", help="a seed, a range 0-99, or a list 1,5,9-12")
    parser.add_argument("-q", "--quiet", action="store_true", help="print only failures")
    parser.add_argument("-d", "--describe", action="store_true", help="print every spec")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    failed = refused = 0
    for seed in _seeds(args.seeds):
        spec = spec_from_seed(seed)
        if args.describe:
            print(spec.describe())
        try:
            outcome = run_local(spec)
        except FuzzFailure as exc:
            failed += 1
            lines = str(exc).splitlines()
            summary = " | ".join(lines[:2] if lines[1].startswith("call") else lines[:1])
            print(f"FAIL {summary[:300]}")
            print(f"     diagnosis: {diagnose(spec) or ['no single change makes it pass']}")
            if not args.quiet:
                print("\n".join(lines[1:]))
                if exc.__cause__ is not None:
                    traceback.print_exception(exc.__cause__, limit=-3)
            continue
        if outcome.refused:
            refused += 1
        if not args.quiet:
            status = f"refused at {outcome.phase}: {outcome.refused}" if outcome.refused else "ok"
            print(f"seed {seed}: {status[:200]}")
    total = len(_seeds(args.seeds))
    print(f"{total} specs: {failed} failed, {refused} refused, {total - failed - refused} ran")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
