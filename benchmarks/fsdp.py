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
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _smoke
import torch
import torch.distributed as dist
from _pipes import (
    SMALL_GPT,
    HandPipeline,
    alternate,
    batches,
    fill_shards,
    gpt_parser,
    loss_difference,
    middle_plan,
    peak_above,
    print_peaks,
)

from pipedialect.models import TinyGPT, cross_entropy_loss
from pipedialect.runtime.launch import launch

PP, DP = 2, 2


def _model(args: argparse.Namespace) -> TinyGPT:
    return TinyGPT(vocab=args.vocab, dim=args.dim, max_len=args.seq, num_blocks=args.blocks, seed=0)


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


# -- the torch dialect ---------------------------------------------------------------------------


def _dialect_engine(
    args: argparse.Namespace, mode: str, state: dict[str, torch.Tensor] | None = None
) -> tuple[Any, int]:
    """The torch dialect's engine; with ``state``, built on meta and filled from it."""
    import pipedialect

    dialect = pipedialect.get_dialect("torch")
    dialect.init_distributed()
    plan, extra = middle_plan(lambda: _model(args), args.blocks, state)
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


def _hand_written(
    args: argparse.Namespace, state: dict[str, torch.Tensor] | None = None
) -> HandPipeline:
    """torchtitan's recipe by hand on a (pp, dp) mesh (:class:`_pipes.HandPipeline`). With
    ``state`` (a state dict), the model is built on the meta device and each shard is filled
    from it after ``to_empty`` (torchtitan's order: split, ``fully_shard``, ``to_empty``,
    init)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    if state is None:
        return HandPipeline(args, _model(args), mesh)
    with torch.device("meta"):
        model = _model(args)
    fill = fill_shards(state, args.blocks)
    return HandPipeline(args, model, mesh, after_sharding=fill)


# -- the runs ------------------------------------------------------------------------------------


def timing(args: argparse.Namespace) -> dict[str, Any]:
    """Both engines (and the DDP mode for the state count) in one process group, alternating."""
    torch.set_num_threads(1)
    fsdp, replica = _dialect_engine(args, "fsdp")
    ddp, _ = _dialect_engine(args, "ddp")
    hand = _hand_written(args)
    data = batches(args, replica)
    counts = {"fsdp": _state_bytes(fsdp), "ddp": _state_bytes(ddp)}
    steps: dict[str, Callable[[], Any]] = {
        "torch dialect (fsdp)": lambda: fsdp.train_batch(iter(data)),
        "hand-written (torchtitan style)": lambda: hand.train_batch(data),
        "torch dialect (ddp)": lambda: ddp.train_batch(iter(data)),
    }
    times, losses = alternate(steps, args.warmup, args.steps)
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

    def load() -> dict[str, torch.Tensor]:
        return torch.load(state_file, mmap=True, weights_only=True)

    return peak_above(
        args,
        which,
        lambda: _hand_written(args, load()),
        lambda: _dialect_engine(args, "fsdp", load()),
    )


def main() -> None:
    parser = gpt_parser(
        __doc__, steps=5, warmup=2, dim=384, blocks=8, seq=32, vocab=512, micro=4, gas=4
    )
    args = _smoke.parse_args(parser, SMALL_GPT)
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
    print_peaks(
        "fresh processes, meta build, shards filled from one state dict file",
        "torch dialect (fsdp)",
        mem_ours,
        mem_hand,
    )
    diff = loss_difference(first["losses"], ours, hand)
    print(f"\nlargest relative loss difference, torch dialect vs hand-written: {diff:.2e}")


if __name__ == "__main__":
    main()
