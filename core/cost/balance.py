"""Choosing split points automatically: cost models, an exact solver, and per-stage costs.

``choose_split_points(model, 4, "flops", example_inputs=batch)`` returns split points that
:func:`pipedialect.partition` accepts and that make the four stages' costs as even as the model
allows. The candidates are every module forward calls exactly once, at any depth, that computes
something and is not inside a module that runs as one call (an fx leaf such as
``nn.TransformerEncoderLayer``, or a ``leaf_modules`` entry); by default the split points are
chosen among the model's own blocks ([Note: blocks]); the model is measured once ([Note:
balance trace] in ``_profile``) and the contiguous-partition problem solved exactly
([Note: balance solver] in ``_solver``).

[Note: blocks]
A stage boundary inside a block (after a decoder layer's ``q_proj``) sends what the rest of the
block needs, often several tensors the block's end reduces to one: a Llama layer's attention
cut there sends 2.5 times the bytes of a cut between layers, for a few percent of FLOPs. So
the split points are chosen, unless ``candidates=`` says otherwise, among the *blocks*: the
layers a Hugging Face model's ``config.base_model_pp_plan`` names (its decoder layers), else the
children of the model's outermost ``nn.ModuleList`` and ``nn.Sequential`` containers (the layers
of an ``nn.Sequential`` model), a container inside a block (a block's MLP, an MoE layer's
experts) not counting. The planner (:func:`pipedialect.planner.plan_layout`) cuts among the same
blocks by default. When the blocks cannot make
``num_stages`` stages (fewer blocks than stages, or none), every candidate is used.

Cost models (``balance=``), each a stage's cost per micro-batch:

- ``"parameters"``: trainable parameter elements the stage reads (DeepSpeed's default method
  counts the same thing); needs no example inputs;
- ``"flops"``: forward + backward FLOPs, counted on fake tensors with
  ``torch.utils.flop_counter``'s formulas (matrix products and convolutions);
- ``"memory"``: parameter, gradient and optimizer-state bytes, plus the activation bytes 1F1B
  keeps in flight: stage ``k`` of ``p`` holds up to ``min(p - k, m)`` micro-batches;
- ``"time"``: forward + backward seconds measured on the example inputs (the median of a few
  runs); under ``torch.distributed`` every rank takes rank 0's measurement, so all agree.

[Note: boundary bytes]
A cut's bytes per micro-batch ``b`` (what crosses it forward; its gradient as many bytes back)
steer the choice between cuts: a cut carrying ``b`` bytes more than the narrowest candidate costs
the two stages beside it ``2 b / bandwidth`` seconds more each, at ``bandwidth`` bytes per second
between stages (default :data:`DEFAULT_BANDWIDTH`, 25 GB/s: one 200 Gb/s link). ``"time"``
adds them to its seconds; ``"flops"`` converts them to FLOPs at ``flops_per_second`` (default
:data:`DEFAULT_FLOPS_PER_SECOND`, 1e14: a sustained 100 TFLOP/s), so each extra byte weighs
``2 * flops_per_second / bandwidth`` FLOPs; ``"parameters"`` and ``"memory"``, whose units are
no time, ignore them. ``bandwidth=None`` leaves them out. Only the excess over the narrowest
cut counts: what every cut carries anyway is no reason to prefer one split of the compute over
another, and charged in full it would make a middle stage (two boundaries) look busier than an
end stage (one) by a constant that, on a model of small blocks, outweighs the compute and
piles it onto the end stages. So ``"flops"`` balances FLOPs, and ``"time"`` seconds, with the
boundary bytes moving a cut only where cuts differ in what they carry; among splits of equal
cost, the one with the most even compute wins (:mod:`pipedialect.cost._solver`). The layout
model the planner uses (:func:`pipedialect.cost.predict`) prices every message in full in its
simulation.

Every method but ``"time"`` depends on the model and the inputs' shapes alone, so every rank
chooses the same split points; ``"time"`` is a collective when a process group is initialised.
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypedDict, Unpack, get_args

from torch import nn

from ..errors import ConfigError, PartitionError, SplitPointError
from . import _profile
from ._bubble import predicted_bubble
from ._profile import timing_threads
from ._schedules import deepspeed_program
from ._simulate import Simulation, StageTimes, simulate
from ._solver import solve
from .module_paths import check_execution_order, resolve_leaves

__all__ = [
    "DEFAULT_BANDWIDTH",
    "DEFAULT_FLOPS_PER_SECOND",
    "BalanceMethod",
    "BalanceOptions",
    "ModelProfile",
    "PlanCosts",
    "StageCosts",
    "balanced_split_points",
    "choose_split_points",
    "plan_costs",
    "profile_model",
    "timing_threads",
]

logger = logging.getLogger(__name__)

BalanceMethod = Literal["parameters", "flops", "memory", "time"]
_METHODS: tuple[str, ...] = get_args(BalanceMethod)

#: Bytes per second between two stages the cost models assume by default (25 GB/s).
DEFAULT_BANDWIDTH = 25e9
#: Sustained FLOP/s of one stage's device that ``"flops"`` assumes to weigh boundary bytes.
DEFAULT_FLOPS_PER_SECOND = 1e14


def _one_f_one_b(
    num_stages: int, micro_batches: int | None, times: Sequence[tuple[float, float]] | None = None
) -> Simulation:
    """DeepSpeed's 1F1B of ``num_stages`` stages replayed by the simulator, with each stage's
    ``(forward, backward)`` seconds (default: none) and free communication; ``micro_batches``
    None stands for at least ``num_stages``."""
    m = num_stages if micro_batches is None else micro_batches
    stages = [StageTimes(f, b, 0.0, split=False) for f, b in times or [(0.0, 0.0)] * num_stages]
    return simulate(deepspeed_program(num_stages, m), stages)


@dataclass(frozen=True)
class StageCosts:
    """One stage's predicted costs; per micro-batch unless said otherwise, None if unmeasured."""

    #: The stage's index.
    stage: int
    #: The split point the stage ends after (None for the last stage).
    ends_after: str | None
    #: Parameter elements the stage holds (a parameter shared with another stage counts in both).
    parameters: int
    #: Bytes of those parameters.
    parameter_bytes: int
    #: Parameter, gradient, optimizer-state and buffer bytes (per rank, not per micro-batch).
    state_bytes: int
    #: Forward + backward FLOPs.
    flops: float | None
    #: Bytes the stage's forward saves for backward.
    activation_bytes: int | None
    #: Micro-batches 1F1B keeps in flight on this stage (the simulator's count:
    #: ``min(p - k, m)``).
    in_flight: int
    #: ``state_bytes + in_flight * activation_bytes``.
    memory_bytes: int | None
    #: Bytes the stage sends to the next one (0 for the last stage).
    boundary_bytes: int | None
    #: Measured forward + backward seconds.
    time: float | None
    #: The forward's part of :attr:`time`.
    forward_time: float | None = None


