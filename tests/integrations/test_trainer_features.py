"""``PipelineTrainer`` beyond the step: checkpoints either trainer resumes, the tokenizer saved,
batches as collators make them, evaluation with metrics, Trainer's bf16 and gradient
checkpointing, the arguments' parser, callbacks, and what is refused when it is built.

The reference is always plain ``transformers.Trainer`` on the unsplit model in this process,
with the same data, seed and arguments (``examples/hf_trainer.py`` builds both: a Llama with a
tied head and a Qwen2), compared with the tolerances of ``test_trainer.py`` (fp32: rel 1e-5).
Everything here runs the local dialect in this process; test_trainer.py runs the example under
``torchrun`` on the torch and DeepSpeed dialects.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import test_trainer as base
import transformers
from test_trainer import LOCAL, REL, assert_same_run, example, train_in_process

import pipedialect
from pipedialect import CheckpointError, MissingCapabilityError, PipeDialectWarning
from pipedialect.errors import TrainingArgumentError
from pipedialect.integrations import transformers as integration
from pipedialect.integrations.transformers import (
    PipelineTrainer,
    PipelineTrainingArguments,
)

transformers.logging.set_verbosity_error()

#: The bf16 bound ([Note: stages under autocast]): one micro-batch's loss and gradients are the
#: unsplit model's under autocast bit for bit; over steps, fp32 sums in another order (the
#: engine's accumulation) move a value by an ulp, which a later bf16 rounding can turn into a
#: bf16 ulp (2**-8). Measured on the example's 5 steps: losses 4.5e-5, eval 1.4e-5, gradient
#: norms 2.6e-3.
BF16_REL = {"losses": 1e-3, "eval_loss": 1e-3, "grad_norms": 1e-2}

SAVING = {"save_strategy": "steps", "save_steps": 2}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


# -- checkpoints, both ways ([Note: checkpoints both ways]) -----------------------------------


def test_plain_trainer_resumes_a_pipeline_checkpoint_exactly(tmp_path: Path) -> None:
    """Plain Trainer resumed from PipelineTrainer's checkpoint-2 trains steps 3 to 5 as the
    uninterrupted run: the optimizer's moments, the schedule (the learning rate is not
    restarted from warm-up) and the step come from the folder."""
    whole = train_in_process(tmp_path / "ref", **SAVING)
    train_in_process(tmp_path / "pipe", pipeline=LOCAL, **SAVING)
    folder = tmp_path / "pipe" / "checkpoint-2"
    assert (folder / "optimizer.pt").is_file() and (folder / "scheduler.pt").is_file()
    resumed = train_in_process(tmp_path / "plain", resume=str(folder), **SAVING)
    assert resumed["learning_rates"][2:] == pytest.approx(whole["learning_rates"][2:], rel=REL)
    assert resumed["losses"][2:] == pytest.approx(whole["losses"][2:], rel=REL)
    assert resumed["grad_norms"][2:] == pytest.approx(whole["grad_norms"][2:], rel=REL)
    base.assert_same_weights(tmp_path / "plain" / "final", tmp_path / "ref" / "final")


def test_pipeline_trainer_resumes_a_plain_trainer_checkpoint_exactly(tmp_path: Path) -> None:
    """The other way: plain Trainer's folder has no pipeline/; the weights load through
    Trainer's own loading and the optimizer's state is mapped onto the stages by name."""
    whole = train_in_process(tmp_path / "ref", family="qwen2", **SAVING)
    folder = tmp_path / "ref" / "checkpoint-2"
    assert not (folder / "pipeline").exists()
    resumed = train_in_process(
        tmp_path / "pipe", family="qwen2", pipeline=LOCAL, resume=str(folder), **SAVING
    )
    assert resumed["learning_rates"][2:] == pytest.approx(whole["learning_rates"][2:], rel=REL)
    assert resumed["losses"][2:] == pytest.approx(whole["losses"][2:], rel=REL)
    assert resumed["grad_norms"][2:] == pytest.approx(whole["grad_norms"][2:], rel=REL)
    base.assert_same_weights(tmp_path / "pipe" / "final", tmp_path / "ref" / "final", "qwen2")


def test_a_folder_without_optimizer_state_is_refused_by_name(tmp_path: Path) -> None:
    train_in_process(tmp_path / "ref", **SAVING)
    folder = tmp_path / "ref" / "checkpoint-2"
    (folder / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError, match=r"no pipeline/ folder .* and no optimizer\.pt"):
        train_in_process(tmp_path / "pipe", pipeline=LOCAL, resume=str(folder), **SAVING)


# -- the tokenizer, and batches as collators make them ---------------------------------------


def _tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over the example's vocabulary, built in memory (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, example.VOCAB)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="</s>", unk_token="</s>"
    )


class Ragged(torch.utils.data.Dataset[dict[str, list[int]]]):
    """Tokenised rows of 5 to 16 tokens, as a tokenizer's map over a text data set gives."""

    def __init__(self, count: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        lengths = torch.randint(5, example.SEQ + 1, (count,), generator=gen)
        self.rows = [torch.randint(2, example.VOCAB, (int(n),), generator=gen) for n in lengths]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        ids = self.rows[i].tolist()
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}


