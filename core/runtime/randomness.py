"""Random numbers drawn in forward: one stream per stage and micro-batch, on every rank.

[Note: random streams]
Dropout masks and ``torch.randn_like`` noise are drawn from a generator. In the unsplit model
every draw of a micro-batch comes from one generator, one after the other; in a pipeline each
rank has its own generator, so a stage on another rank would draw other numbers, and a
schedule that interleaves micro-batches would draw them in another order. No rank can know how
far the unsplit model's generator would have advanced by the time its stage starts (that
depends on every earlier stage's draws), so the pipeline does not try to reproduce the unsplit
model's single stream. Instead every stage draws from its own stream:

    the forward of stage ``k`` on micro-batch ``m`` of step ``t`` draws from the default
    generator seeded with ``stream_seed(seed, kind, t, 0, m, k)``,

where ``kind`` is ``"train"`` or ``"eval"``, ``t`` is the optimizer step being taken
(``global_steps + 1``) in training and the steps taken so far (``global_steps``) in
evaluation, and ``seed`` is ``pipe_engine(seed=)`` (0 by default). Data-parallel replicas
draw alike on their own micro-batches, as ranks seeded alike do (the key's replica component,
0 in every engine, is there for a caller that wants them apart). The streams depend on
nothing a runtime chooses (which rank runs the stage, the schedule, the order in which
micro-batches are interleaved, recomputation), so the local, deepspeed and torch dialects draw
the same numbers for the same plan, at every schedule. The generator's state outside the
stage is left as it was: a stage's forward consumes none of the rank's own randomness.
Recomputation replays the same draws: ``torch.utils.checkpoint`` restores the state it saw on
entry, which is this stream's, and DeepSpeed's activation checkpointing re-runs the stage with
the micro-batch index it had in the forward.

The unsplit model draws the same numbers when it is run under :class:`ReferenceStreams`: one
``with streams.micro_batch(kind, step, m):`` around each forward seeds stage 0's stream on
entry and, through forward hooks on the split-point modules, stage ``k + 1``'s stream right after
split point ``k`` returns -- where the plan's stage boundary falls. So a pipeline with dropout
equals the unsplit model run under :class:`ReferenceStreams` of the same split points and seed;
a plan with other split points (another depth) draws other (equally distributed) masks.
Draws made by ``loss_fn`` are outside every stage and use the rank's own generator.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError

__all__ = [
    "ReferenceStreams",
    "StageRandomness",
    "begin_streams",
    "drawing_from",
    "not_counted",
    "stream_seed",
]

#: The two kinds of forward a stream belongs to.
KINDS = ("train", "eval")


def stream_seed(seed: int, kind: str, step: int, replica: int, micro_batch: int, stage: int) -> int:
    """The seed of stage ``stage``'s stream on one micro-batch; see [Note: random streams].

    A hash of every component, so that neighbouring micro-batches or stages get unrelated
    streams; the same on every rank and every run.
    """
    if kind not in KINDS:
        raise ConfigError(f"a random stream's kind is one of {list(KINDS)}, got {kind!r}")
    text = (
        f"pipedialect:{int(seed)}:{kind}:{int(step)}:{int(replica)}:{int(micro_batch)}:{int(stage)}"
    )
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


@contextlib.contextmanager
def drawing_from(seed: int, devices: Sequence[torch.device] = ()) -> Iterator[None]:
    """Draw from generators seeded with ``seed`` (the CPU one and those of ``devices``), then put
    every generator back as it was: what runs inside consumes none of the caller's randomness."""
    cuda = [d.index if d.index is not None else torch.cuda.current_device() for d in devices]
    with torch.random.fork_rng(devices=cuda):
        torch.default_generator.manual_seed(seed)
        for index in cuda:
            torch.cuda.default_generators[index].manual_seed(seed)
        yield


