"""The timeline of a pipeline: what each rank computed, sent and waited for, and when.

:func:`trace` records, on every rank, the forward and backward of each stage for each
micro-batch, the optimizer step and (where the dialect reports them) the sends and receives,
while the engine's ``train_batch``/``eval_batch`` run inside it:

.. code-block:: python

   with pipedialect.trace(engine, "timeline.json") as recorded:
       for _ in range(4):
           engine.train_batch(data_iter)
   print(recorded.timeline.describe())

On leaving, the ranks' spans are gathered (every rank gets the whole :class:`Timeline`), and
rank 0 writes a Chrome trace (``chrome://tracing``, https://ui.perfetto.dev: ``pid`` is the rank,
``tid`` the stage) and a PNG of the schedule, ranks as rows. The measured bubble of each rank is
``1 - busy / window``: ``busy`` is the rank's forward and backward time, ``window`` runs from the
first forward of a step to its last backward on any rank; beside it the theoretical bubble of
GPipe and 1F1B, ``(p - 1) / (v m + p - 1)`` for ``p`` pipeline ranks holding ``v`` stages each and
``m`` micro-batches. Both are :mod:`pipedialect.cost`'s ([Note: the bubble]), which the
planner's predictions use too.

[Note: how spans are taken]
Forward and backward are the same on every dialect: a forward pre/post hook pair on the module
that runs each stage (its :class:`~pipedialect.StageWrapper`) times its forward; the backward of
micro-batch ``k`` starts when the gradient of one of that forward's outputs arrives (a tensor
hook) and ends with the last gradient the stage computes for it (hooks on that forward's inputs,
and on the stage's parameters while its backward is open). A forward run again inside a backward
(activation recomputation) is part of that backward, not a new micro-batch. Every hook returns
None and every wrapper passes its call through, so tracing changes no value. The stages come
from the engine's dialect (``Dialect.engine_state``: each stage's id and the module that runs
it), which must declare ``tracing`` (``pipedialect.dialect`` [Note: features through the
contract]). Sends, receives and the dialect's own optimizer step are taken by the dialect, in
its ``Dialect.instrument(engine, recorder)`` hook, so the core imports no runtime. Clocks are
``time.perf_counter_ns()`` relative to an origin every rank takes right after a barrier.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .contracts import Capability, HeldStage, Instrumented, RuntimeEngine
from .cost import idle_fractions, predicted_bubble, step_window
from .dialect import Dialect, require_capability
from .errors import ConfigError

__all__ = [
    "COMPUTE_KINDS",
    "Recorder",
    "Span",
    "StepBubble",
    "Timeline",
    "Trace",
    "patch_attribute",
    "trace",
]

logger = logging.getLogger(__name__)

#: The span kinds that count as busy in the bubble.
COMPUTE_KINDS = frozenset({"forward", "backward"})

_SHORT = {"forward": "F", "backward": "B"}


@dataclass(frozen=True)
class Span:
    """One interval of one rank's time."""

    #: ``"forward"``, ``"backward"``, ``"send"``, ``"recv"``, ``"optimizer"``, ``"reduce"`` or
    #: ``"step"`` (a whole ``train_batch``/``eval_batch``).
    kind: str
    #: The label: ``F3``/``B3`` for micro-batch 3, ``send``, ``recv``, ``opt``, ...
    name: str
    #: The global rank that spent it.
    rank: int
    #: The stage it belongs to (a rank-wide span: the rank's first stage).
    stage: int
    #: The index of the ``train_batch``/``eval_batch`` call within the trace (from 0).
    step: int
    #: The micro-batch within the step, where it has one.
    micro_batch: int | None
    #: Nanoseconds since the common origin.
    start_ns: int
    end_ns: int
    #: What was sent or received (``"activations"``, ``"grads"``), or other detail.
    detail: str | None = None

    @property
    def duration_ns(self) -> int:
        """The span's length in nanoseconds."""
        return self.end_ns - self.start_ns


