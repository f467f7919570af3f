"""What the benchmarks that race the torch dialect against hand-written torch pipelining share.

The hand-cut pieces of a GPT (:class:`Head`, :class:`Tail`), torchtitan's recipe on two pipeline
stages (:class:`HandPipeline`: ``fully_shard`` over the data dimension of a device mesh, a
``PipelineStage``, ``Schedule1F1B``, the tied embedding's gradient summed by hand), the loop that
times several engines' steps alternately in the same processes (:func:`alternate`), the
micro-batches (:func:`batches`), the command line of a GPT run (:func:`gpt_parser`,
:data:`SMALL_GPT`) and the resident-set measurements (:func:`peak_above`,
:func:`print_peaks`). ``fsdp.py``, ``tp.py`` and ``torch_vs_deepspeed.py`` use them, so that the
engines they compare are built and timed the same way.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipedialect.models import cross_entropy_loss

__all__ = [
    "SMALL_GPT",
    "HandPipeline",
    "Head",
    "Tail",
    "alternate",
    "batches",
    "gpt_parser",
    "loss_difference",
    "peak_above",
    "print_peaks",
]


#: ``--smoke``'s sizes for :func:`gpt_parser`'s options.
SMALL_GPT: dict[str, Any] = {
    "steps": 1,
    "warmup": 1,
    "dim": 16,
    "blocks": 2,
    "seq": 8,
    "vocab": 32,
    "micro": 2,
    "gas": 2,
}


def gpt_parser(doc: str | None, **defaults: int) -> argparse.ArgumentParser:
    """A command line (described by ``doc``'s first line) with the options of a timed GPT run,
    each defaulting to ``defaults[name]``: ``--steps`` timed after ``--warmup``, the model's
    ``--dim``, ``--blocks``, ``--seq`` and ``--vocab``, ``--micro`` (micro-batch size) and
    ``--gas`` (micro-batches per step)."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    for name in ("steps", "warmup", "dim", "blocks", "seq", "vocab", "micro", "gas"):
        parser.add_argument(f"--{name}", type=int, default=defaults[name])
    return parser


def batches(args: argparse.Namespace, replica: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``args.gas`` micro-batches of next-token ids for ``replica`` (its own seed)."""
    gen = torch.Generator().manual_seed(1 + replica)
    out = []
    for _ in range(args.gas):
        ids = torch.randint(0, args.vocab, (args.micro, args.seq + 1), generator=gen)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


class Head(nn.Module):
    """Stage 0 by hand: the embeddings and the first ``cut`` blocks."""

    def __init__(self, model: Any, cut: int) -> None:
        super().__init__()
        self.wte, self.wpe = model.wte, model.wpe
        self.blocks = nn.ModuleList(model.blocks[:cut])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids) + self.wpe[: ids.size(1)]
        for block in self.blocks:
            h = block(h)
        return h


class Tail(nn.Module):
    """Stage 1 by hand: the other blocks, the final norm and the LM head (tied to the embedding
    of stage 0 through the gradient the pipelines sum by hand). ``untie``: a head of its own,
    a copy of the embedding's weight, for a tensor plan that shards the two differently."""

    def __init__(self, model: Any, cut: int, *, untie: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(model.blocks[cut:])
        self.ln_f = model.ln_f
        if untie:
            head = model.lm_head
            self.lm_head = nn.Linear(head.in_features, head.out_features, bias=False)
            self.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())
        else:
            self.lm_head = model.lm_head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = block(h)
        out: torch.Tensor = self.lm_head(self.ln_f(h))
        return out


class HandPipeline:
    """torchtitan's recipe by hand on two pipeline stages of a ``(pp, dp[, tp])`` device mesh:
    each rank cuts its piece of ``model`` (:class:`Head` or :class:`Tail`), ``before_sharding``
    may change it (``parallelize_module`` on ``tp``), each block and the piece are
    ``fully_shard``-ed over ``dp`` (``reshard_after_forward=False``, as torchtitan does under
    pipelining, FSDP summing), ``after_sharding`` may fill the shards (a model built on meta);
    then a ``PipelineStage`` on ``pp`` and ``Schedule1F1B`` on the concatenated batch, the loss
    divided by ``gas x replicas``, the tied embedding's gradient summed over the pipeline by
    hand, Adam."""

    def __init__(
        self,
        args: argparse.Namespace,
        model: Any,
        mesh: Any,
        *,
        untie: bool = False,
        before_sharding: Callable[[nn.Module, int], None] | None = None,
        after_sharding: Callable[[nn.Module, int], None] | None = None,
    ) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        self.pp_rank = mesh["pp"].get_local_rank()
        self.replica = mesh["dp"].get_local_rank()
        self.pp_group = mesh["pp"].get_group()
        self.replicas = mesh["dp"].size()
        self.tensor = mesh["tp"].size() if "tp" in mesh.mesh_dim_names else 1
        cut = args.blocks // 2
        piece: nn.Module = Head(model, cut) if self.pp_rank == 0 else Tail(model, cut, untie=untie)
        if before_sharding is not None:
            before_sharding(piece, self.pp_rank)
        for block in piece.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
        fully_shard(piece, mesh=mesh["dp"], reshard_after_forward=False)
        if after_sharding is not None:
            after_sharding(piece, self.pp_rank)
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
            2,
            torch.device("cpu"),
            input_args=inputs,
            output_args=outputs,
            group=self.pp_group,
        )
        scale = args.gas * self.replicas

        def loss_fn(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return cross_entropy_loss(out, labels) / scale

        self.schedule = Schedule1F1B(
            stage, n_microbatches=args.gas, loss_fn=loss_fn, scale_grads=False
        )
        self.optimizer = torch.optim.Adam(piece.parameters(), lr=1e-3)
        self.scale = scale

    def train_batch(self, data: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One step; the mean loss of the replicas, on every rank."""
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
        # The last stage's ranks are the last half; one of each replica's tensor group.
        last = gathered[len(gathered) - self.replicas * self.tensor :: self.tensor]
        return sum(last) / self.replicas


def middle_plan(
    make_model: Callable[[], nn.Module], blocks: int, state: Mapping[str, torch.Tensor] | None
) -> tuple[Any, dict[str, Any]]:
    """The dialect's side of :func:`fill_shards`: the model cut after its middle block, and
    ``pipe_engine``'s extra arguments; with ``state``, built on the meta device and filled
    from it (``init_weights``)."""
    import pipedialect
    from pipedialect.plan.weights import from_state_dict

    split = [f"blocks.{blocks // 2 - 1}"]
    if state is None:
        return pipedialect.partition(make_model(), split), {}
    with torch.device("meta"):
        plan = pipedialect.partition(make_model(), split)
    return plan, {"init_weights": from_state_dict(dict(state), plan=plan)}


def fill_shards(state: Mapping[str, torch.Tensor], blocks: int) -> Callable[[nn.Module, int], None]:
    """A :class:`HandPipeline` ``after_sharding`` for a piece built on the meta device:
    ``to_empty``, then each parameter's local shard copied from the whole tensor of the same
    name in ``state`` (the tail's blocks renumbered from the cut, its LM head read from the
    tied embedding), torchtitan's order: split, shard, ``to_empty``, init."""
    from torch.distributed.tensor import distribute_tensor

    def fill(piece: nn.Module, pp_rank: int) -> None:
        piece.to_empty(device="cpu")
        offset = 0 if pp_rank == 0 else blocks // 2  # the tail's blocks.0 is the cut
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

    return fill


def alternate(
    steps: Mapping[str, Callable[[], Any]], warmup: int, count: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Run one step of each engine in turn, ``warmup + count`` times, each timed from a barrier
    to a barrier (the slowest rank's time): machine noise hits every engine alike. Returns the
    times after the warm-up and every loss, by engine."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    losses: dict[str, list[float]] = {name: [] for name in steps}
    for step in range(warmup + count):
        for name, run in steps.items():
            dist.barrier()
            start = time.perf_counter()
            loss = run()
            dist.barrier()
            elapsed = time.perf_counter() - start
            losses[name].append(float(loss))
            if step >= warmup:
                times[name].append(elapsed)
    return times, losses


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_above(
    args: argparse.Namespace,
    which: str,
    hand: Callable[[], HandPipeline],
    ours: Callable[[], tuple[Any, int]],
) -> dict[str, Any]:
    """Peak resident set of this rank above the one before the engine is built, over
    ``warmup + steps`` steps: the hand-written pipeline ``hand`` builds when ``which`` is
    ``"hand"``, else the dialect's engine and this rank's replica that ``ours`` builds."""
    dist.barrier()
    base = _current_rss()
    if which == "hand":
        pipe = hand()
        run: Callable[[Any], Any] = pipe.train_batch
        replica = pipe.replica
    else:
        engine, replica = ours()

        def run(data: Any) -> Any:
            return engine.train_batch(iter(data))

    data = batches(args, replica)
    for _ in range(args.warmup + args.steps):
        run(data)
    dist.barrier()
    return {"rank": dist.get_rank(), "peak": _peak_rss() - base}


def print_peaks(
    title: str, ours: str, mem_ours: Sequence[dict[str, Any]], mem_hand: Sequence[dict[str, Any]]
) -> None:
    """The table of :func:`peak_above`'s results, rank by rank, with the largest and the mean
    (a rank's resident set varies by a few percent between replicas doing the same work: the
    largest rank's peak is what has to fit)."""
    print(f"\npeak resident set above the one before building the engine ({title}):\n")
    print(f"| rank | {ours} | hand-written | ratio |")
    print("|---:|---:|---:|---:|")
    by_rank = {r["rank"]: max(r["peak"], 1) for r in mem_hand}
    for r in sorted(mem_ours, key=lambda r: r["rank"]):
        theirs = by_rank[r["rank"]]
        print(
            f"| {r['rank']} | {r['peak'] / 2**20:.1f} MiB | {theirs / 2**20:.1f} MiB | "
            f"{r['peak'] / theirs:.3f} |"
        )
    mine = [r["peak"] for r in mem_ours]
    theirs_all = list(by_rank.values())
    for name, pick in (("largest", max), ("mean", statistics.mean)):
        print(
            f"| {name} | {pick(mine) / 2**20:.1f} MiB | {pick(theirs_all) / 2**20:.1f} MiB | "
            f"{pick(mine) / pick(theirs_all):.3f} |"
        )


def loss_difference(losses: Mapping[str, list[float]], ours: str, other: str) -> float:
    """The largest relative difference between two engines' losses, step by step."""
    return max(abs(a - b) / abs(b) for a, b in zip(losses[ours], losses[other], strict=True))