def test_variable_length_batches_are_padded_to_one_length_and_train_as_plain_trainer(
    tmp_path: Path,
) -> None:
    """Every collator pads to the longest row of its batch; the stages run one shape. The
    batches are padded further to the longest row (rounded up to 8), chosen when the trainer
    is built and said in a warning, and the run is plain Trainer's (which pads each batch to
    its own longest row); the collator's tokenizer is saved as plain Trainer saves it."""
    tokenizer = _tokenizer()
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    data = {"train_dataset": Ragged(32, 1), "eval_dataset": Ragged(8, 2), "collator": collator}
    ref = train_in_process(tmp_path / "ref", **data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = train_in_process(tmp_path / "pipe", pipeline=LOCAL, **data)
    said = [str(w.message) for w in caught if issubclass(w.category, PipeDialectWarning)]
    assert any("'input_ids': 16" in m and "padded to" in m for m in said), said
    assert_same_run(run, ref)
    saved = sorted(p.name for p in (tmp_path / "pipe" / "final").iterdir())
    theirs = sorted(p.name for p in (tmp_path / "ref" / "final").iterdir())
    assert "tokenizer.json" in theirs
    assert [n for n in saved if n != "pipeline"] == theirs
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "pipe" / "final")
    assert loaded.pad_token == "<pad>"


def test_pad_to_length_is_taken_and_a_longer_batch_is_refused_by_name(tmp_path: Path) -> None:
    collator = transformers.DataCollatorForLanguageModeling(_tokenizer(), mlm=False)
    args = base._arguments(tmp_path, {**LOCAL, "pad_to_length": 12})
    with pytest.raises(
        TrainingArgumentError, match=r"pad_to_length=12, but the rows. .* are up to 16 long"
    ) as info:
        PipelineTrainer(
            model=example.build_model("llama"),
            args=args,
            train_dataset=Ragged(8, 1),
            data_collator=collator,
        )
    assert info.value.argument == "pad_to_length"


# -- evaluation ([Note: evaluation through the last stage]) ---------------------------------


def test_an_eval_set_the_accumulation_does_not_divide_evaluates_as_plain_trainer(
    tmp_path: Path,
) -> None:
    """3 eval batches with gradient_accumulation_steps 2: the last group is filled with a copy
    whose result is dropped (main crashed at the first evaluation, after training started)."""
    extra = {"eval_strategy": "steps", "eval_steps": 2, "eval_accumulation_steps": 2}
    eval_set = example.TokenData(6, seed=2)
    ref = train_in_process(tmp_path / "ref", eval_dataset=eval_set, **extra)
    run = train_in_process(tmp_path / "pipe", pipeline=LOCAL, eval_dataset=eval_set, **extra)
    assert_same_run(run, ref)
    assert run["evals"] == pytest.approx(ref["evals"], rel=REL)


def _example(tmp_path: Path, *flags: str) -> dict[str, Any]:
    """examples/hf_trainer.py's main() in this process; its JSON line."""
    return base.run_example(*flags, "--out", str(tmp_path / "out"))


