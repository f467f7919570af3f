"""SchemaCodec: exact round trips, hand-written metadata, errors that name paths, caching.

The references are independent of the codec: values compared to themselves after a round trip
with a type-exact equality written here, metadata strings written by hand from the documented
grammar, and tensor leaves found by a depth-first walk written here.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import json
import math
import sys
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import pipedialect
from pipedialect import (
    CodecError,
    MetadataError,
    SchemaCodec,
    StructureChangedError,
    UnsupportedValueError,
)
from pipedialect.runtime import _codec_schema as schema

EXAMPLES = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- an exact equality and a reference leaf walk, written independently of the codec --------


def same(a: Any, b: Any) -> bool:
    """Equal with the same types all the way down; tensors must be the very same objects."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        if math.isnan(a):
            return math.isnan(b)
        return a.hex() == b.hex()  # tells -0.0 from 0.0
    if isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        if len(a) != len(b):
            return False
        for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True):
            if not same(ka, kb) or not same(va, vb):
                return False
        return True
    return bool(a == b)


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    """Tensor leaves in depth-first order, dicts in insertion order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        return [leaf for item in value for leaf in tensor_leaves(item)]
    return []


# -- value strategies -------------------------------------------------------------------------

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.complex64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]

tensors = st.builds(
    lambda dtype, shape, grad: torch.zeros(shape, dtype=dtype).requires_grad_(
        grad and dtype.is_floating_point
    ),
    st.sampled_from(DTYPES),
    st.lists(st.integers(0, 3), max_size=3),
    st.booleans(),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, math.inf, -math.inf, math.nan, 5e-324, 1e300]),
    st.text(max_size=8),
    st.builds(torch.Size, st.lists(st.integers(0, 2**40), max_size=4)),
)
keys = st.one_of(
    st.text(max_size=6),
    st.integers(-5, 2**70),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=False),
)
leaves = st.one_of(tensors, scalars)
values = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(keys, inner, max_size=4),
    ),
    max_leaves=24,
)


# -- the documented format, written by hand ----------------------------------------------------


def payload_a() -> tuple[Any, ...]:
    hidden = torch.randn(2, 4, 8, requires_grad=True)
    mask = torch.ones(2, 1, 4, 4, dtype=torch.bool)
    pos = torch.arange(8).view(2, 4)
    return (hidden, None, (mask, pos), 0.5, 3, True)


def test_metadata_of_payload_a_is_the_documented_string() -> None:
    value = payload_a()
    leaves, metadata = SchemaCodec().encode(value)
    assert metadata == '[1,["t","T",null,["t","T","T"],0.5,3,true]]'
    assert leaves == (value[0], value[2][0], value[2][1])
    assert all(a is b for a, b in zip(leaves, (value[0], *value[2]), strict=True))


@pytest.mark.parametrize(
    ("value", "metadata"),
    [
        ([], '[1,["l"]]'),
        ((), '[1,["t"]]'),
        ({}, '[1,["d"]]'),
        (None, "[1,null]"),
        (True, "[1,true]"),
        (1, "[1,1]"),
        (1.0, "[1,1.0]"),
        (-0.0, "[1,-0.0]"),
        (math.inf, "[1,Infinity]"),
        (-math.inf, "[1,-Infinity]"),
        (math.nan, "[1,NaN]"),
        (0.1, "[1,0.1]"),
        (2**80, f"[1,{2**80}]"),
        ("é\n", '[1,["s","\\u00e9\\n"]]'),
        (torch.Size([2, 3]), '[1,["z",2,3]]'),
        (torch.Size([]), '[1,["z"]]'),
        (dict([("a", None), (1, []), (True, 2)]), '[1,["d","a",null,1,2]]'),  # one key: 1
        ({None: 1, 2.5: 2, False: 3}, '[1,["d",null,1,2.5,2,false,3]]'),
        ([[[]], ((),)], '[1,["l",["l",["l"]],["t",["t"]]]]'),
    ],
)
def test_metadata_matches_the_grammar(value: Any, metadata: str) -> None:
    tensors, got = SchemaCodec().encode(value)
    assert (tensors, got) == ((), metadata)
    assert same(SchemaCodec().decode((), metadata), value)


def test_tensor_paths_and_difference_are_human_readable() -> None:
    codec = SchemaCodec()
    metadata = '[1,["l","T",["d","mask","T",3,["t","T"]]]]'
    assert codec.tensor_paths(metadata) == ["[0]", "[1]['mask']", "[1][3][0]"]
    assert codec.tensor_paths('[1,"T"]') == ["<root>"]
    changed = '[1,["l","T",["d","mask",null,3,["t","T"]]]]'
    assert codec.explain_difference(metadata, changed) == (
        "first difference at [1]['mask']: was a tensor, now None"
    )
    assert codec.explain_difference(metadata, metadata) == "the structures are the same"
    longer = '[1,["l","T",["d","mask","T",3,["t","T","T"]]]]'
    assert codec.explain_difference(metadata, longer) == (
        "first difference at [1][3]: was a tuple of 1 item, now a tuple of 2 items"
    )
    rekeyed = '[1,["l","T",["d","mask","T",4,["t","T"]]]]'
    assert codec.explain_difference(metadata, rekeyed) == (
        "first difference at [1]: was a dict with keys ['mask', 3], now a dict with keys "
        "['mask', 4]"
    )
    assert "cannot be compared" in codec.explain_difference(metadata, "junk")


# -- exact round trips -------------------------------------------------------------------------


@EXAMPLES
@given(values)
def test_round_trip_is_exact_and_sends_only_tensor_leaves(value: Any) -> None:
    sender, receiver = SchemaCodec(), SchemaCodec()
    for _ in range(3):  # first sight (walk, interpreter), then the compiled coders
        tensors, metadata = sender.encode(value)
        expected = tensor_leaves(value)
        assert len(tensors) == len(expected)
        assert all(a is b for a, b in zip(tensors, expected, strict=True))
        assert metadata.isascii()
        json.loads(metadata)
        assert same(receiver.decode(tensors, metadata), value)
        assert same(SchemaCodec().decode(tensors, metadata), value)


@EXAMPLES
@given(st.data(), values)
def test_a_learnt_structure_never_accepts_a_different_value(
    data: st.DataObject, first: Any
) -> None:
    # The generated encoder must refuse every value the generic walk describes differently.
    codec = SchemaCodec()
    codec.encode(first)
    codec.encode(first)
    second = data.draw(st.one_of(mutations(first), values))
    tensors, metadata = codec.encode(second)
    reference = SchemaCodec().encode(second)
    assert metadata == reference[1]
    assert all(a is b for a, b in zip(tensors, reference[0], strict=True))
    assert same(SchemaCodec().decode(tensors, metadata), second)


def mutations(value: Any) -> st.SearchStrategy[Any]:
    """Values that differ from ``value`` at one position, often only slightly."""
    near_leaves = st.sampled_from(
        [None, True, False, 0, 1, -1, 0.0, -0.0, 1.0, math.nan, "", "a", torch.Size([1])]
    )
    options: list[st.SearchStrategy[Any]] = [near_leaves, tensors]
    if isinstance(value, list):
        options.append(st.just(tuple(value)))
        options.append(st.just([*value, None]))
    if isinstance(value, tuple) and not isinstance(value, torch.Size):
        options.append(st.just(list(value)))
        options.append(st.just(value[:-1]))
    if isinstance(value, dict) and value:
        options.append(st.just(dict(reversed(list(value.items())))))
        key = next(iter(value))
        options.append(st.just({**value, key: None}))
        options.append(st.just({(1 if key is True else True): v for v in value.values()}))
    if isinstance(value, (list, tuple)) and value and not isinstance(value, torch.Size):
        options.append(
            st.integers(0, len(value) - 1).flatmap(
                lambda i: mutations(value[i]).map(
                    lambda item: type(value)([*value[:i], item, *value[i + 1 :]])
                )
            )
        )
    if isinstance(value, dict) and value:
        options.append(
            st.sampled_from(list(value)).flatmap(
                lambda k: mutations(value[k]).map(lambda item: {**value, k: item})
            )
        )
    return st.one_of(options)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ([1], [True]),
        ([True], [1]),
        ([1], [1.0]),
        ([0.0], [-0.0]),
        ([math.nan], [0.0]),
        ([math.inf], [-math.inf]),
        (["a"], ["b"]),
        ([torch.Size([2])], [(2,)]),
        ([(1,)], [[1]]),
        ({"a": 1, "b": 2}, {"b": 2, "a": 1}),
        ({1: 0}, {True: 0}),
        ({1: 0}, {1.0: 0}),
        ([torch.zeros(1)], [None]),
        ([None], [torch.zeros(1)]),
        ([[]], [[None]]),
    ],
)
def test_near_misses_are_told_apart_after_compilation(first: Any, second: Any) -> None:
    codec = SchemaCodec()
    for _ in range(3):
        first_md = codec.encode(first)[1]
    tensors, metadata = codec.encode(second)
    assert metadata != first_md
    assert same(SchemaCodec().decode(tensors, metadata), second)


def test_alternating_structures_round_trip() -> None:
    a, b = payload_a(), {"x": torch.ones(1), "y": [1, 2]}
    codec, receiver = SchemaCodec(), SchemaCodec()
    for _ in range(4):
        for value in (a, b):
            assert same(receiver.decode(*codec.encode(value)), value)


def test_tensors_pass_as_they_are() -> None:
    param = torch.nn.Parameter(torch.randn(3))
    meta = torch.empty(2, 2, device="meta")
    view = torch.arange(10)[::2]
    value = [param, meta, view, torch.zeros(0, dtype=torch.complex128)]
    tensors, metadata = SchemaCodec().encode(value)
    assert all(a is b for a, b in zip(tensors, value, strict=True))
    decoded = SchemaCodec().decode(tensors, metadata)
    assert all(a is b for a, b in zip(decoded, value, strict=True))


# -- no device syncs, no parsing once learnt ------------------------------------------------


class _RecordOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_no_tensor_operation_at_all_so_no_sync() -> None:
    # Meta tensors have no data: reading one (.item(), .cpu(), printing) would raise; and no
    # aten operation may run in either direction, cold or warm.
    value = [torch.empty(3, device="meta"), {"k": (torch.empty(1, device="meta"), 2.5)}, None]
    sender, receiver = SchemaCodec(), SchemaCodec()
    with _RecordOps() as recorder:
        for _ in range(3):
            decoded = receiver.decode(*sender.encode(value))
    assert recorder.ops == []
    assert same(decoded, value)


@pytest.mark.cuda
def test_no_device_sync_on_cuda() -> None:
    device = torch.device("cuda")
    value = [torch.ones(3, device=device), {"k": (torch.zeros(1, device=device), 2.5)}, None, 3]
    sender, receiver = SchemaCodec(), SchemaCodec()
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):  # the mode does catch a sync
            value[0].sum().item()
        for _ in range(3):
            decoded = receiver.decode(*sender.encode(value, device))
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert same(decoded, value)


def test_known_structures_skip_the_walk_and_the_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    value = payload_a()
    sender, receiver = SchemaCodec(), SchemaCodec()
    for _ in range(2):
        tensors, metadata = sender.encode(value)
        receiver.decode(tensors, metadata)

    def forbidden(*args: Any) -> Any:
        raise AssertionError("a learnt structure was analysed again")

    monkeypatch.setattr(schema, "walk", forbidden)
    monkeypatch.setattr(schema, "parse", forbidden)
    monkeypatch.setattr(schema, "interpret", forbidden)
    monkeypatch.setattr(json, "loads", forbidden)
    for _ in range(3):
        tensors, metadata = sender.encode(value)
        assert same(receiver.decode(tensors, metadata), value)


def test_caches_are_bounded() -> None:
    codec = SchemaCodec()
    limit = SchemaCodec.MAX_STRUCTURES
    for i in range(3 * limit):
        for _ in range(2):
            tensors, metadata = codec.encode([i])
            assert codec.decode(tensors, metadata) == [i]
    assert len(codec._encoders) <= limit
    assert len(codec._decoders) <= limit


# -- freezing -----------------------------------------------------------------------------------


def test_freeze_names_the_first_differing_path() -> None:
    codec = SchemaCodec(freeze=True)
    value = payload_a()
    for _ in range(3):
        codec.encode(value)
    assert codec.frozen_metadata == codec.encode(value)[1]
    hidden, _, (mask, pos), *rest = value
    with pytest.raises(StructureChangedError) as info:
        codec.encode((hidden, None, (None, pos), *rest))
    assert "[2][0]: was a tensor, now None" in str(info.value)
    with pytest.raises(StructureChangedError) as info:
        codec.encode((hidden, None, (mask, pos), 0.25, 3, True))
    assert "[3]: was the float 0.5, now the float 0.25" in str(info.value)
    with pytest.raises(StructureChangedError, match=r"<root>: was a tuple of 6 items, now a"):
        codec.encode((*value, 1))
    # A changed tensor (same structure) is fine; so is the unfrozen codec.
    codec.encode((torch.zeros(1), None, (mask, pos), 0.5, 3, True))
    SchemaCodec().encode((hidden, None, (None, pos), *rest))


# -- what it refuses -----------------------------------------------------------------------------


class Point(NamedTuple):
    x: int
    y: int


class Colour(enum.IntEnum):
    RED = 1


class Label(str):
    pass


@pytest.mark.parametrize(
    ("value", "path", "hint"),
    [
        ([torch.ones(1), {"a": [1, object()]}], "[1]['a'][1]", "rebuild it"),
        ({"out": Point(1, 2)}, "['out']", "namedtuple"),
        ([collections.OrderedDict(a=1)], "[0]", "plain dict"),
        ([[Colour.RED]], "[0][0]", "builtin type"),
        ((1, Label("x")), "[1]", "builtin type"),
        ([b"bytes"], "[0]", "rebuild it"),
        ({"k": {(1, 2): 3}}, "['k']", "key of type tuple"),
        ({"k": {math.nan: 3}}, "['k']", "NaN"),
        (object(), "<root>", "rebuild it"),
    ],
)
def test_unsupported_values_name_their_path(value: Any, path: str, hint: str) -> None:
    with pytest.raises(UnsupportedValueError) as info:
        SchemaCodec().encode(value)
    message = str(info.value)
    assert f" {path}" in message
    assert hint in message
    assert isinstance(info.value, pipedialect.PipeDialectError)


def test_cycles_depth_and_huge_ints_are_refused() -> None:
    cycle: list[Any] = [1]
    cycle.append([cycle])
    with pytest.raises(UnsupportedValueError, match=r"\[1\]\[0\] contains itself"):
        SchemaCodec().encode(cycle)
    deep: Any = torch.ones(1)
    for _ in range(schema.MAX_DEPTH):
        deep = [deep]
    assert same(SchemaCodec().decode(*SchemaCodec().encode(deep)), deep)
    with pytest.raises(UnsupportedValueError, match="more than 100 deep"):
        SchemaCodec().encode([deep])
    limit = sys.get_int_max_str_digits()
    if limit:
        with pytest.raises(UnsupportedValueError, match=r"the int at \[0\] is too large"):
            SchemaCodec().encode([10 ** (limit + 1)])


def test_the_same_object_twice_is_not_a_cycle() -> None:
    shared = [torch.ones(1)]
    value = [shared, shared, {"a": shared}]
    assert same(SchemaCodec().decode(*SchemaCodec().encode(value)), value)


# -- malformed metadata ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metadata", "piece"),
    [
        ("", "not valid JSON"),
        ("[1,", "not valid JSON"),
        ("[2,null]", "version 1"),
        ('[true,"T"]', "version 1"),
        ("[1]", "version 1"),
        ('{"a":1}', "version 1"),
        ('[1,"X"]', '"X"'),
        ('[1,["q",1]]', '["q", 1]'),
        ('[1,["l",["d","a"]]]', "at [0]"),
        ('[1,["d",[1],2]]', "dict key [1]"),
        ('[1,["d","a",1,"a",2]]', "appears twice"),
        ('[1,["d",1,1,true,2]]', "appears twice"),
        ('[1,["d",NaN,1]]', "dict key nan"),
        ('[1,["s",1]]', '["s", 1]'),
        ('[1,["s","a","b"]]', '["s"'),
        ('[1,["z",1.5]]', '["z", 1.5]'),
        ('[1,["z",true]]', '["z", true]'),
        ('[1,["t",{}]]', "at [0]"),
        ("[1,[]]", "[]"),
        ("[1," + '["l",' * 101 + "null" + "]" * 102, "more than 100 deep"),
        ("[" * 100000, "not valid JSON"),
    ],
)
def test_malformed_metadata_names_the_piece(metadata: str, piece: str) -> None:
    with pytest.raises(MetadataError) as info:
        SchemaCodec().decode((), metadata)
    assert piece in str(info.value)


def test_wrong_tensor_count_is_a_metadata_error() -> None:
    codec = SchemaCodec()
    tensors, metadata = codec.encode(payload_a())
    for _ in range(3):  # interpreter first, then the compiled decoder
        with pytest.raises(MetadataError, match="describes 3 tensor leaves but 2 were given"):
            codec.decode(tensors[:2], metadata)
        with pytest.raises(MetadataError, match="but 4 were given"):
            codec.decode((*tensors, tensors[0]), metadata)
        codec.decode(tensors, metadata)
    for _ in range(3):
        with pytest.raises(MetadataError, match="describes 0 tensor leaves but 1 were given"):
            codec.decode(tensors[:1], "[1,null]")


@EXAMPLES
@given(st.text())
def test_arbitrary_text_raises_only_metadata_errors(text: str) -> None:
    with contextlib.suppress(MetadataError):
        SchemaCodec().decode((), text)


json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(),
        st.sampled_from(["T", "s", "z", "l", "t", "d", "x"]),
        st.text(max_size=3),
    ),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=2), inner),
    max_leaves=20,
)


@EXAMPLES
@given(json_values, st.integers(0, 3))
def test_arbitrary_json_raises_only_metadata_errors(tree: Any, count: int) -> None:
    metadata = json.dumps([1, tree])
    codec = SchemaCodec()
    for _ in range(2):
        with contextlib.suppress(MetadataError):
            codec.decode([torch.zeros(1)] * count, metadata)
    assert isinstance(codec.explain_difference(metadata, '[1,"T"]'), str)


def test_errors_are_codec_errors() -> None:
    assert issubclass(MetadataError, CodecError)
    assert issubclass(UnsupportedValueError, CodecError)
    assert issubclass(StructureChangedError, CodecError)