@dataclass(frozen=True)
class PlanCosts:
    """Predicted costs of every stage of a partition, and what they mean for a step."""

    split_points: tuple[str, ...]
    stages: tuple[StageCosts, ...]
    #: Micro-batches per step, if known (the bubble and step time need it).
    micro_batches: int | None

    @property
    def num_stages(self) -> int:
        """The number of stages."""
        return len(self.stages)

    @property
    def bubble(self) -> float | None:
        """:func:`predicted_bubble` for this plan, or None without ``micro_batches``."""
        if self.micro_batches is None:
            return None
        return predicted_bubble(self.num_stages, self.micro_batches)

    @property
    def step_time(self) -> float | None:
        """The makespan of DeepSpeed's 1F1B step with the stages' measured forward and backward
        seconds, replayed by the simulator (:func:`~pipedialect.cost.simulate`; communication
        free), or None without ``micro_batches`` or times."""
        times = [(s.forward_time, s.time) for s in self.stages]
        if self.micro_batches is None:
            return None
        known = [(f, t - f) for f, t in times if f is not None and t is not None]
        if len(known) < len(times):
            return None
        return _one_f_one_b(self.num_stages, self.micro_batches, known).step_time

    def imbalance(self, metric: str) -> float:
        """``max / mean`` over stages of a :class:`StageCosts` field (1.0: perfectly even)."""
        values = [getattr(s, metric) for s in self.stages]
        if any(v is None for v in values):
            raise ConfigError(f"stage {metric!r} was not measured for this plan")
        mean = sum(values) / len(values)
        return max(values) / mean if mean else 1.0

    def describe_lines(self) -> list[str]:
        """One line per stage, and one for the whole step."""
        lines = []
        for s in self.stages:
            parts = [f"[Stage {s.stage}] {s.parameters:,} parameters"]
            if s.flops is not None:
                parts.append(f"{s.flops:,.0f} FLOPs")
            if s.activation_bytes is not None:
                parts.append(f"activations {_bytes(s.activation_bytes)} x {s.in_flight} in flight")
            if s.memory_bytes is not None:
                parts.append(f"memory {_bytes(s.memory_bytes)}")
            if s.boundary_bytes is not None and s.ends_after is not None:
                parts.append(f"sends {_bytes(s.boundary_bytes)}")
            if s.time is not None:
                parts.append(f"{s.time * 1e3:.3f} ms")
            lines.append(", ".join(parts))
        summary = [f"{self.num_stages} stage(s)"]
        if self.bubble is not None:
            summary.append(f"predicted bubble {self.bubble:.1%} (m={self.micro_batches})")
        if self.step_time is not None:
            summary.append(f"predicted step {self.step_time * 1e3:.3f} ms")
        lines.append("Costs: " + ", ".join(summary))
        return lines

    def describe(self) -> str:
        """:meth:`describe_lines` joined."""
        return "\n".join(self.describe_lines())