def test_the_example_with_metrics_best_model_and_gradient_checkpointing_equals_plain_trainer(
    tmp_path: Path,
) -> None:
    """--eval: compute_metrics every 2 steps, checkpoints every 2 keeping the last 2
    (save_total_limit), the best one by accuracy loaded at the end (load_best_model_at_end);
    --gradient-checkpointing: the model's layers recomputed in backward. Every logged value is
    plain Trainer's (fp32)."""
    flags = ("--eval", "--gradient-checkpointing", "--family", "qwen2")
    ref = _example(tmp_path / "ref", "--reference", *flags)
    run = _example(tmp_path / "pipe", "--dialect", "local", *flags)
    assert_same_run(run, ref)
    assert len(run["evals"]) == 4  # steps 2 and 4, the end of training, the final evaluate()
    for ours, theirs in zip(run["evals"], ref["evals"], strict=True):
        assert ours.keys() == theirs.keys() == {"eval_loss", "eval_accuracy", "eval_log_prob"}
        for key, value in theirs.items():
            assert _rel(ours[key], value) <= REL, (key, ours, theirs)
    assert run["best_checkpoint"] == ref["best_checkpoint"] is not None
    assert run["checkpoints"] == ref["checkpoints"]
    assert len(run["checkpoints"]) == 2 and ref["best_checkpoint"] in run["checkpoints"]
    assert run["final_metrics"] == pytest.approx(ref["final_metrics"], rel=REL)


def test_trainers_bf16_is_autocast_on_every_stage_within_the_documented_bound(
    tmp_path: Path,
) -> None:
    """--bf16 is Trainer's bf16 (torch.autocast over fp32 weights) on every stage: the first
    step's loss is plain Trainer's bf16 loss exactly and not its fp32 one; the whole run stays
    within BF16_REL of plain Trainer's bf16 run."""
    flags = ("--bf16", "--gradient-checkpointing", "--eval")
    ref = _example(tmp_path / "ref", "--reference", *flags)
    fp32 = _example(tmp_path / "fp32", "--reference", "--gradient-checkpointing", "--eval")
    run = _example(tmp_path / "pipe", "--dialect", "local", *flags)
    assert run["losses"][0] == ref["losses"][0] != fp32["losses"][0]
    for key in ("losses", "grad_norms"):
        worst = max(_rel(a, b) for a, b in zip(run[key], ref[key], strict=True))
        assert worst <= BF16_REL[key], (key, run[key], ref[key])
    assert _rel(run["eval_loss"], ref["eval_loss"]) <= BF16_REL["eval_loss"]
    assert run["learning_rates"] == ref["learning_rates"]


def test_predict_returns_plain_trainers_predictions(tmp_path: Path) -> None:
    results = []
    for pipeline in (None, LOCAL):
        kwargs: dict[str, Any] = dict(
            model=example.build_model("llama"),
            args=base._arguments(tmp_path, pipeline),
            train_dataset=example.TokenData(8, seed=1),
        )
        trainer = transformers.Trainer(**kwargs) if pipeline is None else PipelineTrainer(**kwargs)
        results.append(trainer.predict(example.TokenData(6, seed=3)))
    ref, run = results
    torch.testing.assert_close(
        torch.as_tensor(run.predictions), torch.as_tensor(ref.predictions), rtol=REL, atol=1e-6
    )
    assert (run.label_ids == ref.label_ids).all()
    assert _rel(run.metrics["test_loss"], ref.metrics["test_loss"]) <= REL


