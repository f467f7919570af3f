"""Hugging Face ``Trainer`` through a pipeline: ``PipelineTrainer`` logs what plain ``Trainer``
logs, and refuses by name what it cannot honour.

The reference is plain ``transformers.Trainer`` training the unsplit model in one process on the
same data, seed and ``TrainingArguments`` (``examples/hf_trainer.py`` builds both: a small
Llama with a tied head and a Qwen2 with attention biases, from configs). Compared: the loss,
gradient norm and learning rate logged at every step, the eval loss, and the trained weights as
``save_model`` writes them (fp32: rel 1e-5). The multi-process tests run the example itself:
under ``torchrun``, as its docstring says, once per dialect, and otherwise its ``main()`` on
ranks of the launcher (torchrun's environment, forked ranks); the others run both trainers in
this process on the local dialect.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "hf_trainer.py"
sys.path.insert(0, str(EXAMPLE.parent))

import hf_trainer as example  # noqa: E402
import transformers  # noqa: E402
from _fresh import torchrun_argv  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from pipedialect.errors import TrainingArgumentError  # noqa: E402
from pipedialect.integrations.transformers import (  # noqa: E402
    REFUSED_TRAINING_ARGUMENTS,
    PipelineTrainer,
    PipelineTrainingArguments,
    check_trainer,
    pp_plan_split_points,
)

transformers.logging.set_verbosity_error()

REL = 1e-5
BIN = Path(sys.executable).parent


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def assert_same_run(run: dict[str, Any], ref: dict[str, Any]) -> None:
    """Every logged step (and the eval loss) within rel 1e-5; the same number of steps."""
    for key in ("losses", "grad_norms", "learning_rates"):
        assert len(run[key]) == len(ref[key]) > 0, key
        pairs = zip(run[key], ref[key], strict=True)
        worst = max(_rel(a, b) if b else abs(a - b) for a, b in pairs)
        assert worst <= REL, f"{key}: {run[key]} vs {ref[key]} (rel {worst:.1e})"
    assert _rel(run["eval_loss"], ref["eval_loss"]) <= REL


def assert_same_weights(saved: Path, reference: Path, family: str = "llama") -> None:
    """``save_model``'s ``model.safetensors``: the same tensors, within rel 1e-5 each (the
    largest difference over the largest value), and the model moved."""
    ours, theirs = (
        load_file(saved / "model.safetensors"),
        load_file(reference / "model.safetensors"),
    )
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():
        err = float((ours[name] - value).abs().max())
        assert err <= REL * max(float(value.abs().max()), 1e-12), f"{name}: {err:.2e}"
    start = example.build_model(family).state_dict()
    assert any(not torch.equal(theirs[n], start[n]) for n in theirs if n in start)


def _arguments(
    out: Path, pipeline: dict[str, Any] | None = None, **overrides: Any
) -> transformers.TrainingArguments:
    """The example's arguments with ``overrides``: plain Trainer's, or with ``pipeline``'s
    fields a ``PipelineTrainingArguments``."""
    args = example.training_arguments(str(out))
    fields = {k: getattr(args, k) for k in _ARGUMENT_FIELDS}
    if pipeline is None:
        return transformers.TrainingArguments(**{**fields, **overrides})
    return PipelineTrainingArguments(**{**fields, **pipeline, **overrides})


#: The fields of ``example.training_arguments`` a test may override.
_ARGUMENT_FIELDS = (
    "output_dir",
    "per_device_train_batch_size",
    "per_device_eval_batch_size",
    "gradient_accumulation_steps",
    "max_steps",
    "learning_rate",
    "weight_decay",
    "max_grad_norm",
    "logging_steps",
    "seed",
    "use_cpu",
    "report_to",
    "save_strategy",
    "disable_tqdm",
)


def _steps(trainer: transformers.Trainer) -> dict[str, Any]:
    rows = [r for r in trainer.state.log_history if "loss" in r and "step" in r]
    return {
        "losses": [r["loss"] for r in rows],
        "grad_norms": [r["grad_norm"] for r in rows],
        "learning_rates": [r["learning_rate"] for r in rows],
        "evals": [r["eval_loss"] for r in trainer.state.log_history if "eval_loss" in r],
    }


def train_in_process(
    out: Path,
    *,
    family: str = "llama",
    pipeline: dict[str, Any] | None = None,
    resume: str | None = None,
    train_dataset: Any = None,
    eval_dataset: Any = None,
    collator: Any = None,
    trainer_kwargs: dict[str, Any] | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Train with plain Trainer (``pipeline=None``) or PipelineTrainer (``pipeline``: the
    PipelineTrainingArguments fields); save the model into ``out/final``; return what it
    logged."""
    overrides.setdefault("lr_scheduler_type", "cosine")
    overrides.setdefault("warmup_steps", 2)
    kwargs: dict[str, Any] = dict(
        model=example.build_model(family),
        args=_arguments(out, pipeline, **overrides),
        train_dataset=train_dataset or example.TokenData(example.TRAIN_SAMPLES, seed=1),
        eval_dataset=eval_dataset or example.TokenData(example.EVAL_SAMPLES, seed=2),
        **(trainer_kwargs or {}),
    )
    if collator is not None:
        kwargs["data_collator"] = collator
    trainer: transformers.Trainer = (
        transformers.Trainer(**kwargs) if pipeline is None else PipelineTrainer(**kwargs)
    )
    trainer.train(resume_from_checkpoint=resume)
    result = {**_steps(trainer), "eval_loss": trainer.evaluate()["eval_loss"]}
    trainer.save_model(str(out / "final"))
    return result


