"""Tensor parallelism inside pipeline stages on the torch dialect: PP2 x DP2 x TP2, eight ranks.

One launch (``_torch_tp_workers``) trains several cases one after the other on a pipeline of
two stages whose modules are sharded over a tensor axis of two ranks, with two replicas that
are whole (``data_parallel_mode="ddp"``: each replica is a PP2 x TP2 pipeline) or sharded
(``"fsdp"``: PP2 x FSDP2 x TP2). The test process trains the unsplit model with a plain PyTorch
loop on both replicas' micro-batches and compares every step's loss on every rank, the
evaluation loss, and the final parameters read back whole with
``pipedialect.checkpoint.consolidate``. The tied embedding and LM head sit on different stages;
clipping acts on every step; Adam runs in fp64 (its rounding noise would otherwise be scaled up
on parameters whose gradient is nearly zero). A meta-device build has every rank materialise
its shards only. The last case builds models whose attention is wrong on a shard (one of them
on the meta device), and the first step must refuse the wrong head count by name.

The other tests here need no process: the plan is checked before any rank builds anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _ds_workers
import _torch_tp_workers as workers
import pytest
import torch
from _compare import ATOL, RTOL, assert_tensor_close
from _reference import call_model, steps_from, train_unsplit

import pipedialect
import pipedialect.checkpoint as portable
from pipedialect import Capability, ConfigError, MissingCapabilityError, TieError
from pipedialect.models import MHGPT_TENSOR_PLAN, MultiHeadGPT
from pipedialect.plan.partition import partition
from pipedialect.runtime.launch import launch

TIMEOUT = 1200.0  # eight ranks on two shared cores
DP = workers.DP
PARAM_RTOL = 1e-5
BF16_BAND = 0.02

CASES: list[dict[str, Any]] = [
    {"name": "ddp_sgd", "mode": "ddp", "schedule": "1f1b", "opt": "sgd", "gas": 2, "clip": 0.05},
    {"name": "fsdp_sgd", "mode": "fsdp", "schedule": "1f1b", "opt": "sgd", "gas": 2},
    {
        "name": "fsdp_adam64",
        "mode": "fsdp",
        "schedule": "gpipe",
        "opt": "adam",
        "gas": 4,
        "clip": 0.05,
        "dtype": "float64",
        "meta": True,
        "recompute": ["blocks.*"],
    },
    {
        "name": "ddp_adam64",
        "mode": "ddp",
        "schedule": "1f1b",
        "opt": "adam",
        "gas": 2,
        "clip": 0.05,
        "dtype": "float64",
        "meta": True,
    },
    {
        "name": "fsdp_bf16",
        "mode": "fsdp",
        "schedule": "1f1b",
        "opt": "adam",
        "gas": 2,
        "bf16": True,
    },
    # The 3D layout's checkpoint (fp64 Adam: its sharded state moves too) on torch PP4 x DDP2.
    {
        "name": "pp4_from_3d",
        "from": "fsdp_adam64",
        "saved_steps": 3,
        "opt": "adam",
        "gas": 4,
        "clip": 0.05,
        "dtype": "float64",
        "steps": 2,
    },
    {"name": "traps", "mode": "ddp", "schedule": "1f1b", "opt": "sgd", "gas": 2, "traps": True},
]


def _case(case: dict[str, Any]) -> dict[str, Any]:
    return {"micro": 2, "steps": 3, **case}


def reference(case: dict[str, Any]) -> tuple[list[float], dict[str, torch.Tensor], float]:
    """The unsplit model trained on both replicas' micro-batches: losses, state, eval loss."""
    spec = _ds_workers.spec_for(workers.MODEL)
    dtype = "float32" if case.get("bf16") else case.get("dtype", "float32")
    with workers.default_dtype(dtype):
        model = spec.build(0)
        optimizer: torch.optim.Optimizer = (
            torch.optim.SGD(model.parameters(), lr=0.1)
            if case["opt"] == "sgd"
            else torch.optim.Adam(model.parameters(), lr=1e-2)
        )
        gas, micro, steps = case["gas"], case["micro"], case["steps"]
        streams = [_ds_workers.data_stream(spec, steps * gas, micro, d) for d in range(DP)]
        losses = train_unsplit(
            model,
            optimizer,
            steps_from(streams, steps, gas),
            spec.loss_fn,
            clip=case.get("clip", 0.0),
        ).losses
        evals = []
        with torch.no_grad():
            for d in range(DP):
                for inputs, labels in _ds_workers.data_stream(spec, gas, micro, DP + d):
                    evals.append(spec.loss_fn(call_model(model, inputs), labels).item())
        return losses, model.state_dict(), sum(evals) / len(evals)


