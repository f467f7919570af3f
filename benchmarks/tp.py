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
  engine in fresh processes (one launch each), same steps. Target: <= 1.05.

Timings on a shared, loaded machine are noisy (eight processes on few cores): repeat the run and
read the ratios, not the absolute numbers. ``--smoke`` runs a tiny model for one step (the
script must not rot; its numbers mean nothing).

    python benchmarks/tp.py [--steps 5] [--dim 256] [--blocks 4] [--seq 32] [--gas 4]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

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


def _batches(args: argparse.Namespace, replica: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1 + replica)
    out = []
    for _ in range(args.gas):
        ids = torch.randint(0, args.vocab, (args.micro, args.seq + 1), generator=gen)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


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


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _now_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _dialect_engine(args: argparse.Namespace, mode: str, tensor: int) -> tuple[Any, int]:
    import pipedialect

    dialect = pipedialect.get_dialect("torch")
    dp = PP * DP * TP // (PP * tensor)
    topology = dialect.make_topology(PP, data_parallel=dp, tensor_parallel=tensor)
    plan = pipedialect.partition(_model(args), [f"blocks.{args.blocks // 2 - 1}"])
    config = _config(args, dp)
    extra: dict[str, Any] = {"tensor_parallel": MHGPT_TENSOR_PLAN} if tensor > 1 else {}
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


class _Head(nn.Module):
    def __init__(self, model: MultiHeadGPT, cut: int) -> None:
        super().__init__()
        self.wte, self.wpe = model.wte, model.wpe
        self.blocks = nn.ModuleList(model.blocks[:cut])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids) + self.wpe[: ids.size(1)]
        for block in self.blocks:
            h = block(h)
        return h


class _Tail(nn.Module):
    def __init__(self, model: MultiHeadGPT, cut: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(model.blocks[cut:])
        self.ln_f = model.ln_f
        self.lm_head = nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=False)
        self.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = block(h)
        out: torch.Tensor = self.lm_head(self.ln_f(h))
        return out


