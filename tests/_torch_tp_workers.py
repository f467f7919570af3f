"""What each rank runs in the torch dialect's tensor-parallel tests (importable by spawned ranks).

Eight ranks, one gloo process group: every case is a pipeline of two stages, two replicas and
a tensor axis of two ranks (``make_topology(2, data_parallel=2, tensor_parallel=2)``): so each
replica is a PP2 x TP2 pipeline, whose replicas are whole (``data_parallel_mode="ddp"``) or
sharded (``"fsdp"``, the 3D layout). The model is :class:`pipedialect.models.MultiHeadGPT`
with its tensor plan: its embedding (stage 0) and LM head (stage 1) are one tied weight,
sharded by vocabulary on both stages. Replica ``d`` reads the stream seeded ``DATA_SEED + d``;
each case saves a portable checkpoint that the test process consolidates and compares with
the unsplit model. The last case builds models whose code is wrong under tensor parallelism
(the global head count in a reshape: refused by the first step's check; a whole parameter
combined with a query shard: the shards are then gathered, so it trains right) and reports
what their first step did, and a resume case loads the 3D layout's portable
checkpoint into torch PP4 x DDP2 and trains on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import _ds_workers
import torch
import torch.distributed as dist
from _torch_fsdp_workers import default_dtype, train_and_save
from torch import nn

import pipedialect
import pipedialect.checkpoint as portable
from pipedialect import PipeDialectError
from pipedialect.models import MultiHeadAttention, MultiHeadGPT
from pipedialect.plan.partition import partition
from pipedialect.plan.weights import from_state_dict
from pipedialect.runtime.sharded import is_sharded, local_part

DP = 2
TP = 2
MODEL = "mhgpt"
#: The sharded layers: what tensor parallelism divides.
SHARDED = ("attn.q", "attn.k", "attn.v", "attn.o", "fc1", "fc2", "wte", "lm_head")


class GlobalHeads(MultiHeadAttention):
    """Reshapes with the model's head count: right unsplit, wrong on a shard of the heads."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        heads = 4
        q = self.q(x).view(b, s, heads, -1).transpose(1, 2)
        k = self.k(x).view(b, s, heads, -1).transpose(1, 2)
        v = self.v(x).view(b, s, heads, -1).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)).softmax(dim=-1)
        out = (scores @ v).transpose(1, 2).reshape(b, s, -1)
        result: torch.Tensor = self.o(out)
        return result


class WholeGain(MultiHeadAttention):
    """Multiplies the query shard by a whole parameter: its gradient would be partial."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__(dim, heads)
        self.gain = nn.Parameter(torch.full((1,), 1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        q = (self.q(x) * self.gain).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)).softmax(dim=-1)
        out = (scores @ v).transpose(1, 2).reshape(b, s, -1)
        result: torch.Tensor = self.o(out)
        return result


def trap_model(kind: str) -> nn.Module:
    """:class:`MultiHeadGPT` whose attention is ``kind`` (``heads`` or ``gain``)."""
    model = MultiHeadGPT(seed=0)
    cls = GlobalHeads if kind == "heads" else WholeGain
    for block in model.blocks:
        old = block.attn
        block.attn = cls(16, 4)
        block.attn.load_state_dict(old.state_dict(), strict=False)
    return model


def config(case: dict[str, Any]) -> dict[str, Any]:
    cfg = _ds_workers.ds_config(
        case["opt"], gas=case["gas"], micro=case["micro"], dp=DP, clip=case.get("clip", 0.0)
    )
    if case.get("bf16"):
        cfg["bf16"] = {"enabled": True}
    return cfg


def build(
    case: dict[str, Any], make_model: Callable[[], nn.Module] | None = None
) -> tuple[Any, Any, int]:
    """The case's plan, engine and this rank's replica; the model ``make_model()`` builds, else
    the registry's."""
    spec = _ds_workers.spec_for(MODEL)
    cfg = config(case)
    dialect = type(pipedialect.get_dialect("torch"))(schedule=case["schedule"])
    topology = dialect.make_topology(2, data_parallel=DP, tensor_parallel=TP)
    replica = int(topology.get_coord(dist.get_rank()).data)
    split = spec.split_points_for(2)
    kwargs: dict[str, Any] = {}
    if case.get("recompute"):
        kwargs["recompute"] = case["recompute"]
    extra: dict[str, Any] = {}
    make = make_model if make_model is not None else lambda: spec.build(0)
    if case.get("meta"):  # each rank materialises its shards only, from the unsplit weights
        state = make().state_dict()
        with torch.device("meta"):
            plan = partition(make(), split, **kwargs)
        extra["init_weights"] = from_state_dict(state, plan=plan)
    else:
        plan = partition(make(), split, **kwargs)
    module = dialect.pipe_engine(
        plan,
        config=cfg,
        loss_fn=spec.loss_fn,
        topology=topology,
        data_parallel_mode=case["mode"],
        tensor_parallel=spec.tensor_plan,
        **extra,
    )
    engine = dialect.runtime_engine(module, config=cfg, check_finite=True)
    return plan, engine, replica


