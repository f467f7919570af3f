"""What runs where the dialect's engines live: on each rank of a launch, or in the test process.

:func:`run_cases` builds and drives one engine per case and leaves one record per case and rank
in ``out_dir`` (``<case>.rank<r>.pkl``) as soon as the case is done, so that the test process
keeps what finished even when a later case brings the launch down. A case that raises is
recorded with its exception; in a multi-process run the rank then stops (its peers may be
waiting for it in a collective, and the launcher ends them), except after a build mistake the
dialect refused with a :class:`~pipedialect.PipeDialectError`, which every rank raises alike
before any collective.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...errors import PipeDialectError
from ...interfaces import Capability, Dialect, RuntimeEngine, Topology
from ...partition import PipelinePlan, partition
from ...stage import StageWrapper
from .._options import EngineOptions
from ._cases import Case, get_case
from ._data import eval_stream, suite_config, train_stream
from ._models import suite_model

__all__ = [
    "ContractError",
    "Probe",
    "detached",
    "ends_launch",
    "one_thread",
    "record_path",
    "run_cases",
]

Record = dict[str, Any]


class ContractError(AssertionError):
    """The dialect broke a contract the suite checks on a rank (not an error it raised)."""


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one intra-op thread: the suite's models are tiny, and on a few shared cores
    more threads only contend (each launched rank already runs with ``OMP_NUM_THREADS=1``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def record_path(out_dir: str | Path, case_id: str, rank: int) -> Path:
    """Where rank ``rank`` leaves its record of ``case_id``."""
    return Path(out_dir) / f"{case_id}.rank{rank}.pkl"


def _write(out_dir: str, case_id: str, rank: int, record: Record) -> None:
    record["time"] = time.time()
    path = record_path(out_dir, case_id, rank)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(record))
    tmp.replace(path)  # atomic: the test process never reads half a record


def ends_launch(case: Case, record: Record) -> bool:
    """Whether a multi-process rank stops after recording ``record`` of ``case``."""
    if record.get("status", "ok") == "ok":
        return False
    return not (case.kind == "build-error" and record.get("pipedialect_error", False))


def run_cases(
    dialect: Dialect,
    case_ids: Sequence[str],
    out_dir: str,
    options: EngineOptions,
    in_process: bool = False,
) -> int:
    """Run ``case_ids`` in order on this rank; return how many were recorded."""
    multi = not in_process and Capability.MULTI_PROCESS in dialect.capabilities
    rank = int(os.environ.get("RANK", "0")) if multi else 0
    if multi:
        dialect.init_distributed()
    done = 0
    for case_id in case_ids:
        case = get_case(case_id)
        record: Record = {"case": case_id, "rank": rank}
        partial: Record = {}
        try:
            record.update(_RUNNERS[case.kind](dialect, case, options, out_dir, multi, partial))
            record["status"] = "ok"
        except Exception as exc:
            record.update(partial)
            record.update(
                status="raised",
                error_type=type(exc).__name__,
                pipedialect_error=isinstance(exc, PipeDialectError),
                contract_error=isinstance(exc, ContractError),
                message=str(exc),
                traceback=traceback.format_exc(),
            )
            _write(out_dir, case_id, rank, record)
            done += 1
            if multi and ends_launch(case, record):
                raise
            continue
        _write(out_dir, case_id, rank, record)
        done += 1
    return done


# -- building -------------------------------------------------------------------------------


class Probe:
    """Records what each stage wrapper decodes in its first micro-batch with grad enabled."""

    def __init__(self) -> None:
        self.received: dict[int, list[Any]] = {}

    def attach(self, wrapper: StageWrapper) -> None:
        original = wrapper.receive
        stage = wrapper.stage_id

        def receive(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[Any]:
            values = original(args, kwargs)
            if stage > 0 and stage not in self.received and torch.is_grad_enabled():
                self.received[stage] = detached(values)
            return values

        wrapper.receive = receive  # type: ignore[method-assign]


def detached(value: Any) -> Any:
    """A copy of ``value`` with every tensor detached, cloned and moved to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: detached(v) for k, v in value.items()}
    if isinstance(value, list):
        return [detached(v) for v in value]
    if isinstance(value, tuple) and not isinstance(value, torch.Size):
        return tuple(detached(v) for v in value)
    return value


def _replica(topology: Topology, multi: bool) -> int:
    if not multi:
        return 0
    import torch.distributed as dist

    coord = topology.get_coord(dist.get_rank())
    return int(getattr(coord, "data", 0))


