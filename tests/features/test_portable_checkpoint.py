"""Portable checkpoints: ``pipedialect.checkpoint`` across dialects and layouts.

The reference is always the unsplit model trained by a plain PyTorch loop (``torch.optim.Adam``,
``clip_grad_norm_``) on the same samples per step, never the code's own output. One launch
trains ``skiptied`` on DeepSpeed PP=4 (a tie between stages 0 and 3) and saves; a second one
resumes it on DeepSpeed PP=2 x DP=2, on torch PP=2 x DP=2 and on torch PP=2 x FSDP=2 (one
process group of 4 ranks), and the FSDP run's own checkpoint (saved from shards) on DeepSpeed
PP=2 x DP=2 and torch PP=4; the test process resumes both on local. Every later loss must
equal an uninterrupted local run's, and the reference's, to 1e-6 relative: the layouts sum
gradients in other orders (data-parallel all-reduce, the clipping norm over ranks), so bitwise
equality holds only where the arithmetic is the same, which the local-to-local resumes check
exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _hf_workers as hf
import _model_registry
import _portable_ckpt_workers as workers
import pytest
import torch
from _compare import ATOL, RTOL, assert_tensor_close
from torch import nn

import pipedialect
import pipedialect.checkpoint as ckpt
from pipedialect import CheckpointError
from pipedialect.plan.partition import partition
from pipedialect.runtime.launch import launch

LAUNCH_TIMEOUT = 900.0


def reference(steps: int) -> tuple[list[float], nn.Module]:
    """The unsplit model trained ``steps`` steps by hand: per-step losses and the model."""
    spec = _model_registry.spec_for(workers.MODEL)
    model = spec.build(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=workers.LR)
    data = workers.stream()
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        total = 0.0
        for inputs, labels in data[step * 4 : step * 4 + 4]:
            loss = spec.loss_fn(model(inputs), labels)
            (loss / 4).backward()
            total += loss.item() / 4
        torch.nn.utils.clip_grad_norm_(model.parameters(), workers.CLIP)
        optimizer.step()
        losses.append(total)
    return losses, model


def _assert_params(got: dict[str, torch.Tensor], model: nn.Module, what: str) -> None:
    expected = dict(model.named_parameters(remove_duplicate=False))
    for name, value in got.items():
        assert_tensor_close(value, expected[name].detach(), f"{what}: {name}")


@pytest.fixture(scope="module")
def pp4_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """A portable checkpoint saved by DeepSpeed PP=4 after 3 steps, and what each rank saw."""
    root = tmp_path_factory.mktemp("pp4")
    results = launch(workers.save_on_deepspeed_pp4, 4, str(root / "ckpt"), timeout=LAUNCH_TIMEOUT)
    return root / "ckpt", results


@pytest.mark.distributed
def test_deepspeed_pp4_checkpoint_resumes_on_deepspeed_pp2_dp2_torch_fsdp_and_local(
    pp4_checkpoint: tuple[Path, list[dict[str, Any]]],
) -> None:
    ckpt_dir, saved = pp4_checkpoint
    ref_losses, _ = reference(workers.STEPS)
    _, at_save = reference(workers.SAVED_AT)
    _, at_end = reference(workers.STEPS)
    for r in saved:
        assert r["losses"] == pytest.approx(ref_losses[:3], rel=RTOL, abs=ATOL)
        _assert_params(r["params"], at_save, f"deepspeed PP=4 rank {r['rank']}")
    assert (ckpt_dir / "latest").read_text() == "global_step3"

    # The uninterrupted local run, and the local resume (other initial weights, PP=1).
    _, straight_engine, _ = workers.build("local", 4, 1)
    straight = workers.train(straight_engine, workers.Position(0, 1), workers.STEPS)
    assert straight == pytest.approx(ref_losses, rel=RTOL, abs=ATOL)
    later = straight[workers.SAVED_AT :]
    plan, engine, _ = workers.build("local", 1, 1, seed=9)
    loader = workers.Position(0, 1)
    ckpt.load(engine, ckpt_dir, dataloader=loader)
    assert (engine.global_steps, loader.step) == (3, 3)
    _assert_params(workers.params(plan, engine, "local"), at_save, "local after load")
    local_losses = workers.train(engine, loader, workers.STEPS - workers.SAVED_AT)
    assert local_losses == pytest.approx(later, rel=RTOL, abs=ATOL)
    _assert_params(workers.params(plan, engine, "local"), at_end, "local resumed")

    fsdp_dir = ckpt_dir.parent / "fsdp"
    resumed = launch(
        workers.resume_on_four_ranks, 4, str(ckpt_dir), str(fsdp_dir), timeout=LAUNCH_TIMEOUT
    )
    _, at_fsdp_save = reference(workers.SAVED_AT + 1)
    runs = {
        "deepspeed": ("PP=2 x DP=2", workers.SAVED_AT, at_save),
        "torch": ("PP=2 x DP=2", workers.SAVED_AT, at_save),
        "fsdp": ("PP=2 x FSDP=2", workers.SAVED_AT, at_save),
        "deepspeed from fsdp": ("PP=2 x DP=2", workers.SAVED_AT + 1, at_fsdp_save),
        "torch pp4 from fsdp": ("PP=4", workers.SAVED_AT + 1, at_fsdp_save),
    }
    for dialect, (layout, start, at_start) in runs.items():
        seen = set()
        names: set[str] = set()
        for r in resumed:
            run = r[dialect]
            what = f"{dialect} {layout} rank {r['rank']}"
            loaded = run["loaded"]
            assert loaded["global_steps"] == start, what
            assert loaded["loader_step"] == start, what
            _assert_params(loaded["params"], at_start, f"{what} after load")
            assert run["losses"] == pytest.approx(ref_losses[start:], rel=RTOL, abs=ATOL), what
            assert run["global_steps"] == workers.STEPS, what
            _assert_params(run["params"], at_end, what)
            seen.add((tuple(run["stages"]), run["replica"]))
            names |= set(run["params"])
        if dialect == "torch pp4 from fsdp":
            assert seen == {((k,), 0) for k in range(4)}, dialect
        else:
            assert seen == {((0,), 0), ((0,), 1), ((1,), 0), ((1,), 1)}, dialect
        assert names == set(dict(at_end.named_parameters(remove_duplicate=False)))
    # The checkpoint PP=2 x FSDP=2 saved, read whole, and resumed on local.
    state = ckpt.consolidate(fsdp_dir)
    for name, value in at_fsdp_save.state_dict().items():
        assert_tensor_close(state[name], value, f"fsdp checkpoint {name}")
    plan, engine, _ = workers.build("local", 2, 1, seed=9)
    loader = workers.Position(0, 1)
    ckpt.load(engine, fsdp_dir, dataloader=loader)
    assert (engine.global_steps, loader.step) == (workers.SAVED_AT + 1,) * 2
    local_losses = workers.train(engine, loader, workers.STEPS - workers.SAVED_AT - 1)
    assert local_losses == pytest.approx(ref_losses[workers.SAVED_AT + 1 :], rel=RTOL, abs=ATOL)
    _assert_params(workers.params(plan, engine, "local"), at_end, "local from fsdp")
    assert ckpt.read_index(fsdp_dir)["layout"]["dialect"] == "torch"
    # DeepSpeed counts micro-batches and samples too: derived for its own accumulation (2).
    ds = resumed[0]["deepspeed"]["loaded"]
    assert (ds["micro_steps"], ds["global_samples"]) == (3 * 2, 3 * 8)


@pytest.mark.distributed
def test_consolidate_after_a_pipeline_run_equals_the_unsplit_model(
    pp4_checkpoint: tuple[Path, list[dict[str, Any]]],
) -> None:
    ckpt_dir, _ = pp4_checkpoint
    _, trained = reference(workers.SAVED_AT)
    state = ckpt.consolidate(ckpt_dir)
    expected = trained.state_dict()
    assert state.keys() == expected.keys()
    for name, value in expected.items():
        assert_tensor_close(state[name], value, name)
    # The tied weight is stored once, and its two names are one tensor again.
    index = ckpt.read_index(ckpt_dir)
    assert index["aliases"]["out.weight"] == "embed.weight"
    assert "out.weight" not in index["params"]
    assert state["out.weight"] is state["embed.weight"]
    fresh = _model_registry.spec_for(workers.MODEL).build(5)
    fresh.load_state_dict(state, strict=True)
    assert fresh.out.weight is fresh.embed.weight
    assert index["layout"] == {"dialect": "deepspeed", "world_size": 4, "num_stages": 4}
    # Adam's moments and step, keyed by parameter name.
    assert set(index["optimizer"]["state"]["embed.weight"]) == {"exp_avg", "exp_avg_sq", "step"}
    assert index["optimizer"]["groups"][0]["lr"] == workers.LR


# -- one process (local dialect, no process group) ------------------------------------------


@pytest.mark.distributed
def test_a_save_killed_midway_leaves_the_previous_checkpoint_and_latest(tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    # A new tag "b", killed with its files written: "a" and latest are untouched.
    with pytest.raises(pipedialect.LaunchError, match="SIGKILL"):
        launch(workers.killed_in_save, 1, str(ckpt_dir), "b", "0:written", timeout=LAUNCH_TIMEOUT)
    assert (ckpt_dir / "latest").read_text() == "a"
    assert not (ckpt_dir / "b").exists()
    # The tag "a" reused, killed with the old one renamed aside: it loads from a.old.
    with pytest.raises(pipedialect.LaunchError, match="SIGKILL"):
        launch(workers.killed_in_save, 1, str(ckpt_dir), "a", "0:aside", timeout=LAUNCH_TIMEOUT)
    assert not (ckpt_dir / "a").exists() and (ckpt_dir / "a.old").is_dir()
    _, at_one = reference(1)
    plan, engine, _ = workers.build("local", 2, 1, seed=9)
    assert ckpt.load(engine, ckpt_dir).name == "a.old"
    assert engine.global_steps == 1
    _assert_params(workers.params(plan, engine, "local"), at_one, "loaded from a.old")


def _local(model: nn.Module, split: list[str], *, loss: str = "skip", **extra: Any) -> Any:
    """A local engine over ``model`` split at ``split``; ``loss``: whose model's loss."""
    config = {**workers.config(1), **extra}
    dialect = pipedialect.get_dialect("local")
    loss_fn = _model_registry.spec_for(loss).loss_fn
    module = dialect.pipe_engine(partition(model, split), config=config, loss_fn=loss_fn)
    return dialect.runtime_engine(module, config=config)


