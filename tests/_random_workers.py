"""Randomness in forward on every dialect: what each rank runs, and the unsplit reference.

:class:`NoisyNet` draws in every block: an ``nn.Dropout`` module, ``F.dropout`` called in
forward and ``torch.randn_like`` noise (drawn in evaluation too). :func:`run_cases` trains each
case (a depth, a schedule, recomputation, activation checkpointing, data parallelism) for a few
steps and evaluates once; :func:`reference` trains the unsplit model with plain torch, its
forwards run under :class:`~pipedialect.runtime.ReferenceStreams` of the case's split points
and seed ([Note: random streams]); :func:`compare` checks the two.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _compare import ATOL, RTOL, assert_tensor_close
from _reference import steps_from, train_unsplit
from torch import nn

import pipedialect
from pipedialect.runtime import ReferenceStreams

STEPS, GAS, MICRO, DIM, SEED = 3, 2, 2, 8, 7

#: Split points by depth.
SPLITS = {2: ["blocks.1"], 4: ["blocks.0", "blocks.1", "blocks.2"]}


class NoisyBlock(nn.Module):
    """A linear layer, dropout both ways and additive noise."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.tanh(self.lin(x)))
        h = F.dropout(h, 0.2, training=self.training)
        return x + h + 0.1 * torch.randn_like(h)


class NoisyNet(nn.Module):
    """Four noisy blocks and a head; identical weights on every rank."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.blocks = nn.Sequential(*[NoisyBlock() for _ in range(4)])
        self.head = nn.Linear(DIM, 3)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.blocks(x) + 0.05 * torch.rand_like(x))
        return out


class RenormTied(nn.Module):
    """An ``nn.Embedding(max_norm=1)`` on stage 0 tied to the head on stage 1: its forward
    renormalises the rows it looks up, in place."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(1)
        self.embed = nn.Embedding(5, DIM, max_norm=1.0)
        self.body = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, 5, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.tanh(self.body(self.embed(ids))))
        return out


class RunningParam(nn.Module):
    """A frozen ``nn.Parameter`` used as running state, updated on stage 0 and read by both
    stages."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(DIM, DIM)
        self.second = nn.Linear(DIM, 3)
        self.center = nn.Parameter(torch.zeros(DIM), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.center.mul_(0.9).add_(0.1 * x.mean(0))
        h = self.first(x - self.center)
        out: torch.Tensor = self.second(torch.relu(h) - self.center)
        return out


class RunningSolo(nn.Module):
    """Running state kept in a frozen ``nn.Parameter`` of stage 1 only (no tie): the torch
    dialect's set-up run must not update it once more."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(2)
        self.first = nn.Linear(DIM, DIM)
        self.second = nn.Linear(DIM, 3)
        self.center = nn.Parameter(torch.zeros(DIM), requires_grad=False)
        with torch.no_grad():
            for p in (*self.first.parameters(), *self.second.parameters()):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.first(x))
        with torch.no_grad():
            self.center.mul_(0.5).add_(h.mean(0))
        out: torch.Tensor = self.second(h - self.center)
        return out


def solo_run(dialect: Any, case: dict[str, Any]) -> dict[str, Any]:
    """Train :class:`RunningSolo` on two stages; losses and this rank's parameters."""
    plan = pipedialect.partition(RunningSolo(), split_points=["first"])
    conf = config()
    kwargs = _dialect_kwargs(dialect, case, plan.num_stages)
    module = dialect.pipe_engine(plan, config=conf, loss_fn=loss_fn, **kwargs)
    engine = dialect.runtime_engine(module, config=conf)
    data = stream(0, STEPS * GAS)
    losses = [float(engine.train_batch(iter(data[s * GAS : (s + 1) * GAS]))) for s in range(STEPS)]
    stages = list(dialect.local_stages(engine)) if dialect.name != "local" else [0, 1]
    params = {
        n: p.detach().clone()
        for k in stages
        for n, p in plan.stages[k].named_parameters(remove_duplicate=False)
    }
    return {"case": case, "losses": losses, "eval": 0.0, "params": params}


def solo_reference() -> dict[str, Any]:
    """:class:`RunningSolo` unsplit, trained by the plain loop."""
    model = RunningSolo()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    losses = train_unsplit(
        model, opt, steps_from([iter(stream(0, STEPS * GAS))], STEPS, GAS), loss_fn
    )
    return {"losses": losses.losses, "eval": 0.0, "params": dict(model.named_parameters())}