class _HandWritten:
    """torchtitan's recipe by hand: (pp, dp, tp) mesh, parallelize_module then fully_shard,
    PipelineStage on pp, Schedule1F1B, the tie's gradient summed by hand."""

    def __init__(self, args: argparse.Namespace) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (PP, DP, TP), mesh_dim_names=("pp", "dp", "tp"))
        self.pp_rank = mesh["pp"].get_local_rank()
        self.replica = mesh["dp"].get_local_rank()
        self.pp_group = mesh["pp"].get_group()
        cut = args.blocks // 2
        model = _model(args)
        piece: nn.Module = _Head(model, cut) if self.pp_rank == 0 else _Tail(model, cut)
        plan: dict[str, Any] = {}
        for i in range(len(piece.blocks)):  # type: ignore[arg-type]
            for name in ("attn.q", "attn.k", "attn.v", "fc1"):
                plan[f"blocks.{i}.{name}"] = ColwiseParallel(output_layouts=Shard(-1))
            plan[f"blocks.{i}.attn.o"] = RowwiseParallel()
            plan[f"blocks.{i}.fc2"] = RowwiseParallel()
        if self.pp_rank == 0:
            plan["wte"] = RowwiseParallel(input_layouts=Replicate())
        else:
            plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
        parallelize_module(piece, mesh["tp"], plan)
        for block in piece.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
        fully_shard(piece, mesh=mesh["dp"], reshard_after_forward=False)
        for unit in piece.modules():
            if hasattr(unit, "set_gradient_divide_factor"):
                unit.set_gradient_divide_factor(1.0)
                unit.set_force_sum_reduction_for_comms(True)
        self.piece = piece
        self.tied = piece.wte.weight if self.pp_rank == 0 else piece.lm_head.weight
        hidden = torch.zeros(args.micro, args.seq, args.dim, requires_grad=True)
        ids = torch.zeros(args.micro, args.seq, dtype=torch.int64)
        logits = torch.zeros(args.micro, args.seq, args.vocab)
        inputs, outputs = ((ids,), (hidden,)) if self.pp_rank == 0 else ((hidden,), (logits,))
        stage = PipelineStage(
            piece,
            self.pp_rank,
            PP,
            torch.device("cpu"),
            input_args=inputs,
            output_args=outputs,
            group=self.pp_group,
        )
        scale = args.gas * DP

        def loss_fn(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return cross_entropy_loss(out, labels) / scale

        self.schedule = Schedule1F1B(
            stage, n_microbatches=args.gas, loss_fn=loss_fn, scale_grads=False
        )
        self.optimizer = torch.optim.Adam(piece.parameters(), lr=1e-3)
        self.scale = scale

    def train_batch(self, data: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        if self.pp_rank == 0:
            self.schedule.step(torch.cat([ids for ids, _ in data]))
        else:
            self.schedule.step(target=torch.cat([labels for _, labels in data]), losses=losses)
        grad: Any = self.tied.grad
        if grad is not None:
            dist.all_reduce(grad.to_local(), group=self.pp_group)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss = torch.stack(losses).detach().sum() * self.scale / len(losses) if losses else None
        mine = torch.zeros(()) if loss is None else loss.float()
        gathered = [torch.zeros(()) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        last = gathered[PP * DP * TP // 2 :: TP]  # tensor rank 0 of each replica's last stage
        return sum(last) / DP


def timing(args: argparse.Namespace) -> dict[str, Any]:
    """Both 3D engines (and TP1 / TP2 with DDP for the bytes) in one process group."""
    import pipedialect

    torch.set_num_threads(1)
    pipedialect.get_dialect("torch").init_distributed()
    ours, replica = _dialect_engine(args, "fsdp", TP)
    tp2, _ = _dialect_engine(args, "ddp", TP)
    tp1, _ = _dialect_engine(args, "ddp", 1)
    hand = _HandWritten(args)
    data = _batches(args, replica)
    steps: dict[str, Callable[[], Any]] = {
        "torch dialect (3D)": lambda: ours.train_batch(iter(data)),
        "hand-written (torchtitan style)": lambda: hand.train_batch(data),
    }
    times: dict[str, list[float]] = {name: [] for name in steps}
    losses: dict[str, list[float]] = {name: [] for name in steps}
    for step in range(args.warmup + args.steps):
        for name, run in steps.items():
            dist.barrier()
            start = time.perf_counter()
            loss = run()
            dist.barrier()
            losses[name].append(float(loss))
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)
    return {
        "rank": dist.get_rank(),
        "times": times,
        "losses": losses,
        "bytes": {"tp2": _sharded_bytes(tp2), "tp1": _sharded_bytes(tp1)},
    }


def memory(args: argparse.Namespace, which: str) -> dict[str, Any]:
    """One engine in fresh processes: peak resident set above the one before building it."""
    torch.set_num_threads(1)
    import pipedialect

    pipedialect.get_dialect("torch").init_distributed()
    dist.barrier()
    base = _now_rss()
    if which == "hand":
        hand = _HandWritten(args)
        replica = hand.replica
        run: Callable[[Any], Any] = hand.train_batch
    else:
        engine, replica = _dialect_engine(args, "fsdp", TP)

        def run(data: Any) -> Any:
            return engine.train_batch(iter(data))

    data = _batches(args, replica)
    for _ in range(args.warmup + args.steps):
        run(data)
    dist.barrier()
    return {"rank": dist.get_rank(), "peak": _rss() - base}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--gas", type=int, default=4)
    args = _smoke.parse_args(
        parser,
        {
            "dim": 16,
            "heads": 4,
            "blocks": 2,
            "seq": 8,
            "vocab": 32,
            "steps": 1,
            "warmup": 0,
            "gas": 2,
            "micro": 2,
        },
    )
    world = PP * DP * TP
    results = launch(timing, world, args, timeout=3600)
    mem_ours = launch(memory, world, args, "ours", timeout=3600)
    mem_hand = launch(memory, world, args, "hand", timeout=3600)
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
    print("\npeak resident set above the one before building the engine (fresh processes):\n")
    print("| rank | torch dialect (3D) | hand-written | ratio |")
    print("|---:|---:|---:|---:|")
    by_rank = {r["rank"]: r["peak"] for r in mem_hand}
    for r in sorted(mem_ours, key=lambda r: r["rank"]):
        theirs = max(by_rank[r["rank"]], 1)
        print(
            f"| {r['rank']} | {r['peak'] / 2**20:.1f} MiB | {theirs / 2**20:.1f} MiB | "
            f"{r['peak'] / theirs:.3f} |"
        )
    mine = [r["peak"] for r in mem_ours]
    theirs_all = [max(r["peak"], 1) for r in mem_hand]
    print(
        f"| largest | {max(mine) / 2**20:.1f} MiB | {max(theirs_all) / 2**20:.1f} MiB | "
        f"{max(mine) / max(theirs_all):.3f} |"
    )
    diff = max(
        abs(a - b) / abs(b)
        for a, b in zip(first["losses"][ours], first["losses"][hand], strict=True)
    )
    print(f"\nlargest relative loss difference, torch dialect vs hand-written: {diff:.2e}")


if __name__ == "__main__":
    main()
