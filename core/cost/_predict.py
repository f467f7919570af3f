"""The cost and memory model: one layout of one chain, as the simulator's inputs.

[Note: cost model]
For a layout (``p`` pipeline ranks with ``v`` stages each, ``d`` data-parallel replicas in mode
``ddp`` or ``fsdp``, ``t``-way tensor parallelism, ``m`` micro-batches of ``b`` samples) and the
stages its split points make, every stage gets:

- time: the chain's seconds scaled by ``b / batch`` (costs proportional to the micro-batch),
  except the part a micro-batch of any size costs (work on the parameters, measured by timing
  the model at two micro-batch sizes: [Note: seconds that do not scale with the micro-batch]
  in ``cost._profile``), which stays whole; the tensor-parallel part divided by ``t``, plus a
  ring all-reduce over the tensor axis of the row-wise outputs (forward) and the column-wise
  input gradients (backward); recomputation runs the recomputed forward again at the start of
  the backward; the backward splits into an input
  pass and a weight pass in the chain's ``weight_fraction``; every computation also costs
  ``action_overhead`` seconds, plus ``fsdp_unit_overhead`` per FSDP unit (the stage's blocks
  plus its root) under ``fsdp`` and ``tensor_module_overhead`` per tensor-parallel module at
  ``t > 1`` (the runtime's hooks and dispatch, which do not shrink with the work:
  [Note: calibration] measures each); and the backward of every micro-batch but the first of a
  step adds its weight gradient into the accumulated one, the stage's trainable bytes at the
  calibrated ``accumulate_seconds_per_byte`` ([Note: gradient accumulation] in
  ``cost._simulate``);
- communication: a message across a boundary takes ``latency + bytes / bandwidth`` (activations
  forward, their gradients back, the same size); a ring all-reduce of ``x`` bytes over ``n``
  ranks takes ``2 (n - 1) / n * x / bandwidth + 2 (n - 1) * latency`` (a data-parallel
  gradient sum adds ``x`` times the calibrated ``pack_seconds_per_byte`` for packing the
  gradients into a new flat buffer and copying the sum back: [Note: packing the gradients]),
  an all-gather or a reduce-scatter ``(n - 1) / n * x / gather bandwidth + (n - 1) *
  latency``: half an all-reduce where the backend's collectives are rings (NCCL), but gloo's
  all-gather and reduce-scatter take about as long as its all-reduce, so the calibration
  measures their bandwidth apart;
- memory: parameters, gradients and ``optimizer_states`` tensors of optimizer state per
  trainable parameter (Adam: 2), at the parameters' own size; the tensor-parallel parameters
  divided by ``t``. Under ``ddp`` every replica holds them whole and all-reduces the gradients at
  the end of the step; under ``fsdp`` each rank holds ``1/d`` of them, gathers a stage's
  parameters before it computes (held until torch's lowering reshards them) and keeps its
  gradients unsharded from the first backward to the reduce-scatter after the last one. Both
  the gathered parameters and the unsharded gradients are whole (``T`` bytes, not
  ``(d - 1) / d T``): FSDP2 all-gathers into buffers of its own beside the shards it keeps, and
  the reduce-scatter writes the gradient's shard while the whole gradients still exist (the
  resident set of FSDP2 ranks on gloo grows so, for 2 and 4 replicas alike). So during a step
  a stage under ``fsdp`` holds ``2 T`` beyond its shards: with Adam and ``d = 2`` as much as
  under ``ddp``; sharding saves memory between steps and, during them, only from ``d > 2`` on.
  Activations: the bytes the stage's forward saves, scaled by ``b / batch`` (the tensor-parallel
  part divided by ``t``), times the micro-batches in flight that the simulation counts. The
  boundaries: the stage's output kept for its backward per micro-batch in flight, the
  runtime's receive buffers for the whole step, the input gradient while a backward makes it,
  the model's own output on the last stage and, under DeepSpeed, its input on the first
  ([Note: boundary buffers]). A backward of every micro-batch but the first makes each weight
  gradient before adding it into the accumulated one: the stage's largest parameter once more
  while it makes its weight gradients (``B``, or ``W`` of a split backward). A data-parallel
  gradient sum under ``ddp`` holds the rank's gradients once more, packed into one flat
  tensor, while its ``ALL_REDUCE`` runs, and so does DeepSpeed's engine without replicas
  ([Note: packing the gradients]). The calibrated ``memory_overhead`` is added to every
  rank.

What is left out: overlap of communication with computation beyond what the program's order
allows, contention between a rank's messages and its collectives (its own messages queue on
its link: [Note: simulation]), and memory that is neither state, saved activations nor a
boundary: the other temporaries of one computation (a forward's intermediate results before
the next operation frees them), and what
the allocator keeps after a free
(glibc's heap: freed chunks stay in the resident set until the top of the heap is trimmed,
which depends on the order of the frees; measured as ``memory.py`` does, with
``MALLOC_MMAP_THRESHOLD_=65536``, large tensors are mappings of their own and leave the
resident set when freed).

[Note: boundary buffers]
Besides what a stage's forward saves, the runtime holds the tensors that cross its boundaries,
each ``B`` bytes per micro-batch (the chain's boundary bytes scaled by ``b / batch``):

- the output of every micro-batch in flight, until its backward (torch's ``PipelineStage``
  keeps it in ``fwd_cache``, DeepSpeed in its output buffers): an operation rarely saves its
  own output, so the forward's saved bytes do not hold it;
- the received activations and gradients. torch's ``PipelineStage`` allocates a receive buffer
  for every micro-batch of the step, for the activations (every stage whose previous stage is
  on another rank) and for their gradients (every stage whose next one is), when the first
  step starts; they stay until the stage is dropped: ``m`` of each, whatever is in flight.
  DeepSpeed's engine receives into one buffer of each and copies each received activation out
  of it, into a buffer kept per micro-batch in flight: one buffer each, plus the input per
  micro-batch in flight. A stage whose next stage runs on the same rank (the V-shaped
  schedules) hands its output over without a buffer;
- the gradient of a stage's input, which a backward (``B`` or ``I``) makes while the
  received output gradient still exists: ``B`` during the backward ([Note: simulation]);
- the model's own output (``Chain.output_bytes``, scaled like ``B``) on the last stage: kept
  per micro-batch in flight until its backward (the runtimes' output caches; the loss reads
  it), and its gradient, which the loss's backward makes, during the backward; and under
  DeepSpeed the model's input (``Chain.input_bytes``) on the first stage, which its engine
  copies out of the loaded micro-batch into the input buffer of the micro-batch in flight
  (torch's first stage computes on the data's own tensor);
- under DeepSpeed, while a forward runs, the copy of its input buffer it computes on (the
  engine clones the buffer: the received activation, or the model's input on the first
  stage); where the stage's first operation saves its input, that copy is the saved input,
  counted twice while the forward runs.

The received input is counted apart from the forward's saved bytes: where the stage's first
operation saves its input, that input is counted twice, ``B`` per micro-batch in flight too
many. Measured (``benchmarks/planner.py`` on the communication workload, 8 MiB per micro-batch
across the boundary, p=2 m=4, ``MALLOC_MMAP_THRESHOLD_=65536``), glibc's bytes in use at the
peak grew by 158/157 MiB on the torch dialect's two ranks and 159/149 on DeepSpeed's against
76/44 predicted without these terms: the receive buffers alone are 32 MiB per torch rank.
With the model's input and output on DeepSpeed (the same layout, 1 MiB per sample in and
out), the first rank's prediction went from 175 to 191 MiB against 194 measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import ConfigError
from ._chain import Chain, StageProfile
from ._program import Program
from ._simulate import Simulation, StageMemory, StageTimes, simulate

__all__ = ["Cluster", "Layout", "Prediction", "predict"]


@dataclass(frozen=True)
class Cluster:
    """The machines a layout runs on."""

    #: Ranks (processes, one accelerator each).
    world_size: int
    #: Bytes each rank may hold.
    memory_per_rank: float
    #: Bytes per second of one link (point-to-point and collectives alike).
    bandwidth: float
    #: Seconds per message, and per step of a ring collective.
    latency: float = 0.0
    #: Optimizer-state tensors per trainable parameter (Adam: 2, SGD with momentum: 1).
    optimizer_states: int = 2
    #: Seconds the optimizer takes per byte of trainable parameters a rank updates.
    optimizer_seconds_per_byte: float = 0.0
    #: Seconds every forward, backward and weight pass costs on top of its work.
    action_overhead: float = 0.0
    #: Seconds every step costs on top of its schedule (launch, bookkeeping).
    step_overhead: float = 0.0
    #: Bytes per second collectives reach (data-parallel gradient reductions, gathers);
    #: None: ``bandwidth`` ([Note: calibration] measures it).
    collective_bandwidth: float | None = None
    #: Bytes every rank's runtime holds beyond state and activations ([Note: calibration]).
    memory_overhead: float = 0.0
    #: Bytes per second all-gathers and reduce-scatters reach (FSDP's gathers and gradient
    #: reductions), as a ring's ``(n - 1) / n`` of the whole tensor; None: ``ring_bandwidth``
    #: ([Note: calibration] measures it: on gloo they are no faster than an all-reduce).
    shard_bandwidth: float | None = None
    #: Seconds each FSDP unit of a sharded stage (its blocks plus its root) adds to every
    #: computation, beyond ``action_overhead`` ([Note: calibration] measures it).
    fsdp_unit_overhead: float = 0.0
    #: Seconds each tensor-parallel module adds to every computation at ``t > 1``.
    tensor_module_overhead: float = 0.0
    #: Seconds per byte of adding one micro-batch's weight gradient into the step's
    #: accumulated one ([Note: gradient accumulation] in ``cost._simulate``; [Note:
    #: calibration] measures it).
    accumulate_seconds_per_byte: float = 0.0
    #: Seconds per byte of packing a rank's gradients into one new flat buffer before a
    #: data-parallel all-reduce and copying the sum back after it ([Note: packing the
    #: gradients]; [Note: calibration] measures it).
    pack_seconds_per_byte: float = 0.0
    #: Cores the ranks share, all on one host (``os.sched_getaffinity`` of the planning
    #: process); None: every rank has cores of its own. With a chain measured on the CPU
    #: (``Chain.cpu_share``), ranks computing at once beyond these cores slow each other down
    #: ([Note: ranks sharing cores] in ``cost._simulate``).
    cores: int | None = None

    @property
    def ring_bandwidth(self) -> float:
        """The bandwidth all-reduces run at."""
        return self.collective_bandwidth or self.bandwidth

    @property
    def gather_bandwidth(self) -> float:
        """The bandwidth all-gathers and reduce-scatters run at."""
        return self.shard_bandwidth or self.ring_bandwidth

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"world_size must be at least 1, got {self.world_size}")
        if self.memory_per_rank <= 0 or self.bandwidth <= 0:
            raise ConfigError(
                f"memory_per_rank and bandwidth must be positive, got {self.memory_per_rank} "
                f"and {self.bandwidth}"
            )
        if self.latency < 0 or self.optimizer_states < 0:
            raise ConfigError("latency and optimizer_states cannot be negative")
        if self.cores is not None and self.cores < 1:
            raise ConfigError(f"cores must be at least 1, got {self.cores}")


@dataclass(frozen=True)
class Layout:
    """One way to run the model: degrees, schedule, micro-batches, recomputation, split points."""

    #: The dialect's name.
    dialect: str
    #: The schedule (the dialect's name for it; ``deepspeed_1f1b`` for DeepSpeed's).
    schedule: str
    #: Pipeline ranks ``p``.
    pipeline: int
    #: Stages per pipeline rank ``v``.
    stages_per_rank: int
    #: Data-parallel replicas ``d``.
    data_parallel: int
    #: ``"ddp"`` or ``"fsdp"``.
    data_parallel_mode: str
    #: Tensor-parallel degree ``t``.
    tensor_parallel: int
    #: Micro-batches per step ``m``.
    micro_batches: int
    #: Samples per micro-batch.
    micro_batch_size: int
    #: The recomputation option's label (the ``recompute=`` pattern), or None.
    recompute: str | None
    #: The split points: what ``partition(model, split_points)`` takes.
    split_points: tuple[str, ...] = ()
    #: Cut indices into the chain (for the planner's own use).
    cuts: tuple[int, ...] = field(default=(), compare=False, repr=False)
    #: The dialect's own ``pipe_engine`` options this layout needs.
    engine_options: tuple[tuple[str, Any], ...] = field(default=(), compare=False)
    #: What ``partition``'s ``recompute=`` gets for this option.
    recompute_patterns: tuple[str, ...] | None = field(default=None, compare=False, repr=False)

    @property
    def num_stages(self) -> int:
        """``p * v``."""
        return self.pipeline * self.stages_per_rank

    @property
    def world_size(self) -> int:
        """``p * d * t``."""
        return self.pipeline * self.data_parallel * self.tensor_parallel

    @property
    def global_batch(self) -> int:
        """Samples per step over all replicas."""
        return self.data_parallel * self.micro_batches * self.micro_batch_size

    def key(self) -> tuple[Any, ...]:
        """A total order among layouts, for ties."""
        return (
            self.schedule,
            self.pipeline,
            self.stages_per_rank,
            self.data_parallel,
            self.data_parallel_mode,
            self.tensor_parallel,
            self.micro_batches,
            self.recompute or "",
            self.split_points,
        )

    def describe(self) -> str:
        """One line: ``1f1b  p=4 v=1 d=2 ddp t=1  m=8 x 4``."""
        parts = [self.schedule, f"p={self.pipeline}"]
        if self.stages_per_rank != 1:
            parts.append(f"v={self.stages_per_rank}")
        if self.data_parallel > 1:
            parts.append(f"d={self.data_parallel} {self.data_parallel_mode}")
        if self.tensor_parallel > 1:
            parts.append(f"t={self.tensor_parallel}")
        parts.append(f"m={self.micro_batches}x{self.micro_batch_size}")
        if self.recompute:
            parts.append(f"recompute {self.recompute}")
        return " ".join(parts)

    def partition_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`pipedialect.partition` (besides the model)."""
        kwargs: dict[str, Any] = {"split_points": list(self.split_points)}
        if self.recompute_patterns:
            kwargs["recompute"] = list(self.recompute_patterns)
        return kwargs

    def config(self) -> dict[str, Any]:
        """The batch sizes of the DeepSpeed-style config ``pipe_engine`` takes."""
        return {
            "train_batch_size": self.global_batch,
            "train_micro_batch_size_per_gpu": self.micro_batch_size,
            "gradient_accumulation_steps": self.micro_batches,
        }

    def pipe_engine_kwargs(self) -> dict[str, Any]:
        """The dialect's own ``pipe_engine`` options (plus ``topology``: see :meth:`topology`)."""
        return dict(self.engine_options)

    def topology(self, dialect: Any) -> Any:
        """The process grid to pass as ``pipe_engine(..., topology=)``: the dialect's own
        ``make_topology`` when it lays out ``p`` pipeline ranks, else a
        :class:`~pipedialect.GridTopology` of ``pipe = p`` by ``data = d``."""
        from ..errors import TopologyError
        from ..runtime.topology import GridTopology

        kwargs: dict[str, int] = {"data_parallel": self.data_parallel}
        if self.tensor_parallel > 1:
            kwargs["tensor_parallel"] = self.tensor_parallel
        try:
            made = dialect.make_topology(self.num_stages, **kwargs)
        except TopologyError:
            made = None
        if made is not None and made.get_dim("pipe") == self.pipeline:
            return made
        return GridTopology(pipe=self.pipeline, data=self.data_parallel)


