"""What each rank runs in the torch dialect's FSDP tests (importable by spawned ranks).

Four ranks, one gloo process group: every case is a pipeline of two ranks whose stages are
sharded over two replicas (``make_topology(2, 2)``, ``data_parallel_mode="fsdp"``). Replica ``d``
reads the stream seeded ``DATA_SEED + d`` (:func:`_model_registry.data_stream`); each case saves a
portable checkpoint at its end, which the test process consolidates and compares with the
unsplit model trained on both replicas' micro-batches (``tests/_reference.py``). Each rank also
reports what it saw itself: its losses, how much of its stage it holds, how many all-gathers
and reduce-scatters each step ran, and the named errors the guards raised.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import _model_registry
import torch
import torch.distributed as dist

import pipedialect
import pipedialect.checkpoint as portable
from pipedialect import PipeDialectError
from pipedialect.plan.partition import partition
from pipedialect.plan.weights import from_state_dict
from pipedialect.runtime.sharded import is_sharded, local_part

DP = 2
MODEL = "gpt"
#: The LR schedule of the parameter-group case: warm up over 2 steps, then constant.
WARMUP = 2


def warmup(step: int) -> float:
    """The LR factor of the parameter-group case at ``step`` (a ``LambdaLR`` lambda)."""
    return min(1.0, (step + 1) / WARMUP)


def no_decay(named: list[tuple[str, torch.nn.Parameter]]) -> list[dict[str, Any]]:
    """Biases, norms and the tied embedding (``wte.weight`` on both ranks) without decay."""
    exempt = [p for n, p in named if "bias" in n or "ln" in n or n == "wte.weight"]
    decayed = [p for n, p in named if not ("bias" in n or "ln" in n or n == "wte.weight")]
    return [{"params": decayed}, {"params": exempt, "weight_decay": 0.0}]


def config(case: dict[str, Any]) -> dict[str, Any]:
    """The case's DeepSpeed-style config."""
    cfg = _model_registry.ds_config(
        case["opt"], gas=case["gas"], micro=case["micro"], dp=DP, clip=case.get("clip", 0.0)
    )
    if case.get("bf16"):
        cfg["bf16"] = {"enabled": True}
    if case.get("groups"):  # a client optimizer and schedule instead of the config's
        del cfg["optimizer"]
    return cfg


@contextmanager
def default_dtype(name: str) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, name))
    try:
        yield
    finally:
        torch.set_default_dtype(before)


class CollectiveCounter:
    """Counts FSDP's all-gathers and reduce-scatters (each a group's one collective)."""

    def __init__(self) -> None:
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

        self.gathers = 0
        self.reductions = 0
        self._group = group
        self._gather = group.foreach_all_gather
        self._reduce = group.foreach_reduce
        counter = self

        def gather(*args: Any, **kwargs: Any) -> Any:
            counter.gathers += 1
            return counter._gather(*args, **kwargs)

        def reduce(*args: Any, **kwargs: Any) -> Any:
            counter.reductions += 1
            return counter._reduce(*args, **kwargs)

        group.foreach_all_gather = gather
        group.foreach_reduce = reduce

    def take(self) -> tuple[int, int]:
        """The counts since the last call."""
        out = (self.gathers, self.reductions)
        self.gathers = self.reductions = 0
        return out

    def close(self) -> None:
        self._group.foreach_all_gather = self._gather
        self._group.foreach_reduce = self._reduce


def build(case: dict[str, Any], seed: int = 0, **extra: Any) -> tuple[Any, Any, Any, int]:
    """The case's plan, dialect, engine and this rank's replica."""
    spec = _model_registry.spec_for(case.get("model", MODEL))
    cfg = config(case)
    dialect = type(pipedialect.get_dialect("torch"))(schedule=case["schedule"])
    topology = dialect.make_topology(2, DP)
    replica = int(topology.get_coord(dist.get_rank()).data)
    split = spec.split_points_for(2)
    recompute = case.get("recompute")
    kwargs: dict[str, Any] = {"recompute": recompute} if recompute else {}
    if case.get("meta"):  # each rank materialises its shards only, from the unsplit weights
        state = spec.build(seed).state_dict()
        with torch.device("meta"):
            plan = partition(spec.build(seed), split, **kwargs)
        extra["init_weights"] = from_state_dict(state, plan=plan)
    else:
        plan = partition(spec.build(seed), split, **kwargs)
    module = dialect.pipe_engine(
        plan,
        config=cfg,
        loss_fn=spec.loss_fn,
        topology=topology,
        data_parallel_mode="fsdp",
        **extra,
    )
    engine_kwargs: dict[str, Any] = {"check_finite": True}
    if case.get("groups"):
        engine_kwargs.update(
            param_groups=no_decay,
            optimizer=lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1),
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, warmup),
        )
    engine = dialect.runtime_engine(module, config=cfg, **engine_kwargs)
    return plan, dialect, engine, replica


def _held(plan: Any, engine: Any) -> dict[str, Any]:
    """How much of its stage this rank holds, and in what."""
    params = [p for k in engine.stage_ids for p in plan.stages[k].parameters()]
    return {
        "held": sum(local_part(p).numel() for p in params),
        "whole": sum(p.numel() for p in params),
        "all_sharded": all(is_sharded(p) for p in params),
        "dtypes": sorted({str(local_part(p).dtype) for p in params}),
        "masters": sorted(
            {
                f"{'sharded' if is_sharded(m) else 'whole'} {local_part(m).dtype}"
                for m in (engine.mixed.masters if engine.mixed is not None else [])
            }
        ),
    }


