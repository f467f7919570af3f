"""Activation memory with and without ``partition(..., checkpoint="blocks.*")``.

One model whose activations dominate: a long sequence (``--seq`` tokens, batch ``--batch``)
through ``--depth`` pre-norm MLP blocks of width ``--dim`` (a few hundred thousand
parameters, hundreds of MiB of activations). Each variant runs in a fresh interpreter: it
partitions the model into ``--stages`` stages (with or without ``checkpoint="blocks.*"``),
runs forward and backward of one micro-batch through the stage graphs (``plan.graph``, the code
every dialect runs), and reports

- on a GPU, ``torch.cuda.max_memory_allocated`` above what the model and inputs hold;
- on a CPU, the peak resident set (``ru_maxrss``) above the resident set before forward;
- in both, the bytes autograd saves for backward outside checkpointed regions
  (``saved_tensors_hooks``, each storage once) and the inputs the checkpoints keep.

The losses of both variants must be equal (the same maths, recomputed), and the ratio is
printed. Target: checkpointing lowers the peak by at least 40%.

    python benchmarks/memory.py [--seq 2048] [--dim 128] [--depth 16] [--batch 4] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from typing import Any

import torch
from torch import nn

from pipedialect import partition


class Block(nn.Module):
    """A pre-norm MLP block: its hidden activation is four times the residual stream."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
        return out


class LongSequenceNet(nn.Module):
    """Input projection, ``depth`` blocks, output head."""

    def __init__(self, dim: int, depth: int) -> None:
        super().__init__()
        self.inp = nn.Linear(16, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        out: torch.Tensor = self.head(h)
        return out


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(args: argparse.Namespace, checkpoint: bool) -> dict[str, Any]:
    """One variant, in this process: partition, one forward + backward, memory and loss."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    model = LongSequenceNet(args.dim, args.depth).to(device)
    step = args.depth // args.stages
    points = [f"blocks.{step * (k + 1) - 1}" for k in range(args.stages - 1)]
    plan = partition(model, points, checkpoint="blocks.*" if checkpoint else None)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.seq, 16, generator=gen).to(device)
    target = torch.randn(args.batch, args.seq, 16, generator=gen).to(device)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _current_rss()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = torch.nn.functional.mse_loss(plan.graph(x), target)
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _rss_bytes() - base
    return {
        "checkpoint": checkpoint,
        "peak_bytes": peak,
        "saved_bytes": sum(saved.values()),
        "loss": float(loss.detach()),
        "grad_norm": float(
            torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters()))  # type: ignore[union-attr]
        ),
    }


def _fresh(args: argparse.Namespace, checkpoint: bool) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--one", "ckpt" if checkpoint else "plain"]
    for key in ("seq", "dim", "depth", "batch", "stages", "device"):
        cmd += [f"--{key}", str(getattr(args, key))]
    # A fixed mmap threshold: glibc then returns every freed tensor to the system at once, so
    # the resident set follows the live tensors instead of malloc's retained heap.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--one", choices=["plain", "ckpt"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args, args.one == "ckpt")))
        return
    plain, ckpt = _fresh(args, False), _fresh(args, True)
    mib = 1024 * 1024
    print(
        f"LongSequenceNet: batch {args.batch} x {args.seq} tokens, dim {args.dim}, depth "
        f"{args.depth}, {args.stages} stages, {args.device}; torch {torch.__version__}"
    )
    print(f"{'variant':<24}{'peak MiB':>12}{'saved MiB':>12}{'loss':>14}")
    for name, r in (("no checkpoint", plain), ('checkpoint="blocks.*"', ckpt)):
        print(
            f"{name:<24}{r['peak_bytes'] / mib:>12.1f}{r['saved_bytes'] / mib:>12.1f}"
            f"{r['loss']:>14.8f}"
        )
    peak_ratio = ckpt["peak_bytes"] / plain["peak_bytes"]
    saved_ratio = ckpt["saved_bytes"] / plain["saved_bytes"]
    print(f"peak ratio checkpoint / none: {peak_ratio:.3f} ({1 - peak_ratio:.1%} lower)")
    print(f"saved-for-backward ratio:     {saved_ratio:.3f}")
    same = plain["loss"] == ckpt["loss"] and plain["grad_norm"] == ckpt["grad_norm"]
    print(f"identical loss and gradient norm: {same}")
    if not same:
        sys.exit("checkpointing changed the result")


if __name__ == "__main__":
    main()
