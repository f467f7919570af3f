"""``pipedialect demo``: a real pipeline-parallel training run, checked against one process.

A small GPT-style model (:class:`~pipedialect.models.TinyGPT`: token embedding tied to
the LM head) learns a toy language (every sequence counts up with its own stride). The demo
partitions it into ``stages`` pipeline stages, starts ``stages x dp`` processes itself (gloo on
CPUs, NCCL when there is one GPU per process), trains with the chosen dialect while a progress
bar shows the loss, then trains the unsplit model in this process on the same micro-batches and
prints both loss curves side by side with their largest difference. A PNG of the curves is
written when matplotlib is installed. Ctrl-C or SIGTERM stops every process the demo started.

With ``bf16`` the pipeline trains with ``"bf16": {"enabled": true}`` (bf16 parameters and
activations, fp32 master weights: :mod:`pipedialect.engine.precision`) and the demo prints and plots
its curve beside the fp32 unsplit model's, with the largest relative gap between them: bf16
rounds every activation to 8 significant bits, so the curves agree to a few percent, not to
float rounding.

With ``fsdp`` (the torch dialect, two or more replicas) each stage's parameters, gradients and
Adam state are sharded over the replicas (``data_parallel_mode="fsdp"``), and the curve is still
the unsplit model's.

With ``tp`` above 1 (the torch dialect) each stage's MLPs, its token embedding and the tied LM
head are sharded over a tensor axis of ``tp`` ranks (:data:`DEMO_TENSOR_PLAN`); the demo then
runs ``stages x dp x tp`` processes, and with ``fsdp`` too it is the full 3D layout.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from .contracts import Capability
from .dialect import Dialect
from .errors import ConfigError, LaunchError
from .models import TinyGPT, cross_entropy_loss

__all__ = [
    "DemoFailedError",
    "DemoSettings",
    "bf16_gaps",
    "check_settings",
    "demo_batches",
    "demo_config",
    "run_demo",
]

VOCAB = 48
SEQ = 16
DIM = 32
BLOCKS = 8
MICRO = 4
GAS = 4
LR = 3e-3
CLIP = 1.0


@dataclass(frozen=True)
class DemoSettings:
    """What ``pipedialect demo`` runs."""

    #: The dialect to train with.
    dialect: str = "deepspeed"
    #: Pipeline stages (the model has 8 blocks; at most 8 stages).
    stages: int = 2
    #: Data-parallel replicas of the pipeline.
    dp: int = 1
    #: Training steps (each one optimizer step over ``GAS`` micro-batches per replica).
    steps: int = 30
    #: Where the loss-curve PNG goes; None for no picture.
    output: str | None = "pipedialect-demo.png"
    #: Force gloo on CPUs even when GPUs are present.
    cpu: bool = False
    #: Build the model on the meta device; each rank materialises only its stages.
    meta: bool = False
    #: Where to write the Chrome trace of the run (and a PNG of the last step's schedule, the
    #: same path with ``.png``); None for no trace.
    trace: str | None = None
    #: Train the pipeline in bf16 (``"bf16": {"enabled": true}``) and compare it with fp32.
    bf16: bool = False
    #: Shard each stage over the replicas (``data_parallel_mode="fsdp"``).
    fsdp: bool = False
    #: Ranks on the tensor axis: above 1, :data:`DEMO_TENSOR_PLAN` shards each stage over them.
    tp: int = 1


#: What ``--tp`` shards: the MLPs' hidden features, and the vocabulary of the embedding and of
#: the LM head tied to it (TinyGPT's attention has one head, which cannot be split).
DEMO_TENSOR_PLAN = {
    "wte": "rowwise",
    "blocks.*.fc1": "colwise",
    "blocks.*.fc2": "rowwise",
    "lm_head": "colwise",
}


#: The largest relative gap between the bf16 and the fp32 loss curve that ``demo --bf16``
#: reports as agreement. Measured on the local dialect over the 30 default steps: 0.59%; a bf16
#: loss is itself rounded to 8 significant bits (0.4-0.8% at these losses), and the pipelined
#: dialects add their own bf16 rounding of the tied weight's gradient
#: (``tests/engine/test_bf16.py``).
BF16_BAND = 0.05


def demo_config(dp: int, bf16: bool = False) -> dict[str, Any]:
    """The DeepSpeed-style config every dialect trains the demo with (plain Adam, clipping;
    bf16 with fp32 master weights when ``bf16``)."""
    config: dict[str, Any] = {
        "train_batch_size": MICRO * GAS * dp,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": LR, "torch_adam": True, "adam_w_mode": False},
        },
        "gradient_clipping": CLIP,
        "steps_per_print": 10**9,
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


def demo_batches(count: int, replica: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` micro-batches of counting sequences for data-parallel replica ``replica``."""
    gen = torch.Generator().manual_seed(1000 + replica)
    out = []
    for _ in range(count):
        start = torch.randint(0, VOCAB, (MICRO, 1), generator=gen)
        stride = torch.randint(1, 4, (MICRO, 1), generator=gen)
        ids = (start + stride * torch.arange(SEQ + 1)) % VOCAB
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def _model() -> TinyGPT:
    return TinyGPT(vocab=VOCAB, dim=DIM, max_len=SEQ, num_blocks=BLOCKS, seed=0)