class StageRandomness:
    """Which stream a stage's next forward draws from; held by each stage wrapper.

    Engines call :meth:`begin` at the start of every ``train_batch`` and ``eval_batch`` (every
    stage's forwards run in micro-batch order on every schedule, so the wrapper counts them);
    a runtime that re-runs a stage's forward for recomputation sets :attr:`next_micro_batch`
    back first.
    """

    def __init__(self, stage_id: int, seed: int = 0) -> None:
        self.stage_id = stage_id
        #: ``pipe_engine(seed=)``: the root of every stream.
        self.seed = int(seed)
        self.kind = "train"
        self.step = 0
        self.replica = 0
        #: The micro-batch the stage's next forward belongs to.
        self.next_micro_batch = 0

    def begin(self, kind: str, step: int, replica: int = 0) -> None:
        """Start a batch: the next forward is micro-batch 0 of ``kind`` at ``step``."""
        if kind not in KINDS:
            raise ConfigError(f"a random stream's kind is one of {list(KINDS)}, got {kind!r}")
        self.kind, self.step, self.replica = kind, int(step), int(replica)
        self.next_micro_batch = 0

    def current_seed(self, micro_batch: int) -> int:
        """The seed of this stage's stream on ``micro_batch`` of the current batch."""
        return stream_seed(
            self.seed, self.kind, self.step, self.replica, micro_batch, self.stage_id
        )

    @contextlib.contextmanager
    def forward(self, devices: Sequence[torch.device] = ()) -> Iterator[None]:
        """One forward of the stage: draw from its stream on the next micro-batch."""
        micro_batch = self.next_micro_batch
        self.next_micro_batch += 1
        with drawing_from(self.current_seed(micro_batch), devices):
            yield

    @contextlib.contextmanager
    def not_counted(self) -> Iterator[None]:
        """Forwards that are no micro-batch of the run (a set-up run): the count is put back."""
        saved = (self.kind, self.step, self.replica, self.next_micro_batch)
        try:
            yield
        finally:
            self.kind, self.step, self.replica, self.next_micro_batch = saved


def _streams_of(stages: Iterable[nn.Module]) -> list[StageRandomness]:
    found = [getattr(stage, "random", None) for stage in stages]
    return [r for r in found if isinstance(r, StageRandomness)]


def begin_streams(stages: Iterable[nn.Module], kind: str, step: int, replica: int = 0) -> None:
    """:meth:`StageRandomness.begin` on every stage wrapper among ``stages`` (an engine calls it
    at the start of each ``train_batch`` and ``eval_batch``)."""
    for streams in _streams_of(stages):
        streams.begin(kind, step, replica)


@contextlib.contextmanager
def not_counted(stages: Iterable[nn.Module]) -> Iterator[None]:
    """Forwards of ``stages`` that are no micro-batch of the run (a set-up run): every stage
    wrapper's count is put back afterwards."""
    with contextlib.ExitStack() as stack:
        for streams in _streams_of(stages):
            stack.enter_context(streams.not_counted())
        yield


class ReferenceStreams:
    """Make the unsplit ``model`` draw what a pipeline of ``split_points`` draws.

    ``split_points`` are the plan's (``plan.split_points``) and ``seed`` the engine's
    (``pipe_engine(seed=)``). Run each forward of the unsplit model inside
    :meth:`micro_batch`; see [Note: random streams].

    Raises:
        ConfigError: a split point names no submodule of ``model``.
    """

    def __init__(self, model: nn.Module, split_points: Sequence[str], *, seed: int = 0) -> None:
        self.model = model
        self.seed = int(seed)
        modules = dict(model.named_modules(remove_duplicate=False))
        missing = [p for p in split_points if p not in modules]
        if missing:
            raise ConfigError(
                f"split points {missing} name no submodule of the model; pass the plan's "
                "split_points (plan.split_points)"
            )
        self.split_modules = [modules[p] for p in split_points]

    @contextlib.contextmanager
    def micro_batch(
        self,
        kind: str,
        step: int,
        micro_batch: int,
        *,
        replica: int = 0,
        devices: Sequence[torch.device] = (),
    ) -> Iterator[None]:
        """One forward of the model: micro-batch ``micro_batch`` of ``kind`` at ``step``
        (``global_steps + 1`` of the engine in training, ``global_steps`` in evaluation)."""
        seeds = [
            stream_seed(self.seed, kind, step, replica, micro_batch, k)
            for k in range(len(self.split_modules) + 1)
        ]
        handles = []

        def reseed(stage: int) -> Any:
            def hook(module: nn.Module, args: Any, output: Any) -> None:
                del module, args, output
                torch.default_generator.manual_seed(seeds[stage])
                for d in devices:
                    index = d.index if d.index is not None else torch.cuda.current_device()
                    torch.cuda.default_generators[index].manual_seed(seeds[stage])

            return hook

        for k, module in enumerate(self.split_modules):
            handles.append(module.register_forward_hook(reseed(k + 1)))
        try:
            with drawing_from(seeds[0], devices):
                yield
        finally:
            for handle in handles:
                handle.remove()