LOCAL: dict[str, Any] = {"dialect": "local", "num_stages": 2}


@pytest.mark.parametrize(
    ("family", "pipeline", "overrides"),
    [
        ("llama", LOCAL, {}),
        ("qwen2", LOCAL, {}),
        ("llama", {"dialect": "local", "split_points": ["model.layers.2"]}, {}),
        (
            "qwen2",
            {"dialect": "local", "num_stages": 3, "balance": "parameters"},
            {"logging_steps": 2, "max_grad_norm": 0.0, "lr_scheduler_type": "linear"},
        ),
        ("llama", LOCAL, {"weight_decay": 0.0, "warmup_steps": 0.4, "optim": "adamw_torch"}),
    ],
    ids=["llama-pp-plan", "qwen2-pp-plan", "split-points", "balance-log2-noclip", "ratio-warmup"],
)
def test_local_pipeline_trainer_logs_and_saves_what_plain_trainer_does(
    tmp_path: Path, family: str, pipeline: dict[str, Any], overrides: dict[str, Any]
) -> None:
    ref = train_in_process(tmp_path / "ref", family=family, **overrides)
    run = train_in_process(tmp_path / "pipe", family=family, pipeline=pipeline, **overrides)
    assert_same_run(run, ref)
    assert_same_weights(tmp_path / "pipe" / "final", tmp_path / "ref" / "final", family)
    # The pipeline's folder loads as a Hugging Face model, as plain Trainer's does.
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pipe" / "final")
    assert type(loaded).__name__.lower().startswith(family)


def test_save_steps_and_resume_from_checkpoint_continue_as_plain_trainer(tmp_path: Path) -> None:
    saving = {"save_strategy": "steps", "save_steps": 2}
    ref = train_in_process(tmp_path / "ref", **saving)
    ref_resumed = train_in_process(
        tmp_path / "ref", resume=str(tmp_path / "ref" / "checkpoint-2"), **saving
    )
    run = train_in_process(tmp_path / "pipe", pipeline=LOCAL, **saving)
    assert (tmp_path / "pipe" / "checkpoint-2" / "pipeline").is_dir()
    assert (tmp_path / "pipe" / "checkpoint-4" / "model.safetensors").is_file()
    resumed = train_in_process(
        tmp_path / "pipe", pipeline=LOCAL, resume=str(tmp_path / "pipe" / "checkpoint-2"), **saving
    )
    assert_same_run(run, ref)
    assert_same_run(resumed, ref_resumed)
    # The history of steps 1 and 2 comes from checkpoint-2; steps 3 to 5 are trained again, and
    # continue the uninterrupted run.
    assert len(resumed["losses"]) == 5
    assert resumed["losses"][2:] == pytest.approx(run["losses"][2:], rel=REL)
    assert_same_weights(tmp_path / "pipe" / "final", tmp_path / "ref" / "final")