@dataclass(frozen=True)
class Prediction:
    """What the model predicts for one layout."""

    layout: Layout
    #: Seconds per step.
    step_time: float
    #: Peak bytes of each pipeline rank (every replica alike).
    peak_memory: tuple[float, ...]
    #: Whether every rank fits ``memory_per_rank``.
    fits: bool
    simulation: Simulation = field(repr=False)
    #: The stages' costs at this micro-batch size, as the simulator got them.
    stage_times: tuple[StageTimes, ...] = field(repr=False, default=())

    @property
    def bubble(self) -> float:
        """The mean idle fraction of the ranks."""
        return self.simulation.bubble_fraction

    @property
    def throughput(self) -> float:
        """Samples per second."""
        return self.layout.global_batch / self.step_time if self.step_time else 0.0

    @property
    def imbalance(self) -> float:
        """Busiest rank's computation over the mean (1.0: even)."""
        busy = self.simulation.busy
        mean = sum(busy) / len(busy)
        return max(busy) / mean if mean else 1.0


def ring_all_reduce(nbytes: float, ranks: int, cluster: Cluster) -> float:
    """Seconds of a ring all-reduce ([Note: cost model])."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return (
        2 * (ranks - 1) / ranks * nbytes / cluster.ring_bandwidth
        + 2 * (ranks - 1) * cluster.latency
    )


def gradient_sum(nbytes: float, replicas: int, cluster: Cluster) -> float:
    """Seconds of a data-parallel gradient sum of ``nbytes`` per rank over ``replicas``: the
    gradients packed into one new flat buffer, its ring all-reduce and the sum copied back.

    [Note: packing the gradients]
    Neither dialect all-reduces the gradients where they lie: the torch dialect concatenates a
    stage's gradients into one flat tensor (``_replicas.sum_grads``) and DeepSpeed flattens
    its bucket (``allreduce_and_copy``), all-reduces that and copies the sum back into each
    gradient. The flat tensor is new at every step, and above glibc's largest dynamic mmap
    threshold (32 MiB) every such allocation is a fresh mapping whose pages fault on first
    write. Two ranks summing 128 MiB each on 2 cores (load 6): packing 204 ms (32,770 faults;
    95 ms into a buffer reused), the all-reduce 222-237 ms, the copy back 40-42 ms, so the
    all-reduce alone was under half the sum. :func:`~pipedialect.planner.calibrate` measures
    the packing and the copy back per byte (``pack_seconds_per_byte``, every rank at once, 64
    MiB of gradients); smaller gradients may land in reused heap memory and cost less. The
    flat tensor also holds the rank's gradient bytes once more while the all-reduce runs: the
    simulator adds them to the rank's memory during its ``ALL_REDUCE``. DeepSpeed's pipeline
    engine packs them so even without replicas (it all-reduces over its data group of one at
    every step: ``Program.packs_gradients_alone``): measured on the data-parallel workload (16
    MiB per block, p=2 m=4, no replicas, ``MALLOC_MMAP_THRESHOLD_=65536``), glibc's bytes in use
    peaked at +193 MiB per rank, three times the stage's 64 MiB of weights (weights,
    gradients, packed gradients), and +65 MiB after the step. Only the memory is counted there:
    the time of that sum is left out, as before.
    """
    if replicas <= 1 or nbytes <= 0:
        return 0.0
    return ring_all_reduce(nbytes, replicas, cluster) + nbytes * cluster.pack_seconds_per_byte


def ring_gather(nbytes: float, ranks: int, cluster: Cluster) -> float:
    """Seconds of a ring all-gather or reduce-scatter of ``nbytes`` in all (at the cluster's
    :attr:`~Cluster.gather_bandwidth`)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return (ranks - 1) / ranks * nbytes / cluster.gather_bandwidth + (ranks - 1) * cluster.latency