def _error(call: Any) -> str:
    """The named error ``call()`` raises on this rank (it must raise)."""
    try:
        call()
    except PipeDialectError as exc:
        return f"{type(exc).__name__}: {exc}"
    raise AssertionError("no error")


def train_and_save(
    engine: Any,
    spec: Any,
    case: dict[str, Any],
    replica: int,
    ckpt_dir: str,
    after_step: Any = None,
) -> dict[str, Any]:
    """Train ``case["steps"]`` batches of replica ``replica``'s stream, evaluate one batch of
    stream ``DP + replica``, save a portable checkpoint tagged ``case["name"]`` (not under
    bf16: portable checkpoints hold fp32 optimizers only); what every rank reports of it.
    ``after_step()`` runs after each training batch."""
    stream = _model_registry.data_stream
    data = stream(spec, case["steps"] * case["gas"], case["micro"], replica)
    losses = []
    for _ in range(case["steps"]):
        losses.append(float(engine.train_batch(data_iter=data)))
        if after_step is not None:
            after_step()
    eval_loss = float(engine.eval_batch(stream(spec, case["gas"], case["micro"], DP + replica)))
    if not case.get("bf16"):
        portable.save(engine, ckpt_dir, tag=case["name"])
    return {
        "name": case["name"],
        "rank": dist.get_rank(),
        "replica": replica,
        "stages": list(engine.stage_ids),
        "losses": losses,
        "eval_loss": eval_loss,
    }


def _train_case(case: dict[str, Any], ckpt_dir: str) -> dict[str, Any]:
    spec = _model_registry.spec_for(case.get("model", MODEL))
    with default_dtype(case.get("dtype", "float32")):
        plan, _, engine, replica = build(case)
        counter = CollectiveCounter()
        counts: list[Any] = []
        try:
            done = train_and_save(
                engine, spec, case, replica, ckpt_dir, lambda: counts.append(counter.take())
            )
            counter.take()  # the evaluation's
        finally:
            counter.close()
    return {
        **done,
        "counts": counts,
        "units": engine.module.fsdp.num_units,
        "lr": engine.get_lr(),
        **_held(plan, engine),
    }


def _resume_case(case: dict[str, Any], ckpt_dir: str) -> dict[str, Any]:
    """The engine's own checkpoint after 2 steps, resumed by an engine built from other
    weights: its later steps must be the uninterrupted run's, bit for bit."""
    spec = _model_registry.spec_for(MODEL)
    _, _, engine, replica = build(case)
    data = _model_registry.data_stream(spec, case["steps"] * case["gas"], case["micro"], replica)
    losses = []
    for step in range(case["steps"]):
        losses.append(float(engine.train_batch(data_iter=data)))
        if step == 1:
            engine.save_checkpoint(str(Path(ckpt_dir) / "own"), tag="mid")
    _, _, again, _ = build(case, seed=7)
    again.load_checkpoint(str(Path(ckpt_dir) / "own"))
    data = _model_registry.data_stream(spec, case["steps"] * case["gas"], case["micro"], replica)
    for _ in range(2 * case["gas"]):
        next(data)
    resumed = [float(again.train_batch(data_iter=data)) for _ in range(case["steps"] - 2)]
    first = {n: local_part(p).detach().clone() for n, p in engine.module.named_parameters()}
    second = {n: local_part(p).detach().clone() for n, p in again.module.named_parameters()}
    own_files = sorted(p.name for p in (Path(ckpt_dir) / "own" / "mid").glob("*.pt"))

    # The guards, on the engine that has trained: each is refused on every rank, by name.
    rank = dist.get_rank()
    runner = again.module._runners()[0]
    batch = list(_model_registry.data_stream(spec, case["gas"], case["micro"], replica))
    poisoned = next(again.module.parameters())
    saved = local_part(poisoned).detach().clone()
    with torch.no_grad():
        local_part(poisoned).fill_(math.nan)
    guards = {"nonfinite": _error(lambda: again.train_batch(data_iter=iter(batch)))}
    with torch.no_grad():
        local_part(poisoned).copy_(saved)
    runner.set_requires_gradient_sync(False)
    guards["sync"] = _error(lambda: again.train_batch(data_iter=iter(batch)))
    runner.set_requires_gradient_sync(True)
    runner.set_gradient_divide_factor(2.0)
    guards["divide"] = _error(lambda: again.train_batch(data_iter=iter(batch)))
    runner.set_gradient_divide_factor(1.0)
    # Last: an error inside the schedule leaves the process group shut down.
    uneven = [batch[0], (batch[1][0][:1], batch[1][1][:1])]  # a micro-batch of one sample
    guards["uneven"] = _error(lambda: again.train_batch(data_iter=iter(uneven)))
    return {
        "name": case["name"],
        "rank": rank,
        "losses": losses,
        "resumed": resumed,
        "params_equal": all(torch.equal(first[n], second[n]) for n in first),
        "global_steps": again.global_steps,
        "own_files": own_files,
        "guards": guards,
    }


def run_cases(cases: list[dict[str, Any]], ckpt_dir: str) -> list[dict[str, Any]]:
    """Run every case in turn in one process group."""
    pipedialect.get_dialect("torch").init_distributed()
    out = []
    for case in cases:
        if case.get("resume"):  # it ends with the process group shut down
            out.append(_resume_case(case, ckpt_dir))
            break
        out.append(_train_case(case, ckpt_dir))
        dist.barrier()
    return out