def test_evaluation_during_training_and_a_collator_making_the_labels(tmp_path: Path) -> None:
    """eval_strategy="steps" evaluates through eval_batch; a collator builds the labels (dict
    batches by name) from unlabelled rows."""

    class Unlabelled(example.TokenData):
        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            row = super().__getitem__(i)
            return {"input_ids": row["input_ids"], "attention_mask": row["attention_mask"]}

    def collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batch = transformers.default_data_collator(rows)
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        return batch

    extra = {"eval_strategy": "steps", "eval_steps": 2}
    data = Unlabelled(example.TRAIN_SAMPLES, seed=1)
    ref = train_in_process(tmp_path / "ref", train_dataset=data, collator=collate, **extra)
    run = train_in_process(
        tmp_path / "pipe", pipeline=LOCAL, train_dataset=data, collator=collate, **extra
    )
    assert_same_run(run, ref)
    assert len(run["evals"]) == 3  # steps 2 and 4, and the final evaluate()
    assert run["evals"] == pytest.approx(ref["evals"], rel=REL)


def test_evaluate_before_train_then_train_as_plain_trainer(tmp_path: Path) -> None:
    """evaluate() first builds the pipeline; train() then gives it the schedule of its steps."""
    results = []
    for pipeline in (None, LOCAL):
        out = tmp_path / ("ref" if pipeline is None else "pipe")
        kwargs: dict[str, Any] = dict(
            model=example.build_model("llama"),
            args=_arguments(out, pipeline, lr_scheduler_type="cosine", warmup_steps=2),
            train_dataset=example.TokenData(example.TRAIN_SAMPLES, seed=1),
            eval_dataset=example.TokenData(example.EVAL_SAMPLES, seed=2),
        )
        trainer = transformers.Trainer(**kwargs) if pipeline is None else PipelineTrainer(**kwargs)
        before = trainer.evaluate()["eval_loss"]
        trainer.train()
        results.append({**_steps(trainer), "eval_loss": before})
    ref, run = results
    assert_same_run(run, ref)  # the learning rates too: the schedule of 5 steps, not of 0


def test_the_pp_plan_spreads_the_layers_evenly() -> None:
    llama = example.build_model("llama")
    assert pp_plan_split_points(llama, 2) == ("model.layers.1",)
    assert pp_plan_split_points(llama, 3) == ("model.layers.0", "model.layers.2")
    assert pp_plan_split_points(llama, 4) == tuple(f"model.layers.{i}" for i in range(3))
    with pytest.raises(pipedialect_config_error(), match="5 stages cannot split the 4 layers"):
        pp_plan_split_points(llama, 5)
    with pytest.raises(pipedialect_config_error(), match="no base_model_pp_plan"):
        pp_plan_split_points(torch.nn.Linear(2, 2), 2)


def pipedialect_config_error() -> type[Exception]:
    from pipedialect import ConfigError

    return ConfigError


# -- what is refused, by name, when the trainer is built ---------------------------------------


class _OwnLoss(PipelineTrainer):
    def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("never called")


class _OwnStep(PipelineTrainer):
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("never called")


class _OwnPrediction(PipelineTrainer):
    def prediction_step(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("never called")


#: Each refused setting: the TrainingArguments overrides, or the Trainer arguments, that set it.
REFUSALS: dict[str, dict[str, Any]] = {
    "fp16": {"args": {"fp16": True}},
    "bf16_full_eval": {"args": {"bf16_full_eval": True}},
    "fp16_full_eval": {"args": {"fp16_full_eval": True}},
    "torch_compile": {"args": {"torch_compile": True}},
    "label_smoothing_factor": {"args": {"label_smoothing_factor": 0.1}},
    "compute_loss_func": {"trainer": {"compute_loss_func": lambda *a, **k: None}},
    "compute_loss": {"cls": _OwnLoss},
    "training_step": {"cls": _OwnStep},
    "prediction_step": {"cls": _OwnPrediction},
    "optimizers": {"optimizers": True},
    "optim": {"args": {"optim": "adamw_anyprecision"}},
    "optim_target_modules": {"args": {"optim_target_modules": ["attn"]}},
    "lr_scheduler_type": {
        "args": {"lr_scheduler_type": "reduce_lr_on_plateau", "eval_strategy": "steps"}
    },
    "model_init": {"model_init": True},
    "auto_find_batch_size": {"args": {"auto_find_batch_size": True}},
    "per_device_eval_batch_size": {"args": {"per_device_eval_batch_size": 4}},
    "dataloader_drop_last": {"trainer": {"train_dataset": example.TokenData(7, seed=1)}},
    "neftune_noise_alpha": {"args": {"neftune_noise_alpha": 5.0}},
    "use_liger_kernel": {"args": {"use_liger_kernel": True}},
    "debug": {"args": {"debug": "underflow_overflow"}},
    "include_num_input_tokens_seen": {"args": {"include_num_input_tokens_seen": "all"}},
    "gradient_checkpointing_kwargs": {
        "args": {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"offload": True}}
    },
    "include_for_metrics": {"args": {"include_for_metrics": ["inputs"]}},
    "eval_do_concat_batches": {"args": {"eval_do_concat_batches": False}},
    "batch_eval_metrics": {"args": {"batch_eval_metrics": True}},
    "label_names": {"args": {"label_names": ["target"]}},
    "accelerator_config": {"args": {"accelerator_config": {"split_batches": True}}},
    "deepspeed": {
        "args": {"deepspeed": {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {}}}
    },
    "parallelism_config": {"parallelism_config": True},
    "train_sampling_strategy": {"args": {"train_sampling_strategy": "batch_rebalance"}},
}


