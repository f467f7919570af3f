"""This rank's pipeline stage and the engine that trains it with a GPipe schedule.

Each rank runs one stage (``pipe`` coordinate) of one replica (``data`` coordinate) of a
:class:`~pipedialect.Topology`. A batch is ``gas`` micro-batches: every forward first, passing
the stage wrapper's wire tensors to the next rank, then every backward in reverse order, passing
the gradients of the received floating-point tensors back. Every wire tensor goes as raw bytes
after a small header (count, dtypes, shapes), so any dtype and any shape can cross, and shapes
may change from one micro-batch to the next.

After the backwards: the copies of a tied parameter sum their gradients (one all-reduce per
tie, among the ranks of the stages that hold it in the same replica), replicas average theirs,
the gradient norm of the whole pipeline is clipped, and the optimizer steps. Losses are
averaged over micro-batches and replicas and returned on every rank, as DeepSpeed does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipedialect.sdk import (
    ConfigError,
    PipelinePlan,
    Topology,
    TrainingConfig,
    build_optimizer,
    stage_root,
)

__all__ = ["SendRecvEngine", "SendRecvPipeline"]

logger = logging.getLogger(__name__)

_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}


def send_tensors(tensors: Sequence[torch.Tensor], dst: int) -> None:
    """Send ``tensors`` to rank ``dst``: a header (count, then dtype, ndim, shape each), bytes."""
    header = [len(tensors)]
    for t in tensors:
        header += [_CODE[t.dtype], t.dim(), *t.shape]
    head = torch.tensor(header, dtype=torch.int64)
    dist.send(torch.tensor([head.numel()], dtype=torch.int64), dst)
    dist.send(head, dst)
    for t in tensors:
        if t.numel():
            dist.send(t.detach().contiguous().reshape(-1).view(torch.uint8), dst)


def recv_tensors(src: int) -> list[torch.Tensor]:
    """Receive what :func:`send_tensors` sent from rank ``src``."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src)
    head = torch.zeros(int(size.item()), dtype=torch.int64)
    dist.recv(head, src)
    fields = head.tolist()
    count, pos = fields[0], 1
    out = []
    for _ in range(count):
        dtype, ndim = _DTYPES[fields[pos]], fields[pos + 1]
        shape = fields[pos + 2 : pos + 2 + ndim]
        pos += 2 + ndim
        t = torch.empty(shape, dtype=dtype)
        if t.numel():
            buf = torch.empty(t.numel() * t.element_size(), dtype=torch.uint8)
            dist.recv(buf, src)
            t = buf.view(dtype).reshape(shape)
        out.append(t)
    return out