def _bytes(n: int) -> str:
    if n < 1024:
        return f"{n:,} B"
    value = n / 1024
    for unit in ("KiB", "MiB"):
        if value < 1024:
            return f"{value:,.1f} {unit}"
        value /= 1024
    return f"{value:,.1f} GiB"


class ModelProfile:
    """One measurement of a model: its split-point candidates and their costs.

    Build it with :func:`profile_model`; :meth:`choose` and :meth:`costs` reuse it, so a model
    is measured once however many stage counts or methods are tried.
    """

    def __init__(
        self,
        model_name: str,
        trace: _profile.Trace,
        aliases: Mapping[str, str],
        blocks: Sequence[str] = (),
    ):
        self._name = model_name
        self._trace = trace
        self._aliases = dict(aliases)
        self._why: dict[str, str | None] = {
            path: self._reason(rec) for path, rec in trace.modules.items()
        }
        self.candidates: tuple[str, ...] = tuple(
            sorted(
                (p for p, why in self._why.items() if why is None),
                key=lambda p: trace.modules[p].exit,
            )
        )
        """The modules that can end a stage, in the order forward finishes them."""
        block_set = set(blocks)
        self.blocks: tuple[str, ...] = tuple(p for p in self.candidates if p in block_set)
        """The candidates that are the model's own blocks ([Note: blocks]): where
        :meth:`choose` cuts unless told otherwise."""

    def _reason(self, rec: _profile.ModuleCalls) -> str | None:
        if rec.path == "":
            return "it is the whole model"
        if rec.hidden is not None:
            return rec.hidden
        if rec.calls > 1:
            return (
                f"forward calls it {rec.calls} times; a stage boundary must follow exactly one call"
            )
        if sum(self._trace.ops[rec.enter + 1 : rec.exit + 1]) == 0:
            return "it computes nothing (no tensor operation)"
        return None

    @property
    def timing(self) -> _profile.Timing | None:
        """How the times were measured (threads, runs, spread), None without ``measure_time``."""
        return self._trace.timing

    @property
    def methods(self) -> tuple[str, ...]:
        """The balance methods this measurement supports."""
        have = ["parameters"]
        if self._trace.forward_flops is not None:
            have += ["flops", "memory"]
        if self._trace.forward_time is not None:
            have.append("time")
        return tuple(have)

    def why_not(self, path: str) -> str | None:
        """Why ``path`` cannot be a split point, or None if it can."""
        canonical = self._aliases.get(path)
        if canonical is None:
            return f"it is not a module of {self._name}"
        if canonical not in self._trace.modules:
            return "forward never calls it (as self.<name>(...)) in the measured run"
        return self._why[canonical]

    def _resolve(self, path: str, what: str) -> str:
        if not isinstance(path, str):
            raise SplitPointError(f"{what} {path!r} is not a module path (a str)")
        why = self.why_not(path)
        if why is not None:
            raise SplitPointError(f"{what} {path!r} cannot end a pipeline stage: {why}")
        return self._aliases[path]

    def _exit(self, path: str) -> int:
        return self._trace.modules[path].exit

    def _check_nesting(self, points: Sequence[str], what: str) -> None:
        for a, b in itertools.pairwise(points):
            if self._trace.modules[b].enter < self._exit(a):
                raise SplitPointError(
                    f"{what} {a!r} is inside {b!r}; a split point runs as one call, so it "
                    f"cannot contain another. Drop one of them."
                )

    def choose(
        self,
        num_stages: int,
        balance: BalanceMethod,
        *,
        split_points: Sequence[str] = (),
        candidates: Sequence[str] | None = None,
        micro_batches: int | None = None,
        bandwidth: float | None = DEFAULT_BANDWIDTH,
        flops_per_second: float = DEFAULT_FLOPS_PER_SECOND,
        optimizer_states: int = 2,
    ) -> list[str]:
        """Split points for ``num_stages`` stages that minimise the largest stage cost.

        Args:
            num_stages: how many stages.
            balance: the cost model (see the module docstring).
            split_points: split points the answer must contain; the others are chosen between
                them.
            candidates: restrict the other split points to these modules (say, the layers of
                a hand-written pipeline; :attr:`candidates` for every module that can end a
                stage); default: the model's blocks (:attr:`blocks`), or every candidate when
                they cannot make ``num_stages`` stages ([Note: blocks]).
            micro_batches: ``m``, for the activations 1F1B keeps in flight (``"memory"``);
                default: at least ``num_stages``.
            bandwidth: bytes per second between stages, which prices each cut's boundary bytes
                for ``"flops"`` and ``"time"`` (see the module docstring); None: free.
            flops_per_second: what ``"flops"`` turns those seconds into FLOPs at.
            optimizer_states: tensors of optimizer state per trainable parameter (Adam: 2).

        Raises:
            ConfigError: an unknown method, or one this measurement cannot serve.
            SplitPointError: a given split point or candidate cannot end a stage.
            PartitionError: no partition into ``num_stages`` stages exists.
        """
        if not isinstance(num_stages, int) or num_stages < 1:
            raise ConfigError(f"num_stages must be a positive int, got {num_stages!r}")
        if balance not in _METHODS:
            raise ConfigError(f"balance must be one of {list(_METHODS)}, got {balance!r}")
        if balance not in self.methods:
            need = "measure_time=True" if balance == "time" else "example_inputs"
            raise ConfigError(f"balance={balance!r} needs a measurement taken with {need}")
        if micro_batches is not None and micro_batches < 1:
            raise ConfigError(f"micro_batches must be at least 1, got {micro_batches}")
        for what, value in (("bandwidth", bandwidth), ("flops_per_second", flops_per_second)):
            if value is not None and not (isinstance(value, int | float) and value > 0):
                raise ConfigError(f"{what} must be a positive number, got {value!r}")
        if isinstance(split_points, str):
            raise SplitPointError(
                f"split_points must be a list of module paths: [{split_points!r}]"
            )
        fixed = sorted({self._resolve(p, "split point") for p in split_points}, key=self._exit)
        self._check_nesting(fixed, "split point")
        if len(fixed) > num_stages - 1:
            raise SplitPointError(
                f"{len(fixed)} fixed split points make at least {len(fixed) + 1} stages, more "
                f"than num_stages={num_stages}"
            )
        if candidates is not None:
            if isinstance(candidates, str):
                raise SplitPointError(
                    f"candidates must be a list of module paths: [{candidates!r}]"
                )
            pools = [{self._resolve(p, "candidate") for p in candidates}]
        elif self.blocks:
            pools = [set(self.blocks), set(self.candidates)]
        else:
            pools = [set(self.candidates)]
        if num_stages == 1:
            return []
        per_byte = self._byte_cost(balance, bandwidth, flops_per_second)
        solution = None
        ordered: list[str] = []
        for number, pool in enumerate(pools):
            ordered = sorted(pool | set(fixed), key=self._exit)
            solution = self._solve(
                ordered, fixed, balance, num_stages, micro_batches, optimizer_states, per_byte
            )
            if solution is not None:
                break
            if number + 1 < len(pools):
                logger.info(
                    "the %d blocks of %s cannot make %d stages: choosing among every candidate",
                    len(self.blocks),
                    self._name,
                    num_stages,
                )
        if solution is None:
            raise PartitionError(
                f"{self._name} cannot be cut into {num_stages} stages"
                + (f" around the split points {fixed}" if fixed else "")
                + f": only {len(ordered)} module(s) can end a stage and the last stage must "
                "compute something. Use fewer stages, or more candidates (module calls that "
                "are not nested in each other)."
            )
        points = [ordered[c] for c in solution.cuts]
        logger.info(
            "balance=%r chose %s for %d stages (largest stage cost %.6g)",
            balance,
            points,
            num_stages,
            solution.bottleneck,
        )
        return points

    def _byte_cost(self, balance: str, bandwidth: float | None, flops_per_second: float) -> float:
        """What one byte across a cut costs each stage beside it, in ``balance``'s unit."""
        if bandwidth is None or balance in ("parameters", "memory"):
            return 0.0
        seconds = 2.0 / bandwidth  # the activation forward, its gradient backward
        return seconds if balance == "time" else seconds * flops_per_second

    def _solve(
        self,
        ordered: Sequence[str],
        fixed: Sequence[str],
        balance: str,
        num_stages: int,
        micro_batches: int | None,
        optimizer_states: int,
        per_byte: float,
    ) -> Any:
        """The solver's answer for cuts among ``ordered`` (fixed ones included), or None."""
        xs = [self._exit(p) for p in ordered]
        channels, scales, overlaps = self._channels(
            balance, xs, num_stages, micro_batches, optimizer_states
        )
        boundary = None
        if per_byte and self._trace.crossing is not None and xs:
            # What a cut costs beyond the narrowest candidate ([Note: boundary bytes]).
            narrowest = min(self._trace.crossing[x] for x in xs)
            boundary = [per_byte * (self._trace.crossing[x] - narrowest) for x in xs]
        enters = [self._trace.modules[p].enter for p in ordered]
        nested_from = [bisect.bisect_right(xs, enters[j]) for j in range(len(ordered))]
        last_op = max((g for g, n in enumerate(self._trace.ops) if n), default=0)
        return solve(
            channels,
            num_stages,
            scales=scales,
            boundary=boundary,
            nested_from=nested_from,
            fixed=[ordered.index(p) for p in fixed],
            last_cut_below=bisect.bisect_left(xs, last_op),
            overlaps=overlaps,
        )

    def _channels(
        self,
        balance: str,
        xs: Sequence[int],
        num_stages: int,
        micro_batches: int | None,
        optimizer_states: int,
    ) -> tuple[list[list[float]], list[list[float]] | None, list[tuple[int, int, int, float]]]:
        """The solver's cost channels, stage scales and overlaps for cuts after events ``xs``."""
        trace = self._trace
        atoms = _profile.fold(trace, xs)
        if balance == "parameters":
            params, overlaps = _union_channel(
                [self._trainable_numel(names) for names in atoms.state], 0
            )
            return [params], None, overlaps
        if balance == "memory":
            state, state_overlaps = _union_channel(
                [self._state_bytes(names, optimizer_states) for names in atoms.state], 0
            )
            activation, act_overlaps = _union_channel([self._saved_bytes(r) for r in atoms.gaps], 1)
            held = _one_f_one_b(num_stages, micro_batches).in_flight
            scales = [[1.0, float(held[k])] for k in range(num_stages)]
            return [state, activation], scales, state_overlaps + act_overlaps
        if balance == "flops":
            fwd, bwd = trace.forward_flops or [], trace.backward_flops or []
        else:
            fwd, bwd = trace.forward_time or [], trace.backward_time or []
        return [[sum(fwd[g] + bwd[g] for g in r) for r in atoms.gaps]], None, []

    def _trainable_numel(self, names: frozenset[str]) -> dict[str, float]:
        state = self._trace.state
        return {
            n: float(state[n].numel)
            for n in sorted(names)
            if state[n].is_parameter and state[n].trainable
        }

    def _state_bytes(self, names: frozenset[str], optimizer_states: int) -> dict[str, float]:
        """Bytes per parameter or buffer: weights, gradients and optimizer states if trainable."""
        out = {}
        for name in sorted(names):
            item = self._trace.state[name]
            out[name] = float(item.nbytes * (2 + optimizer_states if item.trainable else 1))
        return out

    def _saved_bytes(self, gaps: range) -> dict[int, float]:
        """Bytes of every storage forward saves for backward in ``gaps``, once each."""
        merged: dict[int, float] = {}
        for g in gaps:
            for key, nbytes in (self._trace.saved or [])[g].items():
                merged[key] = float(nbytes)
        return merged

    def costs(
        self,
        split_points: Sequence[str],
        *,
        micro_batches: int | None = None,
        optimizer_states: int = 2,
    ) -> PlanCosts:
        """Every stage's predicted costs for ``split_points`` (in execution order)."""
        if isinstance(split_points, str):
            raise SplitPointError(
                f"split_points must be a list of module paths: [{split_points!r}]"
            )
        points = [self._resolve(p, "split point") for p in split_points]
        xs = [self._exit(p) for p in points]
        check_execution_order(points, xs, "finishes")
        self._check_nesting(points, "split point")
        trace = self._trace
        atoms = _profile.fold(trace, xs)
        p = len(points) + 1
        if points and atoms.ops[-1] == 0:
            raise SplitPointError(
                f"split point {points[-1]!r} is the last computation in forward: the stage "
                "after it would compute nothing"
            )
        held = _one_f_one_b(p, micro_batches).in_flight
        stages = []
        for k in range(p):
            names = atoms.state[k]
            params = [trace.state[n] for n in names if trace.state[n].is_parameter]
            gaps = atoms.gaps[k]
            flops = None
            if trace.forward_flops is not None and trace.backward_flops is not None:
                flops = sum(trace.forward_flops[g] + trace.backward_flops[g] for g in gaps)
            seconds = forward = None
            if trace.forward_time is not None and trace.backward_time is not None:
                forward = sum(trace.forward_time[g] for g in gaps)
                seconds = forward + sum(trace.backward_time[g] for g in gaps)
            activation = None
            if trace.saved is not None:
                activation = int(sum(self._saved_bytes(gaps).values()))
            state = int(sum(self._state_bytes(names, optimizer_states).values()))
            in_flight = held[k]
            boundary = None
            if trace.crossing is not None:
                boundary = trace.crossing[xs[k]] if k < p - 1 else 0
            stages.append(
                StageCosts(
                    stage=k,
                    ends_after=points[k] if k < p - 1 else None,
                    parameters=sum(i.numel for i in params),
                    parameter_bytes=sum(i.nbytes for i in params),
                    state_bytes=state,
                    flops=flops,
                    activation_bytes=activation,
                    in_flight=in_flight,
                    memory_bytes=None if activation is None else state + in_flight * activation,
                    boundary_bytes=boundary,
                    time=seconds,
                    forward_time=forward,
                )
            )
        return PlanCosts(
            split_points=tuple(points), stages=tuple(stages), micro_batches=micro_batches
        )