def _held(plan: Any, engine: Any) -> dict[str, Any]:
    """Elements of the sharded layers this rank holds, and of the whole layers (a rowwise
    layer's bias is whole on every rank of the tensor axis: left out)."""
    named = [
        (n, p)
        for k in engine.stage_ids
        for n, p in plan.stages[k].named_parameters()
        if any(s in n for s in SHARDED) and not n.endswith(("o.bias", "fc2.bias"))
    ]
    return {
        "held": sum(local_part(p).numel() for _, p in named),
        "whole": sum(p.numel() for _, p in named),
        "all_sharded": all(is_sharded(p) for _, p in named),
        "dtypes": sorted({str(local_part(p).dtype) for _, p in named}),
    }


def _train_case(case: dict[str, Any], ckpt_dir: str) -> dict[str, Any]:
    spec = _ds_workers.spec_for(MODEL)
    with default_dtype(case.get("dtype", "float32")):
        plan, engine, replica = build(case)
        done = train_and_save(engine, spec, case, replica, ckpt_dir)
    return {**done, **_held(plan, engine)}


def _trap_case(case: dict[str, Any]) -> dict[str, Any]:
    spec = _ds_workers.spec_for(MODEL)
    out: dict[str, Any] = {"name": case["name"], "rank": dist.get_rank()}
    # A meta-device build is checked too, on the weights init_weights gave its shards.
    for kind, meta in (("heads", False), ("gain", False), ("heads", True)):
        _, engine, replica = build({**case, "meta": meta}, lambda k=kind: trap_model(k))
        data = _ds_workers.data_stream(spec, case["gas"], case["micro"], replica)
        try:
            outcome = f"loss {float(engine.train_batch(data_iter=data))!r}"
        except PipeDialectError as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        out[f"{kind}-meta" if meta else kind] = outcome
        dist.barrier()
    return out


def _resume_case(case: dict[str, Any], ckpt_dir: str) -> dict[str, Any]:
    """Torch PP4 x DDP2 (no tensor axis, other initial weights) resumes the portable checkpoint
    of case ``case["from"]`` (saved by PP2 x FSDP2 x TP2), trains on, and saves again."""
    spec = _ds_workers.spec_for(MODEL)
    with default_dtype(case.get("dtype", "float32")):
        cfg = config(case)
        dialect = pipedialect.get_dialect("torch")
        topology = dialect.make_topology(4, data_parallel=DP)
        replica = int(topology.get_coord(dist.get_rank()).data)
        plan = partition(spec.build(9), spec.split_points_for(4))
        module = dialect.pipe_engine(plan, config=cfg, loss_fn=spec.loss_fn, topology=topology)
        engine = dialect.runtime_engine(module, config=cfg, check_finite=True)
        portable.load(engine, ckpt_dir, tag=case["from"])
        done = case["saved_steps"] * case["gas"]
        data = _ds_workers.data_stream(
            spec, done + case["steps"] * case["gas"], case["micro"], replica
        )
        for _ in range(done):
            next(data)
        losses = [float(engine.train_batch(data_iter=data)) for _ in range(case["steps"])]
        portable.save(engine, ckpt_dir, tag=case["name"])
    return {
        "name": case["name"],
        "rank": dist.get_rank(),
        "stages": list(engine.stage_ids),
        "replica": replica,
        "losses": losses,
        "global_steps": engine.global_steps,
    }