def written_tie_run(dialect: Any, case: dict[str, Any]) -> dict[str, Any]:
    """Train a model whose forward writes a tied parameter in place: what each rank raised."""
    if case["written"] == "renorm":
        model: nn.Module = RenormTied()
        split, data = ["body"], [(torch.randint(0, 5, (MICRO, 3)), torch.randint(0, 5, (MICRO, 3)))]
        loss = lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())  # noqa: E731
    else:
        model, split, data = RunningParam(), ["first"], stream(0, 1)
        loss = loss_fn
    before = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    plan = pipedialect.partition(model, split_points=split)
    conf = config()
    kwargs = _dialect_kwargs(dialect, case, plan.num_stages)
    try:  # refused while building, on every rank alike (the forward's check is a backstop)
        module = dialect.pipe_engine(plan, config=conf, loss_fn=loss, **kwargs)
        engine = dialect.runtime_engine(module, config=conf)
        engine.train_batch(iter(data * GAS))
        raised, phase = "", "trained"
    except pipedialect.PipeDialectError as exc:
        raised, phase = (
            f"{type(exc).__name__}: {exc}",
            "build" if "engine" not in locals() else "step",
        )
    return {"case": case, "raised": raised, "phase": phase, "before": before}


def check_written_tie(result: dict[str, Any]) -> None:
    """Refused by name, before the optimizer stepped."""
    raised = result["raised"]
    assert raised.startswith("TieError"), result
    name = "embed.weight" if result["case"]["written"] == "renorm" else "center"
    assert f"tied parameter {name!r}" in raised or "tied parameter" in raised, raised
    assert "register_buffer" in raised and "split points" in raised, raised
    assert result["phase"] == "build", result  # before anything ran


