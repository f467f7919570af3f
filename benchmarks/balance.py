"""Automatic stage balancing against DeepSpeed's parameter rule and an equal-count split.

One run, one model whose layers are unequal: a large input embedding (many parameters, no
FLOPs), transformer blocks whose MLPs have different widths, and a small output head.

- **FLOPs** (``--stages`` p): max/mean of the stages' forward + backward FLOPs for
  ``balance="flops"`` over every candidate module (``candidates=profile.candidates``, boundary
  bytes not priced: ``bandwidth=None``), ``balance="flops"`` restricted to the layer
  sequence a hand-written ``PipelineModule`` would use (embedding, each block, norm, head),
  DeepSpeed's ``partition_method="parameters"`` on that sequence (its ``partition_balanced``
  rule over trainable parameter counts, rewritten in ``pipedialect.cost._solver``), and an
  equal count of layers per stage. The FLOPs are counted on the partitioned stages themselves
  with ``torch.utils.flop_counter.FlopCounterMode`` (real tensors, forward and backward), not
  taken from the balancer's own prediction.
- **Time** (p stages, m micro-batches): ``balance="time"`` against the equal-count split. On the
  local dialect every stage of each plan is timed alone (forward + backward of one micro-batch
  on the tensors it receives, the loss included on the last stage; the median of ``--repeats``,
  the two plans alternating), and a step of m micro-batches through a p-stage pipeline takes
  ``sum(t) + (m - 1) * max(t)``. The local dialect's own ``train_batch`` runs the stages one after
  the other, so its time is printed as a check that both plans do the same work. With
  ``--ranks``, the step is also measured for real: the torch dialect, 1F1B, p ranks over gloo,
  both plans in the same processes, their steps alternating and timed barrier to barrier.

    python benchmarks/balance.py [--stages 4] [--micro-batches 8] [--ranks]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

import _smoke
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from pipedialect import PipelinePlan, partition
from pipedialect.cost._solver import spread_partition, uniform_partition
from pipedialect.cost.balance import profile_model
from pipedialect.models import CausalSelfAttention, cross_entropy_loss, seeded_init
from pipedialect.runtime.launch import launch


class Embed(nn.Module):
    """Token and position embeddings."""

    def __init__(self, vocab: int, dim: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.tok(ids) + self.pos[: ids.size(1)]
        return out


class Block(nn.Module):
    """A pre-norm transformer block with an MLP of its own width."""

    def __init__(self, dim: int, width: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim)
        self.ln2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, width)
        self.down = nn.Linear(width, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.down(F.gelu(self.up(self.ln2(x))))
        return out


class UnequalLM(nn.Module):
    """Large embedding, blocks of different widths, small head."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.embed = Embed(args.vocab, args.dim, args.seq)
        self.blocks = nn.ModuleList(Block(args.dim, w) for w in args.widths)
        self.ln_f = nn.LayerNorm(args.dim)
        self.head = nn.Linear(args.dim, args.classes, bias=False)
        seeded_init(self, 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        out: torch.Tensor = self.head(self.ln_f(h))
        return out

    def layers(self) -> list[str]:
        """The layer sequence of a hand-written pipeline."""
        return ["embed", *(f"blocks.{i}" for i in range(len(self.blocks))), "ln_f", "head"]


def _batches(args: argparse.Namespace, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, args.vocab, (args.micro, args.seq), generator=gen),
            torch.randint(0, args.classes, (args.micro, args.seq), generator=gen),
        )
        for _ in range(count)
    ]


TIME = 'balance="time"'
EQUAL = "equal count"


def _from_parts(layers: Sequence[str], parts: Sequence[int]) -> list[str]:
    """Split points for DeepSpeed-style part boundaries over ``layers``."""
    return [layers[end - 1] for end in parts[1:-1]]


# -- per-stage measurements on real tensors ----------------------------------------------------


def _stage_inputs(plan: PipelinePlan, ids: torch.Tensor) -> list[tuple[Any, ...]]:
    """What every stage receives for one micro-batch; float tensors as gradient leaves."""
    captured: dict[int, tuple[Any, ...]] = {}
    hooks = [
        stage.register_forward_pre_hook(lambda _m, a, k=k: captured.__setitem__(k, a))
        for k, stage in enumerate(plan.stages)
    ]
    with torch.no_grad():
        plan.graph(ids)
    for hook in hooks:
        hook.remove()

    def leaf(v: Any, k: int) -> Any:
        if isinstance(v, torch.Tensor) and v.is_floating_point() and k > 0:
            return v.detach().requires_grad_(True)
        return v

    return [pytree.tree_map(lambda v, k=k: leaf(v, k), captured[k]) for k in range(len(captured))]


