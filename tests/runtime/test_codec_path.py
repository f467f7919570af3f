"""The seed's path codec, checked against Slapo 0.0.3's own published code.

Slapo's ``pipeline.py`` is loaded from its wheel by ``benchmarks/_slapo.py`` (downloaded once
into a cache). When it cannot be had the tests that need it fail: they do not skip.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import math
import sys
import types
from pathlib import Path
from typing import Any

import _slapo_workers as first_test
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pipedialect
from pipedialect import CodecError, MetadataError, UnsupportedValueError, partition
from pipedialect.dialects.deepspeed import pipeline
from pipedialect.dialects.deepspeed.pipeline import (
    PathCodec,
    WrappedTypeCode,
    decode_metadata,
    encode_metadata,
    flat_and_name_tensor_list,
    flatten,
    get_simple_nested_list_str,
    unflatten,
)
from pipedialect.runtime.wire import WireDecoder, WireEncoder

EXAMPLES = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HELPER = Path(__file__).resolve().parents[2] / "benchmarks" / "_slapo.py"
CPU = torch.device("cpu")


#: The tests comparing with Slapo run pip on first use (``pip download`` of its wheel, then
#: cached): they are in the packaging tier, not the quick loop.
needs_slapo = pytest.mark.packaging


def slapo() -> types.ModuleType:
    """Slapo 0.0.3's ``framework_dialect/deepspeed/pipeline.py`` (raises if unavailable)."""
    name = "_pipedialect_benchmarks_slapo"
    helper = sys.modules.get(name)
    if helper is None:
        spec = importlib.util.spec_from_file_location(name, HELPER)
        assert spec is not None and spec.loader is not None
        helper = importlib.util.module_from_spec(spec)
        sys.modules[name] = helper
        spec.loader.exec_module(helper)
    module: types.ModuleType = helper.load_pipeline()
    return module


# -- values Slapo 0.0.3 accepts ------------------------------------------------------------------

slapo_leaves = st.one_of(
    st.builds(
        lambda dtype, n: torch.zeros(n, dtype=dtype),
        st.sampled_from([torch.float32, torch.float16, torch.int64, torch.bool, torch.uint8]),
        st.integers(0, 3),
    ),
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
)
slapo_values = st.recursive(
    slapo_leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=3), inner, max_size=3),
    ),
    max_leaves=20,
)
slapo_outputs = st.one_of(
    st.lists(slapo_values, max_size=5), st.lists(slapo_values, max_size=5).map(tuple)
)


def has_empty_container(value: Any) -> bool:
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return not value or any(has_empty_container(v) for v in value)
    return False


def seed_view(value: Any) -> Any:
    """What the seed format can restore: every list, tuple and dict as a tuple of its values."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return tuple(seed_view(v) for v in value)
    return value


def same(a: Any, b: Any) -> bool:
    """Type-exact equality; tensors must be the same objects; NaN equals NaN."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a.hex() == b.hex()
    if isinstance(a, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def same_wire(ours: torch.Tensor, theirs: torch.Tensor, original: Any) -> bool:
    """One wire tensor of ours against Slapo's at the same position."""
    if isinstance(original, torch.Tensor):
        return ours is original and theirs is original
    if original is None:
        return ours.dtype == theirs.dtype == torch.int64 and ours.item() == theirs.item() == 0
    if isinstance(original, float):  # ours keeps float64; Slapo rounds to float32
        return ours.dtype == torch.float64 and same(ours.item(), original)
    return (
        ours.dtype == theirs.dtype
        and ours.shape == theirs.shape == ()
        and bool(ours.item() == theirs.item() == original)
    )


def leaves_of(value: Any) -> list[Any]:
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in leaves_of(v)]
    return [value]


# -- byte-identical to Slapo ---------------------------------------------------------------------