@dataclass(frozen=True)
class StageInputs:
    """One stage under a layout: what the simulator takes, and the state it holds."""

    times: StageTimes
    memory: StageMemory
    #: Bytes of state always held (parameters, gradients, optimizer state; sharded under FSDP).
    base: float
    #: Trainable bytes the rank updates for this stage (after sharding).
    trainable: float
    #: Trainable bytes before data-parallel sharding (what DDP all-reduces).
    gradient: float
    #: Seconds of one boundary message to the next stage.
    message: float


def _scaled(fixed: float, seconds: float, scale: float) -> float:
    """What ``seconds`` at the chain's micro-batch become at ``scale`` times its samples, as a
    factor, when ``fixed`` of them do not scale."""
    share = fixed / seconds if seconds > 0 else 0.0
    return share + (1.0 - share) * scale


def stage_inputs(
    stage: StageProfile,
    layout: Layout,
    chain: Chain,
    cluster: Cluster,
    *,
    split: bool,
) -> StageInputs:
    """The simulator's inputs for one stage ([Note: cost model])."""
    scale = layout.micro_batch_size / chain.batch
    t, d = layout.tensor_parallel, layout.data_parallel
    forward = (stage.forward - stage.tensor_forward) + stage.tensor_forward / t
    backward = (stage.backward - stage.tensor_backward) + stage.tensor_backward / t
    recompute = stage.recompute * (forward / stage.forward) if stage.forward else 0.0
    # The seconds a micro-batch of any size costs stay whole, the rest scales with the samples
    # ([Note: seconds that do not scale with the micro-batch] in cost._profile); each share is
    # the stage's own, so the tensor-parallel part keeps its division by t.
    forward_scale = _scaled(stage.forward_fixed, stage.forward, scale)
    backward_scale = _scaled(stage.backward_fixed, stage.backward, scale)
    forward = forward * forward_scale + ring_all_reduce(
        stage.tensor_forward_bytes * scale, t, cluster
    )
    backward = backward * backward_scale + ring_all_reduce(
        stage.tensor_backward_bytes * scale, t, cluster
    )
    recompute *= forward_scale
    weight = backward * chain.weight_fraction
    trainable = (stage.parameter_bytes - stage.tensor_parameter_bytes) + (
        stage.tensor_parameter_bytes / t
    )
    activation = (
        (stage.activation_bytes - stage.tensor_activation_bytes) + stage.tensor_activation_bytes / t
    ) * scale
    per_parameter = 2 + cluster.optimizer_states
    fsdp = layout.data_parallel_mode == "fsdp" and d > 1
    shard = d if fsdp else 1
    base = trainable * per_parameter / shard + stage.state_bytes
    # FSDP2 gathers into a whole-size buffer beside the shard it keeps, and accumulates whole
    # gradients beside the gradient's shard ([Note: cost model]): both whole, not (d - 1) / d.
    gathered = trainable
    # What the runtime adds per computation: its own cost, FSDP's hooks per unit (one per block
    # plus the root), DTensor's dispatch per sharded module ([Note: calibration]).
    overhead = cluster.action_overhead
    if fsdp:
        overhead += cluster.fsdp_unit_overhead * (stage.blocks + 1)
    if t > 1:
        overhead += cluster.tensor_module_overhead * stage.tensor_modules
    times = StageTimes(
        forward=forward,
        backward_input=backward - weight + recompute,
        backward_weight=weight,
        split=split,
        action_overhead=overhead,
        all_gather=ring_gather(trainable, d, cluster) if fsdp else 0.0,
        reduce_grad=ring_gather(trainable, d, cluster) if fsdp else 0.0,
        # Gradients accumulate whole, also under FSDP (sharded after the last backward).
        accumulate=trainable * cluster.accumulate_seconds_per_byte,
        cpu_share=chain.cpu_share or 0.0,
    )
    memory = StageMemory(
        activation=activation,
        gathered=gathered if fsdp else 0.0,
        gradient=gathered if fsdp else 0.0,
        transient=stage.rematerialized_bytes * scale,
    )
    message = cluster.latency + stage.boundary_bytes * scale / cluster.bandwidth
    return StageInputs(times, memory, base, trainable / shard, trainable, message)