def _check_trained(per_rank: list[dict[str, Any]], case: dict[str, Any], ckpt: Path) -> None:
    ref_losses, ref_state, ref_eval = reference(case)
    failures = []
    shards = workers.TP * (DP if case["mode"] == "fsdp" else 1)
    for r in per_rank:
        label = f"{case['name']} rank {r['rank']} (replica {r['replica']}, stage {r['stages']})"
        if case.get("bf16"):  # bf16 sums round otherwise: a band around the fp32 model
            gaps = [abs(x - y) / abs(y) for x, y in zip(r["losses"], ref_losses, strict=True)]
            if max(gaps) > BF16_BAND or r["dtypes"] != ["torch.bfloat16"]:
                failures.append(f"{label} bf16 {r['dtypes']} losses {r['losses']} vs {ref_losses}")
            continue
        if r["losses"] != pytest.approx(ref_losses, rel=RTOL, abs=ATOL):
            failures.append(f"{label} losses {r['losses']} != {ref_losses}")
        if r["eval_loss"] != pytest.approx(ref_eval, rel=RTOL, abs=ATOL):
            failures.append(f"{label} eval {r['eval_loss']} != {ref_eval}")
        # The sharded layers: a 1/TP part (1/(TP x DP) under FSDP) on every rank.
        if not (r["all_sharded"] and shards * r["held"] == r["whole"]):
            failures.append(f"{label} holds {r['held']} of {r['whole']} sharded elements")
    assert not failures, "\n".join(failures)
    if case.get("bf16"):
        return
    state = portable.consolidate(ckpt, case["name"])
    assert set(state) == set(ref_state)
    for name, value in ref_state.items():
        assert state[name].dtype == value.dtype, name
        assert_tensor_close(state[name], value, f"{case['name']} {name}", rtol=PARAM_RTOL)


def _check_resumed(per_rank: list[dict[str, Any]], case: dict[str, Any], ckpt: Path) -> None:
    """PP4 x DDP2 resumed from the 3D checkpoint: the unsplit model's later losses and
    parameters, as if never stopped."""
    whole = {**case, "steps": case["saved_steps"] + case["steps"]}
    ref_losses, ref_state, _ = reference(whole)
    later = ref_losses[case["saved_steps"] :]
    assert sorted((tuple(r["stages"]), r["replica"]) for r in per_rank) == sorted(
        ((k,), d) for k in range(4) for d in range(DP)
    )
    for r in per_rank:
        assert r["global_steps"] == whole["steps"], r
        assert r["losses"] == pytest.approx(later, rel=RTOL, abs=ATOL), (r["rank"], later)
    state = portable.consolidate(ckpt, case["name"])
    for name, value in ref_state.items():
        assert_tensor_close(state[name], value, f"{case['name']} {name}", rtol=PARAM_RTOL)


