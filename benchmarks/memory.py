"""Activation memory with and without ``partition(..., recompute="blocks.*")``.

One model whose activations dominate: a long sequence (``--seq`` tokens, batch ``--batch``)
through ``--depth`` pre-norm MLP blocks of width ``--dim`` (a few hundred thousand
parameters, hundreds of MiB of activations). Each variant runs in a fresh interpreter: it
partitions the model into ``--stages`` stages (with or without ``recompute="blocks.*"``),
runs forward and backward of one micro-batch through the stage graphs (``plan.graph``, the code
every dialect runs), and reports

- on a GPU, ``torch.cuda.max_memory_allocated`` above what the model and inputs hold;
- on a CPU, the peak resident set (``ru_maxrss``) above the resident set before forward;
- in both, the bytes autograd saves for backward outside recomputed regions
  (``saved_tensors_hooks``, each storage once) and the inputs the checkpoints keep.

The losses of both variants must be equal (the same maths, recomputed), and the ratio is
printed. Target: checkpointing lowers the peak by at least 40%.

    python benchmarks/memory.py [--seq 2048] [--dim 128] [--depth 16] [--batch 4] [--device cpu]

``--pipeline`` measures instead a model bigger than one rank: TinyGPT (``--blocks`` blocks of
width ``--dim``, the embedding tied to the LM head) on 4 DeepSpeed ranks (PP=4, gloo on CPUs),
two variants launched one after the other, each in fresh processes, with the same weights and
micro-batches:

- ``hand-written``: a ``PipelineModule`` of ``LayerSpec``/``TiedLayerSpec`` (each rank builds
  only its own layers, as DeepSpeed's users write it);
- ``pipedialect``: the unmodified model built on the meta device, partitioned, and
  ``pipe_engine(..., init_weights=fn)`` filling only the rank's stage.

Printed per rank: the peak resident set (``ru_maxrss``; and ``torch.cuda.max_memory_allocated``
on a GPU) of each and their ratio (target <= 1.05), and whether the losses are identical.

    python benchmarks/memory.py --pipeline [--blocks 24] [--dim 1024] [--steps 2]

``--bf16`` measures what ``"bf16": {"enabled": true}`` keeps per stage: TinyGPT (``--blocks``
blocks of width ``--dim``, tied embedding) partitioned into ``--stages`` stages on the local
dialect, trained one step in fp32 and one in bf16 in the same run, on the same weights and
micro-batches. Just before each optimizer step (when the step's gradients exist) it counts, per
stage, the bytes of the parameters and of the gradients the step uses (``param.grad`` in fp32,
the engine's gradient buffers in bf16; a tied weight on the first stage holding it), and after
the step the fp32 master weights and the optimizer state. Printed: the bf16 / fp32 ratio of
parameter + gradient bytes per stage (expected 0.500) and the whole model state.

    python benchmarks/memory.py --bf16 [--blocks 24] [--dim 128] [--stages 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from typing import Any

import _smoke
import torch
from torch import nn

from pipedialect import partition
from pipedialect.models import GPTBlock, TinyGPT, seeded_init


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
    plan = partition(model, points, recompute="blocks.*" if checkpoint else None)
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


# -- a model bigger than one rank: meta + init_weights against LayerSpec ------------------------

PP = 4


class _Embed(nn.Module):
    """Token and position embedding; on the last stage, tied, it is the LM head."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.wte = nn.Embedding(args.vocab, args.dim)
        self.wpe = nn.Parameter(torch.zeros(args.seq, args.dim))
        seeded_init(self, 10_000)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.wte(ids) + self.wpe[: ids.size(1)]
        return out


def _lm_head(embed: _Embed, h: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(h, embed.wte.weight)


class _Block(GPTBlock):
    def __init__(self, args: argparse.Namespace, index: int) -> None:
        super().__init__(args.dim)
        seeded_init(self, index)


class _FinalNorm(nn.LayerNorm):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args.dim)
        seeded_init(self, 20_000)


