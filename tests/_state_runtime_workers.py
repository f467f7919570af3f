"""Models with state, what each rank runs with them, and the unsplit references.

Module-level, so that spawned ranks can import it. Every case builds the model (identical
weights on every rank: per-module seeded init), freezes what the case freezes, partitions it,
trains it on a dialect and evaluates it; it returns the losses, the evaluation loss, and the
parameters and buffers of the stages this rank ran. :func:`reference` trains the unsplit model
with a plain PyTorch loop in one process on the same micro-batches: the model is partitioned
first and copied after, so whatever capturing did to it, the reference starts from the same
state as the pipeline. :func:`failures` injects an error on one rank and records what every
rank raised, and how fast.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from _error_records import timed_attempt
from torch import nn

import pipedialect
from pipedialect.engine.param_groups import no_weight_decay
from pipedialect.models import TinyGPT, cross_entropy_loss, mse_loss, seeded_init
from pipedialect.plan.partition import partition

DATA_SEED = 500
LR = 1e-2
_ATTRS = ("rank", "what", "error", "stage", "micro_batch", "field", "ranks")


# -- models ------------------------------------------------------------------------------------


class BNBlock(nn.Module):
    """``h + relu(bn(W h))``: running statistics updated by every training forward.

    The Linear has no bias: BatchNorm removes it, so its gradient would be float noise, which
    Adam scales up to full steps (the runs would differ by the noise, not by a bug).
    """

    def __init__(self, dim: int, affine: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim, bias=False)
        self.bn = nn.BatchNorm1d(dim, affine=affine)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = h + torch.relu(self.bn(self.lin(h)))
        return out


class StackNet(nn.Module):
    """Four blocks, each ``block(dim)``, between an input and an output projection: the nets
    here differ only in their block."""

    def __init__(self, block: Callable[[int], nn.Module], dim: int = 8, seed: int = 0) -> None:
        super().__init__()
        self.inp = nn.Linear(4, dim)
        self.blocks = nn.ModuleList(block(dim) for _ in range(4))
        self.head = nn.Linear(dim, 3)
        seeded_init(self, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        out: torch.Tensor = self.head(h)
        return out


class BNNet(StackNet):
    """Four BatchNorm blocks between an input and an output projection."""

    def __init__(self, dim: int = 8, affine: bool = True, seed: int = 0) -> None:
        super().__init__(lambda d: BNBlock(d, affine), dim, seed)


class Scale(nn.Module):
    """A buffer updated in place and then saved for backward (``h / scale``)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.scale.mul_(0.9)
        return h / self.scale


class ScaleBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.scale = Scale(dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.tanh(self.scale(self.lin(h)))
        return out


class ScaleNet(StackNet):
    def __init__(self, dim: int = 8, seed: int = 0) -> None:
        super().__init__(ScaleBlock, dim, seed)


class InplaceBlock(nn.Module):
    """Updates its input in place first: ``h += 0.1`` and an in-place ReLU, then a Linear."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.act = nn.ReLU(inplace=True)
        self.lin = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h.add_(0.1)
        out: torch.Tensor = self.lin(self.act(h))
        return out


class InplaceNet(nn.Module):
    """In-place operations right after every split point, on the value that crossed it; the
    embedding ``e`` crosses every boundary too and is updated in place by the last block."""

    def __init__(self, dim: int = 8, seed: int = 0) -> None:
        super().__init__()
        self.inp = nn.Linear(4, dim)
        self.blocks = nn.ModuleList(InplaceBlock(dim) for _ in range(4))
        self.head = nn.Linear(dim, 3)
        seeded_init(self, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.inp(x)
        h = self.blocks[0](e * 1.0)
        for block in self.blocks[1:]:
            h = block(h)
        e.mul_(0.5)
        out: torch.Tensor = self.head(h + e)
        return out


class ParamFreeTail(nn.Module):
    """A tail without parameters (the last stage trains nothing) that uses every feature."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        t = torch.tanh(h)
        return torch.stack([t[:, i::3].sum(1) for i in range(3)], 1)


class TailNet(nn.Module):
    def __init__(self, dim: int = 8, seed: int = 0) -> None:
        super().__init__()
        self.inp = nn.Linear(4, dim)
        self.blocks = nn.ModuleList(BNBlock(dim, True) for _ in range(2))
        self.tail = ParamFreeTail()
        seeded_init(self, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        out: torch.Tensor = self.tail(h)
        return out


# -- specs ---------------------------------------------------------------------------------------


def _float_batch(gen: torch.Generator, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(micro, 4, generator=gen), torch.randn(micro, 3, generator=gen)


def _token_batch(gen: torch.Generator, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 32, (micro, 9), generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _freeze_prefixes(*prefixes: str) -> Callable[[nn.Module], None]:
    def freeze(model: nn.Module) -> None:
        for name, param in model.named_parameters():
            if name.startswith(prefixes):
                param.requires_grad_(False)

    return freeze


@dataclass(frozen=True)
class Spec:
    factory: Callable[..., nn.Module]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    split_points: dict[int, tuple[str, ...]]
    batch: Callable[[torch.Generator, int], tuple[torch.Tensor, torch.Tensor]]
    partition_kwargs: dict[str, Any] = field(default_factory=dict)
    freeze: Callable[[nn.Module], None] | None = None
    #: Sets the modes of the training pattern after ``model.train()`` (a frozen BatchNorm);
    #: the reference applies it too.
    modes: Callable[[nn.Module], None] | None = None
    #: Registers hooks before partition (the reference builds its own model and calls it too).
    prepare: Callable[[nn.Module], None] | None = None
    #: What the training loop sets on the model before step ``i`` (both runs).
    between_steps: Callable[[nn.Module, int], None] | None = None


_FOUR = {2: ("blocks.1",), 4: ("blocks.0", "blocks.1", "blocks.2")}
SPECS: dict[str, Spec] = {
    "bn": Spec(BNNet, mse_loss, _FOUR, _float_batch),
    "bn_plain": Spec(lambda seed: BNNet(affine=False, seed=seed), mse_loss, _FOUR, _float_batch),
    "scale": Spec(ScaleNet, mse_loss, _FOUR, _float_batch, {"leaf_modules": [Scale]}),
    "inplace": Spec(InplaceNet, mse_loss, _FOUR, _float_batch),
    # LoRA-like: the first stage (input projection and two blocks) is frozen.
    "frozen_first": Spec(
        BNNet,
        mse_loss,
        _FOUR,
        _float_batch,
        freeze=_freeze_prefixes("inp.", "blocks.0.", "blocks.1."),
    ),
    "param_free_last": Spec(TailNet, mse_loss, {2: ("blocks.1",)}, _float_batch),
    # A GPT whose whole first stage is frozen (the tied embedding with it): for bf16.
    "frozen_gpt_first": Spec(
        TinyGPT,
        cross_entropy_loss,
        {2: ("blocks.1",)},
        _token_batch,
        freeze=_freeze_prefixes("wte.", "wpe", "blocks.0.", "blocks.1."),
    ),
    # The tied embedding / LM head and the first block frozen (the tie spans both stages).
    "frozen_tie": Spec(
        TinyGPT,
        cross_entropy_loss,
        {2: ("blocks.1",)},
        _token_batch,
        freeze=_freeze_prefixes("wte.", "blocks.0."),
    ),
}


# -- around the graph: per-module modes, custom autograd Functions, hooks, loop-set values ------


def _freeze_norms(*paths: str) -> Callable[[nn.Module], None]:
    """``model.bn.eval()`` after ``model.train()``: frozen BatchNorms in fine-tuning."""

    def modes(model: nn.Module) -> None:
        for path in paths:
            model.get_submodule(path).eval()

    return modes


class NormsEvalNet(BNNet):
    """A ``train()`` override that keeps every BatchNorm in eval (detectron2's frozen norms)."""

    def train(self, mode: bool = True) -> NormsEvalNet:
        super().train(mode)
        for module in self.modules():
            if isinstance(module, nn.BatchNorm1d):
                module.eval()
        return self


class GradScale(torch.autograd.Function):
    """Identity forward; backward scales the gradient by -0.5 (a gradient reversal layer)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * -0.5


class ReversalBlock(nn.Module):
    """``h + tanh(W GradScale(h))``: the Function's backward changes every earlier gradient."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = h + torch.tanh(self.lin(GradScale.apply(h)))
        return out


class ReversalNet(StackNet):
    def __init__(self, dim: int = 8, seed: int = 0) -> None:
        super().__init__(ReversalBlock, dim, seed)


# The gradient hooks shift as well as scale: Adam's steps do not change when every gradient of
# a parameter is scaled by one constant, so a lost scaling alone would go unseen.


def _scale_grad(grad: torch.Tensor) -> torch.Tensor:
    return grad * 2.0 + 0.01


def _halve_output(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    return output * 0.5


def _shift_input(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return (args[0] + 0.1,)


def _halve_grad_input(module: nn.Module, grad_input: Any, grad_output: Any) -> Any:
    return tuple(None if g is None else g * 0.5 + 0.01 for g in grad_input)


def _hooks(backward: bool) -> Callable[[nn.Module], None]:
    """A forward hook, a pre-forward hook, a full backward hook (fx only: torch.export refuses
    it) on traced-through blocks, and a parameter's tensor hook, each changing the numbers."""

    def prepare(model: nn.Module) -> None:
        model.get_submodule("blocks.1").register_forward_hook(_halve_output)
        model.get_submodule("blocks.2").register_forward_pre_hook(_shift_input)
        if backward:
            model.get_submodule("blocks.3").register_full_backward_hook(_halve_grad_input)
        model.get_parameter("blocks.0.lin.weight").register_hook(_scale_grad)

    return prepare


class Annealed(nn.Module):
    """``h + tanh(W h / temp) * gain``: ``temp`` a buffer, ``gain`` a plain float."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.register_buffer("temp", torch.ones(()))
        self.gain = 1.0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = h + torch.tanh(self.lin(h) / self.temp) * self.gain
        return out


class PlainBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = h + torch.tanh(self.lin(h))
        return out


class PlainNet(StackNet):
    """:class:`ReversalNet` without the Function: ``h + tanh(W h)`` blocks."""

    block: Callable[[int], nn.Module] = PlainBlock

    def __init__(self, dim: int = 8, seed: int = 0) -> None:
        super().__init__(type(self).block, dim, seed)


class AnnealedNet(PlainNet):
    block = Annealed


def _anneal_reassign(model: nn.Module, step: int) -> None:
    """``model.blocks[i].temp = torch.tensor(1 / (1 + step))``: a buffer re-assigned."""
    for i in (0, 2):
        model.get_submodule(f"blocks.{i}").temp = torch.tensor(1.0 / (1 + step))


def _anneal_in_place(model: nn.Module, step: int) -> None:
    model.get_submodule("blocks.3").get_buffer("temp").fill_(1.0 / (1 + step))


def _anneal_buffers(model: nn.Module, step: int) -> None:
    _anneal_reassign(model, step)
    _anneal_in_place(model, step)


def _anneal_float(model: nn.Module, step: int) -> None:
    """``model.blocks[2].gain = ...``: a plain float the capture wrote into the graph."""
    model.get_submodule("blocks.2").gain = 1.0 / (1 + step)


def _hook_after(model: nn.Module, step: int) -> None:
    """A forward hook added to a captured block after partition, before the second step."""
    if step == 1:
        model.get_submodule("blocks.2").register_forward_hook(_halve_output)


def _leaf_hook_after(model: nn.Module, step: int) -> None:
    """A forward hook added to a Linear (a leaf the fx stages call) before the second step."""
    if step == 1:
        model.get_submodule("blocks.2.lin").register_forward_hook(_halve_output)


SPECS.update(
    {
        # One frozen BatchNorm on each stage of two (and on stages 0 and 2 of four).
        "frozen_bn": Spec(
            BNNet, mse_loss, _FOUR, _float_batch, modes=_freeze_norms("blocks.0.bn", "blocks.2.bn")
        ),
        # modes=: model.train() before partition, which runs the override.
        "norms_eval": Spec(NormsEvalNet, mse_loss, _FOUR, _float_batch, modes=_freeze_norms()),
        "reversal": Spec(ReversalNet, mse_loss, _FOUR, _float_batch),
        "hooks": Spec(PlainNet, mse_loss, _FOUR, _float_batch, prepare=_hooks(True)),
        "forward_hooks": Spec(PlainNet, mse_loss, _FOUR, _float_batch, prepare=_hooks(False)),
        "anneal_buffer": Spec(
            AnnealedNet,
            mse_loss,
            _FOUR,
            _float_batch,
            between_steps=_anneal_buffers,
        ),
        "anneal_float": Spec(
            AnnealedNet, mse_loss, _FOUR, _float_batch, between_steps=_anneal_float
        ),
        "hook_after": Spec(PlainNet, mse_loss, _FOUR, _float_batch, between_steps=_hook_after),
        "leaf_hook_after": Spec(
            PlainNet, mse_loss, _FOUR, _float_batch, between_steps=_leaf_hook_after
        ),
    }
)


def spec_of(case: dict[str, Any]) -> Spec:
    return SPECS[case["model"]]


def build(case: dict[str, Any]) -> tuple[nn.Module, Any]:
    """The case's model (frozen where the case says) and its plan."""
    spec = spec_of(case)
    model = spec.factory(seed=0)
    if spec.freeze is not None:
        spec.freeze(model)
    if spec.modes is not None:
        model.train()
        spec.modes(model)
    if spec.prepare is not None:
        spec.prepare(model)
    kwargs = dict(spec.partition_kwargs)
    if case.get("recompute"):
        kwargs["recompute"] = case["recompute"]
    if case.get("export"):
        kwargs["example_inputs"] = (batches(case, 1)[0][0],)
    plan = partition(model, spec.split_points[case.get("stages", 2)], **kwargs)
    return model, plan


def to_bf16(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(torch.bfloat16) if value.is_floating_point() else value
    if isinstance(value, tuple | list):
        return type(value)(to_bf16(v) for v in value)
    return value


def batches(case: dict[str, Any], count: int, offset: int = 0) -> list[Any]:
    """``count`` micro-batches of the case's data (skipping ``offset``), bf16 under bf16."""
    gen = torch.Generator().manual_seed(DATA_SEED)
    micro = case.get("micro", 4)
    out = [spec_of(case).batch(gen, micro) for _ in range(offset + count)][offset:]
    return [to_bf16(b) for b in out] if case.get("bf16") else out


def steps_of(case: dict[str, Any]) -> tuple[int, int]:
    return case.get("steps", 3), case.get("gas", 4)


def config(case: dict[str, Any]) -> dict[str, Any]:
    """A DeepSpeed config: plain Adam, or AdamW with decay; no clipping unless asked."""
    gas, micro = case.get("gas", 4), case.get("micro", 4)
    params: dict[str, Any] = {"lr": LR, "torch_adam": True, "adam_w_mode": False}
    if case.get("optimizer") == "adamw":
        params = {"lr": LR, "torch_adam": True, "adam_w_mode": True, "weight_decay": 0.1}
    out: dict[str, Any] = {
        "train_batch_size": gas * micro,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": case.get("clip", 0.0),
        "steps_per_print": 10**9,
        "optimizer": {"type": "Adam", "params": params},
    }
    if case.get("bf16"):
        out["bf16"] = {"enabled": True}
    return out


# -- the unsplit reference -----------------------------------------------------------------------


def _forward(model: nn.Module, inputs: Any) -> Any:
    return model(*inputs) if isinstance(inputs, tuple | list) else model(inputs)


def _groups(model: nn.Module, case: dict[str, Any]) -> list[Any]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if case.get("groups"):
        return [g for g in no_weight_decay()(named) if g["params"]]
    return [p for _, p in named]


def reference(case: dict[str, Any]) -> dict[str, Any]:
    """The unsplit model trained with a plain loop (fp32, or DeepSpeed's bf16 recipe)."""
    model, _ = build(case)
    net = copy.deepcopy(model)
    spec = spec_of(case)
    if spec.prepare is not None:  # a deep copy leaves tensor hooks behind: build it again
        net = spec.factory(seed=0)
        spec.prepare(net)
    steps, gas = steps_of(case)
    data = batches(case, steps * gas)
    initial = {n: p.detach().clone() for n, p in net.named_parameters()}
    net.train()
    if spec.modes is not None:
        spec.modes(net)
    if case.get("bf16"):
        import _bf16_workers

        # DeepSpeed casts every parameter, frozen ones too; the recipe casts what it trains.
        with torch.no_grad():
            for param in net.parameters():
                param.data = param.data.to(torch.bfloat16)
        run = _bf16_workers.reference_bf16(net, spec.loss_fn, iter(data), steps, gas)
        losses = run["losses"]
    else:
        groups = _groups(net, case)
        if case.get("optimizer") == "adamw":
            opt: torch.optim.Optimizer = torch.optim.AdamW(groups, lr=LR, weight_decay=0.1)
        else:
            opt = torch.optim.Adam(groups, lr=LR)
        trainable = [p for p in dict.fromkeys(net.parameters()) if p.requires_grad]
        losses = []
        for step in range(steps):
            if spec.between_steps is not None:
                spec.between_steps(net, step)
            total = 0.0
            for inputs, labels in data[step * gas : (step + 1) * gas]:
                loss = spec.loss_fn(_forward(net, inputs), labels)
                (loss / gas).backward()
                total += float(loss.detach()) / gas
            if case.get("clip", 0.0) > 0:
                torch.nn.utils.clip_grad_norm_(trainable, case["clip"])
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(total)
    net.eval()
    with torch.no_grad():
        evals = [
            spec.loss_fn(_forward(net, inputs), labels)
            for inputs, labels in batches(case, gas, offset=steps * gas)
        ]
    # Summed in the loss's own dtype and divided, as DeepSpeed does (bf16 under bf16).
    total = evals[0].clone()
    for extra in evals[1:]:
        total += extra
    return {
        "losses": losses,
        "eval": float((total / len(evals)).float()),
        "params": {
            n: p.detach().float().clone() for n, p in net.named_parameters(remove_duplicate=False)
        },
        "buffers": {n: b.detach().clone() for n, b in net.named_buffers()},
        "initial": initial,
    }


# -- what a rank runs ----------------------------------------------------------------------------


def run_case(dialect_name: str, case: dict[str, Any]) -> dict[str, Any]:
    """Train and evaluate one case on this rank; return what the test compares."""
    dialect = pipedialect.get_dialect(dialect_name)
    model, plan = build(case)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    spec = spec_of(case)
    cfg = config(case)
    kwargs: dict[str, Any] = {}
    if dialect_name == "torch":
        kwargs["schedule"] = case.get("schedule", "1f1b")
    elif dialect_name == "deepspeed":
        kwargs["topology"] = dialect.make_topology(plan.num_stages, 1)
        if case.get("interval"):
            kwargs["activation_checkpoint_interval"] = case["interval"]
    module = dialect.pipe_engine(plan, config=cfg, loss_fn=spec.loss_fn, **kwargs)
    engine_kwargs: dict[str, Any] = {}
    if case.get("groups"):
        engine_kwargs["param_groups"] = no_weight_decay()
    engine = dialect.runtime_engine(module, config=cfg, **engine_kwargs)
    stages = (
        list(dialect.local_stages(engine))
        if dialect_name != "local"
        else list(range(plan.num_stages))
    )
    steps, gas = steps_of(case)
    data = iter(batches(case, steps * gas))
    losses = []
    for step in range(steps):
        if spec.between_steps is not None:
            spec.between_steps(model, step)
        losses.append(float(engine.train_batch(data)))
    evaluated = float(engine.eval_batch(iter(batches(case, gas, offset=steps * gas))))
    params: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    for k in stages:
        for n, p in plan.stages[k].named_parameters(remove_duplicate=False):
            params[n] = p.detach().float().cpu().clone()
        for n, b in plan.stages[k].named_buffers():
            buffers[n] = b.detach().cpu().clone()
    frozen = {  # under bf16 as the engine cast them
        n: bool(torch.equal(p.detach().cpu(), initial[n].to(p.dtype)))
        for n, p in model.named_parameters()
        if not p.requires_grad and n in params
    }
    return {
        "case": case,
        "stages": stages,
        "losses": losses,
        "eval": evaluated,
        "params": params,
        "buffers": buffers,
        "frozen_unchanged": frozen,
    }


def run(dialect_name: str, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every case in turn on this rank, in one process group; a case that raises is recorded
    (and, if it shut the process group down, the next case gets a new one)."""
    import torch.distributed as dist

    pipedialect.get_dialect(dialect_name).init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    base = dist.distributed_c10d._get_default_store()
    out = []
    for index, case in enumerate(cases):
        try:
            out.append(run_case(dialect_name, case))
        except Exception as exc:
            out.append({"case": case, "error": f"{type(exc).__name__}: {exc}"})
        if not _fresh_group(base, f"case{index}", rank, world):
            dist.barrier()
    return out


# -- an error on one rank ------------------------------------------------------------------------


class _Injected(Exception):
    """What the tests raise on one rank."""


def _attempt(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn``; return the error it raised (type, bases, attributes, message, seconds)."""
    return timed_attempt(fn, _ATTRS)


def _fresh_group(base: Any, name: str, rank: int, world: int) -> bool:
    """Join a new process group (on a fresh part of the launch's store) if the last one was
    shut down; return whether it was."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    dist.init_process_group("gloo", store=dist.PrefixStore(name, base), rank=rank, world_size=world)
    return True


def failures(dialect_name: str) -> dict[str, Any]:
    """Inject one failure per case on one rank; record what every rank raised."""
    import torch.distributed as dist

    dialect = pipedialect.get_dialect(dialect_name)
    dialect.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    base = dist.distributed_c10d._get_default_store()
    case = {"model": "bn", "stages": 2, "gas": 2, "steps": 2}
    spec = spec_of(case)
    out: dict[str, Any] = {"rank": rank, "shut_down": {}}

    def engine(loss_fn: Any = None, param_groups: Any = None) -> tuple[Any, Any]:
        _, plan = build(case)
        kwargs: dict[str, Any] = {}
        if dialect_name == "deepspeed":
            kwargs["topology"] = dialect.make_topology(2, 1)
        module = dialect.pipe_engine(
            plan, config=config(case), loss_fn=loss_fn or spec.loss_fn, **kwargs
        )
        built = dialect.runtime_engine(module, config=config(case), param_groups=param_groups)
        return plan, built

    def step(eng: Any, index: int = 0) -> Any:
        return eng.train_batch(iter(batches(case, 2, offset=2 * index)))

    def record(name: str, fn: Callable[[], Any]) -> None:
        out[name] = _attempt(fn)
        if dist.is_initialized():
            dist.barrier()
        out["shut_down"][name] = _fresh_group(base, name, rank, world)

    # The loss raises on the last stage, in the second step.
    calls = {"n": 0}

    def bad_loss(outputs: Any, labels: Any) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 3:
            raise _Injected("injected loss failure")
        return spec.loss_fn(outputs, labels)

    held: list[Any] = []

    def loss_case() -> None:
        _, eng = engine(bad_loss)
        held.append(eng)
        for i in range(2):
            step(eng, i)

    out["loss"] = _attempt(loss_case)
    # A step after the process group was shut down is refused at once, by name.
    out["after_loss"] = _attempt(lambda: step(held[0]))
    out["shut_down"]["loss"] = _fresh_group(base, "loss", rank, world)

    # The data iterator raises on rank 1 (it reads the labels), after one micro-batch.
    _, eng = engine()

    def data_case() -> None:
        items = batches(case, 2)

        def stream() -> Iterator[Any]:
            yield items[0]
            if rank == 1:
                raise _Injected("injected data failure")
            yield items[1]

        eng.train_batch(stream())

    record("data", data_case)
    # The same engine trains on: the process group survived an error agreed at the step's start.
    out["after_data"] = _attempt(lambda: step(eng)) if not out["shut_down"]["data"] else None

    # Saving a checkpoint fails on rank 1 only.
    import tempfile

    directory = tempfile.mkdtemp(prefix="pipedialect-fail-save-")
    _, eng = engine()
    step(eng)
    if rank == 1:
        if dialect_name == "deepspeed":
            module = eng.module

            def fail_save(*args: Any, **kwargs: Any) -> None:
                raise _Injected("injected save failure")

            module.save_state_dict = fail_save
        else:

            def fail_write(*args: Any, **kwargs: Any) -> None:
                raise _Injected("injected save failure")

            eng._write_checkpoint = fail_write
    record("save", lambda: eng.save_checkpoint(directory, tag="t1"))

    # Building the engine fails on rank 0 only (its param_groups function raises).
    def groups(named: list[tuple[str, nn.Parameter]]) -> list[dict[str, Any]]:
        if rank == 0:
            raise _Injected("injected build failure")
        return [{"params": [p for _, p in named]}]

    record("build", lambda: engine(param_groups=groups))

    # eval_batch: the loss raises on the last stage.
    def bad_eval_loss(outputs: Any, labels: Any) -> torch.Tensor:
        if not torch.is_grad_enabled():
            raise _Injected("injected eval failure")
        return spec.loss_fn(outputs, labels)

    def eval_case() -> None:
        _, eng = engine(bad_eval_loss)
        step(eng)
        eng.eval_batch(iter(batches(case, 2, offset=2)))

    record("eval", eval_case)

    # The tied embedding frozen on rank 1 only.
    def tie_case() -> None:
        tied = {"model": "frozen_tie", "stages": 2, "gas": 2}
        model = TinyGPT()
        if rank == 1:
            model.wte.weight.requires_grad_(False)
        plan = partition(model, SPECS["frozen_tie"].split_points[2])
        kwargs: dict[str, Any] = {}
        if dialect_name == "deepspeed":
            kwargs["topology"] = dialect.make_topology(2, 1)
        dialect.pipe_engine(plan, config=config(tied), loss_fn=cross_entropy_loss, **kwargs)

    record("tie", tie_case)
    return out