def _dialect_kwargs(dialect: Any, case: dict[str, Any], stages: int) -> dict[str, Any]:
    """torch's schedule; DeepSpeed's topology (the ranks left over become replicas)."""
    if dialect.name == "torch":
        return {"schedule": case["schedule"]}
    if dialect.name == "deepspeed":
        return {"topology": dialect.make_topology(stages, dist.get_world_size() // stages)}
    return {}


def loss_fn(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, labels)


def stream(replica: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` micro-batches of one data-parallel replica."""
    gen = torch.Generator().manual_seed(100 + replica)
    return [
        (torch.randn(MICRO, DIM, generator=gen), torch.randint(0, 3, (MICRO,), generator=gen))
        for _ in range(count)
    ]


def config() -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.2}},
    }


def plan_of(case: dict[str, Any]) -> Any:
    return pipedialect.partition(
        NoisyNet(), split_points=SPLITS[case["stages"]], recompute=case.get("recompute")
    )


def train(dialect: Any, case: dict[str, Any], replica: int = 0, dp: int = 1) -> dict[str, Any]:
    """Train ``case`` for :data:`STEPS` steps, then evaluate once; losses and parameters."""
    plan = plan_of(case)
    conf = config()
    conf["train_batch_size"] = MICRO * GAS * dp
    kwargs: dict[str, Any] = {"seed": SEED}
    if dialect.name == "torch":
        kwargs["schedule"] = case["schedule"]
    if dialect.name == "deepspeed":
        kwargs["topology"] = topology = dialect.make_topology(plan.num_stages, dp)
        replica = topology.get_coord(dist.get_rank()).data
        if case.get("interval"):
            kwargs["activation_checkpoint_interval"] = case["interval"]
    module = dialect.pipe_engine(plan, config=conf, loss_fn=loss_fn, **kwargs)
    engine = dialect.runtime_engine(module, config=conf)
    data = stream(replica, STEPS * GAS + GAS)
    losses = [float(engine.train_batch(iter(data[s * GAS : (s + 1) * GAS]))) for s in range(STEPS)]
    evaluated = float(engine.eval_batch(iter(data[STEPS * GAS :])))
    stages = (
        list(dialect.local_stages(engine))
        if dialect.name != "local"
        else list(range(plan.num_stages))
    )
    params = {
        n: p.detach().clone()
        for k in stages
        for n, p in plan.stages[k].named_parameters(remove_duplicate=False)
    }
    return {"case": case, "losses": losses, "eval": evaluated, "params": params}


def run_cases(dialect_name: str, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every case in turn on this rank (``case["dp"]`` data-parallel replicas on deepspeed)."""
    torch.set_num_threads(1)
    dialect = pipedialect.get_dialect(dialect_name)
    dialect.init_distributed()
    results = []
    for case in cases:
        if case.get("solo"):
            results.append(solo_run(dialect, case))
            dist.barrier()
            continue
        if case.get("written"):  # refused while building (or in a forward): last
            results.append(written_tie_run(dialect, case))
            break
        if case.get("trainability"):
            results.append(trainability_run(dialect, case))
            dist.barrier()
            continue
        dp = case.get("dp", 1)
        replica = dist.get_rank() // (dist.get_world_size() // dp)
        results.append(train(dialect, case, replica, dp))
        dist.barrier()
    return results


def trainability_run(dialect: Any, case: dict[str, Any]) -> dict[str, Any]:
    """``blocks.0`` frozen when the engine is built; then unfrozen, set back, the head frozen:
    what each ``train_batch`` raised (``""`` when it trained), on this rank."""
    model = NoisyNet()
    model.blocks[0].requires_grad_(False)
    plan = pipedialect.partition(model, split_points=SPLITS[case["stages"]])
    conf = config()
    kwargs = _dialect_kwargs(dialect, case, plan.num_stages)
    module = dialect.pipe_engine(plan, config=conf, loss_fn=loss_fn, **kwargs)
    engine = dialect.runtime_engine(module, config=conf)
    data = stream(0, 4 * GAS)
    outcomes = []

    def step(s: int) -> None:
        try:
            engine.train_batch(iter(data[s * GAS : (s + 1) * GAS]))
            outcomes.append("")
        except pipedialect.PipeDialectError as exc:
            outcomes.append(f"{type(exc).__name__}: {exc}")

    step(0)
    model.blocks[0].requires_grad_(True)  # unfrozen after build
    step(1)
    model.blocks[0].requires_grad_(False)  # set back: trains again
    step(1)
    model.head.requires_grad_(False)  # frozen after build
    step(2)
    return {"case": case, "outcomes": outcomes, "steps": engine.global_steps}


def check_trainability(result: dict[str, Any]) -> None:
    """Unfreezing and freezing after build are refused by name before the step, with the fix;
    the engine trains on once they are set back."""
    unfrozen, back, frozen = result["outcomes"][1:]
    assert result["outcomes"][0] == "" and back == "", result
    assert unfrozen.startswith("TrainabilityChangedError"), unfrozen
    assert "'blocks.0.lin." in unfrozen and "was unfrozen" in unfrozen, unfrozen
    assert "runtime_engine" in unfrozen and "requires_grad_(False)" in unfrozen, unfrozen
    assert frozen.startswith("TrainabilityChangedError"), frozen
    assert "'head." in frozen and "was frozen" in frozen, frozen
    assert result["steps"] == 2, result  # the refused steps took no step


def reference(case: dict[str, Any], seed: int = SEED) -> dict[str, Any]:
    """The unsplit model, plain torch, drawing from the case's streams (of ``seed``)."""
    dp = case.get("dp", 1)
    model = NoisyNet()
    streams = ReferenceStreams(model, SPLITS[case["stages"]], seed=seed)
    data = [iter(stream(r, STEPS * GAS + GAS)) for r in range(dp)]
    count = [0]

    def forward(model: nn.Module, inputs: Any) -> Any:
        j = count[0]
        count[0] += 1
        step, within = divmod(j, GAS * dp)
        micro_batch = within % GAS  # replicas draw alike ([Note: random streams])
        with streams.micro_batch("train", step + 1, micro_batch):
            return model(inputs)

    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    losses = train_unsplit(model, opt, steps_from(data, STEPS, GAS), loss_fn, forward=forward)
    model.eval()
    evals = []
    with torch.no_grad():
        for i, (x, y) in enumerate(stream(0, STEPS * GAS + GAS)[STEPS * GAS :]):
            with streams.micro_batch("eval", STEPS, i):
                evals.append(float(loss_fn(model(x), y)))
    return {
        "losses": losses.losses,
        "eval": sum(evals) / len(evals),
        "params": dict(model.named_parameters()),
    }


def compare(result: dict[str, Any], ref: dict[str, Any]) -> None:
    """The pipeline's losses (the mean over replicas), evaluation and parameters equal the
    reference's (fp32, 1e-6 relative)."""
    what = f"{result['case']}"
    torch.testing.assert_close(
        torch.tensor(result["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=ATOL, msg=what
    )
    if (
        result["case"].get("dp", 1) == 1 and "solo" not in result["case"]
    ):  # replica 0's data, the reference's evaluation
        torch.testing.assert_close(result["eval"], ref["eval"], rtol=RTOL, atol=ATOL, msg=what)
    assert result["params"], what
    for name, value in result["params"].items():
        assert_tensor_close(value, ref["params"][name].detach(), f"{what} {name}")