class _Dropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.5)
        self.b = nn.Linear(16, 4)
        self.register_buffer("scale", torch.full((4,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.relu(self.a(x)))) * self.scale


def _dropout_batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(50 + step)
    return [(torch.randn(2, 8, generator=g), torch.randn(2, 4, generator=g)) for _ in range(4)]


def test_dropout_model_resumes_with_identical_later_losses(tmp_path: Path) -> None:
    """The stages' dropout streams follow the restored step counter and the split points
    ([Note: random streams]): a fresh engine of the same plan continues the same masks."""
    engine = _local(_Dropout(), ["drop"])
    for step in range(2):
        engine.train_batch(iter(_dropout_batches(step)))
    ckpt.save(engine, tmp_path)
    straight = [float(engine.train_batch(iter(_dropout_batches(s)))) for s in range(2, 5)]
    resumed_engine = _local(_Dropout(), ["drop"])
    with torch.no_grad():
        resumed_engine.module.stages[0].mod.a.weight.add_(1.0)  # the checkpoint must win
    torch.manual_seed(1234)  # and its random number generators
    ckpt.load(resumed_engine, tmp_path)
    resumed = [float(resumed_engine.train_batch(iter(_dropout_batches(s)))) for s in range(2, 5)]
    assert resumed == straight
    # The buffer is saved and consolidated with the parameters.
    assert ckpt.consolidate(tmp_path).keys() == _Dropout().state_dict().keys()


def test_flipped_bytes_in_a_saved_shard_are_a_checkpoint_error(tmp_path: Path) -> None:
    engine = _local(_model_registry.spec_for("skip").build(0), ["blocks.1"])
    engine.train_batch(iter(_model_registry.spec_for("skip").micro_batches(4, batch_size=2)))
    path = ckpt.save(engine, tmp_path, tag="t")
    shard = path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    shard.write_bytes(bytes(data))
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    with pytest.raises(CheckpointError, match=rf"checkpoint file {shard} is corrupted"):
        ckpt.load(engine, tmp_path)
    with pytest.raises(CheckpointError, match=rf"checkpoint file {shard} is corrupted"):
        ckpt.consolidate(tmp_path)
    after = dict(engine.module.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)  # nothing was loaded
    shard.write_bytes(bytes(data[:100]))
    with pytest.raises(CheckpointError, match=r"has 100 bytes.*truncated"):
        ckpt.load(engine, path)


def test_a_different_model_is_a_checkpoint_error_naming_the_parameters(tmp_path: Path) -> None:
    spec = _model_registry.spec_for("skip")
    engine = _local(spec.factory(seed=0, dim=16), ["blocks.1"])
    ckpt.save(engine, tmp_path, tag="small")
    wider = _local(spec.factory(seed=0, dim=24), ["blocks.1"])
    with pytest.raises(CheckpointError, match=r"mismatched: stem\.weight \(shape \(16, ") as info:
        ckpt.load(wider, tmp_path)
    assert info.value.parameter == "stem.weight"
    other = _local(_Dropout(), ["drop"])
    with pytest.raises(CheckpointError, match=r"missing: a\.weight.*unexpected: blocks\.0"):
        ckpt.load(other, tmp_path)


def test_a_checkpoint_that_is_not_portable_or_not_there_is_named(tmp_path: Path) -> None:
    spec = _model_registry.spec_for("skip")
    engine = _local(spec.factory(seed=0, dim=16), ["blocks.1"])
    engine.save_checkpoint(tmp_path / "own", tag="x")  # the dialect's own format
    with pytest.raises(CheckpointError, match=r"has no pipedialect_index\.pt: it is not a"):
        ckpt.load(engine, tmp_path / "own")
    with pytest.raises(CheckpointError, match=r"no latest file and is not a checkpoint"):
        ckpt.load(engine, tmp_path / "nothing")
    with pytest.raises(CheckpointError, match=r"no checkpoint tag 'gone'"):
        ckpt.load(engine, tmp_path / "own", tag="gone")
    with pytest.raises(CheckpointError, match=r"holds no data-loader state"):
        ckpt.save(engine, tmp_path / "p")
        ckpt.load(engine, tmp_path / "p", dataloader=workers.Position(0, 1))


def test_local_resume_on_another_plan_is_exact_with_scheduler_and_groups(tmp_path: Path) -> None:
    spec = _model_registry.spec_for(workers.MODEL)
    schedule = {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 0.02}}
    data = workers.stream()
    split = ["blocks.0", "blocks.1", "blocks.2"]
    engine = _local(spec.build(0), split, loss=workers.MODEL, scheduler=schedule)
    for step in range(3):
        engine.train_batch(iter(data[4 * step : 4 * step + 4]))
    ckpt.save(engine, tmp_path / "c")
    straight = [float(engine.train_batch(iter(data[4 * s : 4 * s + 4]))) for s in range(3, 6)]
    resumed = _local(spec.build(3), ["blocks.1"], loss=workers.MODEL, scheduler=schedule)
    ckpt.load(resumed, tmp_path / "c" / "global_step3")  # one checkpoint's directory
    saved_lr = ckpt.read_index(tmp_path / "c")["optimizer"]["groups"][0]["lr"]
    assert resumed.get_lr() == [saved_lr]
    again = [float(resumed.train_batch(iter(data[4 * s : 4 * s + 4]))) for s in range(3, 6)]
    assert again == straight
    assert resumed.get_lr() == engine.get_lr()