@needs_slapo
@EXAMPLES
@given(slapo_outputs)
def test_flatten_matches_slapo_byte_for_byte(outputs: Any) -> None:
    reference = slapo()
    their_md, their_ret = reference.flatten(outputs, CPU)
    our_md, our_ret = flatten(outputs, CPU)
    assert encode_metadata(our_md) == reference.encode_metadata(their_md)
    assert our_md == their_md
    originals = leaves_of(outputs)
    assert len(our_ret) == len(their_ret) == len(originals)
    for ours, theirs, original in zip(our_ret, their_ret, originals, strict=True):
        assert same_wire(ours, theirs, original)


@needs_slapo
@EXAMPLES
@given(slapo_outputs)
def test_unflatten_matches_slapo_on_both_wires(outputs: Any) -> None:
    reference = slapo()
    metadata = encode_metadata(flatten(outputs, CPU)[0])
    for wire in (flatten(outputs, CPU)[1], reference.flatten(outputs, CPU)[1]):
        ours = unflatten(wire, decode_metadata(metadata))
        if metadata:  # Slapo cannot decode the empty output
            assert decode_metadata(metadata) == reference.decode_metadata(metadata)
            assert same(ours, reference.unflatten(wire, reference.decode_metadata(metadata)))
        else:
            assert ours == ()


@EXAMPLES
@given(slapo_outputs)
def test_round_trip_keeps_every_value_the_format_can_express(outputs: Any) -> None:
    metadata, ret = flatten(outputs, CPU)
    restored = unflatten(ret, decode_metadata(encode_metadata(metadata)))
    if not has_empty_container(outputs) or not outputs:
        assert same(restored, seed_view(outputs))  # floats too: float64 on the wire
    codec = PathCodec()
    tensors, text = codec.encode(outputs)
    assert text == encode_metadata(metadata)
    decoded = codec.decode(tensors, text)
    assert isinstance(decoded, list)
    assert same(tuple(decoded), restored)


@pytest.mark.parametrize(
    ("outputs", "metadata"),
    [
        (lambda t: [t[0], (t[1], None), 3], "0,0|1.0,0|1.1,2|2,1"),
        (lambda t: [[t[1], t[2]]], "0.0,0|0.1,0"),
        (lambda t: [[t[1]], [t[2]]], "0.0,0|1.0,0"),
        (lambda t: [t[0], [t[1], [t[2]]], 2.5, True], "0,0|1.0,0|1.1.0,0|2,1|3,1"),
        (lambda t: [t[0], {"a": t[1], "b": t[2]}], "0,0|1.0,0|1.1,0"),
        (lambda t: [torch.Size((2, 3)), t[0]], "0.0,1|0.1,1|1,0"),
        (lambda t: [t[0], [], t[1]], "0,0|2,0"),
        (lambda t: [], ""),
    ],
)
def test_documented_examples(outputs: Any, metadata: str) -> None:
    t = [torch.ones(1), torch.ones(2), torch.ones(3)]
    value = outputs(t)
    md, ret = flatten(value, CPU)
    assert encode_metadata(md) == metadata
    assert len(ret) == len(md)


def test_documented_lossy_cases() -> None:
    t0, t1 = torch.ones(1), torch.ones(2)
    cases = [
        ([t0, [], t1], (t0, (), t1)),
        ([t0, []], (t0,)),
        ([{"a": t0}, torch.Size([2])], ((t0,), (2,))),
        ([[t0, 1]], ((t0, 1),)),
    ]
    for value, restored in cases:
        md, ret = flatten(value, CPU)
        assert same(unflatten(ret, decode_metadata(encode_metadata(md))), restored)


def test_floats_keep_float64_precision() -> None:
    value = [0.1, 1e-310, -0.0, math.pi]
    md, ret = flatten(value, CPU)
    assert all(t.dtype == torch.float64 for t in ret)
    assert same(unflatten(ret, md), tuple(value))


def test_empty_output_round_trips() -> None:
    md, ret = flatten([], CPU)
    assert (md, ret, encode_metadata(md)) == ([], [], "")
    assert decode_metadata("") == []
    assert unflatten([], decode_metadata("")) == ()
    codec = PathCodec()
    assert codec.decode(*codec.encode([])) == []


