"""PP x FSDP on the torch dialect: state per rank against whole stages, and cost against a
hand-written torchtitan-style pipeline.

Four ranks (PP=2 x data 2, gloo, CPU), TinyGPT (embedding tied to the LM head), the same
weights and micro-batches everywhere, Adam. Three measurements in one run:

- ``state``: per-rank bytes of parameters + gradients + optimizer state, counted from what each
  rank holds (a sharded tensor's local part; gradients as they are just before the optimizer
  steps, Adam's moments after), PP=2 x FSDP=2 against PP=2 x DDP=2 of the torch dialect, trained
  in the same processes. Target: FSDP / DDP <= 0.55 on every rank (0.5 is ideal).
- ``time``: median step time of the torch dialect with ``data_parallel_mode="fsdp"`` against a
  hand-written pipeline in torchtitan's style: each rank cuts its piece of the model by hand,
  ``fully_shard``s each block and the piece (``reshard_after_forward=False``, as torchtitan
  does under pipelining) over the data dimension of a ``(pp, dp)`` device mesh, wraps it in a
  ``PipelineStage`` on the pipeline dimension and runs ``Schedule1F1B`` on the concatenated
  batch, with the loss divided by ``gas x replicas`` and FSDP summing (its divide factor 1), the
  tied embedding's sharded gradient summed over the pipeline by hand. Both engines live in the
  same processes and their steps alternate, each timed from a barrier to a barrier. Target:
  torch dialect / hand-written <= 1.05.
- ``memory``: peak resident set of each rank above its resident set before the engine is built,
  each engine in fresh processes (one launch each), same steps, both built the way a model
  bigger than one rank is: on the meta device, sharded, then each rank's shards filled from
  the same state dict file (``torch.load(..., mmap=True)``): the torch dialect with
  ``init_weights=from_state_dict(...)``, the hand-written pipeline with ``to_empty`` and a
  copy of each shard's slice (torchtitan's order: split, ``fully_shard``, ``to_empty``, init).
  Target: <= 1.05.

Printed: a table per measurement, and the largest relative difference between the two engines'
losses (the same model and data: float noise).

    python benchmarks/fsdp.py [--steps 5] [--dim 384] [--blocks 8] [--seq 32] [--gas 4]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _smoke
import torch
import torch.distributed as dist
from torch import nn

from pipedialect.models import TinyGPT, cross_entropy_loss
from pipedialect.runtime.launch import launch

PP, DP = 2, 2


def _model(args: argparse.Namespace) -> TinyGPT:
    return TinyGPT(vocab=args.vocab, dim=args.dim, max_len=args.seq, num_blocks=args.blocks, seed=0)


def _batches(args: argparse.Namespace, replica: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1 + replica)
    out = []
    for _ in range(args.gas):
        ids = torch.randint(0, args.vocab, (args.micro, args.seq + 1), generator=gen)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "train_batch_size": args.micro * args.gas * DP,
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": args.gas,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": 1e-3, "torch_adam": True, "adam_w_mode": False},
        },
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _now_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


# -- the torch dialect ---------------------------------------------------------------------------


def _dialect_engine(
    args: argparse.Namespace, mode: str, state: dict[str, torch.Tensor] | None = None
) -> tuple[Any, int]:
    """The torch dialect's engine; with ``state``, built on meta and filled from it."""
    import pipedialect
    from pipedialect.plan.weights import from_state_dict

    dialect = pipedialect.get_dialect("torch")
    dialect.init_distributed()
    split = [f"blocks.{args.blocks // 2 - 1}"]
    extra: dict[str, Any] = {}
    if state is None:
        plan = pipedialect.partition(_model(args), split)
    else:
        with torch.device("meta"):
            plan = pipedialect.partition(_model(args), split)
        extra["init_weights"] = from_state_dict(state, plan=plan)
    topology = dialect.make_topology(2, DP)
    module = dialect.pipe_engine(
        plan,
        config=_config(args),
        loss_fn=cross_entropy_loss,
        topology=topology,
        data_parallel_mode=mode,
        **extra,
    )
    engine = dialect.runtime_engine(module, config=_config(args))
    return engine, int(topology.get_coord(dist.get_rank()).data)