def _union_channel(
    per_atom: Sequence[Mapping[Any, float]], channel: int
) -> tuple[list[float], list[tuple[int, int, int, float]]]:
    """Per-atom totals of keyed amounts, and an overlap for each key's consecutive users.

    A stage then costs exactly the union of its atoms' keys ([Note: balance solver]).
    """
    values = [sum(amounts.values()) for amounts in per_atom]
    last_user: dict[Any, int] = {}
    overlaps = []
    for atom, amounts in enumerate(per_atom):
        for key, amount in amounts.items():
            if key in last_user:
                overlaps.append((channel, last_user[key], atom, amount))
            last_user[key] = atom
    return values, overlaps


def profile_model(
    model: nn.Module,
    *,
    example_inputs: Mapping[str, Any] | None = None,
    concrete_args: Mapping[str, Any] | None = None,
    leaf_modules: Sequence[str | type[nn.Module]] | None = None,
    measure_time: bool = False,
    repeats: int = 3,
    every_rank: bool = True,
    threads: int | None = None,
) -> ModelProfile:
    """Measure ``model`` once for :meth:`ModelProfile.choose` and :meth:`ModelProfile.costs`.

    Args:
        model: the model, unchanged by the measurement (it may live on the meta device unless
            ``measure_time``).
        example_inputs: ``{parameter name: tensor}``, one micro-batch, as for
            :func:`pipedialect.partition`. Given, forward and backward run on fake tensors of
            these shapes (FLOPs, activation and boundary bytes); without, the forward is traced
            with torch.fx and only parameters are counted.
        concrete_args: values for forward's other parameters, as for ``partition``.
        leaf_modules: modules that run as one call, as for ``partition``: nothing inside them
            is a candidate.
        measure_time: also time forward and backward on the real example inputs (a warm-up,
            then ``repeats`` runs or more until they agree, the median per module, with torch
            pinned to this process's share of the cores: :attr:`ModelProfile.timing` says how
            many threads, runs and what spread); under ``torch.distributed`` every
            rank must call this, and all take rank 0's times.
        repeats: timed runs.
        every_rank: under ``torch.distributed``, every rank calls this and all take rank 0's
            times (a rank that is alone in calling it is refused by name, [Note: measurements
            agree across ranks]); False: this rank's own times, no collective.
        threads: the intra-op threads to time with (default: this process's share of the
            cores, :func:`timing_threads`).
    """
    leaf_ids, leaf_types, _ = resolve_leaves(model, leaf_modules or ())
    hidden = _profile._hidden_modules(model, leaf_ids, leaf_types)
    if example_inputs is None:
        if measure_time:
            raise ConfigError("measure_time needs example_inputs to run the model on")
        trace = _profile.trace_fx(model, concrete_args, leaf_ids, leaf_types, hidden)
    else:
        if not isinstance(example_inputs, Mapping):
            raise ConfigError(
                "example_inputs must map forward's parameter names to tensors, got "
                f"{type(example_inputs).__name__}"
            )
        trace = _profile.trace_fake(model, example_inputs, concrete_args or {}, hidden)
        if measure_time:
            if repeats < 1:
                raise ConfigError(f"repeats must be at least 1, got {repeats}")
            if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
                raise ConfigError(
                    "measure_time runs the real model; this one has parameters on the meta "
                    "device. Use balance='flops' or 'memory', which need only shapes."
                )
            _profile.measure_time(
                model, example_inputs, concrete_args or {}, trace, repeats, threads
            )
            if every_rank:
                _profile.agree_across_ranks(trace)
    canonical = {id(m): name for name, m in model.named_modules()}
    aliases = {name: canonical[id(m)] for name, m in model.named_modules(remove_duplicate=False)}
    return ModelProfile(type(model).__name__, trace, aliases, _blocks(model))


