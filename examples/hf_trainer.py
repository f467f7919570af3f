"""Train a small Hugging Face causal LM with ``Trainer``, pipelined by pipedialect.

    torchrun --nproc_per_node 2 examples/hf_trainer.py --dialect torch      # or deepspeed
    python examples/hf_trainer.py --dialect local                           # every stage here
    python examples/hf_trainer.py --reference                               # plain Trainer

The model (Llama by default, ``--family qwen2`` for Qwen2) is built from a small config with
random weights, so nothing is downloaded. The pipelined runs use
``pipedialect.integrations.transformers.PipelineTrainer`` with the same ``TrainingArguments``
as the reference, which is plain ``transformers.Trainer`` in one process; the split is the
model config's ``base_model_pp_plan``, one stage per process. Every run ends by printing one
JSON line: the loss, gradient norm and learning rate logged at each step, and the eval loss
after training. ``--save DIR`` also writes the trained model (``save_pretrained`` files) there.

``--stages 2`` under ``torchrun --nproc_per_node 4`` trains two data-parallel replicas of a
two-stage pipeline: each replica reads every other batch, so a step sees the samples a single
process sees with twice the accumulation steps (``--reference --accumulation 4``).

``--bf16`` trains in Trainer's bf16 (``torch.autocast`` over fp32 weights, on every stage);
``--gradient-checkpointing`` recomputes the model's layers in backward (the same numbers);
``--eval`` evaluates every 2 steps with ``compute_metrics`` (token accuracy and mean log-prob),
saves a checkpoint there (keeping the last 2) and loads the best one at the end; the JSON line
then also has every evaluation. ``--resume DIR`` resumes from a checkpoint folder (either
trainer's: each resumes the other's). Both runs take the same arguments:

    torchrun --nproc_per_node 2 examples/hf_trainer.py --bf16 --gradient-checkpointing --eval
    python examples/hf_trainer.py --reference --bf16 --gradient-checkpointing --eval
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model comes from a config: no downloads

import torch
import transformers
from torch.utils.data import Dataset

VOCAB, SEQ, TRAIN_SAMPLES, EVAL_SAMPLES = 64, 16, 32, 8


def build_model(family: str) -> transformers.PreTrainedModel:
    """The same random model in every process (seeded here: Trainer seeds after the model).

    Llama ties its LM head to the embedding; Qwen2 does not, and its attention has biases.
    Qwen2's ``k_proj.bias`` is frozen: adding a constant to every key shifts each softmax row
    by a constant, so its gradient is zero up to rounding, and Adam turns that rounding noise
    into full-size steps that no two summation orders share.
    """
    sizes = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        use_cache=False,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=1,
        attn_implementation="eager",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        if family == "llama":
            model: transformers.PreTrainedModel = transformers.LlamaForCausalLM(
                transformers.LlamaConfig(tie_word_embeddings=True, **sizes)
            )
        elif family == "qwen2":
            model = transformers.Qwen2ForCausalLM(
                transformers.Qwen2Config(tie_word_embeddings=False, **sizes)
            )
            for name, param in model.named_parameters():
                if name.endswith("k_proj.bias"):
                    param.requires_grad_(False)
        else:
            raise SystemExit(f"unknown --family {family!r}: llama or qwen2")
    return model


class TokenData(Dataset[dict[str, torch.Tensor]]):
    """Random token sequences of one length, each with a padded tail of random length (labels
    -100 and attention 0 there): the loss is a mean over the real tokens of the whole step."""

    def __init__(self, count: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(2, VOCAB, (count, SEQ), generator=gen)
        self.keep = torch.randint(SEQ // 3, SEQ + 1, (count,), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, keep = self.ids[i].clone(), int(self.keep[i])
        mask = torch.ones(SEQ, dtype=torch.long)
        labels = ids.clone()
        ids[keep:], mask[keep:], labels[keep:] = 0, 0, -100
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def training_arguments(
    out: str,
    accumulation: int = 2,
    *,
    cls: type[transformers.TrainingArguments] = transformers.TrainingArguments,
    checkpointing: bool = False,
    evaluation: bool = False,
    bf16: bool = False,
    **pipeline: Any,
) -> transformers.TrainingArguments:
    """What both runs train with: 2 sequences per micro-batch, 2 micro-batches per step
    (``cls`` is plain Trainer's arguments or ``PipelineTrainingArguments`` with ``pipeline``)."""
    extra: dict[str, Any] = {"save_strategy": "no", "bf16": bf16}
    if checkpointing:
        extra["gradient_checkpointing"] = True
    if evaluation:
        extra.update(
            eval_strategy="steps",
            eval_steps=2,
            save_strategy="steps",
            save_steps=2,
            save_total_limit=2,
            load_best_model_at_end=True,
            metric_for_best_model="accuracy",
        )
    return cls(
        output_dir=out,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=accumulation,
        max_steps=5,
        learning_rate=1e-2,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        weight_decay=0.1,
        max_grad_norm=0.5,
        logging_steps=1,
        seed=7,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        **{**extra, **pipeline},
    )


def compute_metrics(prediction: transformers.EvalPrediction) -> dict[str, float]:
    """Next-token accuracy and mean log-probability over the labelled tokens."""
    logits = torch.as_tensor(prediction.predictions)[:, :-1]
    labels = torch.as_tensor(prediction.label_ids)[:, 1:]
    mask = labels != -100
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    picked = log_probs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    correct = (logits.argmax(-1) == labels) & mask
    return {
        "accuracy": float(correct.sum() / mask.sum()),
        "log_prob": float(picked[mask].mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dialect", default="torch", help="torch, deepspeed or local")
    parser.add_argument("--reference", action="store_true", help="plain Trainer, one process")
    parser.add_argument("--family", default="llama", help="llama (tied head) or qwen2")
    parser.add_argument("--out", default="hf_trainer_output", help="Trainer's output_dir")
    parser.add_argument("--save", default=None, help="write the trained model here")
    parser.add_argument("--stages", type=int, default=None, help="default: one per process")
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per step")
    parser.add_argument(
        "--gradient-checkpointing", action="store_true", help="recompute the layers in backward"
    )
    parser.add_argument(
        "--eval", action="store_true", help="evaluate with metrics, checkpoint, load the best"
    )
    parser.add_argument("--bf16", action="store_true", help="Trainer's bf16 (autocast)")
    parser.add_argument("--resume", default=None, help="a checkpoint folder to resume from")
    parser.add_argument("--fsdp", action="store_true", help="shard the stages over the replicas")
    parser.add_argument(
        "--tp", type=int, default=None, help="tensor-parallel ranks per stage (the model's plan)"
    )
    options = parser.parse_args()

    transformers.logging.set_verbosity_error()
    model = build_model(options.family)
    arguments: dict[str, Any] = dict(
        checkpointing=options.gradient_checkpointing, evaluation=options.eval, bf16=options.bf16
    )
    common: dict[str, Any] = dict(
        model=model,
        train_dataset=TokenData(TRAIN_SAMPLES, seed=1),
        eval_dataset=TokenData(EVAL_SAMPLES, seed=2),
        compute_metrics=compute_metrics if options.eval else None,
    )
    if options.reference:
        args = training_arguments(options.out, options.accumulation, **arguments)
        trainer: transformers.Trainer = transformers.Trainer(args=args, **common)
    else:
        from pipedialect.integrations.transformers import (
            PipelineTrainer,
            PipelineTrainingArguments,
        )

        # The split: the config's base_model_pp_plan over one stage per process (two on local).
        stages = 2 if options.dialect == "local" and options.stages is None else options.stages
        args = training_arguments(
            options.out,
            options.accumulation,
            cls=PipelineTrainingArguments,
            dialect=options.dialect,
            num_stages=stages,
            data_parallel_mode="fsdp" if options.fsdp else None,
            tensor_parallel=options.tp,
            **arguments,
        )
        trainer = PipelineTrainer(args=args, **common)
    trainer.train(resume_from_checkpoint=options.resume)
    metrics = trainer.evaluate()
    if options.save is not None:
        trainer.save_model(options.save)
    steps = [row for row in trainer.state.log_history if "loss" in row and "step" in row]
    result = {
        "losses": [row["loss"] for row in steps],
        "grad_norms": [row["grad_norm"] for row in steps],
        "learning_rates": [row["learning_rate"] for row in steps],
        "eval_loss": metrics["eval_loss"],
        "evals": [
            {
                k: v
                for k, v in row.items()
                if k.startswith("eval_") and "runtime" not in k and "per_second" not in k
            }
            for row in trainer.state.log_history
            if "eval_loss" in row
        ],
        "final_metrics": {
            k: v for k, v in metrics.items() if k in ("eval_accuracy", "eval_log_prob")
        },
        "best_checkpoint": None
        if trainer.state.best_model_checkpoint is None
        else Path(trainer.state.best_model_checkpoint).name,
        "checkpoints": sorted(p.name for p in Path(options.out).glob("checkpoint-*")),
    }
    if trainer.is_world_process_zero():
        sys.stdout.flush()
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