def _build(tmp_path: Path, case: dict[str, Any]) -> PipelineTrainer:
    model = example.build_model("llama")
    args = _arguments(tmp_path, LOCAL, **case.get("args", {}))
    if case.get("parallelism_config"):
        from accelerate.parallelism_config import ParallelismConfig

        args.parallelism_config = ParallelismConfig()
    kwargs: dict[str, Any] = {
        "train_dataset": example.TokenData(8, seed=1),
        "eval_dataset": example.TokenData(4, seed=2),
        **case.get("trainer", {}),
    }
    if case.get("optimizers"):
        optimizer = torch.optim.AdamW(model.parameters())
        kwargs["optimizers"] = (optimizer, None)
    if case.get("model_init"):
        kwargs["model_init"] = lambda: example.build_model("llama")
        model = None
    cls = case.get("cls", PipelineTrainer)
    trainer: PipelineTrainer = cls(model=model, args=args, **kwargs)
    return trainer


def test_every_refusal_is_tested() -> None:
    assert set(REFUSALS) | {"fsdp"} == set(REFUSED_TRAINING_ARGUMENTS)


@pytest.fixture
def forget_trainer_state() -> Any:
    """Trainer's DeepSpeed and accelerate keep process-wide state (the DeepSpeed config, the
    accelerator's distributed type, environment variables): a refused trainer must not leave
    it to the next one."""
    environ = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(environ)
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    AcceleratorState._reset_state(True)


@pytest.mark.parametrize("setting", sorted(REFUSALS))
def test_a_setting_a_pipeline_cannot_honour_is_refused_by_name(
    tmp_path: Path, setting: str, forget_trainer_state: Any
) -> None:
    with pytest.raises(TrainingArgumentError) as info:
        _build(tmp_path, REFUSALS[setting])
    assert setting in str(info.value)
    assert info.value.argument == setting


def test_fsdp_is_refused_by_name(tmp_path: Path) -> None:
    # TrainingArguments itself refuses fsdp in one process; under torchrun the trainer does.
    trainer = _build(tmp_path, {})
    trainer.args.fsdp = ["full_shard"]
    with pytest.raises(TrainingArgumentError, match="cannot honour fsdp") as info:
        check_trainer(trainer)
    assert info.value.argument == "fsdp"


def test_a_short_last_accumulation_step_is_refused_before_it_runs(tmp_path: Path) -> None:
    """3 batches an epoch with gradient_accumulation_steps=2: the second step would have one
    micro-batch; the first trains, the second is refused by name before anything runs."""
    case = {
        "args": {"max_steps": -1, "num_train_epochs": 1},
        "trainer": {"train_dataset": example.TokenData(6, seed=1)},
    }
    trainer = _build(tmp_path, case)
    with pytest.raises(TrainingArgumentError, match="optimizer step of 1 micro-batches") as info:
        trainer.train()
    assert info.value.argument == "gradient_accumulation_steps"
    assert trainer.state.global_step == 1


# -- the example, under torchrun, against plain Trainer ------------------------------------------


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PIPEDIALECT_PLUGINS"}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def _last_line(argv: list[str], cwd: Path) -> dict[str, Any]:
    proc = subprocess.run(
        argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=900, check=False
    )
    report = f"{argv}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, report
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith('{"losses": ['), report
    result: dict[str, Any] = json.loads(last)
    return result


def run_example(*argv: str) -> dict[str, Any]:
    """examples/hf_trainer.py's ``main()`` in this process, with ``argv``; its JSON line."""
    import _trainer_workers

    result = _trainer_workers.run_example(*argv)
    assert result is not None, f"the example printed no result with {argv}"
    return result


