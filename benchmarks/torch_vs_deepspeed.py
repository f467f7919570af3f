"""The torch dialect's step time against the DeepSpeed dialect and hand-written torch pipelining.

One run, two ranks (PP=2, gloo, CPU), one model, the same weights and micro-batches:

- ``torch dialect``: the unmodified model, ``pipedialect.partition`` + the torch dialect
  (``--schedule``, 1F1B by default; a looped or V-shaped schedule gets 4 stages, 2 per rank);
- ``deepspeed dialect``: the same plan trained by DeepSpeed's ``PipelineEngine``;
- ``hand-written torch``: ``torch.distributed.pipelining`` used directly, as its documentation
  shows: two ``nn.Module`` pieces cut from the model by hand, a ``PipelineStage`` with example
  tensors per rank, ``Schedule1F1B`` on the concatenated batch, the tied embedding's gradient
  all-reduced by hand before the optimizer step.

With ``--data-parallel 2`` the run is PP=2 x DP=2 on four ranks: the torch and the DeepSpeed
dialect each replicate the pipeline twice (``make_topology(stages, 2)``), each replica training
on its own micro-batches; the hand-written engine, a single pipeline, is left out.

All three engines live in the same processes and their steps alternate, so machine noise (the
two cores are shared) hits each alike. A step is timed from a barrier to a barrier, so it is the
slower rank's time. Printed: the median and the fastest step time of each, the ratios of the
torch dialect to the other two, and the largest difference between their losses (they train the
same model from the same weights on the same data, so it must be float noise).

    python benchmarks/torch_vs_deepspeed.py [--steps 20] [--dim 128] [--blocks 8] [--schedule 1f1b]
                                            [--data-parallel 1]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import _smoke
import torch
from _pipes import SMALL_GPT, Head, Tail, alternate, batches, gpt_parser
from torch import nn

from pipedialect.models import TinyGPT, cross_entropy_loss
from pipedialect.runtime.launch import launch


def _model(args: argparse.Namespace) -> TinyGPT:
    return TinyGPT(vocab=args.vocab, dim=args.dim, max_len=args.seq, num_blocks=args.blocks, seed=0)


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "train_batch_size": args.micro * args.gas * args.data_parallel,
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": args.gas,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": 1e-3, "torch_adam": True, "adam_w_mode": False},
        },
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }


# -- hand-written torch.distributed.pipelining -------------------------------------------------


class _HandWritten:
    """``PipelineStage`` + ``Schedule1F1B`` on hand-cut pieces, tied gradient synced by hand."""

    def __init__(self, args: argparse.Namespace, cut: int) -> None:
        import torch.distributed as dist
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        self.rank = dist.get_rank()
        model = _model(args)
        ids, _ = batches(args)[0]
        # Static metadata: the boundary activation carries a gradient, so say so.
        hidden = torch.zeros(args.micro, args.seq, args.dim, requires_grad=True)
        if self.rank == 0:
            self.piece: nn.Module = Head(model, cut)
            inputs, outputs = (ids,), (hidden,)
            self.tied = model.wte.weight
        else:
            self.piece = Tail(model, cut)
            inputs, outputs = (hidden,), (torch.zeros(args.micro, args.seq, args.vocab),)
            self.tied = model.lm_head.weight
        stage = PipelineStage(
            self.piece, self.rank, 2, torch.device("cpu"), input_args=inputs, output_args=outputs
        )
        self.schedule = Schedule1F1B(stage, n_microbatches=args.gas, loss_fn=cross_entropy_loss)
        self.optimizer = torch.optim.Adam(self.piece.parameters(), lr=1e-3)

    def train_batch(self, data: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        import torch.distributed as dist

        losses: list[torch.Tensor] = []
        if self.rank == 0:
            self.schedule.step(torch.cat([ids for ids, _ in data]))
        else:
            self.schedule.step(target=torch.cat([labels for _, labels in data]), losses=losses)
        if self.tied.grad is not None:
            dist.all_reduce(self.tied.grad)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss = torch.stack(losses).detach().mean() if losses else torch.zeros(())
        dist.broadcast(loss, src=1)
        return loss


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist

    import pipedialect
    from pipedialect.plan.partition import partition

    torch.set_num_threads(1)
    deepspeed_dialect = pipedialect.get_dialect("deepspeed")
    deepspeed_dialect.init_distributed()  # gloo; the other engines share the process group
    config = _config(args)
    cut = args.blocks // 2  # blocks 0..cut-1 on stage 0
    split = [f"blocks.{cut - 1}"]

    from pipedialect.dialects.torch import TorchDialect

    torch_dialect = TorchDialect(schedule=args.schedule)
    # Looped and V-shaped schedules run 2 stages per rank: cut the blocks into 4 pieces.
    per_rank = 4 // torch_dialect.make_topology(4).get_dim("pipe")
    pieces = 2 * per_rank
    torch_split = [f"blocks.{args.blocks * (i + 1) // pieces - 1}" for i in range(pieces - 1)]
    torch_plan = partition(_model(args), torch_split)
    dp = args.data_parallel
    torch_topology = torch_dialect.make_topology(pieces, dp)
    torch_module = torch_dialect.pipe_engine(
        torch_plan,
        config=config,
        loss_fn=cross_entropy_loss,
        schedule=args.schedule,
        topology=torch_topology,
    )
    torch_engine = torch_dialect.runtime_engine(torch_module, config=config)

    ds_plan = partition(_model(args), split)
    ds_module = deepspeed_dialect.pipe_engine(
        ds_plan,
        config=config,
        loss_fn=cross_entropy_loss,
        topology=deepspeed_dialect.make_topology(2, dp),
    )
    ds_engine = deepspeed_dialect.runtime_engine(ds_module, config=config)

    data = batches(args, int(torch_topology.get_coord(dist.get_rank()).data))
    steps: dict[str, Callable[[], torch.Tensor]] = {
        "torch dialect": lambda: torch_engine.train_batch(iter(data)),
        "deepspeed dialect": lambda: ds_engine.train_batch(iter(data)),
    }
    if dp == 1:
        hand = _HandWritten(args, cut)
        steps["hand-written torch"] = lambda: hand.train_batch(data)
    times, losses = alternate(steps, args.warmup, args.steps)
    return {"rank": dist.get_rank(), "times": times, "losses": losses}


def main() -> None:
    parser = gpt_parser(
        __doc__, steps=20, warmup=3, dim=128, blocks=8, seq=64, vocab=512, micro=4, gas=8
    )
    parser.add_argument("--schedule", default="1f1b", help="the torch dialect's schedule")
    parser.add_argument("--data-parallel", type=int, default=1, help="pipeline replicas")
    args = _smoke.parse_args(parser, SMALL_GPT)
    ranks = 2 * args.data_parallel
    results = launch(worker, ranks, args, timeout=1800)
    first = next(r for r in results if r["rank"] == 0)
    med = {name: statistics.median(values) * 1e3 for name, values in first["times"].items()}
    best = {name: min(values) * 1e3 for name, values in first["times"].items()}
    names = list(med)
    diff = max(
        abs(a - b) / abs(b)
        for name in names[1:]
        for a, b in zip(first["losses"]["torch dialect"], first["losses"][name], strict=True)
    )
    print(
        f"PP=2 x DP={args.data_parallel}, gloo, CPU ({ranks} ranks): TinyGPT dim={args.dim} "
        f"blocks={args.blocks} seq={args.seq} vocab={args.vocab}, micro-batch {args.micro} x "
        f"{args.gas} per replica, Adam; torch dialect schedule {args.schedule!r}; {args.steps} "
        f"steps after {args.warmup} warm-up, alternating"
    )
    print()
    print(
        f"| {'engine':<18} | {'median step':>11} | {'fastest step':>12} | "
        f"{'torch dialect / this (median)':>29} | {'(fastest)':>9} |"
    )
    print(f"|{'-' * 20}|{'-' * 13}|{'-' * 14}|{'-' * 31}|{'-' * 11}|")
    for name in names:
        ratio = med["torch dialect"] / med[name]
        ratio_best = best["torch dialect"] / best[name]
        print(
            f"| {name:<18} | {med[name]:>8.1f} ms | {best[name]:>9.1f} ms | {ratio:>29.3f} | "
            f"{ratio_best:>9.3f} |"
        )
    print()
    print(f"largest relative loss difference to the torch dialect: {diff:.2e}")


if __name__ == "__main__":
    main()
