"""What each rank runs in the distributed fuzz tests (module-level, so spawned ranks import it).

Every rank joins one process group, then trains several generated models one after the other
(a launch costs seconds on two shared cores; a model a fraction of one). For each seed it draws
the spec, builds the whole model (identical weights on every rank: per-module seeded init; or
on the meta device, each rank then filling the stages it runs from the state of a normally built
model), partitions it (split points, recomputed blocks) and runs the spec's train/eval
schedule on the dialect; it returns the losses, and the parameters and buffers of the stages it
ran, by their original names, and what ``partition()`` changed on the model (it must change
nothing). With ``fsdp`` the torch dialect runs each model on two stages sharded over two
replicas (four ranks, ``data_parallel_mode="fsdp"``) that read the same micro-batches: the
replicas' mean gradient is then the unsplit model's on those micro-batches, and every buffer
sees what the unsplit model's sees, so the reference is unchanged while the sharding, the
units, the reduction and the loss scale are all exercised (parameters are reported whole).
With ``tp`` each model runs on two stages whose stem and blocks' linear layers are sharded over
a tensor axis of two ranks (:func:`tensor_plan`; four ranks), both ranks of the axis reading
the same micro-batches: the reference is the unsplit model's again.
:func:`compare` runs the unsplit reference in the test process and compares. A named
pipedialect error while building or in the first call is returned as a refusal (every rank must
refuse alike); one in a later call, or any other exception, fails the launch.
"""

from __future__ import annotations

from typing import Any

import _fuzz_models as fm
import torch
import torch.distributed as dist

import pipedialect
from pipedialect.runtime.sharded import gathered


def tensor_plan(spec: fm.FuzzSpec) -> dict[str, str]:
    """The tensor-parallel plan the fuzzer gives ``spec`` over two ranks: the stem colwise (its
    output gathered whole), and every block's ``lin`` colwise or rowwise (by the seed's parity:
    a rowwise module fed a whole tensor cuts its own slice of it)."""
    if spec.dim % 2:
        return {}
    plan = {"stem": "colwise"}
    if any(st.params != "none" for st in spec.state) or not spec.state:
        plan["blocks.*.lin"] = "rowwise" if spec.seed % 2 else "colwise"
    return plan


def _one(dialect: Any, spec: fm.FuzzSpec, fsdp: bool = False, tp: bool = False) -> dict[str, Any]:
    model = fm.build_model(spec)  # on the meta device when spec.meta: each rank fills its own
    batches = fm.micro_batches(spec)
    initial = fm.buffer_values(fm.FuzzModel(spec))
    try:
        plan = fm.partition_spec(model, spec, batches)
    except pipedialect.PipeDialectError as exc:  # every rank refuses alike, before any collective
        return {"refused": f"{type(exc).__name__}: {exc}", "phase": "partition"}
    changed = fm.side_effects(spec, model, initial)  # what partition() left on the model
    config = fm.ds_config(spec)
    phase = "build"
    losses = []
    try:
        if tp:
            module = dialect.pipe_engine(
                plan,
                config=config,
                loss_fn=fm.fuzz_loss,
                schedule=spec.pipe_schedule,
                topology=dialect.make_topology(plan.num_stages, 1, tensor_parallel=2),
                tensor_parallel=tensor_plan(spec),
                init_weights=fm.init_weights(spec, plan),
            )
        elif fsdp:
            config["train_batch_size"] *= 2  # two replicas, each reading the same batches
            module = dialect.pipe_engine(
                plan,
                config=config,
                loss_fn=fm.fuzz_loss,
                schedule=spec.pipe_schedule,
                topology=dialect.make_topology(plan.num_stages, 2),
                data_parallel_mode="fsdp",
                init_weights=fm.init_weights(spec, plan),
            )
        elif dialect.name == "deepspeed":
            module = dialect.pipe_engine(
                plan,
                config=config,
                loss_fn=fm.fuzz_loss,
                topology=dialect.make_topology(plan.num_stages, 1),
                dynamic_shapes=spec.dynamic,
                init_weights=fm.init_weights(spec, plan),
            )
        else:
            module = dialect.pipe_engine(
                plan,
                config=config,
                loss_fn=fm.fuzz_loss,
                schedule=spec.pipe_schedule,
                init_weights=fm.init_weights(spec, plan),
            )
        engine = dialect.runtime_engine(module, config=config)
        for k, (op, chunk) in enumerate(zip(spec.schedule, fm.chunks(spec, batches), strict=True)):
            phase = f"call {k} ({op})"
            fm.set_between_calls(model, k)
            call = engine.train_batch if op == "train" else engine.eval_batch
            retrained = fm.refuses_retrain(spec, k, model, call, chunk)
            if retrained:
                raise fm.failure(spec, retrained)
            losses.append(float(call(iter(chunk))))
    except pipedialect.PipeDialectError as exc:
        if phase.startswith("call") and not phase.startswith("call 0"):
            raise
        return {"refused": f"{type(exc).__name__}: {exc}", "phase": phase, "changed": changed}
    stages = list(dialect.local_stages(engine))
    params = {
        n: gathered(p).detach().cpu().clone()  # a shard gathered whole (every rank, alike)
        for k in stages
        for n, p in plan.stages[k].named_parameters(remove_duplicate=False)
    }
    buffers = {
        f"{n} (stage {k})": b.detach().cpu().clone()
        for k in stages
        for n, b in plan.stages[k].named_buffers(remove_duplicate=False)
    }
    return {
        "rank": dist.get_rank(),
        "split_points": list(plan.split_points),
        "stages": stages,
        "losses": losses,
        "params": params,
        "buffers": buffers,
        "changed": changed,
    }