def _check_local_resume(cases: list[dict[str, Any]], ckpt: Path) -> None:
    """The local dialect (one process, both replicas' micro-batches per step) resumes the 3D
    layout's checkpoint."""
    saved = next(c for c in cases if c["name"] == "fsdp_adam64")
    extra = 2
    whole = {**saved, "steps": saved["steps"] + extra}
    ref_losses, ref_state, _ = reference(whole)
    spec = _ds_workers.spec_for(workers.MODEL)
    gas = saved["gas"]
    with workers.default_dtype("float64"):
        cfg = _ds_workers.ds_config("adam", gas=gas * DP, micro=saved["micro"], dp=1, clip=0.05)
        dialect = pipedialect.get_dialect("local")
        plan = partition(spec.build(9), spec.split_points_for(2))
        engine = dialect.runtime_engine(
            dialect.pipe_engine(plan, config=cfg, loss_fn=spec.loss_fn), config=cfg
        )
        portable.load(engine, ckpt, tag=saved["name"])
        streams = [
            list(_ds_workers.data_stream(spec, whole["steps"] * gas, saved["micro"], d))
            for d in range(DP)
        ]
        losses = []
        for step in range(saved["steps"], whole["steps"]):
            batch = [mb for s in streams for mb in s[step * gas : (step + 1) * gas]]
            losses.append(float(engine.train_batch(iter(batch))))
        portable.save(engine, ckpt / "local", tag="end")
    assert losses == pytest.approx(ref_losses[saved["steps"] :], rel=RTOL, abs=ATOL)
    state = portable.consolidate(ckpt / "local", "end")
    for name, value in ref_state.items():
        assert_tensor_close(state[name], value, f"local from 3D {name}", rtol=PARAM_RTOL)


@pytest.mark.distributed
def test_pp2_dp2_tp2_trains_like_the_unsplit_model_and_refuses_wrong_attention(
    tmp_path: Path,
) -> None:
    cases = [_case(c) for c in CASES]
    launched = launch(workers.run_cases, 8, cases, str(tmp_path), timeout=TIMEOUT)
    by_case = list(zip(*launched, strict=True))
    for case, per_rank in zip(cases, by_case, strict=True):
        if case.get("traps"):
            continue
        if case.get("from"):
            _check_resumed(list(per_rank), case, tmp_path)
            continue
        _check_trained(list(per_rank), case, tmp_path)
    _check_local_resume(cases, tmp_path)
    # DeepSpeed PP2 resumes the 3D layout's fp32 SGD checkpoint (its own two-rank launch).
    deepspeed = {
        "name": "deepspeed_from_3d",
        "from": "fsdp_sgd",
        "saved_steps": 3,
        "opt": "sgd",
        "gas": 2,
        "micro": 2,
        "steps": 2,
    }
    resumed = launch(workers.resume_on_deepspeed, 2, str(tmp_path), deepspeed, timeout=TIMEOUT)
    whole = {**deepspeed, "steps": 5}
    ref_losses, ref_state, _ = reference(whole)
    for r in resumed:
        assert r["losses"] == pytest.approx(ref_losses[3:], rel=RTOL, abs=ATOL), r
    state = portable.consolidate(tmp_path, "deepspeed_from_3d")
    for name, value in ref_state.items():
        assert_tensor_close(state[name], value, f"deepspeed from 3D {name}", rtol=PARAM_RTOL)
    # A whole parameter times the query shard would get a partial gradient: the queries' code
    # is then not the shards' own, so q, k and v are gathered whole and it trains right (the
    # unsplit trap model's first loss); the global head count is refused by the first step.
    traps = next(c for c in cases if c.get("traps"))
    spec = _ds_workers.spec_for(workers.MODEL)
    gain = workers.trap_model("gain")
    with torch.no_grad():
        first = [
            spec.loss_fn(call_model(gain, inputs), labels).item()
            for d in range(DP)
            for inputs, labels in _ds_workers.data_stream(spec, traps["gas"], traps["micro"], d)
        ]
    expected = sum(first) / len(first)
    for r in by_case[-1]:
        for built in ("heads", "heads-meta"):  # a meta-device build is checked too
            assert r[built].startswith("PlanMismatchError: [Stage "), (built, r[built])
            assert "under tensor_parallel" in r[built], (built, r[built])
        assert r["gain"].startswith("loss "), r["gain"]
        assert float(r["gain"][5:]) == pytest.approx(expected, rel=RTOL, abs=ATOL), r["gain"]


# -- before any rank builds ---------------------------------------------------------------------


