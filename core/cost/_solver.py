"""The exact contiguous-partition solver of :mod:`pipedialect.cost.balance`, and DeepSpeed's rule.

[Note: balance solver]
The model is a sequence of ``n + 1`` atoms separated by ``n`` candidate cuts (cut ``c`` falls
between atom ``c`` and atom ``c + 1``). A partition into ``p`` stages picks ``p - 1`` cuts;
stage ``k`` holds the atoms between its two cuts and costs

    sum over channels t of scale[k][t] * (its atoms' channel-t total - its overlaps in t)
        + boundary[its first cut] + boundary[its last cut]

so a stage-dependent weight (1F1B keeps ``p - k`` micro-batches of activations on stage ``k``)
and a charge for the bytes each boundary carries both fit. An *overlap* ``(t, a, b, amount)``
takes ``amount`` off channel ``t`` of a stage holding both atoms ``a`` and ``b``: a parameter or
a saved tensor several atoms use is held once per stage, so each pair of its consecutive users
gets an overlap of its size, and a stage's total is exactly the size of the union.

The solver minimises the largest stage cost exactly, by dynamic programming over (stage, last
cut): ``O(p * n^2)`` time, vectorised over the previous cut with torch float64 and chunked, so
memory stays ``O(n * chunk)`` (plus an ``(n + 2)^2`` table per channel that has overlaps).

Among the partitions with the optimal bottleneck it then picks the one with the smallest sum of
squared stage costs (a second exact DP restricted to stages that fit under the bottleneck), and
among those the one whose last cut comes earliest, then the cut before it, and so on; so the
answer depends on the costs alone and every rank that holds the same costs gets the same cuts.

Ties are broken by compute. With boundary charges, several partitions can share the optimal
bottleneck (a stage whose cost is mostly its charges sets it); squared costs that include the
charges would then push compute onto the end stages, which pay one charge where a middle stage
pays two. So among the partitions within the bottleneck the solver first minimises the largest
stage cost *without* the charges (the compute alone), then the sum of its squares; each is an
exact DP restricted to stages whose full cost stays within the bottleneck.

Constraints the model imposes:

- ``nested_from[j]``: cut ``j`` ends a module whose call contains the cuts
  ``nested_from[j] .. j - 1``; a split point runs as one call, so cut ``j`` cannot follow any of
  them. Calls nest properly, so forbidding this for consecutive cuts forbids it for every pair.
- ``fixed``: cuts the user chose; no stage may step over one.
- ``last_cut_below``: the last stage must compute something, so the last cut must be below it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

__all__: list[str] = []

_INF = float("inf")
# Matrix entries per chunk of end states: bounds the solver's memory for a few thousand atoms.
_CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class Solution:
    """Cuts (candidate indices, ascending), the bottleneck, and every stage's cost."""

    cuts: tuple[int, ...]
    bottleneck: float
    stage_costs: tuple[float, ...]


def solve(
    channels: Sequence[Sequence[float]],
    num_stages: int,
    *,
    scales: Sequence[Sequence[float]] | None = None,
    boundary: Sequence[float] | None = None,
    nested_from: Sequence[int] | None = None,
    fixed: Iterable[int] = (),
    last_cut_below: int | None = None,
    overlaps: Iterable[tuple[int, int, int, float]] = (),
) -> Solution | None:
    """Minimise the largest stage cost over contiguous partitions ([Note: balance solver]).

    Args:
        channels: ``T`` cost channels, each with one value per atom (``n + 1`` values).
        num_stages: ``p``.
        scales: ``p`` rows of ``T`` multipliers (stage ``k``'s weight of each channel);
            default 1.
        boundary: ``n`` values: the charge of cut ``c``, added to both stages beside it.
        nested_from: ``n`` values, see the note; default: no nesting.
        fixed: cuts every answer must contain.
        last_cut_below: the last cut must be smaller; default ``n``.
        overlaps: ``(channel, atom a, atom b, amount)`` with ``a < b``, see the note.

    Returns:
        The optimal partition, or None when no partition satisfies the constraints.
    """
    if not channels:
        raise ValueError("solve needs at least one cost channel")
    num_atoms = len(channels[0])
    if num_atoms < 1 or any(len(ch) != num_atoms for ch in channels):
        raise ValueError("every cost channel needs the same, non-zero number of atoms")
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}")
    problem = _Problem.build(
        channels, num_stages, scales, boundary, nested_from, fixed, last_cut_below, overlaps
    )
    best, _ = problem.run(bound=None)
    bottleneck = float(best[num_stages - 1][-1])
    if bottleneck == _INF:
        return None
    if bool(problem.charge.any()):
        # Ties broken by compute: the least compute bottleneck within the full one, then the
        # least squared compute ([Note: balance solver]).
        best, _ = problem.run(bound=None, limit=bottleneck, charged=False)
        compute = float(best[num_stages - 1][-1])
        _, choice = problem.run(bound=compute, limit=bottleneck, charged=False)
    else:
        _, choice = problem.run(bound=bottleneck)
    cuts = problem.backtrack(choice)
    costs = problem.stage_costs(cuts)
    return Solution(cuts=cuts, bottleneck=max(costs), stage_costs=costs)


