"""The torch dialect's pipeline module and runtime engine.

:class:`TorchPipeline` (what ``TorchDialect.pipe_engine`` returns) holds this rank's stages, each
a stage wrapper behind a :class:`~torch.distributed.pipelining.PipelineStage` adapter, and the
schedule that drives them. Torch's stages need example boundary tensors, which come from the
first micro-batch ([Note: boundary examples] in ``_setup``), so the ``PipelineStage`` objects and
the schedule are built on the first ``train_batch`` or ``eval_batch``.

:class:`TorchEngine` (what ``runtime_engine`` returns) drives it like DeepSpeed's
``PipelineEngine``: ``train_batch`` takes ``gradient_accumulation_steps`` ``(inputs, labels)``
micro-batches, runs them through the schedule (each loss scaled by ``1/gradient_accumulation_steps``
for its backward), sums tied-weight gradients across ranks ([Note: tied weights on torch] in
``_ties``), clips with the global norm, steps the optimizer once and returns the mean
micro-batch loss on every rank. Only the ranks holding the first or the last stage read the data
iterator, as in DeepSpeed; they read the whole step first and every rank learns whether one of
them failed (``pipedialect.runtime.agreement`` [Note: rank agreement]), so an iterator that runs out
is a :class:`~pipedialect.DataExhaustedError` on every rank, never a hang or a partial step. With
``check_finite`` the losses and gradients are checked before the optimizer steps, on every rank
alike. With a data axis in the topology every replica runs this on its own pipeline and data,
and gradients and the returned loss are averaged over the replicas (``_replicas``
[Note: data parallel on torch]). The configuration is a DeepSpeed config dict with DeepSpeed 0.19.8
semantics (:mod:`pipedialect.engine.config`), so one config gives the same numbers on
every dialect.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Unpack

import torch
import torch.distributed as dist
from torch import nn

from pipedialect import (
    CheckpointError,
    ConfigError,
    DataError,
    PipeDialectError,
    PlanMismatchError,
    StageWrapper,
)
from pipedialect.sdk import (
    EngineBase,
    PipelinePlan,
    SharedEngineArgs,
    TrainingConfig,
    agree_on_error,
    agreed,
    begin_streams,
    check_inputs,
    check_trainable,
    checkpoint_files,
    first_nonfinite_loss,
    is_sharded,
    local_part,
    nonfinite_loss_error,
    parse_config,
    read_checkpoint_file,
    root_nonfinite,
    shape_mismatch,
    stage_root,
)

from ._fsdp import FsdpStages
from ._replicas import Replicas
from ._schedules import ScheduleSpec
from ._setup import StageExamples, infer_examples
from ._stage import BatchContext, LossAdapter, StageRunner, pipeline_stage_class, to_device
from ._tensor import TensorLayout, check_stage, materialise_reference
from ._ties import TieSync, clip_global_norm

__all__ = ["TorchEngine", "TorchPipeline"]


class TorchPipeline(nn.Module):
    """This rank's stages of one plan, and the ``torch.distributed.pipelining`` schedule.

    Built by :meth:`TorchDialect.pipe_engine <pipedialect.dialects.torch.TorchDialect.pipe_engine>`
    after every check has passed; its parameters are those of this rank's stages (each once).
    """

    def __init__(
        self,
        plan: PipelinePlan,
        stages: Sequence[nn.Module],
        *,
        spec: ScheduleSpec,
        placement: Mapping[int, int],
        loss_fn: Callable[[Any, Any], Any],
        config: Mapping[str, Any],
        ties: TieSync,
        device: torch.device,
        replicas: Replicas | None = None,
    ) -> None:
        super().__init__()
        rank = dist.get_rank()
        #: The data-parallel replicas ([Note: data parallel on torch] in ``_replicas``).
        self.replicas = replicas or Replicas(len(set(placement.values())), 1, None)
        self.plan = plan
        self.spec = spec
        self.placement = dict(placement)
        self.num_stages = plan.num_stages
        self.num_ranks = len(set(placement.values()))
        self.rank = rank
        self.stage_ids = tuple(k for k in range(self.num_stages) if placement[k] == rank)
        self.loss_fn = loss_fn
        self.config = dict(config)
        self.ties = ties
        self.device = device
        self.context = BatchContext()
        self.runners = nn.ModuleList(
            StageRunner(stages[k], k, self.num_stages, self.context, device) for k in self.stage_ids
        )
        if not any(t.is_meta for t in self.runners.state_dict().values()):
            self.runners.to(device)  # a meta stage is sharded, then materialised (``_fsdp``)
        #: This rank's stages under FSDP (``_fsdp`` [Note: FSDP on torch]); None otherwise.
        self.fsdp: FsdpStages | None = None
        #: The tensor-parallel layout (``_tensor`` [Note: tensor parallel on torch]); None
        #: without a tensor axis.
        self.tensor_layout: TensorLayout | None = None
        #: Unsharded copies of this rank's tensor-parallel stages, until the first batch has
        #: checked the layout against them.
        self.references: dict[int, nn.Module] = {}
        #: The first batch's layout check failed on some rank: every later batch is refused.
        self._layout_error: PipeDialectError | None = None
        self._loss = LossAdapter(loss_fn, self.context)
        self._stages: list[Any] = []
        self._schedules: dict[int, Any] = {}
        self._examples: dict[int, StageExamples] | None = None

    # -- where things are ------------------------------------------------------------------

    @property
    def holds_first(self) -> bool:
        """Whether this rank runs stage 0 (it reads the model inputs)."""
        return 0 in self.stage_ids

    @property
    def holds_last(self) -> bool:
        """Whether this rank runs the last stage (it reads the labels and computes the loss)."""
        return self.num_stages - 1 in self.stage_ids

    @property
    def last_rank(self) -> int:
        """The rank that runs the last stage."""
        return self.placement[self.num_stages - 1]

    @property
    def sharded(self) -> bool:
        """Whether parameters are sharded over the mesh (FSDP): gradients are reduced by the
        sharding itself, and norms are summed over every rank."""
        return self.fsdp is not None

    @property
    def norm_over_mesh(self) -> bool:
        """Whether the gradient norm is summed over every rank of the mesh (sharded parameters)
        rather than over one pipeline's ranks."""
        return self.fsdp is not None or self.tensor_layout is not None

    def not_counted_here(self) -> set[int]:
        """The ids of this rank's parameters whose gradients another rank counts in the norm:
        a tied copy not on its owning rank, and under tensor parallelism every part that
        another replica or rank of the tensor axis holds too (counted on coordinate 0)."""
        skip = self.ties.not_counted_here()
        if self.tensor_layout is None:
            return skip
        replica, tensor_rank = self.replicas.replica, self.replicas.tensor_rank
        for param in self.parameters():
            if not is_sharded(param):
                if replica or tensor_rank:
                    skip.add(id(param))
                continue
            names = param.device_mesh.mesh_dim_names or ()  # type: ignore[attr-defined]
            if ("data" not in names and replica) or ("tensor" not in names and tensor_rank):
                skip.add(id(param))
        return skip

    def align_grads(self) -> None:
        """Lay out each sharded parameter's gradient as the parameter is laid out.

        DTensor's backward may return a gradient in another placement than its parameter's
        (an embedding sharded by vocabulary gets a replicated gradient); everything after the
        backward -- tie sums, data-parallel sums, norms, checks -- works on local parts, which
        must be the parameter's. Cutting a replicated gradient to a shard is local.
        """
        if self.tensor_layout is None:
            return
        for param in self.parameters():
            grad: Any = param.grad
            laid: Any = param
            if is_sharded(grad) and grad.placements != laid.placements:
                param.grad = grad.redistribute(laid.device_mesh, laid.placements)

    @property
    def built(self) -> bool:
        """Whether the ``PipelineStage`` objects exist (after the first batch)."""
        return bool(self._stages)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Not callable: a pipeline runs through its engine's ``train_batch``/``eval_batch``."""
        raise ConfigError(
            "a torch pipeline module is driven by its engine: call "
            "dialect.runtime_engine(module, config=...).train_batch(data_iter)"
        )

    # -- building the torch objects ----------------------------------------------------------

    def build(self, first_inputs: Any, num_micro_batches: int) -> None:
        """Create the ``PipelineStage`` objects from the first micro-batch (all ranks at once)."""
        stage_cls = pipeline_stage_class()
        self._examples = infer_examples(
            {r.stage_id: r for r in self._runners()}, self.placement, first_inputs, self.device
        )
        if self.tensor_layout is not None:
            self._check_tensor_layout(first_inputs)
        self._stages = [
            stage_cls(
                runner,
                runner.stage_id,
                self.num_stages,
                self.device,
                input_args=self._examples[runner.stage_id].inputs,
                output_args=self._examples[runner.stage_id].outputs,
                group=self.replicas.pipeline_group,
            )
            for runner in self._runners()
        ]
        self.schedule(num_micro_batches)

    def _check_tensor_layout(self, first_inputs: Any) -> None:
        """Run each tensor-parallel stage and its unsharded reference on the first
        micro-batch's boundary values and compare (``_tensor`` [Note: tensor parallel on
        torch]); each reference holds the stage's whole values only during its own check
        ([Note: the layout check's reference])."""
        assert self._examples is not None
        references, self.references = self.references, {}
        error: PipeDialectError | None = None
        try:
            for runner in self._runners():
                k = int(runner.stage_id)
                reference = references.pop(k, None)
                if reference is None:
                    continue
                materialise_reference(reference, runner.stage)
                twin = StageRunner(reference, k, self.num_stages, BatchContext(), self.device)
                args = [first_inputs] if runner.first else list(self._examples[k].inputs)
                check_stage(
                    k,
                    lambda a, r=runner: _run_once(r, a),
                    lambda a, r=twin: _run_once(r, a),
                    reference,
                    runner.stage,
                    args,
                    gradients=self.fsdp is None,
                )
                del reference, twin
        except PlanMismatchError as exc:
            error = exc
        finally:
            if self.fsdp is not None:
                self.fsdp.reshard()
        if error is not None:  # and every later batch is refused too (nothing was checked)
            self._layout_error = error
        # Every rank learns the outcome here, before any schedule runs: a mismatch is raised on
        # every rank alike and the process group stays usable.
        try:
            agree_on_error(error, device=self.device, what="the tensor-parallel layout check")
        except PipeDialectError as exc:
            self._layout_error = exc
            raise

    def begin_streams(self, kind: str, step: int) -> None:
        """Start a batch's random streams on this rank's stages
        (``pipedialect.runtime.randomness`` [Note: random streams])."""
        begin_streams([r.stage for r in self._runners()], kind, step)

    def _runners(self) -> list[StageRunner]:
        return [r for r in self.runners if isinstance(r, StageRunner)]

    def reset_shapes(self) -> None:
        """Drop the torch stages and schedules and every local wrapper's frozen wire state.

        The next batch builds them again from its first micro-batch, with its shapes.
        """
        self._stages = []
        self._schedules = {}
        self._examples = None
        for runner in self._runners():
            if isinstance(runner.stage, StageWrapper):
                runner.stage.reset_wire_state()

    def schedule(self, num_micro_batches: int) -> Any:
        """The schedule for ``num_micro_batches`` (one per count, built on first use)."""
        found = self._schedules.get(num_micro_batches)
        if found is not None:
            return found
        cls = self.spec.torch_class()
        if cls is None:
            raise ConfigError(f"this torch has no {self.spec.torch_name}")
        target: Any = self._stages[0] if self.spec.placement == "single" else self._stages
        try:
            schedule = cls(
                target, n_microbatches=num_micro_batches, loss_fn=self._loss, scale_grads=False
            )
        except ValueError as exc:
            raise ConfigError(
                f"schedule {self.spec.name!r} cannot run {num_micro_batches} micro-batches over "
                f"{self.num_stages} stages on {self.num_ranks} ranks: {exc}. Change "
                "gradient_accumulation_steps (or num_micro_batches)."
            ) from exc
        self._check_placement(schedule)
        self._schedules[num_micro_batches] = schedule
        return schedule

    def _check_placement(self, schedule: Any) -> None:
        used = getattr(schedule, "stage_index_to_group_rank", None)
        if used is None:
            used = self._stages[0].stage_index_to_group_rank
        # Torch counts ranks within this replica's pipeline group.
        ours = {k: self.replicas.position_of(r) for k, r in self.placement.items()}
        if dict(used) != ours:
            from pipedialect import TopologyError

            raise TopologyError(
                f"torch's {type(schedule).__name__} places stages as {dict(used)}, but this "
                f"dialect placed them as {ours}; this torch version changed its "
                "placement convention"
            )

    # -- one batch ----------------------------------------------------------------------------

    def run(self, batches: list[tuple[Any, Any]], count: int, *, train: bool) -> torch.Tensor:
        """Run ``count`` micro-batches through the schedule; return the mean loss (last rank).

        ``batches`` holds the micro-batches on ranks holding the first or last stage, and is
        empty elsewhere.
        """
        if self._layout_error is not None:
            raise self._layout_error
        if self.fsdp is not None:
            self.fsdp.check_untouched()
        if not self.built:
            self.build(batches[0][0] if self.holds_first else None, count)
        schedule = self.schedule(count)
        inputs = [b[0] for b in batches] if self.holds_first else []
        labels = [to_device(b[1], self.device) for b in batches] if self.holds_last else []
        # Each loss is divided by every replica's micro-batches: the data-parallel sum of the
        # gradients is then their mean ([Note: data parallel on torch] in ``_replicas``).
        self.context.start(inputs, labels, count * self.replicas.data if train else 1)
        index = torch.arange(count)
        args = (index,) if self.holds_first else ()
        target = index if self.holds_last else None
        try:
            if train:
                schedule.step(*args, target=target, return_outputs=False)
            else:
                schedule.eval(*args, target=target, return_outputs=False)
        except Exception as exc:
            # Torch wraps what a stage raises in a RuntimeError of its own; a pipedialect error
            # (a changed boundary structure, say) is what the user needs to see.
            ours = _pipedialect_cause(exc)
            if ours is None:
                raise
            raise ours from None
        finally:
            if self.fsdp is not None and not train:
                self.fsdp.reshard()  # training reshards after its reduction; evaluation here
        if not self.holds_last:
            return torch.zeros((), device=self.device)
        missing = [i for i in range(count) if i not in self.context.losses]
        if missing:
            raise ConfigError(f"the schedule computed no loss for micro-batches {missing}")
        total = self.context.losses[0].clone()
        for i in range(1, count):
            total += self.context.losses[i]
        return (total / count).to(self.device)