@dataclass(frozen=True)
class BoundaryMemory:
    """Bytes one stage's boundaries hold ([Note: boundary buffers])."""

    #: Per micro-batch in flight: the output kept for the backward, and under a reused
    #: receive buffer the input copied out of it.
    per_micro_batch: float
    #: For the whole step: the receive buffers.
    kept: float
    #: While a backward runs: the input gradient it makes.
    backward: float
    #: While a forward runs: the copy of the input it computes on (DeepSpeed's engine).
    forward: float = 0.0


def boundary_memory(
    profiles: Sequence[StageProfile], layout: Layout, chain: Chain, program: Program
) -> list[BoundaryMemory]:
    """What each stage's boundaries hold under ``program``'s runtime ([Note: boundary
    buffers])."""
    scale = layout.micro_batch_size / chain.batch
    sent = [s.boundary_bytes * scale for s in profiles]
    place = program.placement
    n, m = len(profiles), layout.micro_batches
    # The model's own output leaves the last stage and its input enters the first.
    output = chain.output_bytes * scale
    loaded = chain.input_bytes * scale
    out = []
    for k in range(n):
        received = sent[k - 1] if k > 0 else 0.0
        # Buffers only where the neighbour is on another rank.
        remote_in = received if k > 0 and place[k - 1] != place[k] else 0.0
        remote_out = sent[k] if k < n - 1 and place[k + 1] != place[k] else 0.0
        if program.receive_buffer_per_micro_batch:
            kept, copied, forward = m * (remote_in + remote_out), 0.0, 0.0
        else:
            kept, copied = remote_in + remote_out, remote_in
            if k == 0:
                copied += loaded
            # Each forward computes on a copy of its input buffer, however the input came.
            forward = received if k > 0 else loaded
        last = output if k == n - 1 else 0.0
        out.append(
            BoundaryMemory(
                per_micro_batch=sent[k] + copied + last,
                kept=kept,
                backward=received + last,
                forward=forward,
            )
        )
    return out