@dataclass
class _Problem:
    """One partition problem in state form: state 0 is the start, ``c + 1`` the cut ``c``,
    ``n + 1`` the end; a stage goes from one state to a later one."""

    num_states: int
    num_stages: int
    prefix: torch.Tensor  # (T, n + 2): prefix[t, s] = sum of channel t over atoms < s
    scales: torch.Tensor  # (p, T)
    charge: torch.Tensor  # (n + 2,): boundary charge of each state (0 at start and end)
    # A stage (s -> e) is allowed iff s <= reach_from[e] and e <= reach_to[s].
    reach_from: torch.Tensor  # (n + 2,)
    reach_to: torch.Tensor  # (n + 2,)
    fixed_states: tuple[int, ...]
    # shared[t][s, e]: the overlap of channel t inside a stage from state s to state e.
    shared: dict[int, torch.Tensor]

    @classmethod
    def build(
        cls,
        channels: Sequence[Sequence[float]],
        num_stages: int,
        scales: Sequence[Sequence[float]] | None,
        boundary: Sequence[float] | None,
        nested_from: Sequence[int] | None,
        fixed: Iterable[int],
        last_cut_below: int | None,
        overlaps: Iterable[tuple[int, int, int, float]],
    ) -> _Problem:
        n = len(channels[0]) - 1
        values = torch.tensor([list(ch) for ch in channels], dtype=torch.float64)
        prefix = torch.zeros(values.shape[0], n + 2, dtype=torch.float64)
        prefix[:, 1:] = torch.cumsum(values, dim=1)
        if scales is None:
            scale_t = torch.ones(num_stages, values.shape[0], dtype=torch.float64)
        else:
            scale_t = torch.tensor([list(row) for row in scales], dtype=torch.float64)
            if scale_t.shape != (num_stages, values.shape[0]):
                raise ValueError("scales needs one row per stage and one column per channel")
        charge = torch.zeros(n + 2, dtype=torch.float64)
        if boundary is not None:
            if len(boundary) != n:
                raise ValueError(f"boundary needs one value per cut ({n}), got {len(boundary)}")
            charge[1 : n + 1] = torch.tensor(list(boundary), dtype=torch.float64)
        nest = list(range(n)) if nested_from is None else list(nested_from)
        if len(nest) != n or any(not 0 <= v <= j for j, v in enumerate(nest)):
            raise ValueError("nested_from[j] must lie in 0..j for every cut j")
        last = n if last_cut_below is None else last_cut_below
        # reach_from[e]: the latest state a stage ending at e may start from.
        reach_from = torch.tensor([-1, *nest, last], dtype=torch.int64)
        fixed_states = tuple(sorted({c + 1 for c in fixed}))
        if any(not 1 <= s <= n for s in fixed_states):
            raise ValueError(f"fixed cuts must lie in 0..{n - 1}")
        # reach_to[s]: the furthest state a stage starting at s may end at (the next fixed cut).
        reach_to = torch.full((n + 2,), n + 1, dtype=torch.int64)
        for s in range(n + 2):
            later = [f for f in fixed_states if f > s]
            if later:
                reach_to[s] = later[0]
        shared: dict[int, torch.Tensor] = {}
        for t, a, b, amount in overlaps:
            if not (0 <= t < values.shape[0] and 0 <= a < b <= n):
                raise ValueError(f"overlap {(t, a, b)} names no channel or no pair of atoms")
            # Atoms a..b lie in the stage (s -> e) iff s <= a and b < e.
            table = shared.setdefault(t, torch.zeros(n + 2, n + 2, dtype=torch.float64))
            table[a, b + 1] += amount
        for t, table in shared.items():
            table = torch.flip(torch.cumsum(torch.flip(table, [0]), 0), [0])
            shared[t] = torch.cumsum(table, 1)
        return cls(
            n + 2, num_stages, prefix, scale_t, charge, reach_from, reach_to, fixed_states, shared
        )

    def _costs(
        self, k: int, ends: torch.Tensor, charged: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage ``k``'s cost from every state to each of ``ends`` (with the boundary charges
        unless ``charged`` is False), and which are allowed."""
        starts = torch.arange(self.num_states)
        sums = self.prefix[:, None, ends] - self.prefix[:, :, None]  # (T, states, ends)
        for t, table in self.shared.items():
            sums[t] -= table[:, ends]
        cost = torch.einsum("t,tse->se", self.scales[k], sums)
        if charged:
            cost = cost + self.charge[:, None] + self.charge[None, ends]
        allowed = (
            (starts[:, None] < ends[None, :])
            & (starts[:, None] <= self.reach_from[ends][None, :])
            & (ends[None, :] <= self.reach_to[:, None])
        )
        return cost, allowed

    def run(
        self, bound: float | None, limit: float | None = None, charged: bool = True
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The DP: without ``bound``, minimise the bottleneck; with it, minimise the sum of
        squared stage costs among stages costing at most ``bound``. Costs leave the boundary
        charges out unless ``charged``; with ``limit``, only stages whose full cost (charges
        included) is at most ``limit`` are allowed. Returns the value and the chosen previous
        state for every (stage, end state)."""
        p, states = self.num_stages, self.num_states
        chunk = max(1, _CHUNK_ELEMENTS // (states * self.prefix.shape[0]))
        best: list[torch.Tensor] = []
        choice: list[torch.Tensor] = []
        for k in range(p):
            value = torch.full((states,), _INF, dtype=torch.float64)
            arg = torch.full((states,), -1, dtype=torch.int64)
            if k == 0:
                prev = torch.full((states,), _INF, dtype=torch.float64)
                prev[0] = 0.0
            else:
                prev = best[k - 1]
            # Intermediate stages end on a cut; the last one ends at the end state.
            end_states = [states - 1] if k == p - 1 else list(range(1, states - 1))
            for lo in range(0, len(end_states), chunk):
                ends = torch.tensor(end_states[lo : lo + chunk], dtype=torch.int64)
                cost, allowed = self._costs(k, ends, charged)
                if limit is not None:
                    full = cost if charged else self._costs(k, ends)[0]
                    allowed = allowed & (full <= limit)
                if bound is None:
                    total = torch.maximum(prev[:, None], cost)
                else:
                    allowed = allowed & (cost <= bound)
                    total = prev[:, None] + cost * cost
                total = torch.where(allowed, total, _INF)
                # torch.min along a dim returns the first minimal index: the earliest start.
                low, where = torch.min(total, dim=0)
                value[ends] = low
                arg[ends] = torch.where(low < _INF, where, -1)
            best.append(value)
            choice.append(arg)
        return best, choice

    def backtrack(self, choice: Sequence[torch.Tensor]) -> tuple[int, ...]:
        state = self.num_states - 1
        cuts: list[int] = []
        for k in range(self.num_stages - 1, 0, -1):
            state = int(choice[k][state])
            cuts.append(state - 1)
        cuts.reverse()
        return tuple(cuts)

    def stage_costs(self, cuts: Sequence[int]) -> tuple[float, ...]:
        states = [0, *(c + 1 for c in cuts), self.num_states - 1]
        out = []
        for k in range(self.num_stages):
            s, e = states[k], states[k + 1]
            cost, _ = self._costs(k, torch.tensor([e]))
            out.append(float(cost[s, 0]))
        return tuple(out)


def spread_partition(weights: Sequence[float], num_parts: int) -> list[int]:
    """DeepSpeed's ``partition_method="parameters"`` rule, for comparison: part boundaries.

    ``PipelineModule`` counts each layer's trainable parameters and splits the layer list with
    ``partition_balanced``: a dynamic programme over (layers, parts) that keeps, for each
    prefix, the split whose part sums have the smallest spread (largest minus smallest),
    preferring the latest previous boundary on a tie; with no more layers than parts it gives one
    layer per part. Returns ``num_parts + 1`` indices, part ``k`` being layers
    ``[parts[k], parts[k + 1])``, as DeepSpeed's ``parts`` list.
    """
    n = len(weights)
    if n <= num_parts:
        return [min(k, n) for k in range(num_parts + 1)]
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    # table[i][j]: (spread, largest, smallest, previous boundary) for i layers in j parts.
    table: list[list[tuple[float, float, float, int] | None]] = [
        [None] * (num_parts + 1) for _ in range(n + 1)
    ]
    table[0][0] = (0.0, 0.0, _INF, 0)
    for i in range(1, n + 1):
        for j in range(1, min(i, num_parts) + 1):
            chosen: tuple[float, float, float, int] | None = None
            for k in range(i):
                before = table[k][j - 1]
                if before is None:
                    continue
                part = prefix[i] - prefix[k]
                largest, smallest = max(before[1], part), min(before[2], part)
                spread = largest - smallest
                if chosen is None or spread <= chosen[0]:
                    chosen = (spread, largest, smallest, k)
            table[i][j] = chosen
    parts = [n]
    for j in range(num_parts, 0, -1):
        entry = table[parts[-1]][j]
        if entry is None:  # pragma: no cover - every prefix of >= j layers has a j-part split
            raise ValueError("no split of the layers into the requested number of parts")
        parts.append(entry[3])
    parts.reverse()
    return parts


def uniform_partition(num_items: int, num_parts: int) -> list[int]:
    """An equal-count split: ``num_parts + 1`` boundaries, the first parts one item larger."""
    if num_items <= num_parts:
        return [min(k, num_items) for k in range(num_parts + 1)]
    size, extra = divmod(num_items, num_parts)
    parts = [0]
    for k in range(num_parts):
        parts.append(parts[-1] + size + (1 if k < extra else 0))
    return parts
