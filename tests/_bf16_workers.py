"""bf16 runs on every dialect, and the independent references they are compared with.

Module-level so that spawned ranks can import it. ``train`` runs one dialect (the local one in
this process, deepspeed and torch on launched ranks) and returns the losses and the parameters
of the stages it trained, as fp32 copies, by their original names. The references train the
unsplit model in one process with plain PyTorch written here, not with pipedialect code:

- :func:`reference_fp32`: the fp32 model (the loss curve bf16 must stay near);
- :func:`reference_bf16`: DeepSpeed's bf16 recipe written out by hand -- the model's parameters
  cast to bf16, fp32 master copies stepped by a torch optimizer, each micro-batch's bf16
  gradient added into a buffer of ``accum`` dtype, the global norm, the master -> model copy.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

import pipedialect
from pipedialect.models import ModelSpec, get_model
from pipedialect.plan.partition import partition

DATA_SEED = 100
LR = 1e-2


def config(
    gas: int,
    micro: int,
    *,
    bf16: bool = True,
    accum: str | None = None,
    comm: str | None = None,
    clip: float = 0.0,
    weight_decay: float | None = None,
) -> dict[str, Any]:
    """A DeepSpeed config: plain Adam (AdamW with ``weight_decay``), optional bf16."""
    params: dict[str, Any] = {"lr": LR, "torch_adam": True, "adam_w_mode": False}
    if weight_decay is not None:
        params = {"lr": LR, "torch_adam": True, "adam_w_mode": True, "weight_decay": weight_decay}
    out: dict[str, Any] = {
        "train_batch_size": micro * gas,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "steps_per_print": 10**9,
        "optimizer": {"type": "Adam", "params": params},
    }
    if bf16:
        out["bf16"] = {"enabled": True}
    if accum is not None:
        out["data_types"] = {"grad_accum_dtype": accum}
    if comm is not None:
        out["communication_data_type"] = comm
    return out


def to_bf16(value: Any) -> Any:
    """Float tensors in ``value`` as bf16 (model inputs are passed on as they come, as in
    DeepSpeed, so a bf16 run's data is bf16)."""
    if isinstance(value, torch.Tensor):
        return value.to(torch.bfloat16) if value.is_floating_point() else value
    if isinstance(value, tuple | list):
        return type(value)(to_bf16(v) for v in value)
    return value


def batches(spec: ModelSpec, count: int, micro: int, bf16: bool) -> list[Any]:
    """The micro-batches of a run (float tensors in bf16 for a bf16 run)."""
    out = list(spec.micro_batches(count, batch_size=micro, seed=DATA_SEED))
    return [to_bf16(b) for b in out] if bf16 else out


def _stage_params(plan: Any, stages: Any) -> dict[str, torch.Tensor]:
    return {
        n: p.detach().to("cpu", torch.float32).clone()
        for k in stages
        for n, p in plan.stages[k].named_parameters(remove_duplicate=False)
    }


def no_decay_and_tie(named: list[tuple[str, nn.Parameter]]) -> list[dict[str, Any]]:
    """Biases, norms and the tied embedding (named ``wte.weight`` on every rank) without decay."""
    exempt = [p for n, p in named if "bias" in n or "ln" in n or n == "wte.weight"]
    decayed = [p for n, p in named if not ("bias" in n or "ln" in n or n == "wte.weight")]
    return [{"params": decayed}, {"params": exempt, "weight_decay": 0.0}]


def train(
    dialect_name: str,
    model: str,
    num_stages: int,
    steps: int,
    gas: int,
    micro: int,
    *,
    bf16: bool = True,
    accum: str | None = None,
    comm: str | None = None,
    clip: float = 0.0,
    weight_decay: float | None = None,
    param_groups: bool = False,
    zero1: bool = False,
    schedule: str | None = None,
) -> dict[str, Any]:
    """Train ``steps`` batches on ``dialect_name``; return losses and this rank's parameters.

    ``schedule``: a torch dialect schedule, its stages placed over the ranks by the dialect.
    """
    spec = get_model(model)
    cfg = config(
        gas, micro, bf16=bf16, accum=accum, comm=comm, clip=clip, weight_decay=weight_decay
    )
    if zero1:
        cfg["zero_optimization"] = {"stage": 1}
    plan = partition(spec.build(0), spec.split_points_for(num_stages))
    dialect = pipedialect.get_dialect(dialect_name)
    dialect.init_distributed()
    kwargs: dict[str, Any] = {}
    if schedule is not None:
        kwargs["schedule"] = schedule
    elif dialect_name != "local":
        kwargs["topology"] = dialect.make_topology(num_stages, 1)
    module = dialect.pipe_engine(plan, config=cfg, loss_fn=spec.loss_fn, **kwargs)
    engine_kwargs: dict[str, Any] = {"param_groups": no_decay_and_tie} if param_groups else {}
    engine = dialect.runtime_engine(module, config=cfg, **engine_kwargs)
    data = iter(batches(spec, steps * gas, micro, bf16))
    losses = [float(engine.train_batch(data_iter=data)) for _ in range(steps)]
    stages = list(dialect.local_stages(engine))
    dtypes = {str(p.dtype) for k in stages for p in plan.stages[k].parameters()}
    return {
        "losses": losses,
        "stages": stages,
        "params": _stage_params(plan, stages),
        "dtypes": sorted(dtypes),
        "optimizer": type(engine.optimizer).__name__,
        "grad_acc_dtype": str(getattr(engine.optimizer, "grad_acc_dtype", None)),
        "groups": [
            (len(g["params"]), g.get("weight_decay")) for g in engine.optimizer.param_groups
        ],
    }


def _forward(model: nn.Module, inputs: Any) -> Any:
    return model(*inputs) if isinstance(inputs, tuple | list) else model(inputs)


def _groups(model: nn.Module, param_groups: bool) -> list[Any]:
    named = list(model.named_parameters())  # a tied weight once, under its first name
    if not param_groups:
        return [p for _, p in named]
    return no_decay_and_tie(named)


def _optimizer(params: list[Any], weight_decay: float | None) -> torch.optim.Optimizer:
    if weight_decay is None:
        return torch.optim.Adam(params, lr=LR)
    return torch.optim.AdamW(params, lr=LR, weight_decay=weight_decay)


def reference_fp32(
    model: str,
    steps: int,
    gas: int,
    micro: int,
    *,
    clip: float = 0.0,
    weight_decay: float | None = None,
    param_groups: bool = False,
) -> dict[str, Any]:
    """The unsplit fp32 model trained with plain PyTorch on the same micro-batches."""
    spec = get_model(model)
    net = spec.build(0)
    opt = _optimizer(_groups(net, param_groups), weight_decay)
    unique = list(dict.fromkeys(net.parameters()))
    data = iter(batches(spec, steps * gas, micro, bf16=False))
    losses = []
    for _ in range(steps):
        total = 0.0
        for _ in range(gas):
            inputs, labels = next(data)
            loss = spec.loss_fn(_forward(net, inputs), labels)
            (loss / gas).backward()
            total += float(loss.detach()) / gas
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(unique, clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    params = {n: p.detach().clone() for n, p in net.named_parameters(remove_duplicate=False)}
    return {"losses": losses, "params": params}


def reference_bf16(
    net: nn.Module,
    loss_fn: Any,
    data: Iterator[Any],
    steps: int,
    gas: int,
    *,
    accum: torch.dtype = torch.bfloat16,
    comm: torch.dtype = torch.bfloat16,
    clip: float = 0.0,
    lr: float = LR,
) -> dict[str, Any]:
    """DeepSpeed's bf16 recipe on the unsplit model, written out with plain PyTorch.

    Parameters bf16 (buffers untouched), fp32 masters from them, plain Adam on the masters;
    after each micro-batch ``buffer += grad.to(accum)``; after the last one every buffer goes
    through ``comm`` and back (DeepSpeed's data-parallel reduction, which runs with one replica
    too); the global norm of the buffers (each
    tensor's fp32 norm), a skipped step when it is not finite, ``coef = clip / (norm + 1e-6)``
    applied when below 1; the masters' gradients are the buffers in fp32; the model takes the
    masters rounded to bf16. The loss is summed and divided in its own dtype.
    """
    params = [p for p in dict.fromkeys(net.parameters()) if p.requires_grad]
    with torch.no_grad():
        for p in params:
            p.data = p.data.to(torch.bfloat16)
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    buffers = [torch.zeros_like(p, dtype=accum) for p in params]
    opt = torch.optim.Adam(masters, lr=lr)
    losses: list[float] = []
    for _ in range(steps):
        step_losses = []
        for _ in range(gas):
            inputs, labels = next(data)
            loss = loss_fn(_forward(net, inputs), labels)
            (loss / gas).backward()
            with torch.no_grad():
                for p, b in zip(params, buffers, strict=True):
                    if p.grad is not None:
                        b += p.grad.to(accum)
                        p.grad = None
            step_losses.append(loss.detach())
        total_loss = step_losses[0].clone()
        for extra in step_losses[1:]:
            total_loss += extra
        losses.append(float((total_loss / gas).float()))
        with torch.no_grad():
            for b in buffers:
                b.copy_(b.to(comm))
            norm = torch.stack([b.float().norm(2) for b in buffers]).pow(2).sum().sqrt()
            if math.isfinite(float(norm)):
                coef = clip / (norm + 1e-6)
                if clip > 0 and float(coef) < 1:
                    for b in buffers:
                        b.mul_(coef)
                for m, b in zip(masters, buffers, strict=True):
                    m.grad = b.float()
                opt.step()
                for p, m in zip(params, masters, strict=True):
                    p.copy_(m)
            for b in buffers:
                b.zero_()
    named = {n: p.detach().float().clone() for n, p in net.named_parameters(remove_duplicate=False)}
    return {"losses": losses, "params": named, "masters": masters}


def reference_bf16_model(
    model: str,
    steps: int,
    gas: int,
    micro: int,
    *,
    accum: torch.dtype = torch.bfloat16,
    comm: torch.dtype = torch.bfloat16,
) -> dict[str, Any]:
    """:func:`reference_bf16` on a demo model and the runs' data."""
    spec = get_model(model)
    data = iter(batches(spec, steps * gas, micro, bf16=True))
    return reference_bf16(spec.build(0), spec.loss_fn, data, steps, gas, accum=accum, comm=comm)