def _run_once(runner: StageRunner, args: Sequence[Any]) -> Any:
    """One forward of ``runner`` outside the schedule (through its own call, hooks included);
    the stage's raw output on the last stage, else its wire."""
    ctx = runner._context
    if runner.first:
        saved = ctx.inputs
        ctx.inputs = [args[0]]
        try:
            out = runner(torch.zeros(1, dtype=torch.int64))
        finally:
            ctx.inputs = saved
    else:
        out = runner(*args)
    if runner.last:
        out = ctx.pending_output
        ctx.pending_output = None
        ctx.has_pending = False
    return out


class _Accumulate:
    """A stage's ``after_backward``: move its bf16 gradients into the engine's buffers."""

    def __init__(self, engine: EngineBase, params: list[nn.Parameter]) -> None:
        self.engine = engine
        self.params = params

    def __call__(self) -> None:
        self.engine.accumulate_grads(self.params)


def _sum_over(value: torch.Tensor, device: torch.device, group: Any) -> torch.Tensor:
    """``value`` summed over ``group`` (one pipeline's ranks; None: every rank)."""
    total = value.to(device=device, dtype=torch.float32)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total


def _pipedialect_cause(exc: BaseException) -> PipeDialectError | None:
    """The first :class:`~pipedialect.PipeDialectError` in ``exc``'s chain of causes."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, PipeDialectError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


class TorchEngine(EngineBase):
    """Trains a :class:`TorchPipeline` with DeepSpeed ``PipelineEngine`` semantics."""

    module: TorchPipeline

    def __init__(
        self,
        module: TorchPipeline,
        config: TrainingConfig,
        **options: Unpack[SharedEngineArgs],
    ) -> None:
        super().__init__(module, config, **options)
        # bf16: each stage moves its gradients into the high-precision buffers after every
        # micro-batch's backward, as DeepSpeed's pipeline engine does per stage
        # (pipedialect.engine.precision [Note: bf16 as DeepSpeed does it]).
        for runner in module._runners():
            runner.after_backward = (
                None if self.mixed is None else _Accumulate(self, list(runner.parameters()))
            )

    def named_trainable(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters under their original names; a tied weight appears once, under
        its tie group's first name (the same on every rank holding it, so that a name filter puts
        every copy in the same group)."""
        module = self.module
        canonical: dict[int, str] = {}
        for group, copy in zip(module.plan.tie_groups, module.ties.copies, strict=True):
            if copy.param is not None:
                canonical[id(copy.param)] = group.members[0][0]
        named: list[tuple[str, nn.Parameter]] = []
        seen: set[int] = set()
        for runner in module._runners():
            stage = runner.stage
            root = stage_root(stage)
            for name, param in root.named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    named.append((canonical.get(id(param), name), param))
        return named

    @property
    def stage_ids(self) -> tuple[int, ...]:
        """The stages this rank runs."""
        return self.module.stage_ids

    def is_first_stage(self) -> bool:
        """Whether this rank runs stage 0."""
        return self.module.holds_first

    def is_last_stage(self) -> bool:
        """Whether this rank runs the last stage."""
        return self.module.holds_last

    # -- training ----------------------------------------------------------------------------

    def _pull(
        self, data_iter: Iterator[Any] | None, count: int, what: str, source: str
    ) -> list[tuple[Any, Any]]:
        """Read the step's micro-batches (on the ranks that read data); every rank raises if
        any of them failed to."""
        error: PipeDialectError | None = None
        batches: list[tuple[Any, Any]] = []
        try:
            batches = self._read(data_iter, count, what, source)
        except PipeDialectError as exc:
            error = exc
        except Exception as exc:
            error = DataError(f"the data iterator raised {type(exc).__name__}: {exc}")
            error.__cause__ = exc
        agree_on_error(error, device=self.module.device, what=what)
        return batches

    def _read(
        self, data_iter: Iterator[Any] | None, count: int, what: str, source: str
    ) -> list[tuple[Any, Any]]:
        if not (self.module.holds_first or self.module.holds_last):
            return []
        if data_iter is None:
            data_iter = self._data_iterator
        if data_iter is None:
            raise ConfigError(
                f"rank {self.module.rank} runs stage(s) {list(self.stage_ids)}, which read the "
                f"data: pass a data_iter to {what} (or call set_dataiterator first)"
            )
        batches = self.pull_pairs(data_iter, count, what=what, source=source)
        if self.module.holds_first:
            for i, (inputs, _) in enumerate(batches):
                check_inputs(inputs, self.module.plan.input_names, i)
        return batches

    def _check_finite(self, count: int, step: int) -> None:
        """Raise :class:`~pipedialect.NonFiniteError` on every rank if a loss or a gradient of
        this step is not finite anywhere (the loss takes precedence, then the earliest stage)."""
        error: PipeDialectError | None = None
        if self.module.holds_last:
            losses = [self.module.context.losses[i] for i in range(count)]
            bad = first_nonfinite_loss(losses)
            if bad is not None:
                error = nonfinite_loss_error(
                    losses[bad], step=step, stage=self.module.num_stages - 1, micro_batch=bad
                )
        if error is None:
            runners = self.module._runners()
            error = self.check_finite_grads(((r.stage_id, r.stage) for r in runners), step)
        agree_on_error(error, device=self.module.device, what=f"step {step}", choose=root_nonfinite)

    def _broadcast_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The mean loss over the replicas, on every rank."""
        module = self.module
        last = module.replicas.position_of(module.last_rank)
        return module.replicas.mean_loss(loss, last, module.device)

    def _agreed(self, what: str) -> contextlib.AbstractContextManager[None]:
        """A phase every rank runs together (a step, an evaluation, a checkpoint's save or
        load): an error on one rank is raised on every rank
        (``pipedialect.runtime.agreement`` [Note: one error, every rank])."""
        stages = ", ".join(str(k) for k in self.stage_ids)
        return agreed(what, where=f"[Stage {stages}] ")

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """Train on ``gradient_accumulation_steps`` micro-batches; return their mean loss.

        An error on any rank is raised on every rank (:class:`~pipedialect.RankFailedError`
        for an exception of the user's code), never a hang.
        """
        with self._agreed(f"train_batch (step {self.global_steps + 1})"):
            return self._train_batch(data_iter)

    def _train_batch(self, data_iter: Iterator[Any] | None) -> torch.Tensor:
        check_trainable(
            [r.stage for r in self.module._runners()], self.global_steps + 1, self.module.device
        )
        gas = self.config.gradient_accumulation_steps
        batches = self._pull(data_iter, gas, "train_batch", "gradient_accumulation_steps")
        self.module.train()
        module = self.module
        module.begin_streams("train", self.global_steps + 1)
        params = [p for p in module.parameters() if p.requires_grad]
        grad_of = None if self.mixed is None else self.grad_of
        try:
            loss = module.run(batches, gas, train=True)
            module.align_grads()
            self.accumulate_grads()  # bf16: whatever a backward path left in a bf16 .grad
            if grad_of is None:
                module.ties.all_reduce_grads()
                if not module.sharded:  # FSDP reduce-scattered them in the schedule
                    module.replicas.sum_grads(params)
            else:
                module.ties.all_reduce_grads(grad_of)
                # Each loss was divided by every replica's micro-batches: a sum, no division.
                if not module.sharded:
                    self.reduce_grads(
                        module.replicas.sum_flat if module.replicas.data > 1 else None
                    )
            if self.check_finite:
                self._check_finite(gas, self.global_steps + 1)
        except BaseException:
            self.zero_grads()
            raise
        skip = module.not_counted_here()
        # Whole gradients: one pipeline's ranks hold one copy of each; shards: every rank.
        norm_group = None if module.norm_over_mesh else module.replicas.pipeline_group
        self.take_step(
            lambda: clip_global_norm(
                params, self.config.gradient_clipping, skip, module.device, norm_group
            ),
            skip=skip,
            all_reduce=lambda total: _sum_over(total, module.device, norm_group),
        )
        return self._broadcast_loss(loss)

    def eval_batch(
        self,
        data_iter: Iterator[Any] | None = None,
        return_logits: bool = False,
        num_micro_batches: int | None = None,
    ) -> Any:
        """Return the mean loss over ``num_micro_batches`` (default: gradient accumulation
        steps) micro-batches without changing any parameter; with ``return_logits`` also the
        last micro-batch's outputs (on the rank holding the last stage, None elsewhere)."""
        with self._agreed("eval_batch"):
            return self._eval_batch(data_iter, return_logits, num_micro_batches)

    def _eval_batch(
        self, data_iter: Iterator[Any] | None, return_logits: bool, num_micro_batches: int | None
    ) -> Any:
        count, source = self.eval_micro_batches(num_micro_batches)
        batches = self._pull(data_iter, count, "eval_batch", source)
        self.module.eval()
        self.module.begin_streams("eval", self.global_steps)
        with torch.no_grad():
            loss = self.module.run(batches, count, train=False)
        mean = self._broadcast_loss(loss)
        if return_logits:
            return mean, self.module.context.last_output if self.module.holds_last else None
        return mean

    def reset_activation_shape(self) -> None:
        """Accept new boundary shapes from the next batch on, as DeepSpeed's method does.

        Every rank must call it at once: the next batch works out the boundary examples again
        ([Note: boundary examples] in ``_setup``), which takes all ranks.
        """
        self.module.reset_shapes()

    # -- checkpoints ---------------------------------------------------------------------------

    def _write_checkpoint(self, staged: Path, client_state: dict[str, Any]) -> None:
        """This rank's stages, optimizer state and step count (see [Note: torch checkpoints])."""
        _Checkpoints.save(self, staged, client_state)

    def _read_checkpoint(
        self, load_dir: Path, tag: str, load_optimizer_states: bool, from_latest: bool
    ) -> tuple[Path, dict[str, Any]]:
        """Verify and load this rank's file; every rank calls it."""
        client_state, path = _Checkpoints.load(
            self, load_dir, tag, load_optimizer_states, from_latest
        )
        return path, client_state


def _rank_file(rank: int) -> str:
    return f"torch_engine_rank{rank}.pt"


class _Checkpoints:
    """[Note: torch checkpoints] One file per rank under ``save_dir/tag``.

    Each rank saves the state of the stages it runs (by stage id, parameters under their
    original names), its optimizer's state, the step count, the plan's fingerprint and the
    placement, published once every rank is done (``checkpoint_files`` [Note: crash-safe
    checkpoints]). Loading verifies the files, checks that the plan and the placement are the
    same (the optimizer state is per rank), loads, and broadcasts the tied weights again (every
    copy was saved, so this only guards against a mixed-up file).
    """

    @staticmethod
    def save(engine: TorchEngine, path: Path, client_state: Mapping[str, Any]) -> None:
        module = engine.module
        torch.save(
            {
                "stages": {k: _local(module.plan.stages[k].state_dict()) for k in module.stage_ids},
                "optimizer": _local(engine.optimizer.state_dict()),
                "lr_scheduler": engine.scheduler_state(),
                "precision": _local(engine.precision_state()),
                "global_steps": engine.global_steps,
                "client_state": dict(client_state),
                "plan": module.plan.fingerprint(),
                "placement": module.placement,
                "data_parallel": module.replicas.data,
            },
            path / _rank_file(module.rank),
        )

    @staticmethod
    def load(
        engine: TorchEngine, root: Path, tag: str, load_optimizer_states: bool, from_latest: bool
    ) -> tuple[dict[str, Any], Path]:
        module = engine.module
        state: dict[str, Any] = {}
        error: CheckpointError | None = None
        path = root / tag
        try:
            path = checkpoint_files.resolve(root, tag, from_latest=from_latest)
            state = _Checkpoints._read(module, path, tag, from_latest)
        except CheckpointError as exc:
            error = exc
        # Every rank learns whether every other one can load, so none is left waiting in the
        # broadcast below while another has raised.
        problems: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(problems, None if error is None else str(error))
        failed = [p for p in problems if p is not None]
        if error is not None:
            raise error
        if failed:
            raise CheckpointError(failed[0])
        if module.fsdp is not None:
            module.fsdp.reshard()  # no gathered copy may outlive the weights it was made from
        for k in module.stage_ids:
            stage = module.plan.stages[k]
            stage.load_state_dict(_sharded_like(state["stages"][k], stage.state_dict()))
        precision = state.get("precision")
        if precision is not None and engine.mixed is not None:
            masters = engine.mixed.masters
            precision = {**precision, "masters": _sharded_like(precision["masters"], masters)}
        engine.load_precision_state(precision, str(path))
        if load_optimizer_states:
            engine.optimizer.load_state_dict(_sharded_optimizer(state["optimizer"], engine))
        engine.load_scheduler_state(state.get("lr_scheduler"))
        engine.global_steps = int(state["global_steps"])
        module.ties.broadcast_weights()
        checkpoint_files.load_rng_state(path)
        return dict(state["client_state"]), path

    @staticmethod
    def _read(module: TorchPipeline, path: Path, tag: str, from_latest: bool) -> dict[str, Any]:
        file = path / _rank_file(module.rank)
        if path.is_dir() and not file.is_file():
            raise CheckpointError(
                f"rank {module.rank} finds no {file.name} in {path}; load a checkpoint saved by "
                f"the same number of ranks ({module.num_ranks})"
            )
        state = read_checkpoint_file(file, tag, module.device, from_latest=from_latest)
        saved = state.get("stages", {})
        for k in module.stage_ids:
            mismatch = shape_mismatch(saved.get(k, {}), _local(module.plan.stages[k].state_dict()))
            if mismatch is not None:
                name, old, new = mismatch
                raise CheckpointError(
                    f"[Stage {k}] checkpoint {file} was saved from a differently sized model: "
                    f"parameter {name!r} has shape {old} there but {new} here; build the model "
                    "with the sizes it was saved with",
                    parameter=name,
                )
        if state.get("plan") != module.plan.fingerprint():
            raise CheckpointError(
                f"checkpoint {file} was saved from a different pipeline plan; partition the same "
                "model with the same split points before loading it"
            )
        saved_dp = int(state.get("data_parallel", 1))
        if saved_dp != module.replicas.data:
            raise CheckpointError(
                f"checkpoint {file} was saved by {saved_dp} data-parallel replica(s), but this "
                f"run has {module.replicas.data}; load it with the topology it was saved with"
            )
        if dict(state.get("placement", {})) != module.placement:
            raise CheckpointError(
                f"checkpoint {file} was saved with stages placed as {state.get('placement')}, "
                f"but this run places them as {module.placement}; use the same schedule family "
                "and number of ranks"
            )
        return state


def _local(value: Any) -> Any:
    """``value`` (a state dict, list or tensor) with each sharded tensor replaced by this
    rank's part: what a per-rank checkpoint file holds (``pipedialect.runtime.sharded``)."""
    if isinstance(value, torch.Tensor):
        return local_part(value).detach() if is_sharded(value) else value
    if isinstance(value, Mapping):
        return type(value)((k, _local(v)) for k, v in value.items())  # type: ignore[call-arg]
    if isinstance(value, list | tuple):
        return type(value)(_local(v) for v in value)
    return value


def _wrap_like(local: Any, like: Any) -> Any:
    """A saved local part laid out again as the sharded tensor ``like`` (else unchanged)."""
    if not (is_sharded(like) and isinstance(local, torch.Tensor)) or is_sharded(local):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local.to(local_part(like).device),
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def _sharded_like(saved: Any, current: Any) -> Any:
    """A state dict (or list) of local parts, each laid out as its counterpart in ``current``."""
    if isinstance(saved, Mapping) and isinstance(current, Mapping):
        return {k: _wrap_like(v, current.get(k)) for k, v in saved.items()}
    if isinstance(saved, list | tuple) and isinstance(current, list | tuple):
        return [_wrap_like(v, c) for v, c in zip(saved, current, strict=False)]
    return saved


def _sharded_optimizer(saved: Mapping[str, Any], engine: TorchEngine) -> dict[str, Any]:
    """An optimizer state dict of local parts, each per-parameter tensor laid out as its
    parameter (the optimizer numbers its parameters in group order)."""
    params = [p for group in engine.optimizer.param_groups for p in group["params"]]
    state = {}
    for index, entries in saved.get("state", {}).items():
        param = params[int(index)] if int(index) < len(params) else None
        state[index] = {
            name: _wrap_like(value, param)
            if param is not None and isinstance(value, torch.Tensor) and value.dim() > 0
            else value
            for name, value in entries.items()
        }
    return {**saved, "state": state}


def build_engine(
    module: nn.Module, config: Mapping[str, Any] | None, **options: Unpack[SharedEngineArgs]
) -> TorchEngine:
    """Return the :class:`TorchEngine` training ``module`` (``config`` defaults to its own)."""
    if not isinstance(module, TorchPipeline):
        raise ConfigError(
            f"the torch runtime engine trains what TorchDialect.pipe_engine built, got "
            f"{type(module).__name__}"
        )
    given = module.config if config is None else config
    parsed = parse_config(given, world_size=module.replicas.data)
    count = parsed.gradient_accumulation_steps
    problem = module.spec.micro_batch_problem(count, module.num_stages, module.num_ranks)
    if problem is not None:  # found here, on every rank, rather than at the first step
        raise ConfigError(
            f"schedule {module.spec.name!r} cannot run gradient_accumulation_steps={count} "
            f"micro-batches over {module.num_stages} stages on {module.num_ranks} ranks: torch's "
            f"{module.spec.torch_name} {problem}. Raise gradient_accumulation_steps, or choose "
            "schedule='gpipe'"
        )
    return TorchEngine(module, parsed, **options)