def _blocks(model: nn.Module) -> list[str]:
    """The layers a Hugging Face model's ``base_model_pp_plan`` names, else the children of the
    outermost ``ModuleList`` and ``Sequential`` containers ([Note: blocks])."""
    pp_plan = getattr(getattr(model, "config", None), "base_model_pp_plan", None)
    if isinstance(pp_plan, Mapping) and pp_plan:
        prefix = str(getattr(model, "base_model_prefix", "") or "")
        base = getattr(model, prefix, model) if prefix else model
        root = f"{prefix}." if isinstance(base, nn.Module) and base is not model else ""
        for name in pp_plan:
            layers = getattr(base, str(name), None)
            if isinstance(layers, nn.ModuleList) and len(layers) > 0:
                return [f"{root}{name}.{child}" for child, _ in layers.named_children()]
    blocks: list[str] = []
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList | nn.Sequential) or len(module) < 2:
            continue
        if any(path == b or path.startswith(f"{b}.") for b in blocks):
            continue  # a container inside a block
        prefix = f"{path}." if path else ""
        blocks.extend(f"{prefix}{name}" for name, _ in module.named_children())
    return blocks


class BalanceOptions(TypedDict, total=False):
    """What :func:`choose_split_points` and :func:`balanced_split_points` take besides the
    model, the stage count and the method (see :func:`profile_model` and
    :meth:`ModelProfile.choose`)."""

    #: ``{parameter name: tensor}``, one micro-batch (all methods but ``"parameters"``).
    example_inputs: Mapping[str, Any] | None
    #: Split points the answer must contain.
    split_points: Sequence[str]
    #: The modules the other split points are chosen among (default: the model's blocks).
    candidates: Sequence[str] | None
    #: ``m``: micro-batches per step (default: at least ``num_stages``).
    micro_batches: int | None
    #: Values for forward's other parameters, as for ``partition``.
    concrete_args: Mapping[str, Any] | None
    #: Modules that run as one call, as for ``partition``.
    leaf_modules: Sequence[str | type[nn.Module]] | None
    #: Bytes per second between stages (default :data:`DEFAULT_BANDWIDTH`); None: free.
    bandwidth: float | None
    #: What ``"flops"`` turns boundary seconds into FLOPs at.
    flops_per_second: float
    #: Tensors of optimizer state per trainable parameter (Adam: 2).
    optimizer_states: int
    #: Timed runs for ``"time"``.
    repeats: int


