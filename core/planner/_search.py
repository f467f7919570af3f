"""The planner: every layout a dialect offers, predicted, and the fastest that fits.

[Note: layout search]
The search space, for ``W`` ranks and a global batch ``G``: tensor degree ``t`` (1, or a
divisor of ``W`` when the dialect offers tensor parallelism and a plan says which modules to
shard), pipeline ranks ``p`` dividing ``W / t``, ``d = W / (p t)`` replicas in each data mode the
dialect offers, each schedule it runs with each number of stages per rank it allows (``p v``
stages, at most the split points the model has), each micro-batch count ``m`` that divides the
per-replica batch ``G / d`` (up to ``4 p v``, past which the bubble hardly shrinks and the
per-micro-batch costs the model does not see take over; ``micro_batches=`` overrides), and each
recomputation option. The split points of ``n`` stages are the exact balancing solver's
(:mod:`pipedialect.cost.balance`): the cuts minimising the slowest stage's work under ``t``.

Each candidate is predicted by the cost model and the simulator, in the order of a lower bound
on its step time (its busiest rank's computation plus its blocking collectives); the search
stops once that bound exceeds the fastest layout found that fits, and a candidate whose state
alone (one micro-batch of activations per stage) exceeds the memory is not simulated. Neither
shortcut can drop the answer: both bounds hold for every simulation (``exhaustive=True``
predicts every candidate, and the test suite compares the two). Among layouts equally fast,
the one with the smaller peak memory wins, then the smaller :meth:`Layout.key`.

Why the others lose: a candidate slower than the best is compared with it term by term,
``step = communication + idle + busiest rank``, where communication is what the step loses
to messages and collectives (the step minus the same step with free communication), idle the
rest of the busiest rank's wait (the bubble), and the busiest rank's computation splits into the
mean over ranks (more work per rank: recomputation, fewer ranks sharing it) and the excess of
the busiest rank (imbalance). The largest difference names the reason.

After the search, the split points of the fastest layouts are refined ([Note: refining split
points]); ``refine=0`` keeps the solver's, and the comparison with brute force is made so.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..cost import (
    TORCH_SCHEDULES,
    Chain,
    Cluster,
    Layout,
    Prediction,
    Program,
    deepspeed_program,
    lower_bounds,
    place,
    predict,
    stage_weights,
    torch_program,
)
from ..errors import ConfigError
from ._offer import DEEPSPEED_SCHEDULE, Offer

__all__ = ["LayoutPlan", "Row", "search"]

_SLACK = 1e-9


@dataclass(frozen=True)
class Row:
    """One line of the planner's table."""

    layout: Layout
    #: None when the layout was not simulated.
    prediction: Prediction | None
    #: ``best``, ``slower ...``, ``does not fit ...``, ``refused ...``, ``pruned ...``.
    verdict: str


