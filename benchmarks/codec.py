"""Round-trip cost of the boundary codecs, side by side, measured in one run.

Schemes, each sending payloads A and B of research/anchors.md section 4.4 through encode and
decode (the host-side cost per micro-batch and boundary):

* Slapo 0.0.3's own wire path: its ``flatten`` and ``encode_metadata``, the metadata string
  made into a uint8 tensor and read back as its stage wrapper does, then its
  ``decode_metadata`` and ``unflatten`` (Slapo's published code, see ``_slapo.py``);
* ``torch.utils._cxx_pytree`` ``tree_flatten`` and ``tree_unflatten`` (needs ``optree``);
* the path codec of ``pipedialect.dialects.deepspeed.pipeline`` on the same wire path;
* ``pipedialect.SchemaCodec`` ``encode`` and ``decode``. Its metadata tensor is built once per
  boundary by the wire layer, not per micro-batch, so it is not timed; it is counted.

"wire" is the number of tensors that cross the boundary per micro-batch (for the pytree, its
tensor leaves). Ratios are against Slapo and ``_cxx_pytree`` measured in this same run.
Run: ``.venv/bin/python benchmarks/codec.py [--number N] [--repeat R]``.
"""

from __future__ import annotations

import argparse
import platform
import sys
import timeit
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _slapo
import _smoke

from pipedialect import SchemaCodec
from pipedialect.dialects.deepspeed import pipeline as path_codec

Payload = tuple[Any, ...]
RoundTrip = Callable[[], Any]


def payloads() -> dict[str, Payload]:
    """Payload A (7 leaves, 3 tensors) and B (A plus 8 (k, v) pairs: 23 leaves, 19 tensors)."""
    hidden = torch.randn(2, 128, 256, requires_grad=True)
    mask = torch.ones(2, 1, 128, 128, dtype=torch.bool)
    pos = torch.arange(256).view(2, 128)
    a = (hidden, None, (mask, pos), 0.5, 3, True)
    kv = tuple((torch.randn(2, 4, 128, 32), torch.randn(2, 4, 128, 32)) for _ in range(8))
    return {"A": a, "B": (*a, kv)}


def _metadata_tensor(text: str, device: torch.device) -> torch.Tensor:
    """The metadata string as a uint8 tensor, made as Slapo's stage wrapper makes it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage is deprecated
        storage = torch.ByteStorage.from_buffer(bytes(text, "utf8"))  # type: ignore[no-untyped-call]
    return torch.tensor(storage, dtype=torch.uint8, device=device)


def seed_wire_path(module: Any, payload: Payload) -> tuple[RoundTrip, int]:
    """Sender flatten + metadata tensor, receiver metadata read + unflatten, via ``module``."""
    device = torch.device("cpu")

    def round_trip() -> Any:
        metadata, ret = module.flatten(payload, device)
        wire = (*ret, _metadata_tensor(module.encode_metadata(metadata), device))
        text = wire[-1].cpu().numpy().tobytes().decode()
        return module.unflatten(wire[:-1], module.decode_metadata(text))

    _, ret = module.flatten(payload, device)
    return round_trip, len(ret) + 1


def pytree_path(payload: Payload) -> tuple[RoundTrip, int]:
    """``tree_flatten`` + ``tree_unflatten`` of the C++ pytree."""
    from torch.utils import _cxx_pytree as pytree

    def round_trip() -> Any:
        leaves, spec = pytree.tree_flatten(payload)
        return pytree.tree_unflatten(leaves, spec)

    leaves = pytree.tree_leaves(payload)
    return round_trip, sum(isinstance(leaf, torch.Tensor) for leaf in leaves)


def schema_path(payload: Payload) -> tuple[RoundTrip, int]:
    """``SchemaCodec.encode`` on the sender, ``decode`` on a second (receiving) instance."""
    sender, receiver = SchemaCodec(), SchemaCodec()

    def round_trip() -> Any:
        tensors, metadata = sender.encode(payload)
        return receiver.decode(tensors, metadata)

    tensors, _ = sender.encode(payload)
    return round_trip, len(tensors) + 1


def check_exact(name: str, payload: Payload, result: Any) -> None:
    """Refuse to time a scheme whose round trip does not give the payload back."""
    if _signature(result) != _signature(payload):
        raise SystemExit(f"{name}: the round trip changed the payload:\n{result!r}")


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_signature(v) for v in value))
    return (type(value).__name__, repr(value))


def best_us(fn: RoundTrip, number: int, repeat: int) -> float:
    """Best time of one call, in microseconds, over ``repeat`` runs of ``number`` calls."""
    fn()
    fn()
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=3000, help="calls per timing run")
    parser.add_argument("--repeat", type=int, default=5, help="timing runs; the best is kept")
    args = _smoke.parse_args(parser, {"number": 5, "repeat": 1}, argv)
    torch.set_num_threads(1)

    slapo = _slapo.load_pipeline()
    data = payloads()
    schemes: dict[str, Callable[[Payload], tuple[RoundTrip, int]]] = {
        "Slapo 0.0.3 wire path": lambda p: seed_wire_path(slapo, p),
        "torch.utils._cxx_pytree": pytree_path,
        "path codec (seed API)": lambda p: seed_wire_path(path_codec, p),
        "SchemaCodec": schema_path,
    }
    results: dict[str, dict[str, tuple[float, int]]] = {}
    for name, make in schemes.items():
        results[name] = {}
        for label, payload in data.items():
            round_trip, wire = make(payload)
            if name in ("torch.utils._cxx_pytree", "SchemaCodec"):
                check_exact(name, payload, round_trip())
            results[name][label] = (best_us(round_trip, args.number, args.repeat), wire)

    print(
        f"codec round trip per micro-batch: torch {torch.__version__}, Python "
        f"{platform.python_version()}, 1 thread, best of {args.repeat} x {args.number}"
    )
    slapo_r, tree_r = results["Slapo 0.0.3 wire path"], results["torch.utils._cxx_pytree"]
    header = (
        f"{'scheme':<26}{'A us':>9}{'A wire':>8}{'B us':>9}{'B wire':>8}"
        f"{'Slapo/x A':>11}{'Slapo/x B':>11}{'x/pytree A':>12}{'x/pytree B':>12}"
    )
    print(header)
    print("-" * len(header))
    for name, row in results.items():
        cells = [f"{name:<26}"]
        for label in data:
            us, wire = row[label]
            cells.append(f"{us:>9.2f}{wire:>8d}")
        for label in data:
            cells.append(f"{slapo_r[label][0] / row[label][0]:>10.1f}x")
        for label in data:
            cells.append(f"{row[label][0] / tree_r[label][0]:>12.2f}")
        print("".join(cells))

    schema = results["SchemaCodec"]
    print()
    print("targets for SchemaCodec:")
    for label in data:
        speedup = slapo_r[label][0] / schema[label][0]
        ratio = schema[label][0] / tree_r[label][0]
        extra = schema[label][1] - tree_r[label][1]
        verdict = "met" if speedup >= 10 and ratio <= 1.0 and 0 <= extra <= 1 else "MISSED"
        print(
            f"  payload {label}: {speedup:.1f}x faster than Slapo (>= 10), {ratio:.2f} x pytree "
            f"(<= 1.00), wire {schema[label][1]} = {tree_r[label][1]} tensor leaves + {extra} "
            f"(<= 1): {verdict}"
        )


if __name__ == "__main__":
    main()