def test_top_level_dict_is_flattened_over_its_values() -> None:
    t0 = torch.ones(1)
    md, ret = flatten({"a": t0, "b": 2}, CPU)
    assert encode_metadata(md) == "0,0|1,1"
    assert ret[0] is t0


@needs_slapo
def test_same_names_and_signatures_as_slapo() -> None:
    reference = slapo()
    for name in (
        "get_simple_nested_list_str",
        "flat_and_name_tensor_list",
        "encode_metadata",
        "decode_metadata",
        "flatten",
        "unflatten",
    ):
        ours = inspect.signature(getattr(pipeline, name))
        theirs = inspect.signature(getattr(reference, name))
        assert [(p.name, p.default, p.kind) for p in ours.parameters.values()] == [
            (p.name, p.default, p.kind) for p in theirs.parameters.values()
        ], name
    assert {m.name: m.value for m in WrappedTypeCode} == {
        m.name: m.value for m in reference.WrappedTypeCode
    }
    assert set(pipeline.__all__) >= {"PathCodec", "WrappedTypeCode", "flatten", "unflatten"}
    assert len(set(pipeline.__all__)) == len(pipeline.__all__)  # its order is ruff's (RUF022)


# -- the debug printer and the liveness naming -----------------------------------------------


@needs_slapo
@EXAMPLES
@given(slapo_outputs.filter(lambda v: "{" not in repr(v)))
def test_debug_printer_matches_slapo_where_slapo_works(outputs: Any) -> None:
    assert get_simple_nested_list_str(outputs) == slapo().get_simple_nested_list_str(outputs)


def test_debug_printer_handles_everything() -> None:
    value = [
        torch.zeros(2, 3),
        torch.tensor([7]),
        torch.zeros(1, device="meta"),
        {"a": (None, "s"), 1: 2.5},
        torch.Size([4]),
        object(),
    ]
    assert get_simple_nested_list_str(value) == (
        "[tensor(2, 3),scalar(7),tensor(1,),{'a':[None,'s'],1:2.5},[4],<object>]"
    )


def test_flat_and_name_itemises_every_container() -> None:
    t0, t1, t2 = torch.ones(1), torch.ones(2), torch.ones(3)
    value = (t0, (t1, t2), None)
    named = flat_and_name_tensor_list(value, "submod_0", "")
    assert [n for n, _ in named] == [
        "submod_0",
        "submod_0.0",
        "submod_0.1",
        "submod_0.1.0",
        "submod_0.1.1",
        "submod_0.2",
    ]
    assert [v for _, v in named][3] is t1
    nested = flat_and_name_tensor_list(((t0, t1), {"k": t2}), "submod_1", "")
    assert [n for n, _ in nested] == [
        "submod_1",
        "submod_1.0",
        "submod_1.0.0",
        "submod_1.0.1",
        "submod_1.1",
        "submod_1.1.k",
    ]
    assert nested[-1][1] is t2


@needs_slapo
@EXAMPLES
@given(slapo_values)
def test_flat_and_name_keeps_every_name_slapo_gives(value: Any) -> None:
    ours = dict(flat_and_name_tensor_list(value, "submod_2", ""))
    for name, item in slapo().flat_and_name_tensor_list(value, "submod_2", ""):
        assert ours[name] is item


# -- what it refuses, and malformed metadata ----------------------------------------------------


@pytest.mark.parametrize(
    ("value", "path"),
    [
        ([torch.ones(1), ["x"]], "'1.0'"),
        ([1, (2, [object()])], "'1.1.0'"),
        ([{"a": b"x"}], "'0.0'"),
        ([2**63], "'0'"),
        ([[-(2**63) - 1]], "'0.0'"),
    ],
)
def test_unsupported_leaves_name_their_seed_path(value: Any, path: str) -> None:
    with pytest.raises(UnsupportedValueError) as info:
        flatten(value, CPU)
    assert f"at path {path}" in str(info.value)