def choose_split_points(
    model: nn.Module, num_stages: int, balance: BalanceMethod, **options: Unpack[BalanceOptions]
) -> list[str]:
    """Split points for :func:`pipedialect.partition` that balance ``num_stages`` stages.

    ``balance="parameters"`` works without ``example_inputs``; the others need them. See
    :class:`BalanceOptions` for the options.
    """
    points, _ = balanced_split_points(model, num_stages, balance, **options)
    return points


def balanced_split_points(
    model: nn.Module, num_stages: int, balance: BalanceMethod, **options: Unpack[BalanceOptions]
) -> tuple[list[str], PlanCosts]:
    """:func:`choose_split_points`, and the predicted costs of the stages they make (for
    ``micro_batches``, default ``num_stages``): what ``partition(num_stages=, balance=)`` runs,
    measuring the model once."""
    unknown = sorted(set(options) - set(BalanceOptions.__annotations__))
    if unknown:
        raise ConfigError(
            f"unknown balancing option(s) {unknown}; the options are "
            f"{sorted(BalanceOptions.__annotations__)}"
        )
    example_inputs = options.get("example_inputs")
    micro_batches = options.get("micro_batches")
    optimizer_states = options.get("optimizer_states", 2)
    if balance not in _METHODS:
        raise ConfigError(f"balance must be one of {list(_METHODS)}, got {balance!r}")
    if balance != "parameters" and example_inputs is None:
        raise ConfigError(
            f"balance={balance!r} measures the model on one micro-batch ({{parameter name: "
            "tensor}}): pass it (partition's balance_inputs= or example_inputs=, "
            "choose_split_points' example_inputs=), or use balance='parameters'"
        )
    profile = profile_model(
        model,
        example_inputs=example_inputs,
        concrete_args=options.get("concrete_args"),
        leaf_modules=options.get("leaf_modules"),
        measure_time=balance == "time",
        repeats=options.get("repeats", 3),
    )
    points = profile.choose(
        num_stages,
        balance,
        split_points=options.get("split_points", ()),
        candidates=options.get("candidates"),
        micro_batches=micro_batches,
        bandwidth=options.get("bandwidth", DEFAULT_BANDWIDTH),
        flops_per_second=options.get("flops_per_second", DEFAULT_FLOPS_PER_SECOND),
        optimizer_states=optimizer_states,
    )
    costs = profile.costs(
        points,
        micro_batches=num_stages if micro_batches is None else micro_batches,
        optimizer_states=optimizer_states,
    )
    return points, costs


def plan_costs(
    model: nn.Module,
    split_points: Sequence[str],
    *,
    example_inputs: Mapping[str, Any] | None = None,
    micro_batches: int | None = None,
    concrete_args: Mapping[str, Any] | None = None,
    leaf_modules: Sequence[str | type[nn.Module]] | None = None,
    measure_time: bool = False,
    optimizer_states: int = 2,
) -> PlanCosts:
    """Predicted per-stage costs of ``partition(model, split_points)`` (see :class:`StageCosts`)."""
    profile = profile_model(
        model,
        example_inputs=example_inputs,
        concrete_args=concrete_args,
        leaf_modules=leaf_modules,
        measure_time=measure_time,
    )
    return profile.costs(
        split_points, micro_batches=micro_batches, optimizer_states=optimizer_states
    )
