"""``plan_layout``: a model, the machines and a batch in; the layout to run out."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from ..cost import Cluster, checkpoint_label, model_chains, profile_model, timing_threads
from ..errors import ConfigError
from ._calibrate import load_calibration
from ._offer import offer_of
from ._search import LayoutPlan, search

__all__ = ["parse_bytes", "parse_rate", "plan_layout"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_bytes(value: float | str, what: str = "size") -> float:
    """Bytes from a number or a string such as ``"80GiB"``, ``"512 MB"``."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-z]*)\s*", value)
        if match and match.group(2).lower() in _UNITS:
            try:
                return float(match.group(1)) * _UNITS[match.group(2).lower()]
            except ValueError:
                pass
    raise ConfigError(
        f"{what} must be a number of bytes or a string such as '80GiB' or '512MB', got {value!r}"
    )


def parse_rate(value: float | str, what: str = "bandwidth") -> float:
    """Bytes per second from a number or a string such as ``"100GB/s"``, ``"25 GiB/s"``."""
    if isinstance(value, str):
        value = value.strip()
        value = value[:-2] if value.lower().endswith("/s") else value
    return parse_bytes(value, what)


def plan_layout(
    model: nn.Module,
    example_inputs: Mapping[str, Any],
    *,
    world_size: int,
    memory_per_rank: float | str,
    global_batch: int,
    bandwidth: float | str | None = None,
    dialect: Any = "torch",
    latency: float | None = None,
    recompute: str | Sequence[str] | None = None,
    tensor_parallel: Mapping[str, str] | None = None,
    measure_time: bool = False,
    repeats: int = 3,
    flops_per_second: float | None = None,
    micro_batches: Sequence[int] | None = None,
    schedules: Sequence[str] | None = None,
    max_stages_per_rank: int = 4,
    optimizer_states: int = 2,
    weight_fraction: float = 0.5,
    action_overhead: float | None = None,
    step_overhead: float | None = None,
    batch_size: int | None = None,
    candidates: Sequence[str] | None = None,
    concrete_args: Mapping[str, Any] | None = None,
    leaf_modules: Sequence[str | type[nn.Module]] | None = None,
    exhaustive: bool = False,
    refine: int = 3,
    every_rank: bool = True,
) -> LayoutPlan:
    """Choose how to run ``model`` on ``world_size`` ranks: the fastest layout that fits.

    The model is measured once on ``example_inputs`` (one micro-batch); every layout the
    dialect offers is predicted by the cost model and the schedule simulator, and the fastest
    one whose every rank fits ``memory_per_rank`` is returned with the table of the others
    (see ``docs/planning.rst``).

    Args:
        model: the model, unchanged (it may be on the meta device unless ``measure_time``).
        example_inputs: ``{parameter name: tensor}``, one micro-batch, as for ``partition``.
        world_size: ranks (one accelerator each).
        memory_per_rank: bytes, or a string such as ``"80GiB"``.
        global_batch: samples per optimizer step over all replicas.
        bandwidth: bytes per second of one link, or a string such as ``"100GB/s"``; default:
            the stored calibration's ([Note: calibration], ``pipedialect plan --calibrate``),
            whose collectives then also run at its measured all-reduce bandwidth.
        dialect: the dialect (a name or a :class:`~pipedialect.Dialect`); only layouts it runs
            are proposed.
        latency: seconds per message and per collective step (default: the calibration's, else
            0).
        recompute: recomputation to consider besides none: module paths or glob patterns, as
            ``partition(..., recompute=)`` takes them.
        tensor_parallel: ``{module glob: "colwise" | "rowwise"}``: the modules tensor
            parallelism would shard (considered when the dialect offers it).
        measure_time: time the model on this machine (torch pinned to one rank's share of the
            cores: the cores over the ranks on this host under ``torch.distributed``, else over
            ``world_size``); else ``flops_per_second`` turns counted FLOPs into seconds.
        repeats: timed runs with ``measure_time`` (the median per module is taken).
        flops_per_second: the target's sustained FLOP/s per rank.
        micro_batches: the micro-batch counts to try (default: divisors of the per-replica
            batch, up to 4 per stage).
        schedules: restrict the schedules to these (names the dialect runs).
        max_stages_per_rank: the most stages per rank looped schedules may get.
        optimizer_states: optimizer-state tensors per trainable parameter (Adam: 2).
        weight_fraction: the share of each backward in its weight pass.
        action_overhead: seconds every forward, backward and weight pass costs beyond its work
            (default: the stored calibration's for this dialect and machine, else 0).
        step_overhead: seconds every step costs beyond its schedule (likewise). A stored
            calibration also adds the memory each rank's runtime holds to every predicted peak.
        batch_size: samples in ``example_inputs`` (default: their first dimension).
        candidates: the modules a stage may end after (default: the model's blocks, the
            layers of its ``base_model_pp_plan`` or of its outermost ``ModuleList``; pass
            ``profile_model(model, ...).candidates`` to consider every module that can).
        concrete_args, leaf_modules: as for ``partition``.
        exhaustive: predict every layout instead of stopping once none can win.
        refine: how many of the fastest layouts get their split points moved to faster
            neighbours of the solver's (0: the solver's split points as they are).
        every_rank: plan on every rank (the default): under ``torch.distributed`` with
            ``measure_time``, rank 0's measurement is shared with every rank, so all choose the
            same layout, and a call on some ranks only is refused with a
            :class:`~pipedialect.PlanDisagreementError` naming the missing ranks. False: plan
            with this rank's own measurement and no collective (to plan on one rank and send
            the layout to the others yourself). Without ``measure_time`` planning involves no
            collective and every rank gets the same layout either way.

    Raises:
        ConfigError: bad arguments, or no layout fits (the message names the closest).
        PlanDisagreementError: with ``measure_time`` under ``torch.distributed``, some rank
            did not call it (``every_rank=True``).
    """
    from ..dialect import Dialect
    from ..plugins import get_dialect

    target = get_dialect(dialect) if isinstance(dialect, str) else dialect
    if not isinstance(target, Dialect):
        raise ConfigError(f"dialect must be a dialect name or a Dialect, got {dialect!r}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ConfigError(f"world_size must be a positive integer, got {world_size!r}")
    if not isinstance(global_batch, int) or isinstance(global_batch, bool) or global_batch < 1:
        raise ConfigError(f"global_batch must be a positive integer, got {global_batch!r}")
    offer = offer_of(target, schedules)
    calibration = load_calibration(target.name)
    if bandwidth is None and calibration is None:
        raise ConfigError(
            f"bandwidth is needed: no calibration of the {target.name} dialect is stored for "
            "this machine; pass bandwidth= (e.g. '100GB/s') or run `pipedialect plan "
            "--calibrate` (pipedialect.planner.calibrate) once"
        )

    def calibrated(given: float | None, field: str) -> float:
        if given is not None:
            return given
        return float(getattr(calibration, field)) if calibration is not None else 0.0

    cluster = Cluster(
        world_size=world_size,
        memory_per_rank=parse_bytes(memory_per_rank, "memory_per_rank"),
        bandwidth=(
            parse_rate(bandwidth) if bandwidth is not None else calibrated(None, "bandwidth")
        ),
        latency=calibrated(latency, "latency"),
        optimizer_states=optimizer_states,
        action_overhead=calibrated(action_overhead, "action_overhead"),
        step_overhead=calibrated(step_overhead, "step_overhead"),
        collective_bandwidth=(
            calibration.collective_bandwidth
            if calibration is not None and bandwidth is None
            else None
        ),
        memory_overhead=calibration.memory_overhead if calibration is not None else 0.0,
        shard_bandwidth=(
            calibration.shard_bandwidth or None
            if calibration is not None and bandwidth is None
            else None
        ),
        fsdp_unit_overhead=calibration.fsdp_unit_overhead if calibration is not None else 0.0,
        tensor_module_overhead=(
            calibration.tensor_module_overhead if calibration is not None else 0.0
        ),
        accumulate_seconds_per_byte=(
            calibration.accumulate_seconds_per_byte if calibration is not None else 0.0
        ),
        pack_seconds_per_byte=calibration.pack_seconds_per_byte if calibration is not None else 0.0,
        cores=_host_cores(),
    )
    calibration_note = None
    if calibration is not None:
        calibration_note = f"runtime costs {calibration.describe()}"
    options: list[Sequence[str] | None] = [None]
    if recompute is not None:
        options.append([recompute] if isinstance(recompute, str) else list(recompute))
    profile = None
    if measure_time:
        profile = profile_model(
            model,
            example_inputs=example_inputs,
            concrete_args=concrete_args,
            leaf_modules=leaf_modules,
            measure_time=True,
            repeats=repeats,
            every_rank=every_rank,
            # Outside torch.distributed: the share of the cores each of world_size ranks on
            # this machine would get (a CPU run's ranks share it).
            threads=timing_threads(world_size),
        )
    chains = model_chains(
        model,
        example_inputs,
        profile=profile,
        recompute_options=options,
        tensor_parallel=tensor_parallel if offer.tensor_parallel else None,
        measure_time=measure_time,
        repeats=repeats,
        flops_per_second=flops_per_second,
        batch_size=batch_size,
        candidates=candidates,
        concrete_args=concrete_args,
        leaf_modules=leaf_modules,
        weight_fraction=weight_fraction,
        every_rank=every_rank,
    )
    notes = [] if calibration_note is None else [calibration_note]
    if profile is not None and profile.timing is not None:
        notes.append(f"the model was {profile.timing.describe()}")
    if tensor_parallel and not offer.tensor_parallel:
        notes.append("the tensor_parallel plan is ignored: the dialect does not offer it")
    if offer.tensor_parallel and not tensor_parallel:
        notes.append("tensor parallelism: pass tensor_parallel={glob: style} to consider it")
    patterns = {checkpoint_label(o): (tuple(o) if o else None) for o in options}
    return search(
        chains,
        cluster,
        offer,
        global_batch,
        micro_batches=micro_batches,
        tensor_plan=tensor_parallel,
        max_stages_per_rank=max_stages_per_rank,
        recompute_options=patterns,
        exhaustive=exhaustive,
        refine=refine,
        notes=notes,
    )


def _host_cores() -> int:
    """The cores this process may run on: those the ranks of a plan measured here share
    ([Note: ranks sharing cores] in ``cost._simulate``)."""
    import os

    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