def test_non_sequences_are_refused() -> None:
    with pytest.raises(UnsupportedValueError, match="list or tuple"):
        flatten(3, CPU)  # type: ignore[arg-type]
    with pytest.raises(UnsupportedValueError, match="list or tuple"):
        PathCodec().encode(torch.ones(2))
    deep: Any = [torch.ones(1)]
    for _ in range(100):
        deep = [deep]
    with pytest.raises(UnsupportedValueError, match="more than 100 deep"):
        flatten(deep, CPU)


@pytest.mark.parametrize(
    ("metadata", "piece"),
    [
        ("0,0|", "#1 ''"),
        ("0,5", "'0,5'"),
        ("a,0", "'a,0'"),
        ("0.,1", "'0.,1'"),
        ("01,0", "'01,0'"),
        ("-1,0", "'-1,0'"),
        (" 1,0", "' 1,0'"),
        ("1_0,0", "'1_0,0'"),
        ("0,0,0", "'0,0,0'"),
        ("0", "'0'"),
        ("٣,0", "'٣,0'"),
        ("|", "#0 ''"),
        (".".join(["0"] * 101) + ",0", "at most 100 levels"),
    ],
)
def test_malformed_metadata_strings_name_the_piece(metadata: str, piece: str) -> None:
    with pytest.raises(MetadataError) as info:
        decode_metadata(metadata)
    assert piece in str(info.value)


@pytest.mark.parametrize(
    ("metadata", "count", "message"),
    [
        ("0,0|0,0", 2, "path '0' is given twice"),
        ("0.0,0|0,0", 2, "path '0' is given twice"),
        ("0,0|0.1,0", 2, "path '0.1' runs through the value at path '0'"),
        ("0,0", 2, "describes 1 tensors but 2 were given"),
        ("9999999,0", 1, "skips more than"),
        ("0,4", 1, "is a 0-dim tensor"),
    ],
)
def test_inconsistent_metadata_is_a_metadata_error(metadata: str, count: int, message: str) -> None:
    with pytest.raises(MetadataError, match=message):
        unflatten([torch.tensor(1)] * count, decode_metadata(metadata))


def test_unflatten_checks_hand_made_entries() -> None:
    t = torch.tensor(1)
    for entries, message in [
        ([("0", 7)], "unknown type code 7"),
        ([("0", True)], "unknown type code True"),
        ([("x", 0)], "malformed path 'x'"),
        ([("0",)], "not a \\(<path>, <type>\\) pair"),
        ([(["0"], 0)], "malformed path"),
        ([("0", [1])], "unknown type code"),
    ]:
        with pytest.raises(MetadataError, match=message):
            unflatten([t], entries)
    with pytest.raises(MetadataError, match="not a tensor"):
        unflatten([3], [("0", 1)])
    assert unflatten([t], [("0", 1)]) == (1,)
    assert unflatten([t], [("0", "1")]) == (1,)


@EXAMPLES
@given(st.text())
def test_arbitrary_strings_raise_only_metadata_errors(text: str) -> None:
    try:
        entries = decode_metadata(text)
    except MetadataError:
        return
    assert all(isinstance(e, list) and len(e) == 2 for e in entries)


near_metadata = st.lists(
    st.tuples(
        st.lists(st.integers(0, 3), min_size=1, max_size=3).map(lambda p: ".".join(map(str, p))),
        st.integers(0, 4),
    ),
    max_size=6,
).map(lambda entries: "|".join(f"{p},{c}" for p, c in entries))


@EXAMPLES
@given(near_metadata, st.integers(0, 7))
def test_nearly_valid_metadata_raises_only_codec_errors(metadata: str, count: int) -> None:
    wire = [torch.tensor(float(i)) for i in range(count)]
    with contextlib.suppress(MetadataError):
        PathCodec().decode(wire, metadata)