@dataclass(frozen=True)
class LayoutPlan:
    """The planner's answer: the fastest layout that fits, and what every other one does."""

    best: Prediction
    #: Simulated layouts, fastest first (those that fit before those that do not), then the
    #: others.
    rows: tuple[Row, ...]
    cluster: Cluster
    offer: Offer
    #: How many layouts were considered, simulated, and left out without a simulation.
    considered: int
    simulated: int
    notes: tuple[str, ...] = ()
    chains: Mapping[str, Chain] = field(default_factory=dict, repr=False)
    programs: Mapping[tuple[str, int, int, int], Program] = field(default_factory=dict, repr=False)

    @property
    def layout(self) -> Layout:
        """The chosen layout."""
        return self.best.layout

    def partition_kwargs(self) -> dict[str, Any]:
        """``partition(model, **plan.partition_kwargs())``."""
        return self.layout.partition_kwargs()

    def pipe_engine_kwargs(self, dialect: Any | None = None) -> dict[str, Any]:
        """The dialect's own ``pipe_engine`` options; with ``dialect``, ``topology`` too."""
        kwargs = self.layout.pipe_engine_kwargs()
        if dialect is not None:
            kwargs["topology"] = self.layout.topology(dialect)
        return kwargs

    def config(self) -> dict[str, Any]:
        """The batch sizes of the config."""
        return self.layout.config()

    def table(self, top: int = 10) -> str:
        """The ``top`` fastest layouts that fit, then one line per other kind of verdict."""
        return format_table(self.rows, top)

    def describe(self, top: int = 10) -> str:
        """The chosen layout, the table, and what the dialect does not offer."""
        b = self.best
        lay = b.layout
        engine = {**self.pipe_engine_kwargs(), "topology": _Grid(lay)}
        lines = [
            f"Plan for {self.cluster.world_size} ranks on the {self.offer.dialect} dialect: "
            f"{lay.describe()}",
            f"  predicted step {_ms(b.step_time)}, {b.throughput:,.1f} samples/s, bubble "
            f"{b.bubble:.1%}, peak memory {_bytes(max(b.peak_memory))} of "
            f"{_bytes(self.cluster.memory_per_rank)} per rank",
            f"  partition(model, {_kwargs(self.partition_kwargs())})",
            f"  pipe_engine(plan, {_kwargs(engine)})",
            f"  config: {json.dumps(self.config())}",
            f"{self.considered} layouts considered, {self.simulated} simulated",
            "",
            self.table(top),
        ]
        notes = [*self.offer.not_offered, *self.notes]
        if notes:
            lines += ["", *[f"note: {n}" for n in notes]]
        return "\n".join(lines)

    def prediction(self, layout: Layout) -> Prediction:
        """The prediction of ``layout`` (one of the rows, or any layout of the same chains)."""
        for row in self.rows:
            if row.layout == layout and row.prediction is not None:
                return row.prediction
        chain = self.chains[layout.recompute or ""]
        return predict(
            chain,
            layout,
            self.cluster,
            _program(self.programs, layout),
            split_first_stage=self.offer.split_first_stage,
        )

    def write_chrome_trace(self, path: str | Path, layout: Layout | None = None) -> Path:
        """Write the predicted step of ``layout`` (default: the chosen one) as a Chrome trace,
        in the format :func:`pipedialect.trace` writes (see :func:`chrome_trace`)."""
        from ._trace import write_chrome_trace

        return write_chrome_trace(self.prediction(layout or self.layout), path)


class _Grid:
    """How :meth:`LayoutPlan.describe` shows the topology argument."""

    def __init__(self, layout: Layout) -> None:
        self.text = f"<pipe {layout.pipeline} x data {layout.data_parallel}"
        if layout.tensor_parallel > 1:
            self.text += f" x tensor {layout.tensor_parallel}"
        self.text += ">"

    def __repr__(self) -> str:
        return self.text


def _kwargs(kwargs: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def _ms(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:,.1f} us"
    if seconds < 10:
        return f"{seconds * 1e3:,.1f} ms"
    return f"{seconds:,.2f} s"


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def format_table(rows: Sequence[Row], top: int) -> str:
    """The table of :meth:`LayoutPlan.table`."""
    shown = [(r, r.prediction) for r in rows if r.prediction is not None][:top]
    header = ("#", "layout", "step", "samples/s", "bubble", "peak mem", "verdict")
    body = []
    for i, (r, p) in enumerate(shown, 1):
        body.append(
            (
                str(i),
                r.layout.describe(),
                _ms(p.step_time),
                f"{p.throughput:,.1f}",
                f"{p.bubble:.1%}",
                _bytes(max(p.peak_memory)),
                r.verdict,
            )
        )
    widths = [max(len(x[c]) for x in (header, *body)) for c in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in (header, *body)
    ]
    shown_ids = {id(r) for r, _ in shown}
    rest = [r for r in rows if id(r) not in shown_ids]
    if rest:
        counts: dict[str, int] = {}
        for r in rest:
            kind = r.verdict.split(":")[0].split(" by ")[0]
            counts[kind] = counts.get(kind, 0) + 1
        lines.append("not shown: " + ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items())))
    return "\n".join(lines)


# -- enumeration --------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _program(
    programs: dict[tuple[str, int, int, int], Program] | Mapping[Any, Program], layout: Layout
) -> Program:
    key = (layout.schedule, layout.pipeline, layout.micro_batches, layout.stages_per_rank)
    found = programs.get(key)
    if found is None:
        found = build_program(*key)
        if isinstance(programs, dict):
            programs[key] = found
    return found


