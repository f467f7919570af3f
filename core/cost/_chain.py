"""A model as the planner sees it: a chain of atoms between candidate split points.

[Note: the chain]
The planner cuts a model only where :func:`pipedialect.partition` can: after a candidate
module (see :mod:`pipedialect.cost.balance`). Between two consecutive candidates lies an *atom*,
with its forward and backward seconds for one micro-batch of ``batch`` samples (and the part of
them a micro-batch of any size costs), the parameters and
other state it reads (keyed by name, so a parameter two atoms share is counted once per stage),
the tensors its forward saves for the backward (keyed by storage, likewise), and, for tensor
parallelism, the part of all that inside tensor-parallel modules. ``boundary[c]`` is the bytes a
cut after atom ``c`` carries. A stage is a run of atoms; its costs are their sums (their unions
for keyed amounts).

A chain is built from a model by :func:`pipedialect.cost.model_chains` (measured once, on
fake tensors or for real), or written by hand for a model described by its layers' costs.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from ..errors import ConfigError
from ._solver import solve

__all__ = ["Atom", "Chain", "StageProfile"]

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Atom:
    """What lies between two consecutive candidate split points ([Note: the chain])."""

    #: Forward seconds for one micro-batch of the chain's ``batch`` samples.
    forward: float
    #: Backward seconds, likewise (input and weight gradients together).
    backward: float
    #: Trainable parameter bytes, by parameter name.
    parameters: Mapping[str, int] = field(default_factory=dict)
    #: Other state bytes (buffers, frozen parameters), by name.
    state: Mapping[str, int] = field(default_factory=dict)
    #: Bytes the forward keeps for the backward, by storage.
    saved: Mapping[Hashable, int] = field(default_factory=dict)
    #: Forward seconds run again in the backward (the atom is recomputed, ``recompute=``): its
    #: backward then costs ``backward + recompute``, and ``saved`` holds what the checkpoint
    #: keeps rather than what the forward would.
    recompute: float = 0.0
    #: Forward and backward seconds inside tensor-parallel modules (part of the above).
    tensor_forward: float = 0.0
    tensor_backward: float = 0.0
    #: The parameters and saved storages of tensor-parallel modules (sharded over the axis).
    tensor_parameters: frozenset[str] = frozenset()
    tensor_saved: frozenset[Hashable] = frozenset()
    #: Bytes all-reduced over the tensor axis per micro-batch: in the forward (row-wise
    #: outputs) and in the backward (column-wise input gradients).
    tensor_forward_bytes: int = 0
    tensor_backward_bytes: int = 0
    #: Bytes the largest recomputed module in the atom holds again in the backward: what its
    #: forward saves, re-materialised by the recomputation and freed by its own backward
    #: (one recomputed module at a time).
    rematerialized: int = 0
    #: The model's blocks that end in the atom (a sharded stage makes one FSDP unit of each,
    #: plus its root: their hooks cost per computation, [Note: cost model]).
    blocks: int = 0
    #: The tensor-parallel modules the atom calls (each costs the runtime per computation).
    tensor_modules: int = 0
    #: The part of ``forward`` and of ``backward`` that a micro-batch of any size costs (work
    #: on the parameters: [Note: seconds that do not scale with the micro-batch] in
    #: ``cost._profile``); the rest scales with the samples.
    forward_fixed: float = 0.0
    backward_fixed: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.forward_fixed <= self.forward:
            raise ConfigError(
                f"an atom's forward_fixed must lie in [0, forward = {self.forward}], got "
                f"{self.forward_fixed}"
            )
        if not 0.0 <= self.backward_fixed <= self.backward:
            raise ConfigError(
                f"an atom's backward_fixed must lie in [0, backward = {self.backward}], got "
                f"{self.backward_fixed}"
            )


@dataclass(frozen=True)
class StageProfile:
    """One stage's costs at the chain's micro-batch size, before any parallel layout."""

    forward: float
    backward: float
    recompute: float
    parameter_bytes: int
    state_bytes: int
    activation_bytes: int
    #: Bytes the stage sends to the next one (0 for the last).
    boundary_bytes: int
    tensor_forward: float
    tensor_backward: float
    tensor_parameter_bytes: int
    tensor_activation_bytes: int
    tensor_forward_bytes: int
    tensor_backward_bytes: int
    #: The most bytes a recomputation re-materialises at once during the stage's backward.
    rematerialized_bytes: int = 0
    #: The largest trainable parameter's bytes (tensor-parallel ones whole): its gradient is
    #: the largest one a backward makes before adding it into the accumulated one.
    largest_parameter_bytes: int = 0
    #: The model's blocks in the stage, and its tensor-parallel modules.
    blocks: int = 0
    tensor_modules: int = 0
    #: The part of ``forward`` and ``backward`` that does not scale with the micro-batch.
    forward_fixed: float = 0.0
    backward_fixed: float = 0.0


@dataclass(frozen=True)
class Chain:
    """A model as a chain of atoms ([Note: the chain])."""

    atoms: tuple[Atom, ...]
    #: ``cuts[c]``: the split point (module path) that ends atom ``c``; ``len(atoms) - 1`` of them.
    cuts: tuple[str, ...]
    #: ``boundary[c]``: bytes a cut after atom ``c`` carries.
    boundary: tuple[int, ...]
    #: Samples per micro-batch the costs are for.
    batch: int = 1
    #: ``nested_from[c]``: cut ``c`` ends a module whose call contains cuts
    #: ``nested_from[c] .. c - 1``, which cannot come right before it (see ``cost._solver``).
    nested_from: tuple[int, ...] | None = None
    #: The last cut must be below this (the last stage must compute); default: any.
    last_cut_below: int | None = None
    #: The share of each backward that is the weight-gradient pass (split backward schedules
    #: run it separately); matrix products spend about half their backward there.
    weight_fraction: float = 0.5
    #: A label for tables (``"checkpoint blocks.*"``).
    label: str = ""
    #: The share of the computations' seconds that kept the measuring process's ``threads``
    #: busy on the CPU (the rest waited or slept); None: not measured on a CPU, and ranks that
    #: share cores do not slow each other down ([Note: ranks sharing cores] in
    #: ``cost._simulate``).
    cpu_share: float | None = None
    #: The intra-op threads each rank computes with (those the measurement was pinned to).
    threads: int = 1
    #: Bytes of the model's inputs and of its outputs at ``batch`` samples (0: not known).
    input_bytes: int = 0
    output_bytes: int = 0

    def __post_init__(self) -> None:
        n = len(self.atoms)
        if n < 1:
            raise ConfigError("a chain needs at least one atom")
        if len(self.cuts) != n - 1 or len(self.boundary) != n - 1:
            raise ConfigError(
                f"a chain of {n} atoms needs {n - 1} cut names and boundary sizes, got "
                f"{len(self.cuts)} and {len(self.boundary)}"
            )
        if self.batch < 1:
            raise ConfigError(f"a chain's batch must be at least 1, got {self.batch}")
        if not 0.0 <= self.weight_fraction <= 1.0:
            raise ConfigError(f"weight_fraction must lie in [0, 1], got {self.weight_fraction}")
        if self.nested_from is not None and len(self.nested_from) != n - 1:
            raise ConfigError(f"nested_from needs {n - 1} values, got {len(self.nested_from)}")

    @property
    def max_stages(self) -> int:
        """The most stages the chain can be cut into."""
        last = len(self.atoms) - 1 if self.last_cut_below is None else self.last_cut_below
        return 1 + min(len(self.cuts), last)

    def stages(self, cuts: Sequence[int]) -> list[StageProfile]:
        """The costs of the stages that ``cuts`` (ascending cut indices) make."""
        bounds = [-1, *cuts, len(self.atoms) - 1]
        out = []
        for k in range(len(bounds) - 1):
            atoms = self.atoms[bounds[k] + 1 : bounds[k + 1] + 1]
            if not atoms:
                raise ConfigError(f"cuts {list(cuts)} leave stage {k} empty")
            params = _union(a.parameters for a in atoms)
            state = _union(a.state for a in atoms)
            saved = _union(a.saved for a in atoms)
            tp_params = frozenset().union(*(a.tensor_parameters for a in atoms))
            tp_saved = frozenset().union(*(a.tensor_saved for a in atoms))
            out.append(
                StageProfile(
                    forward=sum(a.forward for a in atoms),
                    backward=sum(a.backward for a in atoms),
                    recompute=sum(a.recompute for a in atoms),
                    parameter_bytes=sum(params.values()),
                    state_bytes=sum(state.values()),
                    activation_bytes=sum(saved.values()),
                    boundary_bytes=self.boundary[bounds[k + 1]] if k < len(bounds) - 2 else 0,
                    tensor_forward=sum(a.tensor_forward for a in atoms),
                    tensor_backward=sum(a.tensor_backward for a in atoms),
                    tensor_parameter_bytes=sum(v for n, v in params.items() if n in tp_params),
                    tensor_activation_bytes=sum(v for s, v in saved.items() if s in tp_saved),
                    tensor_forward_bytes=sum(a.tensor_forward_bytes for a in atoms),
                    tensor_backward_bytes=sum(a.tensor_backward_bytes for a in atoms),
                    rematerialized_bytes=max(a.rematerialized for a in atoms),
                    largest_parameter_bytes=max(params.values(), default=0),
                    blocks=sum(a.blocks for a in atoms),
                    tensor_modules=sum(a.tensor_modules for a in atoms),
                    forward_fixed=sum(a.forward_fixed for a in atoms),
                    backward_fixed=sum(a.backward_fixed for a in atoms),
                )
            )
        return out

    def balanced_cuts(self, weights: Sequence[float], num_stages: int) -> tuple[int, ...] | None:
        """The cuts into ``num_stages`` stages that make the largest sum of ``weights`` (one per
        atom) as small as the chain allows, by the exact solver ([Note: balance solver]); None
        when it cannot make that many stages."""
        solution = solve(
            [list(weights)],
            num_stages,
            nested_from=self.nested_from,
            last_cut_below=self.last_cut_below,
        )
        return None if solution is None else solution.cuts

    def split_points(self, cuts: Sequence[int]) -> tuple[str, ...]:
        """The module paths of ``cuts``: what :func:`pipedialect.partition` takes."""
        return tuple(self.cuts[c] for c in cuts)


def _union(maps: Iterable[Mapping[K, int]]) -> dict[K, int]:
    merged: dict[K, int] = {}
    for m in maps:
        merged.update(m)
    return merged