class _Built:
    """A plan, its engine and what the suite needs to read back from it."""

    def __init__(
        self,
        dialect: Dialect,
        case: Case,
        options: EngineOptions,
        multi: bool,
        *,
        seed: int = 0,
        mistake: str = "",
    ) -> None:
        spec = suite_model(case.model)
        self.spec = spec
        self.plan: PipelinePlan = partition(spec.build(seed), spec.split_points_for(case.stages))
        self.config = suite_config(case)
        self.topology = dialect.make_topology(case.stages, case.data_parallel)
        self.replica = _replica(self.topology, multi)
        kwargs: dict[str, Any] = {
            "config": self.config,
            "loss_fn": spec.loss_fn,
            "topology": self.topology,
            **dict(case.engine_kwargs),
            **options.pipe,
        }
        stage_modules: list[nn.Module] | None = None
        self.probe: Probe | None = None
        if not case.default_path:
            wrappers = dialect.wrap_stages(self.plan)
            if case.probe:
                self.probe = Probe()
                for wrapper in wrappers:
                    self.probe.attach(wrapper)
            stage_modules = list(wrappers)
        if mistake == "no-loss-fn":
            del kwargs["loss_fn"]
        elif mistake == "no-config":
            del kwargs["config"]
        elif mistake == "topology":
            kwargs["topology"] = dialect.make_topology(case.stages * 2, 1)
        elif mistake == "stage-count":
            every: list[nn.Module] = list(dialect.wrap_stages(self.plan))
            stage_modules = every[:-1]
        elif mistake == "unknown-kwarg":
            kwargs["no_such_option"] = 1
        module = dialect.pipe_engine(self.plan, stage_modules=stage_modules, **kwargs)
        self.engine: RuntimeEngine = dialect.runtime_engine(
            module, config=self.config, **options.runtime
        )
        self.local = sorted(int(k) for k in dialect.local_stages(self.engine))

    def params(self) -> dict[int, dict[str, torch.Tensor]]:
        """This rank's stages' parameters by their original names (every name of a tied one)."""
        return {
            k: {
                name: p.detach().cpu().clone()
                for name, p in self.plan.stages[k].named_parameters(remove_duplicate=False)
            }
            for k in self.local
        }

    def train(self, batches: Sequence[Any], steps: int) -> tuple[list[float], list[Any]]:
        """Call ``train_batch`` ``steps`` times on ``batches``; losses and params after each."""
        stream = iter(batches)
        losses: list[float] = []
        snapshots: list[Any] = []
        for step in range(1, steps + 1):
            loss = self.engine.train_batch(data_iter=stream)
            losses.append(_loss_value(loss, f"train_batch() of step {step}", self.local))
            snapshots.append(self.params())
        return losses, snapshots


def _loss_value(loss: Any, what: str, stages: Sequence[int]) -> float:
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return float(loss.detach().cpu().item())
    if isinstance(loss, float | int) and not isinstance(loss, bool):
        return float(loss)
    shown = (
        f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else repr(loss)
    )
    raise ContractError(
        f"{what} returned {shown} on the rank of stage(s) {list(stages)}; it must return the "
        "mean micro-batch loss as a one-element tensor on every rank, as DeepSpeed's "
        "PipelineEngine does"
    )


# -- the kinds of case ----------------------------------------------------------------------


def _run_train(
    dialect: Dialect,
    case: Case,
    options: EngineOptions,
    out_dir: str,
    multi: bool,
    partial: Record,
) -> Record:
    built = _Built(dialect, case, options, multi)
    if built.probe is not None:
        partial["received"] = built.probe.received  # filled in as training goes
    batches = train_stream(case, built.replica)
    losses, params = built.train(batches, case.steps)
    eval_loss = _loss_value(
        built.engine.eval_batch(iter(eval_stream(case, built.replica))),
        "eval_batch()",
        built.local,
    )
    return {
        "stages": built.local,
        "replica": built.replica,
        "losses": losses,
        "params": params,
        "eval_loss": eval_loss,
        "received": None if built.probe is None else built.probe.received,
    }


def _run_checkpoint(
    dialect: Dialect,
    case: Case,
    options: EngineOptions,
    out_dir: str,
    multi: bool,
    partial: Record,
) -> Record:
    ckpt = str(Path(out_dir) / f"checkpoint-{case.id}")
    first = _Built(dialect, case, options, multi)
    batches = train_stream(case, first.replica)
    saved_at = case.steps - 1
    losses, params = first.train(batches[: saved_at * case.gas], saved_at)
    save = getattr(first.engine, "save_checkpoint", None)
    if not callable(save):
        raise ContractError(
            "the dialect declares checkpoints but its engine has no "
            "save_checkpoint(save_dir, tag=...) method (DeepSpeed's signature)"
        )
    save(ckpt, tag="suite")
    more_losses, more_params = first.train(batches[saved_at * case.gas :], 1)
    # A fresh engine on other weights (seed 7): everything must come from the checkpoint.
    resumed = _Built(dialect, case, options, multi, seed=7)
    load = getattr(resumed.engine, "load_checkpoint", None)
    if not callable(load):
        raise ContractError(
            "the dialect declares checkpoints but its engine has no "
            "load_checkpoint(load_dir, tag=...) method (DeepSpeed's signature)"
        )
    load(ckpt, tag="suite")
    resumed_losses, resumed_params = resumed.train(batches[saved_at * case.gas :], 1)
    return {
        "stages": first.local,
        "replica": first.replica,
        "losses": losses + more_losses,
        "params": params + more_params,
        "resumed_stages": resumed.local,
        "resumed_losses": resumed_losses,
        "resumed_params": resumed_params,
    }


def _run_build_error(
    dialect: Dialect,
    case: Case,
    options: EngineOptions,
    out_dir: str,
    multi: bool,
    partial: Record,
) -> Record:
    built = _Built(dialect, case, options, multi, mistake=case.mistake)
    if case.mistake == "untied":
        # Refusing the tie when training starts is acceptable too; training it untied is not.
        built.train(train_stream(case, built.replica), 1)
    return {"outcome": "no error", "stages": built.local}


def _run_run_error(
    dialect: Dialect,
    case: Case,
    options: EngineOptions,
    out_dir: str,
    multi: bool,
    partial: Record,
) -> Record:
    built = _Built(dialect, case, options, multi)
    losses, _ = built.train(train_stream(case, built.replica), case.steps)
    return {"outcome": "no error", "stages": built.local, "losses": losses}


_RUNNERS: dict[str, Callable[[Dialect, Case, EngineOptions, str, bool, Record], Record]] = {
    "train": _run_train,
    "checkpoint": _run_checkpoint,
    "build-error": _run_build_error,
    "run-error": _run_run_error,
}