def resume_on_deepspeed(ckpt_dir: str, case: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed PP2 (two ranks, one replica: each step both replicas' micro-batches, in
    replica order) resumes the 3D layout's portable checkpoint of case ``case["from"]``."""
    spec = _ds_workers.spec_for(MODEL)
    gas, micro, saved, steps = case["gas"], case["micro"], case["saved_steps"], case["steps"]
    cfg = _ds_workers.ds_config(case["opt"], gas=gas * DP, micro=micro, dp=1)
    _, engine, _, _ = _ds_workers.build(MODEL, 2, 1, cfg, seed=9)
    portable.load(engine, ckpt_dir, tag=case["from"])
    streams = [
        list(_ds_workers.data_stream(spec, (saved + steps) * gas, micro, d)) for d in range(DP)
    ]
    losses = []
    for step in range(saved, saved + steps):
        batch = [mb for s in streams for mb in s[step * gas : (step + 1) * gas]]
        losses.append(float(engine.train_batch(data_iter=iter(batch))))
    portable.save(engine, ckpt_dir, tag=case["name"])
    return {"rank": dist.get_rank(), "losses": losses}


def run_cases(cases: list[dict[str, Any]], ckpt_dir: str) -> list[dict[str, Any]]:
    """Run every case in turn in one process group."""
    pipedialect.get_dialect("torch").init_distributed()
    out = []
    for case in cases:
        if case.get("traps"):
            out.append(_trap_case(case))
        elif case.get("from"):
            out.append(_resume_case(case, ckpt_dir))
        else:
            out.append(_train_case(case, ckpt_dir))
        dist.barrier()
    return out


#: The Hugging Face case: a tiny Llama (grouped-query attention, tied embeddings, right
#: padding) under its own plan, captured with torch.export.
LLAMA = {"gas": 2, "micro": 2, "steps": 3}


def run_llama(ckpt_dir: str) -> dict[str, Any]:
    """PP2 x TP2 (four ranks) trains the tiny Llama with ``tensor_parallel="auto"``: losses,
    the held part of its sharded layers, and a portable checkpoint tagged ``llama``."""
    import _hf_workers

    dialect = pipedialect.get_dialect("torch")
    dialect.init_distributed()
    family = _hf_workers.FAMILIES["llama"]
    gas, micro, steps = LLAMA["gas"], LLAMA["micro"], LLAMA["steps"]
    cfg = _hf_workers.ds_config(gas, micro, "sgd")
    plan = partition(
        family.build(0),
        [family.split_point],
        example_inputs=family.example_inputs(micro),
        concrete_args=family.fixed,
    )
    topology = dialect.make_topology(2, tensor_parallel=TP)
    module = dialect.pipe_engine(
        plan,
        config=cfg,
        loss_fn=_hf_workers.token_loss,
        topology=topology,
        tensor_parallel="auto",
    )
    engine = dialect.runtime_engine(module, config=cfg, check_finite=True)
    data = family.micro_batches(steps * gas, batch_size=micro)
    losses = [float(engine.train_batch(data_iter=data)) for _ in range(steps)]
    portable.save(engine, ckpt_dir, tag="llama")
    out = {"rank": dist.get_rank(), "stages": list(engine.stage_ids), "losses": losses}
    out.update(_held_named(plan, engine, ("_proj.weight",)))
    # Then bf16, with the tied embedding and LM head sharded by vocabulary as well (the model's
    # own plan leaves them whole): a plan written by hand on top of the config's.
    model = family.build(0)
    plan = partition(
        model,
        [family.split_point],
        example_inputs=family.example_inputs(micro),
        concrete_args=family.fixed,
        dtype=torch.bfloat16,  # captured for the engine's precision
    )
    by_hand = {f"model.{g}": s for g, s in model.config.base_model_tp_plan.items()}
    by_hand.update({"model.embed_tokens": "rowwise", "lm_head": "colwise"})
    cfg = {**cfg, "bf16": {"enabled": True}}
    module = dialect.pipe_engine(
        plan,
        config=cfg,
        loss_fn=_hf_workers.token_loss,
        topology=topology,
        tensor_parallel=by_hand,
    )
    engine = dialect.runtime_engine(module, config=cfg, check_finite=True)
    data = family.micro_batches(steps * gas, batch_size=micro)
    out["bf16_losses"] = [float(engine.train_batch(data_iter=data)) for _ in range(steps)]
    out["bf16_dtypes"] = sorted({str(p.dtype) for p in module.parameters()})
    out["bf16"] = _held_named(
        plan, engine, ("_proj.weight", "embed_tokens.weight", "lm_head.weight")
    )
    return out


def _held_named(plan: Any, engine: Any, suffixes: tuple[str, ...]) -> dict[str, Any]:
    """Elements of this rank's parameters named ``*suffixes`` it holds, of the whole ones, and
    whether each is sharded."""
    named = [
        (n, p)
        for k in engine.stage_ids
        for n, p in plan.stages[k].named_parameters(remove_duplicate=False)
        if n.endswith(suffixes)
    ]
    return {
        "held": sum(local_part(p).numel() for _, p in named),
        "whole": sum(p.numel() for _, p in named),
        "all_sharded": bool(named) and all(is_sharded(p) for _, p in named),
        "names": sorted(n for n, _ in named),
    }
