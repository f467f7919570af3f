"""What pipedialect costs on DeepSpeed: the same model, hand-written versus partitioned.

One run, two ranks (PP=2, gloo, CPU), one config, the same weights and micro-batches:

- ``hand-written``: a ``deepspeed.pipe.PipelineModule`` of ``LayerSpec``s with the embedding and
  the LM head tied through ``TiedLayerSpec``, as DeepSpeed's users write it, trained by the
  DeepSpeed dialect's engine (``runtime_engine``): the peer of the headline ratio, which
  measures what the partitioned stages cost (wrappers, codec, wire);
- ``hand-written, DeepSpeed's engine``: the same module trained by ``deepspeed.initialize``'s
  own ``PipelineEngine``, the peer of the second ratio, which adds what the dialect's engine
  costs per step (micro-batches read and checked before the step, errors agreed on every rank,
  the global gradient norm);
- ``pipedialect``: the unmodified model, ``pipedialect.partition`` + the DeepSpeed dialect.

The engines live in the same processes and their steps alternate, so machine noise hits them
alike; the measurement is repeated ``--rounds`` times, and each round's ratio is printed with
the load average, so a loaded machine shows as spread. Printed: the median ``train_batch`` time
of each engine (each step counted at its slower rank), the ratios (target <= 1.02 for the
headline), the tensors and bytes each sends per micro-batch in the forward direction, and the
largest difference between their losses (they train the same model, so it must be 0).

    python benchmarks/deepspeed_overhead.py [--rounds 5] [--steps 20] [--dim 128] [--blocks 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import _smoke
import torch
import torch.nn.functional as F
from _pipes import SMALL_GPT, gpt_parser
from torch import nn

from pipedialect.models import GPTBlock, TinyGPT, cross_entropy_loss
from pipedialect.runtime.launch import launch


def _reference(args: argparse.Namespace) -> TinyGPT:
    return TinyGPT(vocab=args.vocab, dim=args.dim, max_len=args.seq, num_blocks=args.blocks, seed=0)


class Embed(nn.Module):
    """Token and position embedding (tied with the LM head on the last stage)."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        ref = _reference(args)
        self.wte = ref.wte
        self.wpe = ref.wpe

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.wte(ids) + self.wpe[: ids.size(1)]


def lm_head(embed: Embed, h: torch.Tensor) -> torch.Tensor:
    return F.linear(h, embed.wte.weight)


class Block(GPTBlock):
    def __init__(self, args: argparse.Namespace, index: int) -> None:
        super().__init__(args.dim)
        self.load_state_dict(_reference(args).blocks[index].state_dict())


class FinalNorm(nn.LayerNorm):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args.dim)
        self.load_state_dict(_reference(args).ln_f.state_dict())


def _hand_written(args: argparse.Namespace, topology: Any) -> Any:
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    layers = [
        TiedLayerSpec("embed", Embed, args, tied_weight_attr="wte.weight"),
        *(LayerSpec(Block, args, i) for i in range(args.blocks)),
        LayerSpec(FinalNorm, args),
        TiedLayerSpec("embed", Embed, args, forward_fn=lm_head, tied_weight_attr="wte.weight"),
    ]
    return PipelineModule(
        layers=layers, topology=topology, loss_fn=cross_entropy_loss, partition_method="uniform"
    )