def predict(
    chain: Chain,
    layout: Layout,
    cluster: Cluster,
    program: Program,
    *,
    split_first_stage: bool = True,
    without_communication: bool = False,
    queue_messages: bool = True,
    runtime_buffers: bool = True,
) -> Prediction:
    """Predict one layout: its stages' costs ([Note: cost model]) replayed by the simulator.

    Args:
        chain: the model.
        layout: the layout; its ``cuts`` index ``chain``'s cuts.
        cluster: the machines.
        program: the schedule's program for ``layout`` (``p`` ranks, ``m`` micro-batches).
        split_first_stage: False when the dialect runs the first stage's backward in one piece
            (its inputs need no gradient: [Note: split backward without a gradient-carrying
            input] in the torch dialect).
        without_communication: predict as if every message and collective were free (what the
            planner compares against to tell communication from bubble).
        queue_messages: as :func:`~pipedialect.planner.simulate` takes it.
        runtime_buffers: False to leave out what the boundaries, the model's input and output,
            a weight gradient before it is accumulated and the packed gradients hold ([Note:
            boundary buffers], [Note: packing the gradients]): the memory model before it had
            them, for comparisons.
    """
    if program.num_stages != layout.num_stages or program.micro_batches != layout.micro_batches:
        raise ConfigError(f"the program does not fit the layout {layout.describe()}")
    if len(layout.cuts) != layout.num_stages - 1:
        raise ConfigError(f"layout {layout.describe()} needs {layout.num_stages - 1} cuts")
    if without_communication:
        cluster = replace(cluster, bandwidth=float("inf"), latency=0.0)
    profiles = chain.stages(layout.cuts)
    inputs = [
        stage_inputs(s, layout, chain, cluster, split=split_first_stage or k > 0)
        for k, s in enumerate(profiles)
    ]
    p = program.num_ranks
    gradient = [0.0] * p
    trainable = [0.0] * p
    base = [0.0] * p
    memory = []
    # A backward of every micro-batch but the first adds each weight gradient into the
    # accumulated one after making it: the largest parameter's gradient exists twice.
    accumulates = layout.micro_batches > 1 and runtime_buffers
    held = (
        boundary_memory(profiles, layout, chain, program)
        if runtime_buffers
        else [BoundaryMemory(0.0, 0.0, 0.0)] * len(inputs)
    )
    for k, (inp, buffers) in enumerate(zip(inputs, held, strict=True)):
        r = program.placement[k]
        gradient[r] += inp.gradient
        trainable[r] += inp.trainable
        base[r] += inp.base + buffers.kept
        memory.append(
            replace(
                inp.memory,
                activation=inp.memory.activation + buffers.per_micro_batch,
                transient=inp.memory.transient + buffers.backward,
                forward_copy=buffers.forward,
                weight_gradient=profiles[k].largest_parameter_bytes if accumulates else 0.0,
            )
        )
    ddp = layout.data_parallel_mode != "fsdp"
    all_reduce = [gradient_sum(g, layout.data_parallel, cluster) if ddp else 0.0 for g in gradient]
    # The gradient sum packs the rank's gradients into one new flat tensor ([Note: packing the
    # gradients]): held beside them while the all-reduce runs.
    packs = layout.data_parallel > 1 or program.packs_gradients_alone
    packed = [g if ddp and packs and runtime_buffers else 0.0 for g in gradient]
    optimizer = [cluster.optimizer_seconds_per_byte * b for b in trainable]
    simulation = simulate(
        program,
        [i.times for i in inputs],
        boundaries=[i.message for i in inputs[:-1]],
        all_reduce=all_reduce,
        optimizer=optimizer,
        memory=memory,
        base_memory=base,
        all_reduce_memory=packed,
        queue_messages=queue_messages,
        cores=cluster.cores if chain.cpu_share else None,
        threads=chain.threads,
        processes_per_rank=layout.data_parallel * layout.tensor_parallel,
    )
    peak = tuple(m + cluster.memory_overhead for m in (simulation.peak_memory or tuple(base)))
    return Prediction(
        layout=layout,
        step_time=simulation.step_time + cluster.step_overhead,
        peak_memory=peak,
        fits=max(peak) <= cluster.memory_per_rank,
        simulation=simulation,
        stage_times=tuple(i.times for i in inputs),
    )