# -- Hugging Face -----------------------------------------------------------------------------


def test_hf_gpt2_trained_through_a_pipeline_exports_and_reloads_with_the_same_logits(
    tmp_path: Path,
) -> None:
    import copy

    import transformers

    case = hf.CASES["gpt2"]
    model = case.build(0)
    unsplit = copy.deepcopy(model)
    plan = case.partition(model, 2)
    config = {**workers.config(1), "gradient_accumulation_steps": 2, "train_batch_size": 4}
    dialect = pipedialect.get_dialect("local")
    engine = dialect.runtime_engine(
        dialect.pipe_engine(plan, config=config, loss_fn=case.loss_fn), config=config
    )
    optimizer = torch.optim.Adam(unsplit.parameters(), lr=workers.LR)
    batches = list(case.micro_batches(4, batch_size=2))
    for step in range(2):
        engine.train_batch(iter(batches[2 * step : 2 * step + 2]))
        optimizer.zero_grad()
        for inputs, labels in batches[2 * step : 2 * step + 2]:
            (case.loss_fn(case.forward(unsplit, inputs), labels) / 2).backward()
        torch.nn.utils.clip_grad_norm_(unsplit.parameters(), workers.CLIP)
        optimizer.step()
    ckpt.save(engine, tmp_path / "ckpt")
    with pytest.raises(pipedialect.ConfigError, match=r"architectures list is empty"):
        ckpt.export_hf(tmp_path / "ckpt", tmp_path / "hf", config=unsplit.config)
    out = ckpt.export_hf(
        tmp_path / "ckpt",
        tmp_path / "hf",
        config=unsplit.config,
        model_cls=transformers.GPT2LMHeadModel,
    )
    assert {"config.json", "model.safetensors"} <= {f.name for f in out.iterdir()}
    # transformers picks sdpa attention unless told: eager is what the pipeline ran.
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(out, attn_implementation="eager")
    reloaded.eval()
    trained_state = model.state_dict()
    for name, value in reloaded.state_dict().items():
        assert torch.equal(value, trained_state[name]), name
    unsplit.eval()
    inputs, _ = next(case.micro_batches(1, batch_size=2, seed=77))
    with torch.no_grad():
        logits = case.forward(reloaded, inputs)[0]
        expected = case.forward(unsplit, inputs)[0]
        through_pipeline = engine.eval_batch(
            iter([(inputs, torch.zeros(2, hf.SEQ, dtype=torch.long))]),
            return_logits=True,
            num_micro_batches=1,
        )[1][0]
        # The partitioned model shares its parameters with the pipeline's stages.
        trained = case.forward(model.eval(), inputs)[0]
    assert_tensor_close(logits, expected, "logits of the reloaded model vs the unsplit one")
    assert torch.equal(logits, trained)  # the same weights, bit for bit
    assert_tensor_close(through_pipeline, logits, "the pipeline's logits")
    assert reloaded.lm_head.weight is reloaded.transformer.wte.weight