def _split_points(stages: int) -> list[str]:
    """Split the blocks as evenly as possible: stage k ends after its last block."""
    bounds = [round(BLOCKS * (k + 1) / stages) for k in range(stages - 1)]
    return [f"blocks.{b - 1}" for b in bounds]


def _rank_worker(settings: DemoSettings, progress: str, backend: str) -> list[float]:
    """What each rank runs: partition, build the engine, train, report progress."""
    from . import get_dialect
    from .plan.partition import partition

    torch.manual_seed(0)
    dialect = get_dialect(settings.dialect)
    multi = Capability.MULTI_PROCESS in dialect.capabilities
    if multi:
        dialect.init_distributed(backend)
    rank = int(os.environ.get("RANK", "0"))
    topology = dialect.make_topology(settings.stages, settings.dp, settings.tp)
    config = demo_config(settings.dp, settings.bf16)
    kwargs: dict[str, Any] = {}
    if settings.fsdp:
        kwargs["data_parallel_mode"] = "fsdp"
    if settings.tp > 1:
        kwargs["tensor_parallel"] = DEMO_TENSOR_PLAN
    if settings.meta:
        from .plan.weights import from_state_dict

        with torch.device("meta"):
            model = _model()
        plan = partition(model, _split_points(settings.stages))
        # The reference's seeded weights; a real run reads its checkpoint (from_safetensors).
        kwargs["init_weights"] = from_state_dict(_model().state_dict(), plan=plan)
    else:
        plan = partition(_model(), _split_points(settings.stages))
    module = dialect.pipe_engine(
        plan, config=config, loss_fn=cross_entropy_loss, topology=topology, **kwargs
    )
    engine = dialect.runtime_engine(module, config=config, check_finite=True)
    replica = int(topology.get_coord(rank).data) if multi else 0
    data = iter(demo_batches(settings.steps * GAS, replica))
    losses = []
    recording: Any = contextlib.nullcontext()
    if settings.trace:
        from .trace import trace

        recording = trace(engine, settings.trace, png=settings.output is not None)
    with recording:
        for step in range(settings.steps):
            losses.append(float(engine.train_batch(data_iter=data)))
            if rank == 0:
                with Path(progress).open("a") as f:
                    f.write(json.dumps({"step": step + 1, "loss": losses[-1]}) + "\n")
    return losses


def reference_losses(settings: DemoSettings) -> list[float]:
    """Train the unsplit model in this process on the same micro-batches."""
    model = _model()
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=LR)
    streams = [iter(demo_batches(settings.steps * GAS, r)) for r in range(settings.dp)]
    losses = []
    for _ in range(settings.steps):
        opt.zero_grad()
        total = 0.0
        for stream in streams:
            for _ in range(GAS):
                ids, labels = next(stream)
                loss = cross_entropy_loss(model(ids), labels)
                torch.autograd.backward(loss / (GAS * settings.dp))
                total += loss.item() / (GAS * settings.dp)
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        losses.append(total)
    return losses


class _Progress:
    """A one-line progress bar fed by the progress file rank 0 appends to."""

    def __init__(self, path: Path, total: int, out: TextIO) -> None:
        self.path = path
        self.total = total
        self.out = out
        self.offset = 0
        self.tty = out.isatty()
        self.start = time.monotonic()

    def poll(self) -> None:
        if not self.path.exists():
            return
        with self.path.open() as f:
            f.seek(self.offset)
            lines = f.readlines()
            self.offset = f.tell()
        for line in lines:
            if line.endswith("\n"):
                self._show(json.loads(line))

    def _show(self, entry: dict[str, Any]) -> None:
        step, loss = entry["step"], entry["loss"]
        width = 30
        done = round(width * step / self.total)
        bar = "#" * done + "." * (width - done)
        elapsed = time.monotonic() - self.start
        text = f"[{bar}] step {step:>3}/{self.total}  loss {loss:.4f}  {elapsed:5.1f}s"
        if self.tty:
            self.out.write("\r" + text)
            if step == self.total:
                self.out.write("\n")
        else:
            self.out.write(text + "\n")
        self.out.flush()


