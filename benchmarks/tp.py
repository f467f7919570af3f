"""Tensor parallelism inside pipeline stages on the torch dialect: what a rank holds of the
sharded layers, and cost against a hand-written torchtitan-style 3D pipeline.

Eight ranks (PP=2 x FSDP=2 x TP=2, gloo, CPU), MultiHeadGPT with its tensor plan (heads and MLP
features sharded, the tied embedding and LM head by vocabulary), the same weights and
micro-batches everywhere, Adam. Three measurements:

- ``bytes``: per-rank bytes of the sharded layers' parameters (the modules the plan names),
  PP=2 x DDP=2 x TP=2 against PP=2 x DDP=4 (TP=1), both of the torch dialect, in the same
  processes. Target: TP2 / TP1 <= 0.55 on every rank (0.5 is ideal; a rowwise layer's bias stays
  whole).
- ``time``: median step time of the torch dialect's PP=2 x FSDP=2 x TP=2 against a hand-written
  pipeline in torchtitan's style: each rank cuts its piece of the model by hand, applies
  ``parallelize_module`` on the ``tp`` dimension of a ``(pp, dp, tp)`` device mesh, then
  ``fully_shard`` on the ``dp`` dimension (each block and the piece,
  ``reshard_after_forward=False``), wraps it in a ``PipelineStage`` on the ``pp`` dimension and
  runs ``Schedule1F1B``; the loss is divided by ``gas x replicas``, FSDP sums, the tied
  embedding's gradient is summed over the pipeline by hand. Both engines live in the same
  processes and their steps alternate, each timed from a barrier to a barrier. Target: torch
  dialect / hand-written <= 1.05.
- ``memory``: peak resident set of each rank above the one before the engine is built, each
  engine in fresh processes (one launch each), same steps, both built the way a model bigger
  than one rank is (as ``fsdp.py`` does): on the meta device, sharded, then each rank's shards
  filled from the same state dict file (``torch.load(..., mmap=True)``): the torch dialect with
  ``init_weights=from_state_dict(...)``, the hand-written pipeline in torchtitan's order
  (split, ``parallelize_module``, ``fully_shard``, ``to_empty``, each shard's slice copied).
  Target: <= 1.05.

Timings on a shared, loaded machine are noisy (eight processes on few cores): repeat the run and
read the ratios, not the absolute numbers. ``--smoke`` runs a tiny model for one step (the
script must not rot; its numbers mean nothing).

    python benchmarks/tp.py [--steps 5] [--dim 512] [--blocks 8] [--seq 32] [--gas 4]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _pipes
import _smoke
import torch
import torch.distributed as dist
from torch import nn

from pipedialect.models import MHGPT_TENSOR_PLAN, MultiHeadGPT, cross_entropy_loss
from pipedialect.runtime.launch import launch
from pipedialect.runtime.sharded import local_part

PP, DP, TP = 2, 2, 2
SHARDED = ("attn.q", "attn.k", "attn.v", "attn.o", "fc1", "fc2", "wte", "lm_head")


def _model(args: argparse.Namespace) -> MultiHeadGPT:
    return MultiHeadGPT(
        vocab=args.vocab,
        dim=args.dim,
        heads=args.heads,
        max_len=args.seq,
        num_blocks=args.blocks,
        seed=0,
    )


def _config(args: argparse.Namespace, dp: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": args.gas,
        "train_batch_size": args.micro * args.gas * dp,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": 1e-3, "torch_adam": True, "adam_w_mode": False},
        },
        "steps_per_print": 10**9,
    }


def _dialect_engine(
    args: argparse.Namespace,
    mode: str,
    tensor: int,
    state: dict[str, torch.Tensor] | None = None,
) -> tuple[Any, int]:
    """The torch dialect's engine; with ``state``, built on meta and filled from it."""
    import pipedialect

    dialect = pipedialect.get_dialect("torch")
    dp = PP * DP * TP // (PP * tensor)
    topology = dialect.make_topology(PP, data_parallel=dp, tensor_parallel=tensor)
    config = _config(args, dp)
    plan, extra = _pipes.middle_plan(lambda: _model(args), args.blocks, state)
    if tensor > 1:
        extra["tensor_parallel"] = MHGPT_TENSOR_PLAN
    module = dialect.pipe_engine(
        plan,
        config=config,
        loss_fn=cross_entropy_loss,
        topology=topology,
        data_parallel_mode=mode,
        **extra,
    )
    engine = dialect.runtime_engine(module, config=config)
    return engine, int(topology.get_coord(dist.get_rank()).data)


def _sharded_bytes(engine: Any) -> int:
    return sum(
        local_part(p).numel() * local_part(p).element_size()
        for n, p in engine.module.named_parameters()
        if any(s in n for s in SHARDED)
    )