@functools.lru_cache(maxsize=512)
def build_program(
    schedule: str, pipeline: int, micro_batches: int, stages_per_rank: int
) -> Program:
    """The program of ``schedule`` on ``pipeline`` ranks (``stages_per_rank`` stages each);
    programs are immutable, so they are built once per process."""
    if schedule == DEEPSPEED_SCHEDULE:
        return deepspeed_program(pipeline * stages_per_rank, micro_batches)
    return torch_program(schedule, pipeline, micro_batches, stages_per_rank)


def _placement(schedule: str, pipeline: int, stages_per_rank: int) -> tuple[int, ...]:
    if schedule == DEEPSPEED_SCHEDULE:
        return tuple(range(pipeline))
    return place(pipeline * stages_per_rank, pipeline, TORCH_SCHEDULES[schedule].placement)


@dataclass(frozen=True)
class _Candidate:
    layout: Layout
    bound: float
    memory_bound: float


def _cuts(
    chain: Chain, stages: int, layout: Layout, cluster: Cluster, cache: dict[Any, Any]
) -> tuple[int, ...] | None:
    key = (id(chain), stages, layout.tensor_parallel)
    if key not in cache:
        if stages == 1:
            cache[key] = ()
        elif stages > chain.max_stages:
            cache[key] = None
        else:
            cache[key] = chain.balanced_cuts(stage_weights(chain, layout, cluster), stages)
    result: tuple[int, ...] | None = cache[key]
    return result