def _reference(where: Path, *flags: str) -> dict[str, Any]:
    """Plain Trainer through the example (``--reference``) in this process, saving into
    ``where/final``."""
    return run_example(
        "--reference", *flags, "--out", str(where / "out"), "--save", str(where / "final")
    )


def _launched(nproc: int, *argv: str) -> dict[str, Any]:
    """The example's ``main()`` with ``argv`` on ``nproc`` ranks of the launcher; rank 0's
    result line (the other ranks print none)."""
    import _trainer_workers

    from pipedialect.runtime.launch import launch

    per_rank = launch(_trainer_workers.run_example, nproc, *argv, timeout=900)
    assert per_rank[0] is not None and all(r is None for r in per_rank[1:]), per_rank
    return per_rank[0]


def _torchrun(nproc: int, *args: str) -> list[str]:
    """torchrun of the example with ``args``."""
    return torchrun_argv(EXAMPLE, nproc, *args)


#: The example's flags per launch: each dialect trains each family once, with Trainer's bf16,
#: gradient checkpointing and --eval (metrics, checkpoints, the best model) spread over them.
LAUNCHES = {
    "torch-llama": ("--bf16", "--gradient-checkpointing", "--eval"),
    "deepspeed-qwen2": ("--gradient-checkpointing", "--eval"),
    "deepspeed-llama": ("--bf16",),
    "torch-qwen2": (),
}
#: The launches that run the script under torchrun, as a user does (one per dialect); the
#: others run its ``main()`` on ranks of the launcher, which sets torchrun's environment and
#: forks them from a process that imported torch and transformers once.
TORCHRUN = {"torch-llama", "deepspeed-qwen2"}


def assert_same_eval(
    run: dict[str, Any], ref: dict[str, Any], rel: float = REL, *, same_dir: bool = True
) -> None:
    """Every evaluation's loss and metrics, the best checkpoint and (``same_dir``: both
    runs wrote every checkpoint into their own output_dir) the checkpoints kept."""
    assert len(run["evals"]) == len(ref["evals"])
    for ours, theirs in zip(run["evals"], ref["evals"], strict=True):
        assert ours.keys() == theirs.keys()
        for key, value in theirs.items():
            assert _rel(ours[key], value) <= rel, (key, ours, theirs)
    assert run["best_checkpoint"] == ref["best_checkpoint"]
    if same_dir:
        assert run["checkpoints"] == ref["checkpoints"]


@pytest.mark.distributed
@pytest.mark.parametrize("launch", sorted(LAUNCHES))
def test_the_example_on_two_processes_equals_plain_trainer(tmp_path: Path, launch: str) -> None:
    """Two processes, one stage each (under torchrun for the launches in TORCHRUN); Trainer's
    bf16 within the bound of test_trainer_features.py (BF16_REL), everything else within rel
    1e-5. After the --eval launch of DeepSpeed, plain Trainer resumes the pipeline's
    checkpoint-2 and finishes as the uninterrupted run (optimizer, schedule and step from the
    folder)."""
    from test_trainer_features import BF16_REL

    dialect, family = launch.split("-")
    flags = ("--family", family, *LAUNCHES[launch])
    ref = _reference(tmp_path / "ref", *flags)
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    where = ("--out", str(pipe / "out"), "--save", str(pipe / "final"))
    if launch in TORCHRUN:
        run = _last_line([*_torchrun(2, "--dialect", dialect, *flags), *where], pipe)
    else:
        run = _launched(2, "--dialect", dialect, *flags, *where)
    if "--bf16" in flags:
        assert run["losses"][0] == ref["losses"][0]
        for key in ("losses", "grad_norms"):
            worst = max(_rel(a, b) for a, b in zip(run[key], ref[key], strict=True))
            assert worst <= BF16_REL[key], (key, run[key], ref[key])
        assert _rel(run["eval_loss"], ref["eval_loss"]) <= BF16_REL["eval_loss"]
    else:
        assert_same_run(run, ref)
        assert_same_weights(pipe / "final", tmp_path / "ref" / "final", family)
    if "--eval" in flags:
        assert_same_eval(run, ref, BF16_REL["eval_loss"] if "--bf16" in flags else REL)
        assert len(run["evals"]) == 4 and len(run["final_metrics"]) == 2
    if launch == "deepspeed-qwen2":
        resumed = _reference(
            tmp_path / "plain", *flags, "--resume", str(pipe / "out" / "checkpoint-2")
        )
        assert resumed["losses"][2:] == pytest.approx(ref["losses"][2:], rel=REL)
        assert resumed["learning_rates"] == ref["learning_rates"]
        assert_same_eval(resumed, ref, same_dir=False)  # checkpoint-2 is the pipeline's


