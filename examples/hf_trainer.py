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
"""

from __future__ import annotations

import argparse
import json
import os
import sys

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


def training_arguments(out: str, accumulation: int = 2) -> transformers.TrainingArguments:
    """What both runs train with: 2 sequences per micro-batch, 2 micro-batches per step."""
    return transformers.TrainingArguments(
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
        save_strategy="no",
        disable_tqdm=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dialect", default="torch", help="torch, deepspeed or local")
    parser.add_argument("--reference", action="store_true", help="plain Trainer, one process")
    parser.add_argument("--family", default="llama", help="llama (tied head) or qwen2")
    parser.add_argument("--out", default="hf_trainer_output", help="Trainer's output_dir")
    parser.add_argument("--save", default=None, help="write the trained model here")
    parser.add_argument("--stages", type=int, default=None, help="default: one per process")
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--fsdp", action="store_true", help="shard the stages over the replicas")
    options = parser.parse_args()

    transformers.logging.set_verbosity_error()
    model = build_model(options.family)
    common = dict(
        model=model,
        args=training_arguments(options.out, options.accumulation),
        train_dataset=TokenData(TRAIN_SAMPLES, seed=1),
        eval_dataset=TokenData(EVAL_SAMPLES, seed=2),
    )
    if options.reference:
        trainer: transformers.Trainer = transformers.Trainer(**common)
    else:
        from pipedialect.integrations.transformers import PipelineArguments, PipelineTrainer

        # The split: the config's base_model_pp_plan over one stage per process (two on local).
        stages = 2 if options.dialect == "local" and options.stages is None else options.stages
        mode = "fsdp" if options.fsdp else None
        pipeline = PipelineArguments(
            dialect=options.dialect, num_stages=stages, data_parallel_mode=mode
        )
        trainer = PipelineTrainer(**common, pipeline=pipeline)
    trainer.train()
    metrics = trainer.evaluate()
    if options.save is not None:
        trainer.save_model(options.save)
    steps = [row for row in trainer.state.log_history if "loss" in row and "step" in row]
    result = {
        "losses": [row["loss"] for row in steps],
        "grad_norms": [row["grad_norm"] for row in steps],
        "learning_rates": [row["learning_rate"] for row in steps],
        "eval_loss": metrics["eval_loss"],
    }
    if trainer.is_world_process_zero():
        sys.stdout.flush()
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