def _batches(args: argparse.Namespace, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        ids = torch.randint(0, args.vocab, (args.micro, args.seq + 1), generator=gen)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


class _SendCounter:
    """Counts what DeepSpeed's point-to-point layer sends while active."""

    def __init__(self) -> None:
        import deepspeed.runtime.pipe.p2p as p2p

        self.p2p = p2p
        self.original = p2p.send
        self.tensors = 0
        self.bytes = 0

    def __enter__(self) -> _SendCounter:
        def counting_send(tensor: torch.Tensor, dest_stage: int, async_op: bool = False) -> Any:
            self.tensors += 1
            self.bytes += tensor.numel() * tensor.element_size()
            return self.original(tensor, dest_stage, async_op)

        self.p2p.send = counting_send
        return self

    def __exit__(self, *exc: object) -> None:
        self.p2p.send = self.original


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import deepspeed
    import torch.distributed as dist

    import pipedialect
    from pipedialect.plan.partition import partition

    torch.manual_seed(0)
    dialect = pipedialect.get_dialect("deepspeed")
    dialect.init_distributed()
    topology = dialect.make_topology(2, 1)
    config = {
        "train_batch_size": args.micro * args.gas,
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": args.gas,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }
    hand = dialect.runtime_engine(_hand_written(args, topology), config=config)
    plain_module = _hand_written(args, topology)
    plain, _, _, _ = deepspeed.initialize(
        model=plain_module, model_parameters=list(plain_module.parameters()), config=config
    )
    # Split the unmodified model where DeepSpeed's uniform partition split the layer list
    # (layer 0 is the embedding, layers 1..blocks the blocks).
    last_block_on_stage_0 = hand.module.parts[1] - 2
    plan = partition(_reference(args), [f"blocks.{last_block_on_stage_0}"])
    module = dialect.pipe_engine(plan, config=config, loss_fn=cross_entropy_loss, topology=topology)
    ours = dialect.runtime_engine(module, config=config)
    engines = {HAND: hand, PLAIN: plain, OURS: ours}
    times: dict[str, list[list[float]]] = {name: [] for name in engines}
    losses: dict[str, list[float]] = {name: [] for name in engines}
    sends: dict[str, tuple[int, int]] = {}
    data = _batches(args, args.gas)
    for _ in range(args.rounds):
        for name in engines:
            times[name].append([])
        for step in range(args.warmup + args.steps):
            for name, engine in engines.items():
                dist.barrier()
                start = time.perf_counter()
                loss = engine.train_batch(iter(data))
                elapsed = time.perf_counter() - start
                losses[name].append(float(loss))
                if step >= args.warmup:
                    times[name][-1].append(elapsed)
    for name, engine in engines.items():
        with _SendCounter() as counter:
            engine.train_batch(iter(data))
        if engine.stage_id == 0:
            # Forward sends only: the first stage receives gradients, it sends activations.
            sends[name] = (counter.tensors // args.gas, counter.bytes // args.gas)
    return {"stage": hand.stage_id, "times": times, "losses": losses, "sends": sends}


HAND = "hand-written"
PLAIN = "hand-written, DeepSpeed's engine"
OURS = "pipedialect"


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min), {five:.1f} (5 min) on {os.cpu_count()} CPUs"


def main() -> None:
    parser = gpt_parser(
        __doc__, steps=20, warmup=3, dim=128, blocks=8, seq=64, vocab=512, micro=4, gas=8
    )
    parser.add_argument("--rounds", type=int, default=5)
    args = _smoke.parse_args(parser, {**SMALL_GPT, "rounds": 1})
    load_before = _load()
    results = launch(worker, 2, args, timeout=3600)
    load_after = _load()
    first = next(r for r in results if r["stage"] == 0)
    names = list(first["times"])

    def median(name: str, rnd: int) -> float:
        # Each step's time is the slower rank's: the pipeline is as fast as its slowest stage.
        per_step = zip(*(r["times"][name][rnd] for r in results), strict=True)
        return statistics.median(max(step) for step in per_step)

    meds = {name: [median(name, rnd) for rnd in range(args.rounds)] for name in names}
    ratios = {
        peer: [o / p for o, p in zip(meds[OURS], meds[peer], strict=True)] for peer in (HAND, PLAIN)
    }
    diff = max(
        abs(a - b)
        for peer in (HAND, PLAIN)
        for a, b in zip(first["losses"][peer], first["losses"][OURS], strict=True)
    )
    print(
        f"DeepSpeed PP=2, gloo, CPU: TinyGPT dim={args.dim} blocks={args.blocks} "
        f"seq={args.seq} micro={args.micro} gas={args.gas}; {args.rounds} rounds of "
        f"{args.steps} steps after {args.warmup} warm-up, the engines alternating"
    )
    print(f"before: {load_before}; after: {load_after}")
    print()
    width = max(len(n) for n in names)
    print(
        f"| {'engine':<{width}} | {'median train_batch':>18} | {'tensors/micro-batch':>19} | "
        f"{'bytes/micro-batch':>17} |"
    )
    print(f"|{'-' * (width + 2)}|{'-' * 20}|{'-' * 21}|{'-' * 19}|")
    for name in names:
        tensors, nbytes = first["sends"][name]
        overall = statistics.median(meds[name])
        print(f"| {name:<{width}} | {overall * 1e3:>15.2f} ms | {tensors:>19} | {nbytes:>17} |")
    print()
    for peer, target in ((HAND, " (target <= 1.02)"), (PLAIN, "")):
        values = ratios[peer]
        rounds = ", ".join(f"{r:.3f}" for r in values)
        print(
            f"ratio pipedialect / {peer}: median {statistics.median(values):.3f}, "
            f"min {min(values):.3f}, max {max(values):.3f}{target}; rounds: {rounds}"
        )
    print(f"largest loss difference between the engines: {diff:.2e}")


if __name__ == "__main__":
    main()