def _choose_backend(settings: DemoSettings, world: int) -> tuple[str, dict[str, str]]:
    if not settings.cpu and torch.cuda.is_available() and torch.cuda.device_count() >= world:
        return "nccl", {}
    return "gloo", {"CUDA_VISIBLE_DEVICES": ""}


def bf16_gaps(pipeline: Sequence[float], reference: Sequence[float]) -> list[float]:
    """The relative gap ``|bf16 - fp32| / fp32`` of each step's loss."""
    return [abs(a - b) / abs(b) for a, b in zip(pipeline, reference, strict=True)]


def _print_bf16(pipeline: Sequence[float], reference: Sequence[float], out: TextIO) -> None:
    """The bf16 and fp32 curves side by side, and how far apart they get."""
    print(f"\n{'step':>4}  {'bf16':>10}  {'fp32':>10}  {'relative':>9}", file=out)
    gaps = bf16_gaps(pipeline, reference)
    for step, (a, b, gap) in enumerate(zip(pipeline, reference, gaps, strict=True), start=1):
        print(f"{step:>4}  {a:>10.6f}  {b:>10.6f}  {gap:>8.2%}", file=out)
    verdict = "within" if max(gaps) <= BF16_BAND else "OUTSIDE"
    print(
        f"\nbf16 pipeline vs fp32 unsplit model: largest relative gap {max(gaps):.2%} ({verdict} "
        f"the {BF16_BAND:.0%} band); bf16 loss {pipeline[0]:.3f} -> {pipeline[-1]:.3f}, fp32 "
        f"{reference[0]:.3f} -> {reference[-1]:.3f}",
        file=out,
    )


def _plot(
    path: str,
    pipeline: Sequence[float],
    reference: Sequence[float],
    label: str,
    reference_label: str = "unsplit model, one process",
) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no loss-curve PNG (pip install 'pipedialect[demo]')"
    steps = range(1, len(pipeline) + 1)
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(steps, reference, label=reference_label, linewidth=3, alpha=0.4)
    ax.plot(steps, pipeline, label=label, linestyle="--", marker=".")
    ax.set_xlabel("training step")
    ax.set_ylabel("mean micro-batch loss")
    ax.set_title("pipedialect demo: TinyGPT, tied embedding and LM head")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return f"loss curves written to {path}"


def check_settings(settings: DemoSettings) -> Dialect:
    """Return the dialect ``settings`` name, or raise if the settings cannot run.

    Everything a user can get wrong on the command line is found here, before any process
    starts, so that ``pipedialect demo`` reports it as a usage error.

    Raises:
        ConfigError: a count is out of range, or data parallelism on a one-process dialect.
        DialectNotFoundError: no installed dialect has the name.
    """
    from . import get_dialect

    if not 1 <= settings.stages <= BLOCKS:
        raise ConfigError(
            f"--stages must be between 1 and {BLOCKS} (the model has {BLOCKS} blocks)"
        )
    if settings.dp < 1 or settings.steps < 1:
        raise ConfigError("--dp and --steps must be at least 1")
    dialect = get_dialect(settings.dialect)
    if Capability.MULTI_PROCESS not in dialect.capabilities and settings.dp != 1:
        raise ConfigError(
            f"the {settings.dialect!r} dialect runs every stage in one process, so it has no "
            f"data-parallel replicas: use --dp 1 (or a multi-process dialect such as deepspeed)"
        )
    if settings.fsdp:
        if Capability.SHARDED_DATA_PARALLEL not in dialect.capabilities:
            raise ConfigError(
                f"--fsdp shards the stages over the replicas, which the {settings.dialect!r} "
                "dialect does not declare (sharded-data-parallel): use --dialect torch"
            )
        if settings.dp < 2:
            raise ConfigError("--fsdp shards the stages over the replicas: use --dp 2 or more")
    if settings.tp != 1:
        if settings.tp < 1 or (DIM * 2) % settings.tp or VOCAB % settings.tp:
            raise ConfigError(
                f"--tp must divide the MLP's {DIM * 2} hidden features and the vocabulary of "
                f"{VOCAB}: use 1, 2, 4 or 8 (got {settings.tp})"
            )
        if Capability.TENSOR_PARALLEL not in dialect.capabilities:
            raise ConfigError(
                f"--tp shards each stage over a tensor axis, which the {settings.dialect!r} "
                "dialect does not declare (tensor-parallel): use --dialect torch"
            )
    return dialect