def enumerate_layouts(
    chains: Mapping[str, Chain],
    cluster: Cluster,
    offer: Offer,
    global_batch: int,
    *,
    micro_batches: Sequence[int] | None = None,
    tensor_plan: Mapping[str, str] | None = None,
    max_stages_per_rank: int = 4,
    recompute_options: Mapping[str, tuple[str, ...] | None] | None = None,
) -> Iterator[Layout | Row]:
    """Every layout of the search space ([Note: layout search]), or a :class:`Row` saying why
    a combination cannot run."""
    world = cluster.world_size
    tensor_degrees = [1]
    if offer.tensor_parallel and tensor_plan:
        tensor_degrees = _divisors(world)
    solver_cache: dict[Any, Any] = {}
    for t in tensor_degrees:
        for p in _divisors(world // t):
            d = world // (p * t)
            modes = offer.data_modes(d)
            if global_batch % d:
                continue
            per_replica = global_batch // d
            for mode in modes:
                for schedule in offer.schedules:
                    if not offer.runs(mode, schedule):
                        continue
                    for v in offer.stages_per_rank(schedule, max_stages_per_rank):
                        n = p * v
                        counts = (
                            [m for m in micro_batches if per_replica % m == 0]
                            if micro_batches is not None
                            else [m for m in _divisors(per_replica) if m <= 4 * n]
                        )
                        for m in counts:
                            for label, chain in chains.items():
                                base = Layout(
                                    dialect=offer.dialect,
                                    schedule=schedule,
                                    pipeline=p,
                                    stages_per_rank=v,
                                    data_parallel=d,
                                    data_parallel_mode=mode,
                                    tensor_parallel=t,
                                    micro_batches=m,
                                    micro_batch_size=per_replica // m,
                                    recompute=label or None,
                                    engine_options=offer.engine_options(
                                        schedule, v, mode, t, tensor_plan
                                    ),
                                    recompute_patterns=(recompute_options or {}).get(label),
                                )
                                cuts = _cuts(chain, n, base, cluster, solver_cache)
                                if cuts is None:
                                    yield Row(
                                        base,
                                        None,
                                        f"refused: the model has split points for at most "
                                        f"{chain.max_stages} stages, not {n}",
                                    )
                                    continue
                                yield replace(
                                    base, cuts=cuts, split_points=chain.split_points(cuts)
                                )


def search(
    chains: Mapping[str, Chain],
    cluster: Cluster,
    offer: Offer,
    global_batch: int,
    *,
    micro_batches: Sequence[int] | None = None,
    tensor_plan: Mapping[str, str] | None = None,
    max_stages_per_rank: int = 4,
    recompute_options: Mapping[str, tuple[str, ...] | None] | None = None,
    exhaustive: bool = False,
    refine: int = 3,
    notes: Sequence[str] = (),
) -> LayoutPlan:
    """Predict the layouts of the search space and choose ([Note: layout search]); then move
    the split points of the ``refine`` fastest layouts that fit while that makes their
    simulated step faster ([Note: refining split points]).

    Raises:
        ConfigError: no layout fits (the message names the closest), or none can run at all.
    """
    if global_batch < 1:
        raise ConfigError(f"global_batch must be at least 1, got {global_batch}")
    if not chains:
        raise ConfigError("the planner needs at least one chain (recomputation option)")
    rows: list[Row] = []
    candidates: list[_Candidate] = []
    programs: dict[tuple[str, int, int, int], Program] = {}
    refused: dict[tuple[str, int, int, int], str] = {}
    for item in enumerate_layouts(
        chains,
        cluster,
        offer,
        global_batch,
        micro_batches=micro_batches,
        tensor_plan=tensor_plan,
        max_stages_per_rank=max_stages_per_rank,
        recompute_options=recompute_options,
    ):
        if isinstance(item, Row):
            rows.append(item)
            continue
        chain = chains[item.recompute or ""]
        bound, memory = lower_bounds(
            chain,
            item,
            cluster,
            _placement(item.schedule, item.pipeline, item.stages_per_rank),
            split_first_stage=offer.split_first_stage,
        )
        candidates.append(_Candidate(item, bound, memory))
    if not candidates:
        raise ConfigError(
            "no layout can run: "
            + ("; ".join(sorted({r.verdict for r in rows})) or "the search space is empty")
        )
    candidates.sort(key=lambda c: (c.bound, c.layout.key()))
    best: Prediction | None = None
    predicted: list[Prediction] = []
    for c in candidates:
        if not exhaustive and best is not None and c.bound > best.step_time * (1 + _SLACK):
            rows.append(
                Row(
                    c.layout,
                    None,
                    f"pruned: at least {_ms(c.bound)} per step, slower than the best",
                )
            )
            continue
        if not exhaustive and c.memory_bound > cluster.memory_per_rank:
            rows.append(
                Row(
                    c.layout,
                    None,
                    f"does not fit: at least {_bytes(c.memory_bound)} on a rank, of "
                    f"{_bytes(cluster.memory_per_rank)}",
                )
            )
            continue
        key = (
            c.layout.schedule,
            c.layout.pipeline,
            c.layout.micro_batches,
            c.layout.stages_per_rank,
        )
        if key not in programs and key not in refused:
            try:
                programs[key] = build_program(*key)
            except ConfigError as exc:
                refused[key] = str(exc)
        if key in refused:
            rows.append(Row(c.layout, None, f"refused: {refused[key]}"))
            continue
        pred = predict(
            chains[c.layout.recompute or ""],
            c.layout,
            cluster,
            programs[key],
            split_first_stage=offer.split_first_stage,
        )
        predicted.append(pred)
        if pred.fits and (best is None or _rank_key(pred) < _rank_key(best)):
            best = pred
    if best is None:
        if predicted:
            closest = min(predicted, key=lambda p: max(p.peak_memory))
            need = f"needs {_bytes(max(closest.peak_memory))}"
            name = closest.layout.describe()
        else:
            least = min(candidates, key=lambda c: c.memory_bound)
            need = f"needs at least {_bytes(least.memory_bound)}"
            name = least.layout.describe()
        hint = f"; the closest, {name}, {need}"
        raise ConfigError(
            f"no layout of the {offer.dialect} dialect fits {_bytes(cluster.memory_per_rank)} "
            f"per rank{hint}. Add ranks or memory, try recomputation (recompute=), or a "
            "dialect that shards (FSDP)"
        )
    fitting = sorted((p for p in predicted if p.fits), key=_rank_key)
    if refine:
        refined = [
            _refine(p, chains[p.layout.recompute or ""], cluster, programs, offer)
            for p in fitting[:refine]
        ]
        fitting = sorted(refined + fitting[refine:], key=_rank_key)
        best = fitting[0]
    too_big = sorted((p for p in predicted if not p.fits), key=lambda p: max(p.peak_memory))
    ordered = [
        Row(
            p.layout,
            p,
            _verdict(p, best, chains, programs, cluster, offer, explain=i < _EXPLAINED),
        )
        for i, p in enumerate(fitting)
    ]
    ordered += [
        Row(
            p.layout,
            p,
            f"does not fit: rank {p.peak_memory.index(max(p.peak_memory))} needs "
            f"{_bytes(max(p.peak_memory))}",
        )
        for p in too_big
    ]
    return LayoutPlan(
        best=best,
        rows=tuple(ordered + rows),
        cluster=cluster,
        offer=offer,
        considered=len(candidates) + len(rows),
        simulated=len(predicted),
        notes=tuple(notes),
        chains=dict(chains),
        programs=programs,
    )


def _valid_cuts(chain: Chain, cuts: Sequence[int]) -> bool:
    """Whether ``cuts`` (ascending) are a partition the chain allows ([Note: balance solver])."""
    n = len(chain.cuts)
    if any(not 0 <= c < n for c in cuts) or any(a >= b for a, b in itertools.pairwise(cuts)):
        return False
    if cuts and chain.last_cut_below is not None and cuts[-1] >= chain.last_cut_below:
        return False
    nested = chain.nested_from
    return nested is None or not any(nested[j] <= i < j for i in cuts for j in cuts)


def _refine(
    pred: Prediction,
    chain: Chain,
    cluster: Cluster,
    programs: Mapping[tuple[str, int, int, int], Program],
    offer: Offer,
) -> Prediction:
    """[Note: refining split points]
    The solver's split points minimise the slowest stage's work, which sets the step once
    there are many more micro-batches than stages; with few, the ramp up and down matters too,
    and on random chains a split up to 16% faster (1F1B, ``m = p``) can exist. So the leading
    layouts are improved by shifting a run of consecutive split points (one or more) by one
    candidate while the simulated step gets shorter and the layout still fits: a local search
    from the solver's answer, so a refined layout is never slower than the solver's."""
    program = _program(programs, pred.layout)
    best = pred
    improved = True
    while improved:
        improved = False
        count = len(best.layout.cuts)
        for i, j, delta in itertools.product(range(count), range(count), (-1, 1)):
            if j < i:
                continue
            cuts = list(best.layout.cuts)
            for k in range(i, j + 1):
                cuts[k] += delta
            if not _valid_cuts(chain, cuts):
                continue
            layout = replace(best.layout, cuts=tuple(cuts), split_points=chain.split_points(cuts))
            trial = predict(
                chain, layout, cluster, program, split_first_stage=offer.split_first_stage
            )
            if trial.fits and _rank_key(trial) < _rank_key(best):
                best, improved = trial, True
    return best


def _rank_key(p: Prediction) -> tuple[float, float, tuple[Any, ...]]:
    return (p.step_time, max(p.peak_memory), p.layout.key())


#: Rows whose verdict is explained term by term (each costs one more simulation).
_EXPLAINED = 20


def _verdict(
    pred: Prediction,
    best: Prediction,
    chains: Mapping[str, Chain],
    programs: Mapping[tuple[str, int, int, int], Program],
    cluster: Cluster,
    offer: Offer,
    *,
    explain: bool,
) -> str:
    """``best``, or why ``pred`` is slower ([Note: layout search])."""
    if pred is best:
        return "best"
    slower = pred.step_time / best.step_time - 1 if best.step_time else 0.0
    if pred.step_time <= best.step_time:
        more = max(pred.peak_memory) > max(best.peak_memory)
        return "as fast; more memory" if more else "as fast"
    head = f"slower by {slower:.1%} (+{_ms(pred.step_time - best.step_time)})"
    if not explain:
        return head
    terms_c = _terms(pred, chains, programs, cluster, offer)
    terms_b = _terms(best, chains, programs, cluster, offer)
    deltas = {k: terms_c[k] - terms_b[k] for k in terms_c}
    reason = max(deltas, key=lambda k: deltas[k])
    if reason == "work":
        reason = (
            "recomputation"
            if pred.layout.recompute and not best.layout.recompute
            else "more work per rank"
        )
    return f"{head}: {reason}"


def _terms(
    pred: Prediction,
    chains: Mapping[str, Chain],
    programs: Mapping[tuple[str, int, int, int], Program],
    cluster: Cluster,
    offer: Offer,
) -> dict[str, float]:
    layout = pred.layout
    free = predict(
        chains[layout.recompute or ""],
        layout,
        cluster,
        programs[(layout.schedule, layout.pipeline, layout.micro_batches, layout.stages_per_rank)],
        split_first_stage=offer.split_first_stage,
        without_communication=True,
    )
    busy = free.simulation.busy
    top, mean = max(busy), sum(busy) / len(busy)
    return {
        "communication": pred.step_time - free.step_time,
        "bubble": free.step_time - top,
        "imbalance": top - mean,
        "work": mean,
    }