def _state_bytes(engine: Any) -> dict[str, int]:
    """What the rank holds: parameter, gradient (at the optimizer step) and optimizer bytes."""
    from pipedialect.runtime.sharded import local_part

    def size(t: torch.Tensor) -> int:
        local = local_part(t)
        return local.numel() * local.element_size()

    held: dict[str, int] = {"params": sum(size(p) for p in engine.module.parameters())}
    optimizer = engine.optimizer
    step = optimizer.step

    def counting_step(*a: Any, **k: Any) -> Any:
        held["grads"] = sum(
            size(p.grad) for g in optimizer.param_groups for p in g["params"] if p.grad is not None
        )
        return step(*a, **k)

    optimizer.step = counting_step
    return held


# -- the hand-written torchtitan-style pipeline ---------------------------------------------------


class _Head(nn.Module):
    def __init__(self, model: TinyGPT, cut: int) -> None:
        super().__init__()
        self.wte, self.wpe = model.wte, model.wpe
        self.blocks = nn.ModuleList(model.blocks[:cut])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids) + self.wpe[: ids.size(1)]
        for block in self.blocks:
            h = block(h)
        return h


class _Tail(nn.Module):
    def __init__(self, model: TinyGPT, cut: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(model.blocks[cut:])
        self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = block(h)
        out: torch.Tensor = self.lm_head(self.ln_f(h))
        return out


class _HandWritten:
    """torchtitan's recipe by hand: a (pp, dp) mesh, fully_shard per block and on the piece,
    PipelineStage on the pp dimension, Schedule1F1B, the tie's gradient summed by hand.

    With ``state`` (a state dict), the model is built on the meta device and each shard is
    filled from it after ``to_empty``."""

    def __init__(self, args: argparse.Namespace, state: dict[str, torch.Tensor] | None = None):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B
        from torch.distributed.tensor import distribute_tensor

        mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
        self.pp_rank = mesh["pp"].get_local_rank()
        self.replica = mesh["dp"].get_local_rank()
        self.pp_group = mesh["pp"].get_group()
        cut = args.blocks // 2
        if state is None:
            model = _model(args)
        else:
            with torch.device("meta"):
                model = _model(args)
        piece: nn.Module = _Head(model, cut) if self.pp_rank == 0 else _Tail(model, cut)
        for block in piece.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
        fully_shard(piece, mesh=mesh["dp"], reshard_after_forward=False)
        if state is not None:
            piece.to_empty(device="cpu")
            offset = 0 if self.pp_rank == 0 else cut  # the tail's blocks.0 is the model's cut
            with torch.no_grad():
                for name, param in piece.named_parameters():
                    parts = name.split(".")
                    if parts[0] == "blocks":
                        parts[1] = str(int(parts[1]) + offset)
                    full = state[".".join(parts) if name != "lm_head.weight" else "wte.weight"]
                    local = distribute_tensor(
                        full, param.device_mesh, param.placements, src_data_rank=None
                    )
                    param.to_local().copy_(local.to_local())
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
        grad = self.tied.grad
        if grad is not None:
            dist.all_reduce(grad.to_local(), group=self.pp_group)  # type: ignore[attr-defined]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss = torch.stack(losses).detach().sum() * self.scale / len(losses) if losses else None
        mine = torch.zeros(()) if loss is None else loss.float()
        gathered = [torch.zeros(()) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        return sum(gathered[PP * DP - DP :]) / DP  # the last stage's ranks, averaged


# -- the runs ------------------------------------------------------------------------------------


def timing(args: argparse.Namespace) -> dict[str, Any]:
    """Both engines (and the DDP mode for the state count) in one process group, alternating."""
    torch.set_num_threads(1)
    fsdp, replica = _dialect_engine(args, "fsdp")
    ddp, _ = _dialect_engine(args, "ddp")
    hand = _HandWritten(args)
    data = _batches(args, replica)
    counts = {"fsdp": _state_bytes(fsdp), "ddp": _state_bytes(ddp)}
    steps: dict[str, Callable[[], Any]] = {
        "torch dialect (fsdp)": lambda: fsdp.train_batch(iter(data)),
        "hand-written (torchtitan style)": lambda: hand.train_batch(data),
        "torch dialect (ddp)": lambda: ddp.train_batch(iter(data)),
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
    state = {}
    for name, engine in (("fsdp", fsdp), ("ddp", ddp)):
        from pipedialect.runtime.sharded import local_part

        held = counts[name]
        optim = sum(
            local_part(v).numel() * local_part(v).element_size()
            for s in engine.optimizer.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        )
        state[name] = {"params": held["params"], "grads": held.get("grads", 0), "optim": optim}
    return {"rank": dist.get_rank(), "times": times, "losses": losses, "state": state}


def memory(args: argparse.Namespace, which: str, state_file: str) -> dict[str, Any]:
    """One engine in fresh processes: peak resident set above the one before building it."""
    torch.set_num_threads(1)
    if which == "hand":
        dist.init_process_group("gloo")
    else:
        import pipedialect

        pipedialect.get_dialect("torch").init_distributed()
    dist.barrier()
    base = _now_rss()
    state = torch.load(state_file, mmap=True, weights_only=True)
    if which == "hand":
        hand = _HandWritten(args, state)
        replica = hand.replica
        run: Callable[[Any], Any] = hand.train_batch
    else:
        engine, replica = _dialect_engine(args, "fsdp", state)

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
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--gas", type=int, default=4)
    args = _smoke.parse_args(
        parser,
        {
            "steps": 1,
            "warmup": 1,
            "dim": 16,
            "blocks": 2,
            "seq": 8,
            "vocab": 32,
            "micro": 2,
            "gas": 2,
        },
    )
    results = launch(timing, PP * DP, args, timeout=3600)
    with tempfile.TemporaryDirectory() as tmp:
        state_file = str(Path(tmp) / "model.pt")
        torch.save(_model(args).state_dict(), state_file)
        mem_ours = launch(memory, PP * DP, args, "ours", state_file, timeout=3600)
        mem_hand = launch(memory, PP * DP, args, "hand", state_file, timeout=3600)
    print(
        f"PP={PP} x data {DP}, gloo, CPU ({PP * DP} ranks): TinyGPT dim={args.dim} "
        f"blocks={args.blocks} seq={args.seq} vocab={args.vocab}, micro-batch {args.micro} x "
        f"{args.gas} per replica, Adam, 1F1B; {args.steps} steps after {args.warmup} warm-up"
    )
    print("\nstate per rank (parameters + gradients + Adam state, bytes held):\n")
    print("| rank | stage | FSDP | DDP | FSDP / DDP |")
    print("|---:|---:|---:|---:|---:|")
    for r in results:
        f, d = (sum(r["state"][m].values()) for m in ("fsdp", "ddp"))
        print(f"| {r['rank']} | {r['rank'] // DP} | {f:,} | {d:,} | {f / d:.3f} |")
    first = next(r for r in results if r["rank"] == 0)
    med = {name: statistics.median(v) * 1e3 for name, v in first["times"].items()}
    ours, hand = "torch dialect (fsdp)", "hand-written (torchtitan style)"
    print("\nstep time (median over the steps, the slowest rank's, alternating):\n")
    print("| engine | median step | torch dialect (fsdp) / this |")
    print("|---|---:|---:|")
    for name, value in med.items():
        print(f"| {name} | {value:.1f} ms | {med[ours] / value:.3f} |")
    print(
        "\npeak resident set above the one before building the engine (fresh processes, "
        "meta build, shards filled from one state dict file):\n"
    )
    print("| rank | torch dialect (fsdp) | hand-written | ratio |")
    print("|---:|---:|---:|---:|")
    by_rank = {r["rank"]: r["peak"] for r in mem_hand}
    for r in sorted(mem_ours, key=lambda r: r["rank"]):
        theirs = by_rank[r["rank"]]
        print(
            f"| {r['rank']} | {r['peak'] / 2**20:.1f} MiB | {theirs / 2**20:.1f} MiB | "
            f"{r['peak'] / theirs:.3f} |"
        )
    # A rank's resident set varies by a few percent between replicas doing the same work
    # (the allocator's arenas): the largest rank's peak is what has to fit.
    mine = [r["peak"] for r in mem_ours]
    theirs_all = [r["peak"] for r in mem_hand]
    print(
        f"| largest | {max(mine) / 2**20:.1f} MiB | {max(theirs_all) / 2**20:.1f} MiB | "
        f"{max(mine) / max(theirs_all):.3f} |"
    )
    print(
        f"| mean | {statistics.mean(mine) / 2**20:.1f} MiB | "
        f"{statistics.mean(theirs_all) / 2**20:.1f} MiB | "
        f"{statistics.mean(mine) / statistics.mean(theirs_all):.3f} |"
    )
    diff = max(
        abs(a - b) / abs(b)
        for a, b in zip(first["losses"][ours], first["losses"][hand], strict=True)
    )
    print(f"\nlargest relative loss difference, torch dialect vs hand-written: {diff:.2e}")


if __name__ == "__main__":
    main()