def _run_stage(plan: PipelinePlan, k: int, inputs: tuple[Any, ...], labels: torch.Tensor) -> None:
    out = plan.stages[k](*inputs)
    if k == plan.num_stages - 1:
        cross_entropy_loss(out, labels).backward()
    else:
        outs = [
            t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
    for p in plan.stages[k].parameters():
        p.grad = None


def _stage_flops(plan: PipelinePlan, ids: torch.Tensor, labels: torch.Tensor) -> list[int]:
    flops = []
    for k, inputs in enumerate(_stage_inputs(plan, ids)):
        with FlopCounterMode(display=False) as counter:
            _run_stage(plan, k, inputs, labels)
        flops.append(counter.get_total_flops())
    return flops


def _stage_times(
    plans: dict[str, PipelinePlan], ids: torch.Tensor, labels: torch.Tensor, repeats: int
) -> dict[str, list[list[float]]]:
    """``repeats`` timings of every stage of every plan, the plans alternating."""
    inputs = {name: _stage_inputs(plan, ids) for name, plan in plans.items()}
    samples: dict[str, list[list[float]]] = {
        name: [[] for _ in plan.stages] for name, plan in plans.items()
    }
    for rep in range(repeats + 1):
        for name, plan in plans.items():
            for k in range(plan.num_stages):
                start = time.perf_counter()
                _run_stage(plan, k, inputs[name][k], labels)
                if rep:  # the first round warms up
                    samples[name][k].append(time.perf_counter() - start)
    return samples


def _pipelined(times: Sequence[float], m: int) -> float:
    """A step of ``m`` micro-batches through stages taking ``times`` each."""
    return sum(times) + (m - 1) * max(times)


def _ratio(values: Sequence[float]) -> float:
    return max(values) / (sum(values) / len(values))


def _local_step(plan: PipelinePlan, args: argparse.Namespace, steps: int) -> float:
    import pipedialect

    config = _config(args)
    dialect = pipedialect.get_dialect("local")
    engine = dialect.runtime_engine(
        dialect.pipe_engine(plan, config=config, loss_fn=cross_entropy_loss), config=config
    )
    data = _batches(args, args.micro_batches)
    times = []
    for step in range(steps + 1):
        start = time.perf_counter()
        engine.train_batch(iter(data))
        if step:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "train_batch_size": args.micro * args.micro_batches,
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": args.micro_batches,
        "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }


# -- a real pipeline: the torch dialect on p ranks ---------------------------------------------


def worker(args: argparse.Namespace, plans: dict[str, list[str]]) -> dict[str, Any]:
    """Build both plans' torch-dialect engines and time their steps, alternating."""
    import torch.distributed as dist

    from pipedialect.dialects.torch import TorchDialect

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    dialect = TorchDialect(schedule="1f1b")
    config = _config(args)
    engines = {}
    for name, points in plans.items():
        plan = partition(UnequalLM(args), points)
        module = dialect.pipe_engine(plan, config=config, loss_fn=cross_entropy_loss)
        engines[name] = dialect.runtime_engine(module, config=config)
    data = _batches(args, args.micro_batches)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for step in range(args.warmup + args.steps):
        for name, engine in engines.items():
            dist.barrier()
            start = time.perf_counter()
            engine.train_batch(iter(data))
            dist.barrier()
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)
    rank = dist.get_rank()
    dist.destroy_process_group()
    return {"rank": rank, "times": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=8, help="m per step")
    parser.add_argument("--micro", type=int, default=4, help="micro-batch size")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--classes", type=int, default=256)
    parser.add_argument(
        "--widths", type=int, nargs="+", default=[128, 256, 512, 1024, 1024, 512, 256, 128]
    )
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per stage")
    parser.add_argument("--ranks", action="store_true", help="also run p ranks over gloo")
    parser.add_argument("--steps", type=int, default=10, help="real pipeline steps")
    parser.add_argument("--warmup", type=int, default=2)
    args = _smoke.parse_args(
        parser,
        {
            "stages": 2,
            "micro_batches": 2,
            "micro": 2,
            "dim": 16,
            "seq": 8,
            "vocab": 64,
            "classes": 8,
            "widths": [16, 32, 16],
            "repeats": 1,
            "ranks": False,
            "steps": 1,
            "warmup": 1,
        },
    )
    torch.set_num_threads(1)
    p, m = args.stages, args.micro_batches

    model = UnequalLM(args)
    layers = model.layers()
    cuts = layers[:-1]  # the head is forward's last computation: no cut after it
    ids, labels = _batches(args, 1)[0]
    profile = profile_model(
        model, example_inputs={"ids": ids}, measure_time=True, repeats=args.repeats
    )
    counts = [sum(q.numel() for q in model.get_submodule(n).parameters()) for n in layers]
    # FLOPs and time alone: every candidate module, boundaries free (bandwidth=None).
    every = {"candidates": profile.candidates, "bandwidth": None}
    points = {
        'balance="flops"': profile.choose(p, "flops", **every),
        'balance="flops", layers': profile.choose(p, "flops", candidates=cuts, bandwidth=None),
        "DeepSpeed parameters": _from_parts(layers, spread_partition(counts, p)),
        EQUAL: _from_parts(layers, uniform_partition(len(layers), p)),
        TIME: profile.choose(p, "time", micro_batches=m, **every),
    }
    plans = {name: partition(model, pts) for name, pts in points.items()}

    print(
        f"UnequalLM: vocabulary {args.vocab} x dim {args.dim}, {len(args.widths)} blocks of MLP "
        f"widths {args.widths}, head {args.classes}; micro-batch {args.micro} x seq {args.seq}; "
        f"{len(profile.candidates)} candidate split points; p={p} stages, m={m}"
    )
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s)")
    print()
    print("FLOPs per stage (forward + backward, counted on the stages by FlopCounterMode)")
    print()
    print(
        f"| {'split':<26} | {'split points':<58} | {'max/mean FLOPs':>14} "
        f"| {'max/mean params':>15} |"
    )
    print(f"|{'-' * 28}|{'-' * 60}|{'-' * 16}|{'-' * 17}|")
    for name in list(points)[:4]:
        flops = _stage_flops(plans[name], ids, labels)
        params = [sum(q.numel() for q in s.parameters()) for s in plans[name].stages]
        shown = ", ".join(points[name])
        print(f"| {name:<26} | {shown:<58} | {_ratio(flops):>14.3f} | {_ratio(params):>15.3f} |")
    print()

    timed = {name: plans[name] for name in (TIME, EQUAL)}
    samples = _stage_times(timed, ids, labels, args.repeats)
    print(
        f"Time per stage (forward + backward of one micro-batch; median and fastest of "
        f"{args.repeats}); pipelined step = sum + (m - 1) * max"
    )
    print()
    print(
        f"| {'split':<16} | {'median stage times (ms)':<34} | {'step (median)':>13} "
        f"| {'step (fastest)':>14} | {'local train_batch':>17} |"
    )
    print(f"|{'-' * 18}|{'-' * 36}|{'-' * 15}|{'-' * 16}|{'-' * 19}|")
    med: dict[str, float] = {}
    best: dict[str, float] = {}
    for name, plan in timed.items():
        medians = [statistics.median(s) for s in samples[name]]
        med[name] = _pipelined(medians, m)
        best[name] = _pipelined([min(s) for s in samples[name]], m)
        local = _local_step(plan, args, 3)
        shown = " / ".join(f"{x * 1e3:.2f}" for x in medians)
        print(
            f"| {name:<16} | {shown:<34} | {med[name] * 1e3:>10.1f} ms "
            f"| {best[name] * 1e3:>11.1f} ms | {local * 1e3:>14.1f} ms |"
        )
    print()
    print(
        f"pipelined step, {TIME} / {EQUAL}: {med[TIME] / med[EQUAL]:.3f} (median), "
        f"{best[TIME] / best[EQUAL]:.3f} (fastest)"
    )
    print(f"split points: {TIME} {points[TIME]}, {EQUAL} {points[EQUAL]}")

    if args.ranks:
        real = launch(worker, p, args, {name: points[name] for name in timed}, timeout=1800)[0][
            "times"
        ]
        real_med = {name: statistics.median(v) for name, v in real.items()}
        print()
        print(
            f"torch dialect, 1F1B, {p} ranks over gloo, {args.steps} steps after {args.warmup} "
            "warm-up, alternating"
        )
        for name, value in real_med.items():
            print(f"  {name:<16} median step {value * 1e3:8.1f} ms")
        print(f"  measured step, {TIME} / {EQUAL}: {real_med[TIME] / real_med[EQUAL]:.3f}")


if __name__ == "__main__":
    main()