def run_specs(
    dialect_name: str, cases: list[int | fm.FuzzSpec], fsdp: bool = False, tp: bool = False
) -> list[dict[str, Any]]:
    """Train every case (a seed, or a spec to replay) in turn on this rank; one result each
    (``fsdp``: sharded over two replicas; ``tp``: sharded over a tensor axis of two ranks; see
    the module note)."""
    torch.set_num_threads(1)
    dialect = pipedialect.get_dialect(dialect_name)
    dialect.init_distributed()
    results = []
    for case in cases:
        spec = case if isinstance(case, fm.FuzzSpec) else fm.spec_from_seed(case, dialect_name)  # type: ignore[arg-type]
        try:
            results.append(_one(dialect, spec, fsdp, tp))
        except Exception as exc:  # the launch fails with this rank's traceback: name the model
            exc.add_note(f"while training on {dialect_name}:\n{spec.describe()}")
            raise
        dist.barrier()
    return results


def compare(spec: fm.FuzzSpec, per_rank: list[dict[str, Any]]) -> bool:
    """Check one model's per-rank results against the unsplit model; False if it was refused.

    Raises:
        FuzzFailure: a loss or parameter differs, or a trained parameter is held by no stage.
    """
    refused = [r.get("refused") for r in per_rank]
    changed = sorted({c for r in per_rank for c in r.get("changed", [])})
    if any(refused):
        if len(set(refused)) != 1:
            raise fm.failure(spec, f"the ranks disagree about refusing the model: {refused}")
        if changed:  # refused after partition() had changed the model
            raise fm.failure(spec, f"{per_rank[0]['phase']} refused, after " + "; ".join(changed))
        return False
    model = fm.FuzzModel(spec)
    initial = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    initial_buffers = fm.buffer_values(model)
    # The ranks compute with one thread (run_specs): so does the reference, since a bf16
    # autocast matmul on the CPU rounds by how the threads split it.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        split_points = per_rank[0]["split_points"]
        expected = fm.reference_run(spec, model, fm.micro_batches(spec), split_points)
    finally:
        torch.set_num_threads(threads)
    ref_params = dict(model.named_parameters(remove_duplicate=False))
    ref_buffers = fm.buffer_values(model)
    problems: list[str] = list(changed)
    held: set[str] = set()
    held_buffers: set[str] = set()
    for r in per_rank:
        where = f"rank {r['rank']} stages {r['stages']}: "
        problems += fm.compare_results(
            spec,
            r["losses"],
            expected,
            r["params"],
            ref_params,
            where,
            buffers=r["buffers"],
            ref_buffers=ref_buffers,
            rtol=fm.tolerance(spec, len(per_rank)),
        )
        held.update(r["params"])
        held_buffers.update(key.split(" (stage")[0] for key in r["buffers"])
    moved = {n for n, p in ref_params.items() if not torch.equal(p.detach(), initial[n])}
    if moved - held:
        problems.append(f"trained parameters held by no stage: {sorted(moved - held)}")
    problems += fm.unheld_buffers(held_buffers, initial_buffers, ref_buffers)
    if problems:
        raise fm.failure(
            spec, "the pipeline disagrees with the unsplit model:\n" + "\n".join(problems)
        )
    return True