def test_non_string_metadata_is_a_metadata_error() -> None:
    with pytest.raises(MetadataError, match="must be a str"):
        decode_metadata(b"0,0")  # type: ignore[arg-type]


# -- PathCodec as a TensorCodec --------------------------------------------------------------


def test_path_codec_helpers_and_the_wire() -> None:
    codec = PathCodec()
    t0, t1 = torch.ones(2, requires_grad=True), torch.arange(3)
    _, metadata = codec.encode([t0, (t1, None), 0.5])
    assert metadata == "0,0|1.0,0|1.1,2|2,1"
    assert codec.tensor_paths(metadata) == ["0", "1.0", "1.1", "2"]
    assert codec.explain_difference(metadata, "0,0|1.0,2|1.1,2|2,1") == (
        "first difference at path '1.0': was TORCH_TENSOR, now TRUE_NONE"
    )
    assert codec.explain_difference(metadata, "0,0") == "4 wire tensors before, 1 now"
    sender = WireEncoder(codec, prefix="[Stage 0]")
    receiver = WireDecoder(PathCodec(), prefix="[Stage 1]")
    decoded = receiver.decode(sender.encode([t0, (t1, None), 0.5], CPU))
    assert isinstance(decoded, list)
    assert torch.equal(decoded[0], t0) and decoded[1][0] is t1 and decoded[1][1] is None
    assert decoded[2] == 0.5


def test_errors_are_codec_errors() -> None:
    assert issubclass(MetadataError, CodecError)
    with pytest.raises(CodecError):
        PathCodec().decode([], "x")


# -- the path codec on a stage boundary ------------------------------------------------------


def test_slapos_split_output_crosses_the_path_codec_as_the_unsplit_model_computes() -> None:
    """Slapo's first pipeline test in one process: the block at the cut returns
    ``(h, [tanh(h), None], 3, 0.5)``, the path codec gives the list back as a tuple (its
    definition), and the split-point guard accepts it: loss and gradients are the unsplit
    model's."""
    plan = partition(first_test.TwelveLinears(), [first_test.SPLIT])
    reference = first_test.TwelveLinears()
    stages = first_test.seed_stages(plan)
    inputs, labels = first_test.batch()
    wire = stages[0](inputs)
    (received,) = stages[1].receive((wire,), {})
    assert type(received[1]) is tuple and received[1][1] is None and received[2:] == (3, 0.5)
    loss = first_test.loss_fn(stages[1](wire), labels)
    expected = first_test.loss_fn(reference(inputs), labels)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0.0)
    loss.backward()
    expected.backward()
    grads = {n: p.grad for stage in plan.stages for n, p in stage.named_parameters()}
    assert set(grads) == {n for n, _ in reference.named_parameters()}
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-6, atol=1e-8, msg=name)


class _KeyedBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        return {"h": self.linear(x), "aux": None}


class _ReadsByKey(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _KeyedBlock()
        self.head = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return self.head(out["h"]) if out["aux"] is None else out["h"]


def test_a_dict_read_by_key_through_the_path_codec_is_refused_naming_the_codec() -> None:
    """The path codec gives a dict back as the tuple of its values: the code after the split
    point cannot read its keys, and the error says so (not a capture problem)."""
    model = _ReadsByKey()
    plan = partition(model, ["block"])
    x = torch.randn(2, 4)
    stages = first_test.seed_stages(plan)
    with pytest.raises(UnsupportedValueError) as info:
        stages[1](stages[0](x))
    message = str(info.value)
    assert message.startswith("[Stage 1] the output of split point 'block' is a dict"), message
    assert "codec PathCodec() gives a dict back as a plain tuple of its values" in message
    assert "dict keys" in message and "example_inputs" not in message
    keeping = pipedialect.get_dialect("deepspeed").wrap_stages(plan)  # SchemaCodec
    torch.testing.assert_close(keeping[1](keeping[0](x)), model(x), rtol=0.0, atol=0.0)