def _pipe_engine(plan: Any, tensor_parallel: Any, tensor: int = 2) -> Any:
    dialect = pipedialect.get_dialect("torch")
    spec = _ds_workers.spec_for(workers.MODEL)
    topology = dialect.make_topology(plan.num_stages, data_parallel=1, tensor_parallel=tensor)
    return dialect.pipe_engine(
        plan,
        config=_ds_workers.ds_config("sgd", gas=2, micro=2, dp=1),
        loss_fn=spec.loss_fn,
        topology=topology,
        tensor_parallel=tensor_parallel,
    )


def _plan() -> Any:
    return partition(MultiHeadGPT(seed=0), ["blocks.1"])


def test_the_torch_dialect_declares_tensor_parallel_and_the_others_refuse_it() -> None:
    assert Capability.TENSOR_PARALLEL in pipedialect.get_dialect("torch").capabilities
    topology = pipedialect.get_dialect("torch").make_topology(2, 2, tensor_parallel=2)
    assert topology.world_size() == 8
    assert topology.get_coord(5) == (1, 0, 1)
    for name in ("local", "deepspeed"):
        dialect = pipedialect.get_dialect(name)
        assert Capability.TENSOR_PARALLEL not in dialect.capabilities
        with pytest.raises(MissingCapabilityError, match="tensor-parallel"):
            dialect.make_topology(2, tensor_parallel=2)
    with pytest.raises(MissingCapabilityError, match=r"local dialect does not declare tensor"):
        pipedialect.get_dialect("local").pipe_engine(
            _plan(),
            config=_ds_workers.ds_config("sgd", gas=2, micro=2, dp=1),
            loss_fn=_ds_workers.spec_for(workers.MODEL).loss_fn,
            tensor_parallel=MHGPT_TENSOR_PLAN,
        )


@pytest.mark.parametrize(
    ("plan", "error", "match"),
    [
        ({"blocks.*.attn.qq": "colwise"}, ConfigError, r"glob 'blocks\.\*\.attn\.qq' matches no"),
        ({"blocks.*.ln1": "colwise"}, ConfigError, r"'blocks\.0\.ln1' as 'colwise'.*LayerNorm"),
        ({"blocks.*.fc1": "diagonal"}, ConfigError, "'colwise' or 'rowwise'"),
        ({"blocks.*.fc*": "colwise", "blocks.*.fc2": "rowwise"}, ConfigError, "disjoint"),
        ({"wte": "colwise", "lm_head": "colwise"}, TieError, r"tied weight 'wte\.weight'"),
        ({"lm_head": "colwise"}, TieError, "sharded differently"),
        ("auto", ConfigError, "base_model_tp_plan"),
        (["fc1"], ConfigError, "must be a mapping"),
    ],
)
def test_a_tensor_plan_that_cannot_be_sharded_is_refused_by_name_before_any_rank_builds(
    plan: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        _pipe_engine(_plan(), plan)


def test_shapes_that_do_not_divide_by_the_tensor_axis_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"'blocks\.0\.attn\.q' \(Linear\) has out_features=16"):
        _pipe_engine(_plan(), {"blocks.*.attn.q": "colwise"}, tensor=3)


def test_a_tensor_axis_needs_a_plan_and_a_plan_needs_a_tensor_axis() -> None:
    with pytest.raises(ConfigError, match="no tensor_parallel plan"):
        _pipe_engine(_plan(), None)
    with pytest.raises(ConfigError, match="tensor axis, which has 1 rank"):
        _pipe_engine(_plan(), MHGPT_TENSOR_PLAN, tensor=1)


def test_a_weight_shared_inside_one_stage_is_not_sharded() -> None:
    one = partition(MultiHeadGPT(seed=0, num_blocks=2), [])
    with pytest.raises(TieError, match="in the same stage, sharded otherwise"):
        _pipe_engine(one, {"lm_head": "colwise"})