@dataclass(frozen=True)
class StepBubble:
    """The bubble of one training step."""

    step: int
    #: Micro-batches the step ran.
    micro_batches: int
    #: From the first forward to the last backward, on any rank.
    window_ns: int
    #: Forward and backward time of each rank.
    busy_ns: Mapping[int, int]

    @property
    def bubble(self) -> dict[int, float]:
        """``1 - busy / window`` for each rank ([Note: the bubble])."""
        return idle_fractions(self.busy_ns, self.window_ns)


@dataclass
class Timeline:
    """Every rank's spans of one trace, and what they say about the schedule."""

    spans: list[Span]
    #: The number of pipeline stages.
    num_stages: int

    def ranks(self) -> list[int]:
        """The ranks that recorded something, in order."""
        return sorted({s.rank for s in self.spans})

    def stages_per_rank(self) -> int:
        """The most stages one rank ran (``v`` in the theoretical bubble)."""
        per_rank: dict[int, set[int]] = {}
        for s in self.spans:
            if s.kind in COMPUTE_KINDS:
                per_rank.setdefault(s.rank, set()).add(s.stage)
        return max((len(v) for v in per_rank.values()), default=1)

    def pipeline_depth(self) -> int:
        """Pipeline ranks ``p``: stages over stages per rank (1 when one process runs all)."""
        return max(1, self.num_stages // self.stages_per_rank())

    def steps(self) -> list[StepBubble]:
        """The bubble of every traced step that ran a backward (training steps)."""
        by_step: dict[int, list[Span]] = {}
        for s in self.spans:
            if s.kind in COMPUTE_KINDS:
                by_step.setdefault(s.step, []).append(s)
        result = []
        for step, spans in sorted(by_step.items()):
            if not any(s.kind == "backward" for s in spans):
                continue
            window, busy = step_window(
                ((s.rank, s.start_ns, s.end_ns) for s in spans), {s.rank for s in self.spans}
            )
            micro = {s.micro_batch for s in spans if s.kind == "forward"}
            result.append(StepBubble(step, len(micro), max(window, 1), busy))
        return result

    def bubble(self) -> dict[int, float]:
        """Each rank's measured bubble over all traced training steps."""
        steps = self.steps()
        window = sum(s.window_ns for s in steps)
        if not window:
            return {}
        return idle_fractions(
            {r: sum(s.busy_ns.get(r, 0) for s in steps) for r in self.ranks()}, window
        )

    def micro_batches(self) -> int:
        """Micro-batches per training step (the most any traced step ran)."""
        return max((s.micro_batches for s in self.steps()), default=0)

    def theoretical_bubble(self) -> float:
        """``(p - 1) / (v m + p - 1)``: GPipe's and 1F1B's idle fraction with equal stages
        (:func:`pipedialect.cost.predicted_bubble`); 0.0 before any training step."""
        m = self.micro_batches()
        if m == 0:
            return 0.0
        return predicted_bubble(self.pipeline_depth(), m, self.stages_per_rank())

    def describe(self) -> str:
        """A few lines: the measured bubble of each rank beside the theoretical one."""
        measured = ", ".join(f"rank {r}: {b:.1%}" for r, b in self.bubble().items())
        return (
            f"{len(self.steps())} training step(s), {self.micro_batches()} micro-batches, "
            f"p={self.pipeline_depth()} ranks x v={self.stages_per_rank()} stages\n"
            f"measured bubble: {measured or 'no training step traced'}\n"
            f"theoretical (p-1)/(v*m+p-1): {self.theoretical_bubble():.1%}"
        )

    # -- output -----------------------------------------------------------------------------

    def chrome_trace(self) -> dict[str, Any]:
        """The timeline in the Chrome trace event format (complete ``"X"`` events, in µs)."""
        events: list[dict[str, Any]] = []
        for rank in self.ranks():
            events.append(_meta("process_name", rank, 0, f"rank {rank}"))
            for stage in sorted({s.stage for s in self.spans if s.rank == rank}):
                events.append(_meta("thread_name", rank, stage, f"stage {stage}"))
        for s in sorted(self.spans, key=lambda s: (s.rank, s.start_ns, -s.end_ns)):
            args: dict[str, Any] = {"step": s.step}
            if s.micro_batch is not None:
                args["micro_batch"] = s.micro_batch
            if s.detail is not None:
                args["detail"] = s.detail
            events.append(
                {
                    "name": s.name,
                    "cat": s.kind,
                    "ph": "X",
                    "ts": s.start_ns / 1000.0,
                    "dur": s.duration_ns / 1000.0,
                    "pid": s.rank,
                    "tid": s.stage,
                    "args": args,
                }
            )
        return {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {
                "num_stages": self.num_stages,
                "micro_batches": self.micro_batches(),
                "measured_bubble": {str(r): b for r, b in self.bubble().items()},
                "theoretical_bubble": self.theoretical_bubble(),
            },
        }

    def write_json(self, path: str | Path) -> Path:
        """Write :meth:`chrome_trace` to ``path``."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.chrome_trace()))
        return path

    def write_png(self, path: str | Path, *, step: int | None = None) -> Path:
        """Draw the schedule of ``step`` (default: the last training step), ranks as rows."""
        return _draw(self, Path(path), step)


def _meta(what: str, pid: int, tid: int, name: str) -> dict[str, Any]:
    return {"name": what, "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}


def patch_attribute(obj: Any, name: str, value: Any) -> Callable[[], None]:
    """Set ``obj.name = value`` on the instance; return what undoes it.

    The undo restores the previous instance attribute (or removes ours, uncovering the class's),
    and leaves the attribute alone if someone replaced ours meanwhile.
    """
    had = name in vars(obj)
    previous = vars(obj).get(name)
    setattr(obj, name, value)

    def undo() -> None:
        if vars(obj).get(name) is not value:
            return
        if had:
            setattr(obj, name, previous)
        else:
            delattr(obj, name)

    return undo


@dataclass
class _OpenBackward:
    micro_batch: int
    start: int
    end: int
    order: int


@dataclass
class Recorder:
    """One process's spans; what hooks and dialect instrumentation write to."""

    rank: int
    #: The rank's first stage: where rank-wide spans go.
    home_stage: int
    origin_ns: int = field(default_factory=time.perf_counter_ns)
    step: int = field(default=-1, init=False)
    in_step: bool = field(default=False, init=False)
    _paused: int = field(default=0, init=False)
    _rows: list[list[Any]] = field(default_factory=list, init=False)
    _counters: dict[Any, int] = field(default_factory=dict, init=False)
    _open: dict[int, _OpenBackward] = field(default_factory=dict, init=False)
    _opened: int = field(default=0, init=False)
    #: This step's tensor hooks, removed when it ends.
    step_handles: list[RemovableHandle] = field(default_factory=list, init=False)
    #: What a dialect keeps for the current step (cleared when it ends).
    step_state: dict[Any, Any] = field(default_factory=dict, init=False)

    @property
    def recording(self) -> bool:
        """Whether a step is running and recording is not paused."""
        return self.in_step and not self._paused

    def now(self) -> int:
        """Nanoseconds since the origin."""
        return time.perf_counter_ns() - self.origin_ns

    def add(
        self,
        kind: str,
        name: str,
        stage: int,
        start: int,
        end: int,
        micro_batch: int | None = None,
        detail: str | None = None,
    ) -> int:
        """Record a span; return its index (see :meth:`extend`)."""
        self._rows.append([kind, name, stage, micro_batch, start, end, detail, self.step])
        return len(self._rows) - 1

    def extend(self, index: int, end: int) -> bool:
        """Stretch span ``index`` to ``end`` if it is still the last one recorded."""
        if index != len(self._rows) - 1:
            return False
        self._rows[index][5] = end
        return True

    def next_index(self, key: Any) -> int:
        """0, 1, 2, ... for each ``key`` within the current step (micro-batch numbers)."""
        value = self._counters.get(key, 0)
        self._counters[key] = value + 1
        return value

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Record nothing inside (set-up work that is not part of the schedule)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @contextlib.contextmanager
    def timed(
        self, kind: str, name: str, stage: int, micro_batch: int | None = None
    ) -> Iterator[None]:
        """Record the time spent inside as one span (when recording)."""
        if not self.recording:
            yield
            return
        start = self.now()
        try:
            yield
        finally:
            self.add(kind, name, stage, start, self.now(), micro_batch)

    # -- backward spans ([Note: how spans are taken]) ----------------------------------------

    def open_backward(self, stage: int, micro_batch: int, at: int) -> None:
        """The gradient of ``micro_batch``'s output reached ``stage``."""
        current = self._open.get(stage)
        if current is not None and current.micro_batch == micro_batch:
            current.end = max(current.end, at)
            return
        self.close_backward(stage)
        self._opened += 1
        self._open[stage] = _OpenBackward(micro_batch, at, at, self._opened)

    def touch_backward(self, stage: int, micro_batch: int | None, at: int) -> None:
        """``stage`` computed a gradient of ``micro_batch`` (None: of its open backward)."""
        current = self._open.get(stage)
        if current is not None and micro_batch in (None, current.micro_batch):
            current.end = max(current.end, at)

    def touch_latest(self, stages: Iterable[int], at: int) -> None:
        """A parameter of ``stages`` got its gradient: it belongs to the latest open one."""
        found = [self._open[k] for k in stages if k in self._open]
        if found:
            latest = max(found, key=lambda o: o.order)
            latest.end = max(latest.end, at)

    def close_backward(self, stage: int) -> None:
        """Record ``stage``'s open backward span, if any."""
        current = self._open.pop(stage, None)
        if current is not None:
            k = current.micro_batch
            self.add("backward", f"B{k}", stage, current.start, current.end, k)

    # -- steps --------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """A ``train_batch``/``eval_batch`` call starts."""
        self.step += 1
        self.in_step = True
        self._counters.clear()

    def end_step(self) -> None:
        """It ended: close open backwards and drop this step's hooks."""
        for stage in sorted(self._open):
            self.close_backward(stage)
        for handle in self.step_handles:
            handle.remove()
        self.step_handles.clear()
        self.step_state.clear()
        self.in_step = False

    def spans(self) -> list[Span]:
        """Everything recorded, as spans."""
        return [
            Span(kind, name, self.rank, stage, step, mb, start, end, detail)
            for kind, name, stage, mb, start, end, detail, step in self._rows
        ]


# -- stage hooks --------------------------------------------------------------------------------


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _tensors(v)


def _in_backward() -> bool:
    """Whether autograd is running a backward on this thread (a checkpoint's recompute)."""
    return bool(torch._C._current_graph_task_id() != -1)


class _StageProbe:
    """The hooks of one stage's runner ([Note: how spans are taken])."""

    def __init__(self, recorder: Recorder, stage: HeldStage) -> None:
        self.recorder = recorder
        self.stage_id = stage.stage_id
        self._calls: list[tuple[int, int | None, list[torch.Tensor]]] = []
        runner = stage.runner
        self.handles = [
            runner.register_forward_pre_hook(self._before, with_kwargs=True),
            runner.register_forward_hook(self._after, with_kwargs=True, always_call=True),
        ]

    def _before(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        rec = self.recorder
        if not rec.recording or _in_backward():
            self._calls.append((0, None, []))
            return
        rec.close_backward(self.stage_id)
        k = rec.next_index(("forward", self.stage_id))
        inputs = [
            t for t in _tensors((args, kwargs)) if t.requires_grad and torch.is_grad_enabled()
        ]
        self._calls.append((rec.now(), k, inputs))

    def _after(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        start, k, inputs = self._calls.pop()
        rec = self.recorder
        if k is None:
            return
        rec.add("forward", f"F{k}", self.stage_id, start, rec.now(), k)
        if not torch.is_grad_enabled():
            return
        stage, recorder = self.stage_id, rec

        def output_grad(grad: torch.Tensor) -> None:
            recorder.open_backward(stage, k, recorder.now())

        def input_grad(grad: torch.Tensor) -> None:
            recorder.touch_backward(stage, k, recorder.now())

        for t in _tensors(output):
            if t.requires_grad:
                rec.step_handles.append(t.register_hook(output_grad))  # type: ignore[no-untyped-call]
        for t in inputs:
            rec.step_handles.append(t.register_hook(input_grad))  # type: ignore[no-untyped-call]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _param_hooks(recorder: Recorder, stages: list[HeldStage]) -> list[RemovableHandle]:
    owners: dict[int, tuple[nn.Parameter, set[int]]] = {}
    for stage in stages:
        for p in stage.runner.parameters():
            if p.requires_grad:
                owners.setdefault(id(p), (p, set()))[1].add(stage.stage_id)
    handles = []
    for param, ids in owners.values():
        frozen = tuple(sorted(ids))

        def accumulated(_: torch.Tensor, stage_ids: tuple[int, ...] = frozen) -> None:
            if recorder.recording:
                recorder.touch_latest(stage_ids, recorder.now())

        handles.append(param.register_post_accumulate_grad_hook(accumulated))  # type: ignore[no-untyped-call]
    return handles


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Trace:
    """The context :func:`trace` returns; :attr:`timeline` is set on leaving."""

    def __init__(
        self,
        engine: Any,
        path: str | Path | None,
        png: str | Path | bool,
    ) -> None:
        self.engine = engine
        self.path = None if path is None else Path(path)
        if png is True:
            self.png: Path | None = None if self.path is None else self.path.with_suffix(".png")
        elif png is False:
            self.png = None
        else:
            self.png = Path(png)
        #: Every rank's spans, after the context has been left.
        self.timeline: Timeline | None = None
        self._undo: list[Callable[[], None]] = []
        self._recorder: Recorder | None = None
        self._num_stages = 0

    def __enter__(self) -> Trace:
        dialect = require_capability(self.engine, Capability.TRACING, "pipedialect.trace")
        state = dialect.engine_state(self.engine)
        stages = sorted(state.stages, key=lambda s: s.stage_id)
        if not stages:
            raise ConfigError(
                f"the {dialect.name} dialect's engine_state() reports no stage in this process; "
                "trace() times the stages an engine runs"
            )
        self._num_stages = int(state.num_stages)
        rank, world = _rank_and_world()
        if world > 1:
            import torch.distributed as dist

            dist.barrier()
        recorder = Recorder(rank, stages[0].stage_id)
        self._recorder = recorder
        try:
            self._install(recorder, stages, dialect, state.optimizer)
        except BaseException:
            self._uninstall()
            raise
        return self

    def _install(
        self, recorder: Recorder, stages: list[HeldStage], dialect: Dialect, optimizer: Any
    ) -> None:
        probes = [_StageProbe(recorder, s) for s in stages]
        self._undo.extend(p.remove for p in probes)
        for handle in _param_hooks(recorder, stages):
            self._undo.append(handle.remove)
        engine: RuntimeEngine = self.engine
        for method, original in (
            ("train_batch", engine.train_batch),
            ("eval_batch", engine.eval_batch),
        ):
            self._undo.append(
                patch_attribute(engine, method, _step_method(recorder, original, method))
            )
        instrumented = dialect.instrument(self.engine, recorder)
        if instrumented is not None and not isinstance(instrumented, Instrumented):
            raise ConfigError(
                f"the {dialect.name} dialect's instrument() returned "
                f"{type(instrumented).__name__}, not pipedialect.contracts.Instrumented"
            )
        records = frozenset() if instrumented is None else instrumented.records
        if instrumented is not None:
            self._undo.append(instrumented.undo)
        step = getattr(optimizer, "step", None)
        if "optimizer" not in records and callable(step):
            self._undo.append(patch_attribute(optimizer, "step", _timed_call(recorder, step)))

    def _uninstall(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        recorder = self._recorder
        self._uninstall()
        if recorder is None or exc_type is not None:
            # A failed step leaves the peers anywhere: no collective now, nothing written.
            return
        records = [asdict(s) for s in recorder.spans()]
        rank, world = _rank_and_world()
        if world > 1:
            import torch.distributed as dist

            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, records)
            records = [r for part in gathered for r in part]
        self.timeline = Timeline([Span(**r) for r in records], self._num_stages)
        if rank == 0:
            if self.path is not None:
                self.timeline.write_json(self.path)
            if self.png is not None:
                self.timeline.write_png(self.png)
            logger.info("pipeline timeline:\n%s", self.timeline.describe())


def _step_method(recorder: Recorder, original: Callable[..., Any], name: str) -> Any:
    def step(*args: Any, **kwargs: Any) -> Any:
        if recorder.in_step:  # a step inside a step: count it once
            return original(*args, **kwargs)
        recorder.begin_step()
        start = recorder.now()
        try:
            return original(*args, **kwargs)
        finally:
            recorder.end_step()
            recorder.add("step", name, recorder.home_stage, start, recorder.now())

    return step


def _timed_call(recorder: Recorder, original: Callable[..., Any]) -> Any:
    def step(*args: Any, **kwargs: Any) -> Any:
        with recorder.timed("optimizer", "opt", recorder.home_stage):
            return original(*args, **kwargs)

    return step


def trace(engine: Any, path: str | Path | None = None, *, png: str | Path | bool = True) -> Trace:
    """Record ``engine``'s timeline while the ``with`` block runs; see the module's docstring.

    Every rank enters and leaves the block together (entering waits for all, leaving gathers
    the spans). Rank 0 writes the Chrome trace to ``path`` (if given) and the picture to
    ``png`` (by default ``path`` with the suffix ``.png``; ``False`` for none; it needs
    matplotlib, ``pip install pipedialect[demo]``). A block left by an exception records
    nothing and writes nothing.

    Args:
        engine: what ``dialect.runtime_engine`` returned, on any dialect.
        path: where rank 0 writes the Chrome trace JSON.
        png: where rank 0 draws the schedule of the last training step.
    """
    return Trace(engine, path, png)


# -- the picture --------------------------------------------------------------------------------

_COLOURS = {
    "forward": "#4c72b0",
    "backward": "#55a868",
    "send": "#c44e52",
    "recv": "#dd8452",
    "send/recv": "#da8a7e",
    "optimizer": "#8172b3",
    "reduce": "#937860",
}


def _draw(timeline: Timeline, path: Path, step: int | None) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise ConfigError(
            "drawing the timeline needs matplotlib: pip install 'pipedialect[demo]' (or pass "
            "png=False)"
        ) from exc
    steps = timeline.steps()
    chosen = step if step is not None else (steps[-1].step if steps else 0)
    spans = [s for s in timeline.spans if s.step == chosen and s.kind != "step"]
    ranks = timeline.ranks()
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.7 * len(ranks)), dpi=80)
    if spans:
        t0 = min(s.start_ns for s in spans)
        for s in spans:
            row = ranks.index(s.rank)
            compute = s.kind in COMPUTE_KINDS
            height, bottom = (0.6, row - 0.3) if compute else (0.18, row + 0.32)
            left, width = (s.start_ns - t0) / 1e6, s.duration_ns / 1e6
            ax.broken_barh(
                [(left, width)],
                (bottom, height),
                facecolors=_COLOURS.get(s.kind, "#999999"),
                edgecolor="white",
                linewidth=0.5,
            )
            if compute and s.micro_batch is not None:
                label = str(s.micro_batch)
                if timeline.stages_per_rank() > 1:
                    label = f"{s.stage}:{s.micro_batch}"
                ax.text(
                    left + width / 2, row, label, ha="center", va="center", fontsize=7, color="w"
                )
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_ylim(len(ranks) - 0.4, -0.6)
    ax.set_xlabel("ms since the step's first span")
    measured = ", ".join(f"{b:.0%}" for b in timeline.bubble().values())
    ax.set_title(
        f"step {chosen}: measured bubble per rank {measured or 'n/a'}; "
        f"(p-1)/(v*m+p-1) = {timeline.theoretical_bubble():.0%}",
        fontsize=10,
    )
    kinds = [k for k in _COLOURS if any(s.kind == k for s in spans)]
    if kinds:
        fig.legend(
            handles=[Patch(color=_COLOURS[k], label=k) for k in kinds],
            loc="lower center",
            fontsize=7,
            ncols=len(kinds),
            frameon=False,
        )
    fig.tight_layout(rect=(0.0, 0.06 if kinds else 0.0, 1.0, 1.0))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
