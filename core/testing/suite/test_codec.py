"""Codec: ``decode(encode(value))`` gives the value back, through the dialect's own codec.

Property-based (Hypothesis): the values drawn depend on the capabilities the dialect declares.
Every dialect must carry tuples of float tensors of any shape and float dtype; with
``non-float-tensors`` also integer and bool tensors; with ``python-values`` also None, bools,
ints, floats (including -0.0, the infinities and NaN), strings and ``torch.Size`` inside nested
lists, tuples and dicts (keys and their order kept).
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from ...contracts import Capability
from ...dialect import Dialect
from ...errors import PipeDialectError

try:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "the pipedialect conformance suite needs hypothesis: pip install hypothesis"
    ) from exc

from .._harness._base import SuiteBase
from .._harness._compare import describe, first_difference

__all__ = ["TestCodec", "boundary_values"]

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_OTHERS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)

_SETTINGS = settings(
    max_examples=60,
    deadline=None,
    database=None,
    # Every phase but ``explain``: a failing value is still found and shrunk to a minimal one,
    # whose message names the path that differs. Explaining which parts of it could vary
    # re-runs the test hundreds of times more (two thirds of a failing run's time) and adds
    # nothing to that message.
    phases=tuple(phase for phase in Phase if phase is not Phase.explain),
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        # One test method runs once per dialect, on a fresh instance of its class each time.
        HealthCheck.differing_executors,
    ],
)


def _make_tensor(dtype: torch.dtype, shape: list[int], seed: int, transpose: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=gen).to(dtype)
    elif dtype == torch.bool:
        t = torch.randint(0, 2, shape, generator=gen).bool()
    elif dtype == torch.uint8:
        t = torch.randint(0, 256, shape, generator=gen).to(dtype)
    else:
        t = torch.randint(-100, 100, shape, generator=gen).to(dtype)
    return t.t() if transpose and t.dim() == 2 else t


def tensors(non_float: bool) -> st.SearchStrategy[torch.Tensor]:
    """Small tensors of the dtypes a boundary may carry (some non-contiguous)."""
    dtypes = _FLOATS + (_OTHERS if non_float else ())
    return st.builds(
        _make_tensor,
        st.sampled_from(dtypes),
        st.lists(st.integers(0, 3), max_size=3),
        st.integers(0, 2**16),
        st.booleans(),
    )


def _python_leaves() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=6),
        st.lists(st.integers(0, 5), max_size=3).map(torch.Size),
    )


_KEYS = st.one_of(
    st.text(max_size=5),
    st.integers(-5, 5),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=False, allow_infinity=False),
)


def boundary_values(capabilities: frozenset[Capability]) -> st.SearchStrategy[Any]:
    """What a boundary may carry for a dialect declaring ``capabilities``."""
    leaves = tensors(Capability.NON_FLOAT_TENSORS in capabilities)
    if Capability.PYTHON_VALUES not in capabilities:
        return st.one_of(leaves, st.lists(leaves, min_size=1, max_size=4).map(tuple))
    return st.recursive(
        st.one_of(leaves, _python_leaves()),
        lambda children: st.one_of(
            st.lists(children, max_size=3),
            st.lists(children, max_size=3).map(tuple),
            st.dictionaries(_KEYS, children, max_size=3),
        ),
        max_leaves=8,
    )


def _check_encoded(encoded: Any, head: str) -> tuple[tuple[torch.Tensor, ...], str]:
    if not (isinstance(encoded, tuple) and len(encoded) == 2):
        raise AssertionError(f"{head}: encode() must return (tensors, metadata), got {encoded!r}")
    wire, metadata = encoded
    if not isinstance(metadata, str):
        raise AssertionError(f"{head}: encode() returned metadata of type {type(metadata)}")
    if not all(isinstance(t, torch.Tensor) for t in wire):
        raise AssertionError(f"{head}: encode() put a non-tensor on the wire: {wire!r}")
    return tuple(wire), metadata


class TestCodec(SuiteBase):
    """The dialect's codec is lossless for everything the dialect declares it carries."""

    pytestmark: ClassVar[list[pytest.MarkDecorator]] = [pytest.mark.pipedialect_area("codec")]

    @_SETTINGS
    @given(data=st.data())
    def test_round_trip(self, dialect: Dialect, data: st.DataObject) -> None:
        """One codec instance encodes and decodes a sequence of values of changing structure."""
        codec = dialect.codec
        values = data.draw(st.lists(boundary_values(dialect.capabilities), min_size=1, max_size=4))
        for i, value in enumerate(values):
            head = f"codec of {dialect.name!r} (value {i + 1} through one instance)"
            wire, metadata = _check_encoded(codec.encode(value), head)
            again = codec.encode(value)[1]
            if again != metadata:
                raise AssertionError(
                    f"{head}: encoding the same value twice gave two metadata strings; a stage "
                    "freezes its boundary layout on the metadata, so it must be deterministic"
                )
            diff = first_difference(codec.decode(wire, metadata), value)
            if diff is not None:
                raise AssertionError(
                    f"{head}: decode(encode(value)) differs from the value {diff} (value: "
                    f"{describe(value)})"
                )

    @_SETTINGS
    @given(data=st.data())
    def test_fresh_instance_decodes(self, dialect: Dialect, data: st.DataObject) -> None:
        """A separate codec instance (the next stage's) decodes what one encoded."""
        value = data.draw(boundary_values(dialect.capabilities))
        head = f"codec of {dialect.name!r} (decoded by a fresh instance)"
        wire, metadata = _check_encoded(dialect.codec.encode(value), head)
        diff = first_difference(dialect.codec.decode(wire, metadata), value)
        if diff is not None:
            raise AssertionError(
                f"{head}: the metadata does not carry enough to rebuild the value, {diff}"
            )

    def test_refuses_what_it_cannot_carry(self, dialect: Dialect) -> None:
        """An arbitrary object is refused with a PipeDialectError, never silently dropped."""
        t = torch.ones(2)
        value: Any = (
            {"x": [t, object()]}
            if Capability.PYTHON_VALUES in dialect.capabilities
            else (
                t,
                object(),
            )
        )
        head = f"codec of {dialect.name!r}"
        try:
            encoded = dialect.codec.encode(value)
        except PipeDialectError:
            return
        except Exception as exc:
            pytest.fail(
                f"{head}: encoding an arbitrary object raised {type(exc).__name__} ({exc}); it "
                "must raise a pipedialect.CodecError naming the value's path",
                pytrace=False,
            )
        pytest.fail(
            f"{head}: encoded an arbitrary object without an error (got {encoded!r}); it must "
            "raise a pipedialect.CodecError naming the value's path",
            pytrace=False,
        )