def _layer_values(args: argparse.Namespace, names: list[str]) -> dict[str, torch.Tensor]:
    """The hand-written layers' values under TinyGPT's names, building only the layers needed."""
    out: dict[str, torch.Tensor] = {}
    built: dict[str, nn.Module] = {}
    for name in names:
        if name in ("wte.weight", "lm_head.weight", "wpe"):
            layer = built.setdefault("embed", _Embed(args))
            out[name] = layer.get_parameter("wpe" if name == "wpe" else "wte.weight")
        elif name.startswith("blocks."):
            index, rest = name.split(".", 2)[1:]
            layer = built.setdefault(index, _Block(args, int(index)))
            out[name] = layer.get_parameter(rest)
        else:
            layer = built.setdefault("ln_f", _FinalNorm(args))
            out[name] = layer.get_parameter(name.split(".", 1)[1])
    return out


def _fill(args: argparse.Namespace) -> Any:
    def init_weights(stage: nn.Module) -> None:
        names = [n for n, _ in stage.named_parameters(remove_duplicate=False)]
        values = _layer_values(args, names)
        with torch.no_grad():
            for name in names:
                stage.get_parameter(name).copy_(values[name])

    return init_weights


def _pipeline_rank(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    """One rank of one variant: build, train ``args.steps`` steps, report peak memory."""
    import pipedialect
    from pipedialect.models import cross_entropy_loss

    torch.set_num_threads(1)
    dialect = pipedialect.get_dialect("deepspeed")
    dialect.init_distributed()
    topology = dialect.make_topology(PP, 1)
    config = {
        "train_batch_size": args.micro * args.gas,
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": args.gas,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }
    if variant == "hand-written":
        from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

        layers = [
            TiedLayerSpec("embed", _Embed, args, tied_weight_attr="wte.weight"),
            *(LayerSpec(_Block, args, i) for i in range(args.blocks)),
            LayerSpec(_FinalNorm, args),
            TiedLayerSpec(
                "embed", _Embed, args, forward_fn=_lm_head, tied_weight_attr="wte.weight"
            ),
        ]
        module: nn.Module = PipelineModule(
            layers=layers, topology=topology, loss_fn=cross_entropy_loss, partition_method="uniform"
        )
        parts = list(module.parts)  # type: ignore[attr-defined]
    else:
        with torch.device("meta"):
            model = TinyGPT(
                vocab=args.vocab, dim=args.dim, max_len=args.seq, num_blocks=args.blocks
            )
        # The hand-written pipeline's uniform split: layer 0 is the embedding, 1.. the blocks,
        # then the final norm and the tied head.
        from deepspeed.runtime.utils import partition_uniform

        parts = list(partition_uniform(args.blocks + 3, PP))
        ends = [parts[k] - 1 for k in range(1, PP)]  # the last layer of each stage but one
        points = [f"blocks.{e - 1}" if e <= args.blocks else "ln_f" for e in ends]
        plan = partition(model, points)
        module = dialect.pipe_engine(
            plan,
            config=config,
            loss_fn=cross_entropy_loss,
            topology=topology,
            init_weights=_fill(args),
        )
    engine = dialect.runtime_engine(module, config=config)
    gen = torch.Generator().manual_seed(1)
    data = []
    for _ in range(args.gas):
        ids = torch.randint(0, args.vocab, (args.micro, args.seq + 1), generator=gen)
        data.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    losses = [float(engine.train_batch(iter(data))) for _ in range(args.steps)]
    cuda = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    return {
        "stage": int(engine.stage_id),
        "peak_rss": _rss_bytes(),
        "cuda_peak": cuda,
        "losses": losses,
        "parts": parts,
    }


def pipeline_main(args: argparse.Namespace) -> None:
    """Both variants, PP=4, one after the other; the table of per-rank peaks and ratios."""
    from pipedialect.runtime.launch import launch

    env = {"MALLOC_MMAP_THRESHOLD_": "65536"}
    runs = {
        v: sorted(launch(_pipeline_rank, PP, args, v, timeout=3600, env=env), key=_stage)
        for v in ("hand-written", "pipedialect")
    }
    with torch.device("meta"):  # counted on the model itself: shapes only, no memory
        shapes = TinyGPT(vocab=args.vocab, dim=args.dim, max_len=args.seq, num_blocks=args.blocks)
    params = sum(p.numel() for p in shapes.parameters())
    mib = 1024 * 1024
    print(
        f"TinyGPT {args.blocks} blocks, dim {args.dim}, vocab {args.vocab}, seq {args.seq} "
        f"(~{params * 4 / mib:.0f} MiB of fp32 parameters); DeepSpeed PP={PP}, "
        f"{args.steps} steps of {args.gas} micro-batches of {args.micro}; torch {torch.__version__}"
    )
    print(f"layer split (hand-written): {runs['hand-written'][0]['parts']}")
    print()
    print("| rank | hand-written peak RSS | pipedialect (meta) peak RSS | ratio |")
    print("|-----:|----------------------:|----------------------------:|------:|")
    worst = 0.0
    for hand, ours in zip(runs["hand-written"], runs["pipedialect"], strict=True):
        ratio = ours["peak_rss"] / hand["peak_rss"]
        worst = max(worst, ratio)
        extra = ""
        if hand["cuda_peak"]:
            extra = f" (CUDA {hand['cuda_peak'] / mib:.0f} vs {ours['cuda_peak'] / mib:.0f} MiB)"
        print(
            f"| {hand['stage']:>4} | {hand['peak_rss'] / mib:>17.0f} MiB | "
            f"{ours['peak_rss'] / mib:>23.0f} MiB | {ratio:>5.2f} |{extra}"
        )
    print()
    print(f"worst per-rank ratio: {worst:.3f} (target <= 1.05)")
    last = [runs["hand-written"][-1], runs["pipedialect"][-1]]
    same = last[0]["losses"] == last[1]["losses"]
    print(f"losses hand-written {last[0]['losses']}")
    print(f"losses pipedialect  {last[1]['losses']}")
    print(f"identical losses: {same}")
    if not same:
        sys.exit("the two pipelines trained differently")


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _bf16_run(args: argparse.Namespace, bf16: bool) -> dict[str, Any]:
    """Train one step on the local dialect; the per-stage bytes of parameters and gradients
    (just before the optimizer step), of master weights and of optimizer state (after it)."""
    from pipedialect import get_dialect
    from pipedialect.models import cross_entropy_loss

    model = TinyGPT(
        vocab=args.vocab, dim=args.dim, max_len=args.seq, num_blocks=args.blocks, seed=0
    )
    bounds = [round(args.blocks * (k + 1) / args.stages) for k in range(args.stages - 1)]
    plan = partition(model, [f"blocks.{b - 1}" for b in bounds])
    config: dict[str, Any] = {
        "train_batch_size": args.micro * args.gas,
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": args.gas,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "bf16": {"enabled": bf16},
    }
    dialect = get_dialect("local")
    module = dialect.pipe_engine(plan, config=config, loss_fn=cross_entropy_loss)
    engine: Any = dialect.runtime_engine(module, config=config)
    owner: dict[int, int] = {}  # each parameter counted on the first stage holding it
    for k, stage in enumerate(plan.stages):
        for p in stage.parameters():
            owner.setdefault(id(p), k)
    held = {id(p): p for stage in plan.stages for p in stage.parameters()}
    per_stage: list[dict[str, int]] = [
        {"params": 0, "grads": 0, "masters": 0, "optimizer": 0} for _ in plan.stages
    ]
    original = engine.take_step

    def measured_step(*a: Any, **k: Any) -> Any:
        for pid, p in held.items():
            row = per_stage[owner[pid]]
            row["params"] += _nbytes(p)
            row["grads"] += _nbytes(engine.grad_of(p))
        return original(*a, **k)

    engine.take_step = measured_step
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(args.gas):
        ids = torch.randint(0, args.vocab, (args.micro, args.seq + 1), generator=gen)
        batches.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    loss = float(engine.train_batch(iter(batches)))
    for pid, p in held.items():
        row = per_stage[owner[pid]]
        stepped = p if engine.mixed is None else engine.mixed.master_of(p)
        if engine.mixed is not None:
            row["masters"] += _nbytes(stepped)
        state = engine.optimizer.state.get(stepped, {})
        row["optimizer"] += sum(_nbytes(v) for v in state.values() if v.dim() > 0)
    dtypes = sorted({str(p.dtype) for p in held.values()})
    return {"stages": per_stage, "loss": loss, "dtypes": dtypes}


def bf16_main(args: argparse.Namespace) -> None:
    """``--bf16``: parameter + gradient bytes per stage, bf16 against fp32 (one run)."""
    fp32, bf16 = _bf16_run(args, False), _bf16_run(args, True)
    mib = 1024 * 1024
    print(
        f"TinyGPT: {args.blocks} blocks, dim {args.dim}, vocab {args.vocab}, seq {args.seq}; "
        f"{args.stages} stages on the local dialect; torch {torch.__version__}"
    )
    print(f"parameter dtypes: fp32 run {fp32['dtypes']}, bf16 run {bf16['dtypes']}")
    print()
    print("| stage | fp32 params + grads | bf16 params + grads | ratio |")
    print("|------:|--------------------:|--------------------:|------:|")
    ratios = []
    for k, (a, b) in enumerate(zip(fp32["stages"], bf16["stages"], strict=True)):
        full, half = a["params"] + a["grads"], b["params"] + b["grads"]
        ratios.append(half / full)
        print(f"| {k} | {full / mib:.2f} MiB | {half / mib:.2f} MiB | {half / full:.3f} |")
    print()
    print(
        f"bf16 / fp32 parameter + gradient bytes per stage: {', '.join(f'{r:.3f}' for r in ratios)}"
    )
    for name, run in (("fp32", fp32), ("bf16", bf16)):
        total = {key: sum(row[key] for row in run["stages"]) for key in run["stages"][0]}
        parts = ", ".join(f"{key} {value / mib:.2f}" for key, value in total.items())
        print(
            f"{name} model state, all stages (MiB): {parts}; total {sum(total.values()) / mib:.2f}"
        )
    print(f"losses of the step: fp32 {fp32['loss']:.6f}, bf16 {bf16['loss']:.6f}")
    if any(abs(r - 0.5) > 1e-9 for r in ratios):
        sys.exit("bf16 did not halve the parameter + gradient bytes of every stage")


def _stage(result: dict[str, Any]) -> int:
    return int(result["stage"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--one", choices=["plain", "ckpt"], help=argparse.SUPPRESS)
    parser.add_argument("--pipeline", action="store_true", help="meta + init_weights vs LayerSpec")
    parser.add_argument("--bf16", action="store_true", help="bf16 vs fp32 bytes per stage")
    parser.add_argument("--blocks", type=int, default=24, help="--pipeline: TinyGPT blocks")
    parser.add_argument("--vocab", type=int, default=512, help="--pipeline: vocabulary")
    parser.add_argument("--micro", type=int, default=2, help="--pipeline: micro-batch size")
    parser.add_argument("--gas", type=int, default=4, help="--pipeline: micro-batches per step")
    parser.add_argument("--steps", type=int, default=2, help="--pipeline: training steps")
    args = _smoke.parse_args(
        parser,
        {
            "seq": 64,
            "dim": 16,
            "depth": 4,
            "batch": 2,
            "blocks": 4,
            "vocab": 32,
            "micro": 2,
            "gas": 2,
            "steps": 1,
        },
    )
    if args.bf16:
        if "--seq" not in sys.argv:
            args.seq = 64
        bf16_main(args)
        return
    if args.pipeline:
        if "--dim" not in sys.argv:
            args.dim = 1024
        if "--seq" not in sys.argv:
            args.seq = 64
        pipeline_main(args)
        return
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
    for name, r in (("no checkpoint", plain), ('recompute="blocks.*"', ckpt)):
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