def lower_bounds(
    chain: Chain,
    layout: Layout,
    cluster: Cluster,
    placement: Sequence[int],
    *,
    split_first_stage: bool,
) -> tuple[float, float]:
    """A step time and a peak memory no simulation of ``layout`` can go below: the busiest
    rank's computation plus its blocking all-reduce and optimizer; the fullest rank's state plus
    one micro-batch of activations per stage."""
    profiles = chain.stages(layout.cuts)
    p = layout.pipeline
    busy = [0.0] * p
    gradient = [0.0] * p
    trainable = [0.0] * p
    memory = [0.0] * p
    for k, s in enumerate(profiles):
        inp = stage_inputs(s, layout, chain, cluster, split=split_first_stage or k > 0)
        r = placement[k]
        t = inp.times
        busy[r] += layout.micro_batches * (t.forward + t.backward + 2 * t.action_overhead)
        busy[r] += (layout.micro_batches - 1) * t.accumulate
        gradient[r] += inp.gradient
        trainable[r] += inp.trainable
        memory[r] += inp.base + inp.memory.activation
    ddp = layout.data_parallel_mode != "fsdp"
    step = max(
        busy[r]
        + (gradient_sum(gradient[r], layout.data_parallel, cluster) if ddp else 0.0)
        + cluster.optimizer_seconds_per_byte * trainable[r]
        for r in range(p)
    )
    return step + cluster.step_overhead, max(memory) + cluster.memory_overhead


def stage_weights(chain: Chain, layout: Layout, cluster: Cluster) -> list[float]:
    """Each atom's computation under ``layout``'s tensor degree: what the split solver
    balances (proportional to the stage time, whatever the micro-batch size)."""
    t = layout.tensor_parallel
    out = []
    for a in chain.atoms:
        work = (a.forward - a.tensor_forward) + a.tensor_forward / t
        work += (a.backward - a.tensor_backward) + a.tensor_backward / t
        work += a.recompute
        if t > 1:
            tp_bytes = a.tensor_forward_bytes + a.tensor_backward_bytes
            work += ring_all_reduce(tp_bytes, t, cluster)
        out.append(work)
    return out