class DemoFailedError(LaunchError):
    """A rank of the demo failed; :attr:`log_dir` keeps every rank's log."""

    def __init__(self, message: str, *, log_dir: str) -> None:
        super().__init__(message)
        #: The directory holding ``rank<r>.log`` of every rank, kept for the user.
        self.log_dir = log_dir


def run_demo(settings: DemoSettings, out: TextIO | None = None) -> float:
    """Run the demo; print progress and the comparison to ``out``; return the largest difference.

    ``out`` defaults to ``sys.stdout`` as it is when the demo runs (not when this module was
    imported: a caller that redirects stdout gets the output).

    SIGTERM, like Ctrl-C, stops every process the demo started (the launcher sees to it).

    Raises:
        DemoFailedError: a rank failed; the rank logs stay in its ``log_dir``.
    """
    if out is None:
        out = sys.stdout
    dialect = check_settings(settings)
    multi = Capability.MULTI_PROCESS in dialect.capabilities
    world = settings.stages * settings.dp * settings.tp if multi else 1
    backend, env = _choose_backend(settings, world)
    where = f"{world} process(es), {backend}" if multi else "this process"
    print(
        f"pipedialect demo: TinyGPT ({BLOCKS} blocks, dim {DIM}, vocab {VOCAB}, embedding tied to "
        f"the LM head)\n  dialect {settings.dialect!r}: {settings.stages} stage(s) x "
        f"{settings.dp} replica(s){' sharding each stage (FSDP)' if settings.fsdp else ''}"
        f"{f' x tensor {settings.tp}' if settings.tp > 1 else ''} on "
        f"{where}; {settings.steps} steps of {GAS} micro-batches",
        file=out,
    )
    # Kept when a rank fails: its log is what the user reads next.
    tmp = tempfile.mkdtemp(prefix="pipedialect-demo-")
    try:
        progress_path = Path(tmp) / "progress.jsonl"
        progress = _Progress(progress_path, settings.steps, out)
        if multi:
            from .runtime.launch import launch

            results = launch(
                _rank_worker,
                world,
                settings,
                str(progress_path),
                backend,
                timeout=3600,
                env=env,
                log_dir=tmp,
                on_poll=progress.poll,
            )
            pipeline = results[0]
        else:
            pipeline = _rank_worker(settings, str(progress_path), backend)
        progress.poll()
    except LaunchError as exc:
        raise DemoFailedError(str(exc), log_dir=tmp) from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(tmp, ignore_errors=True)
    reference = reference_losses(settings)
    if settings.bf16:
        _print_bf16(pipeline, reference, out)
        largest = max(abs(a - b) for a, b in zip(pipeline, reference, strict=True))
    else:
        print(f"\n{'step':>4}  {'pipeline':>10}  {'reference':>10}  {'difference':>10}", file=out)
        for step, (a, b) in enumerate(zip(pipeline, reference, strict=True), start=1):
            print(f"{step:>4}  {a:>10.6f}  {b:>10.6f}  {a - b:>10.2e}", file=out)
        largest = max(abs(a - b) for a, b in zip(pipeline, reference, strict=True))
        relative = largest / max(abs(b) for b in reference)
        print(
            f"\nlargest difference from the single-process reference: {largest:.2e} "
            f"({relative:.1e} relative); loss {pipeline[0]:.3f} -> {pipeline[-1]:.3f}",
            file=out,
        )
    if settings.output:
        label = f"{settings.dialect}, {settings.stages} stages x {settings.dp}"
        if settings.fsdp:
            label += " (FSDP)"
        if settings.tp > 1:
            label += f" x tensor {settings.tp}"
        if settings.bf16:
            label += ", bf16"
        reference_label = "unsplit model, one process" + (", fp32" if settings.bf16 else "")
        print(_plot(settings.output, pipeline, reference, label, reference_label), file=out)
    if settings.trace:
        picture = f" and {Path(settings.trace).with_suffix('.png')}" if settings.output else ""
        print(f"timeline: {settings.trace}{picture} (open the JSON in Perfetto)", file=out)
    return largest