def test_auto_reads_a_hugging_face_plan_and_shards_the_exported_graph() -> None:
    """``tensor_parallel="auto"`` takes a tiny Llama's ``base_model_tp_plan`` (under the base
    model's prefix); a Llama is captured with torch.export, whose graphs call no module, so
    the plan is matched against the parameters the graphs read and sharded there."""
    import _hf_workers

    from pipedialect.dialects.torch._tensor import auto_plan, resolve_layout

    family = _hf_workers.FAMILIES["llama"]
    model = family.build(0)
    assert auto_plan(model)["model.layers.*.self_attn.q_proj"] == "colwise"
    assert auto_plan(model)["model.layers.*.mlp.down_proj"] == "rowwise"
    plan = partition(
        model,
        [family.split_point],
        example_inputs=family.example_inputs(),
        concrete_args=family.fixed,
    )
    layout = resolve_layout("auto", plan.stages, plan.model, 2, plan.tie_groups)
    assert layout is not None and layout.graph_stages == {0, 1}
    assert layout.styles[1]["model.layers.1.self_attn.o_proj"] == "rowwise"
    assert layout.sharded_dim(0, "model.layers.0.mlp.up_proj.weight") == 0
    assert layout.sharded_dim(0, "model.layers.0.mlp.down_proj.weight") == 1
    with pytest.raises(ConfigError, match=r"num_embeddings=64.*tensor axis of 3"):
        resolve_layout({"model.embed_tokens": "rowwise"}, plan.stages, plan.model, 3)


@pytest.mark.distributed
def test_a_hugging_face_llama_with_auto_trains_like_the_unsplit_model(tmp_path: Path) -> None:
    """PP2 x TP2 on the exported Llama (grouped-query attention whose captured reshapes name
    the global head counts, padding masks, a cross-stage tie): every step's loss on every rank,
    the consolidated parameters and what ``export_hf`` writes from the checkpoint equal the
    unsplit transformers model's, trained by a plain loop. Then in bf16, with the tied
    embedding and LM head sharded by vocabulary too: the losses within the bf16 band."""
    import _hf_workers

    per_rank = launch(workers.run_llama, 4, str(tmp_path), timeout=TIMEOUT)
    family = _hf_workers.FAMILIES["llama"]
    gas, micro, steps = (workers.LLAMA[k] for k in ("gas", "micro", "steps"))
    model = family.build(0)
    optimizer = _hf_workers.OPTIMIZERS["sgd"][1](model.parameters())
    batches = list(family.micro_batches(steps * gas, batch_size=micro))
    ref = train_unsplit(
        model,
        optimizer,
        [batches[i * gas : (i + 1) * gas] for i in range(steps)],
        _hf_workers.token_loss,
        forward=family.forward,
    )
    assert sorted(r["stages"][0] for r in per_rank) == [0, 0, 1, 1]
    for r in per_rank:
        assert r["losses"] == pytest.approx(ref.losses, rel=RTOL, abs=ATOL), r
        assert r["all_sharded"] and workers.TP * r["held"] == r["whole"], r
        # bf16 (fp32 masters) with the embedding and LM head sharded too: within the bf16
        # band of the fp32 model, every parameter bf16, the vocabulary halves on each rank.
        gaps = [abs(x - y) / abs(y) for x, y in zip(r["bf16_losses"], ref.losses, strict=True)]
        assert max(gaps) <= BF16_BAND, (r["bf16_losses"], ref.losses)
        assert r["bf16_dtypes"] == ["torch.bfloat16"], r["bf16_dtypes"]
        held = r["bf16"]
        vocab = "model.embed_tokens.weight" if r["stages"] == [0] else "lm_head.weight"
        assert vocab in held["names"], held["names"]
        assert held["all_sharded"] and workers.TP * held["held"] == held["whole"], held
    state = portable.consolidate(tmp_path, "llama")
    for name, value in model.state_dict().items():
        if name in state:
            assert_tensor_close(state[name], value, f"llama {name}", rtol=PARAM_RTOL)
    assert {n for n, _ in model.named_parameters()} <= set(state)
    # export_hf turns the tensor-parallel checkpoint into a directory plain transformers loads.
    out = portable.export_hf(
        tmp_path, tmp_path / "hf", config=model.config, model_cls=type(model), tag="llama"
    )
    reloaded = type(model).from_pretrained(out).state_dict()
    for name, value in model.state_dict().items():
        assert_tensor_close(reloaded[name], value, f"llama export_hf {name}", rtol=PARAM_RTOL)