class SendRecvPipeline(nn.Module):
    """This rank's stage, its neighbours and the process groups its collectives use."""

    def __init__(
        self,
        stages: Sequence[nn.Module],
        *,
        plan: PipelinePlan,
        topology: Topology,
        tie_ranks: Sequence[Sequence[Sequence[int]]],
        loss_fn: Callable[[Any, Any], torch.Tensor],
        config: Mapping[str, Any],
    ) -> None:
        super().__init__()
        rank = dist.get_rank()
        coord = topology.get_coord(rank)
        self.stage_id = int(coord.pipe)
        self.replica = int(getattr(coord, "data", 0))
        self.plan = plan
        self.num_stages = plan.num_stages
        self.replicas = max(topology.get_dim("data"), 1)
        self.stage = stages[self.stage_id]
        self.loss_fn = loss_fn
        self.config = dict(config)
        self.prev = self._rank_at(topology, self.stage_id - 1)
        self.next = self._rank_at(topology, self.stage_id + 1)
        root = stage_root(self.stage)
        # Every rank creates every group, in the same order: new_group is a collective.
        self.ties: list[tuple[nn.Parameter, Any, int, bool]] = []
        for group, rank_lists in zip(plan.tie_groups, tie_ranks, strict=True):
            for ranks in rank_lists:
                handle = dist.new_group(sorted(ranks))
                if rank in ranks:
                    param = root.get_parameter(group.names_on(self.stage_id)[0])
                    owner = ranks[0] == rank  # the first stage's copy counts in the norm
                    self.ties.append((param, handle, ranks[0], owner))
        self.dp_group = self._groups(topology, "pipe", self.num_stages)[self.stage_id]
        self.pipe_group = self._groups(topology, "data", self.replicas)[self.replica]

    def _rank_at(self, topology: Topology, stage: int) -> int | None:
        if not 0 <= stage < self.num_stages:
            return None
        return topology.filter_match(pipe=stage, data=self.replica)[0]

    @staticmethod
    def _groups(topology: Topology, axis: str, size: int) -> list[Any]:
        return [dist.new_group(topology.filter_match(**{axis: i})) for i in range(size)]

    # -- what subclasses (and a trace) may change ----------------------------------------

    def send(self, tensors: Sequence[torch.Tensor], dst: int, *, carries: str) -> None:
        """Send ``tensors`` (``carries``: ``"activations"`` or ``"grads"``) to rank ``dst``."""
        send_tensors(tensors, dst)

    def recv(self, src: int, *, carries: str) -> list[torch.Tensor]:
        """Receive what rank ``src`` sent with :meth:`send`."""
        return recv_tensors(src)

    def outgoing(self, wire: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors to send to the next stage, in wire order."""
        return list(wire)

    def sync_tied_gradients(self) -> None:
        """Sum the gradients of each tied parameter's copies (same replica, other stages)."""
        for param, group, _, _ in self.ties:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, group=group)

    # -- the schedule ----------------------------------------------------------------------

    def sync_initial_weights(self) -> None:
        """Make tied copies and replicas start equal: broadcast from the owners."""
        with torch.no_grad():
            for param, group, src, _ in self.ties:
                dist.broadcast(param, src, group=group)
            if self.replicas > 1:
                src = dist.get_process_group_ranks(self.dp_group)[0]
                for param in self.stage.parameters():
                    dist.broadcast(param, src, group=self.dp_group)

    def run(self, data_iter: Iterator[Any], count: int, train: bool) -> torch.Tensor:
        """Run ``count`` micro-batches (forward, then backward if ``train``); the mean loss."""
        first, last = self.stage_id == 0, self.stage_id == self.num_stages - 1
        received: list[list[torch.Tensor]] = []
        sent: list[list[torch.Tensor]] = []
        losses: list[torch.Tensor] = []
        for _ in range(count):
            labels = None
            if first or last:
                inputs, labels = _pair(next(data_iter))
            if first:
                out = self.stage(*(inputs if isinstance(inputs, tuple | list) else (inputs,)))
            else:
                assert self.prev is not None
                wire = self.recv(self.prev, carries="activations")
                if train:
                    for t in wire:
                        if t.is_floating_point():
                            t.requires_grad_()
                received.append([t for t in wire if t.is_floating_point()])
                out = self.stage(tuple(wire))
            if last:
                losses.append(self.loss_fn(out, labels))
            else:
                assert self.next is not None
                outgoing = self.outgoing(out)
                self.send(outgoing, self.next, carries="activations")
                sent.append([t for t in outgoing if t.is_floating_point()])
        if train:
            for m in reversed(range(count)):
                if last:
                    torch.autograd.backward(losses[m] / count)
                else:
                    assert self.next is not None
                    grads = self.recv(self.next, carries="grads")  # one per float sent, in order
                    pairs = [(t, g) for t, g in zip(sent[m], grads, strict=True) if t.requires_grad]
                    if pairs:
                        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
                if not first:
                    assert self.prev is not None
                    self.send(
                        [
                            t.grad if t.grad is not None else torch.zeros_like(t)
                            for t in received[m]
                        ],
                        self.prev,
                        carries="grads",
                    )
        mean = torch.stack([loss.detach() for loss in losses]).mean() if last else torch.zeros(())
        total = (mean / self.replicas).reshape(1)
        dist.all_reduce(total)  # only the last stages contribute: every rank gets the mean
        return total.reshape(())

    def reduce_gradients(self) -> None:
        """Tied copies sum their gradients, then replicas average theirs."""
        self.sync_tied_gradients()
        if self.replicas == 1:
            return
        params = [p for p in self.stage.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
        dist.all_reduce(flat, group=self.dp_group)
        flat /= self.replicas
        offset = 0
        for p in params:
            assert p.grad is not None
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def clip_gradients(self, max_norm: float) -> None:
        """Scale gradients so the pipeline's global 2-norm is at most ``max_norm``."""
        tied_copies = {id(param) for param, _, _, owner in self.ties if not owner}
        local = torch.zeros(1, dtype=torch.float64)
        for p in self.stage.parameters():
            if p.grad is not None and id(p) not in tied_copies:
                local += p.grad.detach().double().pow(2).sum()
        dist.all_reduce(local, group=self.pipe_group)
        norm = float(local.sqrt().item())
        coef = min(1.0, max_norm / (norm + 1e-6))
        for p in self.stage.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)


def _pair(batch: Any) -> tuple[Any, Any]:
    if not isinstance(batch, tuple | list) or len(batch) != 2:
        raise ConfigError("data_iter must yield (inputs, labels) pairs, one per micro-batch")
    return batch[0], batch[1]


class SendRecvEngine:
    """Trains a :class:`SendRecvPipeline`: ``train_batch`` / ``eval_batch`` as DeepSpeed's."""

    def __init__(self, module: SendRecvPipeline, config: TrainingConfig) -> None:
        self.module = module
        self.config = config
        self.optimizer = build_optimizer(config, module.stage.parameters())
        self.global_steps = 0
        module.sync_initial_weights()

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches; mean loss."""
        if data_iter is None:
            raise ConfigError("train_batch() needs a data_iter yielding (inputs, labels)")
        self.module.train()
        loss = self.module.run(data_iter, self.config.gradient_accumulation_steps, train=True)
        self.module.reduce_gradients()
        if self.config.gradient_clipping > 0:
            self.module.clip_gradients(self.config.gradient_clipping)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_steps += 1
        return loss

    def eval_batch(
        self, data_iter: Iterator[Any], num_micro_batches: int | None = None
    ) -> torch.Tensor:
        """The mean loss over ``num_micro_batches`` (default: gas) micro-batches, no update."""
        self.module.eval()
        count = num_micro_batches or self.config.gradient_accumulation_steps
        with torch.no_grad():
            return self.module.run(data_iter, count, train=False)