def _hand_written(
    args: argparse.Namespace, state: dict[str, torch.Tensor] | None = None
) -> _pipes.HandPipeline:
    """torchtitan's recipe by hand on a (pp, dp, tp) mesh (:class:`_pipes.HandPipeline`):
    ``parallelize_module`` on ``tp`` (heads and MLP features, the embedding and the LM head,
    untied, by vocabulary), then ``fully_shard`` on ``dp``. With ``state``, built on the meta
    device and each shard filled from it after sharding."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (PP, DP, TP), mesh_dim_names=("pp", "dp", "tp"))

    def parallelize(piece: nn.Module, pp_rank: int) -> None:
        plan: dict[str, Any] = {}
        for i in range(len(piece.blocks)):  # type: ignore[arg-type]
            for name in ("attn.q", "attn.k", "attn.v", "fc1"):
                plan[f"blocks.{i}.{name}"] = ColwiseParallel(output_layouts=Shard(-1))
            plan[f"blocks.{i}.attn.o"] = RowwiseParallel()
            plan[f"blocks.{i}.fc2"] = RowwiseParallel()
        if pp_rank == 0:
            plan["wte"] = RowwiseParallel(input_layouts=Replicate())
        else:
            plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
        parallelize_module(piece, mesh["tp"], plan)

    if state is None:
        return _pipes.HandPipeline(
            args, _model(args), mesh, untie=True, before_sharding=parallelize
        )
    with torch.device("meta"):
        model = _model(args)
    return _pipes.HandPipeline(
        args,
        model,
        mesh,
        untie=True,
        before_sharding=parallelize,
        after_sharding=_pipes.fill_shards(state, args.blocks),
    )


def timing(args: argparse.Namespace) -> dict[str, Any]:
    """Both 3D engines (and TP1 / TP2 with DDP for the bytes) in one process group."""
    import pipedialect

    torch.set_num_threads(1)
    pipedialect.get_dialect("torch").init_distributed()
    ours, replica = _dialect_engine(args, "fsdp", TP)
    tp2, _ = _dialect_engine(args, "ddp", TP)
    tp1, _ = _dialect_engine(args, "ddp", 1)
    hand = _hand_written(args)
    data = _pipes.batches(args, replica)
    steps: dict[str, Callable[[], Any]] = {
        "torch dialect (3D)": lambda: ours.train_batch(iter(data)),
        "hand-written (torchtitan style)": lambda: hand.train_batch(data),
    }
    times, losses = _pipes.alternate(steps, args.warmup, args.steps)
    return {
        "rank": dist.get_rank(),
        "times": times,
        "losses": losses,
        "bytes": {"tp2": _sharded_bytes(tp2), "tp1": _sharded_bytes(tp1)},
    }


def memory(args: argparse.Namespace, which: str, state_file: str) -> dict[str, Any]:
    """One engine in fresh processes, built on meta and filled from ``state_file``: peak
    resident set above the one before building it."""
    torch.set_num_threads(1)
    import pipedialect

    pipedialect.get_dialect("torch").init_distributed()

    def load() -> dict[str, torch.Tensor]:
        return torch.load(state_file, mmap=True, weights_only=True)

    return _pipes.peak_above(
        args,
        which,
        lambda: _hand_written(args, load()),
        lambda: _dialect_engine(args, "fsdp", TP, load()),
    )


def main() -> None:
    parser = _pipes.gpt_parser(
        __doc__, steps=5, warmup=2, dim=512, blocks=8, seq=32, vocab=512, micro=4, gas=4
    )
    parser.add_argument("--heads", type=int, default=8)
    args = _smoke.parse_args(parser, {**_pipes.SMALL_GPT, "heads": 4, "warmup": 0})
    world = PP * DP * TP
    results = launch(timing, world, args, timeout=3600)
    with tempfile.TemporaryDirectory() as tmp:
        state_file = str(Path(tmp) / "model.pt")
        torch.save(_model(args).state_dict(), state_file)
        mem_ours = launch(memory, world, args, "ours", state_file, timeout=3600)
        mem_hand = launch(memory, world, args, "hand", state_file, timeout=3600)
    print(
        f"PP={PP} x FSDP={DP} x TP={TP}, gloo, CPU ({world} ranks): MultiHeadGPT dim={args.dim} "
        f"heads={args.heads} blocks={args.blocks} seq={args.seq} vocab={args.vocab}, "
        f"micro-batch {args.micro} x {args.gas} per replica, Adam, 1F1B; {args.steps} steps "
        f"after {args.warmup} warm-up (timings under load are noisy)"
    )
    print("\nsharded layers' parameters per rank (bytes held), DDP replicas:\n")
    print("| rank | TP=2 | TP=1 | TP2 / TP1 |")
    print("|---:|---:|---:|---:|")
    for r in results:
        two, one = r["bytes"]["tp2"], r["bytes"]["tp1"]
        print(f"| {r['rank']} | {two:,} | {one:,} | {two / one:.3f} |")
    first = next(r for r in results if r["rank"] == 0)
    med = {name: statistics.median(v) * 1e3 for name, v in first["times"].items()}
    ours, hand = "torch dialect (3D)", "hand-written (torchtitan style)"
    print("\nstep time (median over the steps, alternating):\n")
    print("| engine | median step | torch dialect / this |")
    print("|---|---:|---:|")
    for name, value in med.items():
        print(f"| {name} | {value:.1f} ms | {med[ours] / value:.3f} |")
    _pipes.print_peaks(
        "fresh processes, meta build, shards filled from one state dict file",
        "torch dialect (3D)",
        mem_ours,
        mem_hand,
    )
    diff = _pipes.loss_difference(first["losses"], ours, hand)
    print(f"\nlargest relative loss difference, torch dialect vs hand-written: {diff:.2e}")


if __name__ == "__main__":
    main()