@pytest.mark.distributed
@pytest.mark.parametrize("dialect", ["torch-3d", "deepspeed"])
def test_two_replicas_of_two_stages_equal_plain_trainer_with_twice_the_accumulation(
    tmp_path: Path, dialect: str
) -> None:
    """Two stages by two replicas: Trainer's loaders are sharded over the replicas only (each
    reads every other batch) and the step's token count is summed over them, so a step trains
    on what one process trains on with gradient_accumulation_steps 4; evaluation gathers every
    replica's batches in Trainer's order for compute_metrics. On torch it is the 3D layout
    (eight processes): the stages sharded over the replicas (FSDP) and over a tensor axis of
    two ranks by the Llama's own plan; whole stages on two replicas (four processes) are
    DeepSpeed's layout here, and the torch dialect's own in tests/dialects/torch."""
    ref = _reference(tmp_path / "ref", "--accumulation", "4", "--eval")
    name, _, mode = dialect.partition("-")
    flags = ["--dialect", name, "--stages", "2", "--accumulation", "2", "--eval"]
    if mode:
        flags.extend(["--fsdp", "--tp", "2"])
    pipe = tmp_path / "pipe"
    flags.extend(["--out", str(pipe / "out"), "--save", str(pipe / "final")])
    # The example's ranks, launched with torchrun's environment (the torchrun path itself is
    # test_the_example_on_two_processes_equals_plain_trainer's): forked ranks do not import
    # torch, transformers and the dialect again, eight times over.
    run = _launched(8 if mode else 4, *flags)
    assert_same_run(run, ref)
    assert_same_eval(run, ref)
    assert_same_weights(pipe / "final", tmp_path / "ref" / "final", "llama")
    if mode:  # export_hf from the 3D layout's checkpoint: what plain Trainer saved at that step
        from pipedialect.checkpoint import export_hf

        exported = export_hf(
            pipe / "out" / "checkpoint-4" / "pipeline",
            tmp_path / "hf",
            config=example.build_model("llama").config,
            model_cls=transformers.LlamaForCausalLM,
        )
        assert_same_weights(exported, tmp_path / "ref" / "out" / "checkpoint-4")
        reloaded = transformers.LlamaForCausalLM.from_pretrained(exported)
        assert (
            reloaded.config.num_hidden_layers
            == example.build_model("llama").config.num_hidden_layers
        )


@pytest.mark.distributed
def test_what_can_only_fail_fails_when_the_trainer_is_built_on_every_rank(tmp_path: Path) -> None:
    """Trainer's default gradient_accumulation_steps=1 under 1F1B over two stages, and three
    stages on two processes: each a named error on both ranks in PipelineTrainer(...), not at
    the first step (main: the first at the first step, the second from one rank inside
    get_train_dataloader)."""
    import _trainer_workers

    from pipedialect.runtime.launch import launch

    results = launch(_trainer_workers.pipeline_trainer_refusals, 2, str(tmp_path), timeout=600)
    for micro, world in results:
        assert micro[0] == "ConfigError", micro
        assert "gradient_accumulation_steps=1" in micro[1] and "1F1B" in micro[1], micro
        assert world[0] == "TopologyError", world
        assert "2 processes cannot run 3 stages" in world[1], world
    assert results[0] == results[1]


def test_a_loader_accelerate_does_not_shard_by_batches_is_refused_under_several_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An iterable data set: accelerate dispatches or shards its items over every process, so
    the pipeline ranks of one replica would read other batches (inputs of one, labels of
    another): refused by name rather than trained on."""
    trainer = _build(tmp_path, {})

    rows = [example.TokenData(8, seed=1)[i] for i in range(8)]
    loader = torch.utils.data.DataLoader(
        rows, batch_size=2, collate_fn=transformers.default_data_collator
    )
    monkeypatch.setattr(transformers.TrainingArguments, "world_size", property(lambda _: 2))
    with pytest.raises(TrainingArgumentError, match="map-style data set") as info:
        trainer._shard(loader)
    assert info.value.argument == "train_dataset"