class Recorder(transformers.TrainerCallback):
    """What report_to's integrations see: every event and every log, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, dict[str, float]]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        kept = {k: v for k, v in (logs or {}).items() if "runtime" not in k and "per_sec" not in k}
        self.events.append(("log", state.global_step, kept))

    def on_evaluate(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.events.append(("evaluate", state.global_step, {}))

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.events.append(("save", state.global_step, {}))

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.events.append(("step", state.global_step, {}))


def test_callbacks_see_what_they_see_with_plain_trainer(tmp_path: Path) -> None:
    """Callbacks (what report_to's integrations are) get the same events with the same logs."""
    seen = []
    for pipeline in (None, LOCAL):
        recorder = Recorder()
        train_in_process(
            tmp_path / ("pipe" if pipeline else "ref"),
            pipeline=pipeline,
            trainer_kwargs={"callbacks": [recorder]},
            eval_strategy="steps",
            eval_steps=2,
            **SAVING,
        )
        seen.append(recorder.events)
    ref, run = seen
    assert [(e, s, sorted(logs)) for e, s, logs in run] == [
        (e, s, sorted(logs)) for e, s, logs in ref
    ]
    for (_, _, ours), (_, _, theirs) in zip(run, ref, strict=True):
        for key, value in theirs.items():
            if isinstance(value, float):
                assert _rel(ours[key], value) <= REL, (key, ours, theirs)


# -- the arguments, and what is checked when the trainer is built ----------------------------


def test_hf_argument_parser_reads_the_pipeline_fields() -> None:
    parser = transformers.HfArgumentParser(PipelineTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(
        [
            "--output_dir",
            "out",
            "--dialect",
            "deepspeed",
            "--split_points",
            "model.layers.1",
            "model.layers.2",
            "--pipeline_schedule",
            "gpipe",
            "--gradient_checkpointing",
            "--pad_to_length",
            "32",
            "--learning_rate",
            "0.5",
        ]
    )
    assert isinstance(args, transformers.TrainingArguments)
    assert (args.dialect, args.split_points, args.pipeline_schedule) == (
        "deepspeed",
        ["model.layers.1", "model.layers.2"],
        "gpipe",
    )
    assert (args.pad_to_length, args.learning_rate, args.num_stages) == (32, 0.5, None)
    assert "dialect" in args.to_dict()  # what logging and report_to record
    with pytest.raises(TrainingArgumentError, match="num_stages must be a positive integer"):
        PipelineTrainingArguments(output_dir="out", num_stages=0)


def test_a_transformers_outside_the_supported_range_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers 5.2's Trainer logs another gradient norm and schedule than the pipeline
    (docs/huggingface.rst, "Versions"): refused when the trainer is built, not trained."""
    monkeypatch.setattr(integration.transformers, "__version__", "5.2.0")
    with pytest.raises(pipedialect.ConfigError, match=r"transformers>=5\.24\.0,<6, not 5\.2\.0"):
        PipelineTrainer(
            model=example.build_model("llama"),
            args=base._arguments(tmp_path, LOCAL),
            train_dataset=example.TokenData(8, seed=1),
        )


def test_plain_training_arguments_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(TrainingArgumentError, match=r"args=PipelineTrainingArguments") as info:
        PipelineTrainer(
            model=example.build_model("llama"),
            args=base._arguments(tmp_path),
            train_dataset=example.TokenData(8, seed=1),
        )
    assert info.value.argument == "args"


def test_a_dialect_whose_engines_a_loop_cannot_drive_is_refused_when_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine members the integration reads are the TrainerEngine protocol,
    declared as the trainer-loop capability; a dialect without it is refused at construction,
    naming it, not at the first save."""
    local = pipedialect.get_dialect("local")

    class NoLoop(type(local)):  # type: ignore[misc]
        name = "no-loop"
        capabilities = local.capabilities - {pipedialect.Capability.TRAINER_LOOP}

    monkeypatch.setattr(integration, "get_dialect", lambda name: NoLoop())
    with pytest.raises(MissingCapabilityError, match="trainer-loop") as info:
        PipelineTrainer(
            model=example.build_model("llama"),
            args=base._arguments(tmp_path, LOCAL),
            train_dataset=example.TokenData(8, seed=1),
        )
    assert (info.value.dialect, info.value.capability) == ("no-loop", "trainer-loop")
    assert isinstance(
        local.runtime_engine(
            local.pipe_engine(
                pipedialect.partition(torch.nn.Sequential(torch.nn.Linear(2, 2)), []),
                config={"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1},
                loss_fn=torch.nn.functional.mse_loss,
            ),
            optimizer=lambda groups: torch.optim.SGD(groups, lr=0.1),
        ),
        pipedialect.contracts.TrainerEngine,
    )
