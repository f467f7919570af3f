"""Rank functions for meta-device plans built with ``pipe_engine(..., init_weights=fn)``.

Each rank partitions a model built on the meta device, lets the dialect materialise the stages
it runs, trains, and returns its losses, its stages' parameters and which stages stayed on
meta; the tests compare these with the unsplit model trained in the test's own process
(for the Hugging Face models, the unsplit ``from_pretrained`` model of the same directory).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import _hf_workers as hf
import _model_registry
import torch
import transformers
from torch import nn

import pipedialect
from pipedialect import partition
from pipedialect.plan.weights import from_pretrained, from_state_dict

#: The model every dialect trains from a meta plan: TinyGPT, tied embedding and head across
#: the first and the last stage.
MODEL = "gpt"
STEPS, GAS, MICRO = 3, 2, 2


def _train(
    dialect: Any, plan: Any, config: dict[str, Any], loss_fn: Any, data: Any, **kwargs: Any
) -> dict[str, Any]:
    module = dialect.pipe_engine(plan, config=config, loss_fn=loss_fn, **kwargs)
    engine = dialect.runtime_engine(module, config=config)
    stages = list(dialect.local_stages(engine))
    losses = [float(engine.train_batch(data_iter=data)) for _ in range(STEPS)]
    params = {
        n: p.detach().cpu().clone()
        for k in stages
        for n, p in plan.stages[k].named_parameters(remove_duplicate=False)
    }
    # A tied weight of another rank's stage may be rebound to this rank's copy: not counted.
    tied = {(n, k) for group in plan.tie_groups for n, k in group}
    on_meta = [
        k
        for k, stage in enumerate(plan.stages)
        if all(p.is_meta for n, p in stage.named_parameters() if (n, k) not in tied)
    ]
    return {"stages": stages, "losses": losses, "params": params, "on_meta": on_meta}


def tinygpt_meta_run(dialect_name: str) -> dict[str, Any]:
    """TinyGPT built on meta, 2 stages, each rank's stage filled from the CPU model's state."""
    spec = _model_registry.spec_for(MODEL)
    dialect = pipedialect.get_dialect(dialect_name)
    dialect.init_distributed()
    with torch.device("meta"):
        meta = spec.build(0)
    plan = partition(meta, spec.split_points_for(2))
    state = spec.build(0).state_dict()
    config = _model_registry.ds_config("sgd", gas=GAS, micro=MICRO, dp=1)
    kwargs: dict[str, Any] = {"init_weights": from_state_dict(state, plan=plan)}
    if dialect_name == "deepspeed":
        kwargs["topology"] = dialect.make_topology(2, 1)
    else:
        kwargs["schedule"] = "1F1B"
    data = _model_registry.data_stream(spec, STEPS * GAS, MICRO, 0)
    return _train(dialect, plan, config, spec.loss_fn, data, **kwargs)


#: The Hugging Face models of the checkpoint round trip: the class, the first layer of stage 1.
PRETRAINED = {
    "gpt2": (transformers.GPT2LMHeadModel, "transformer.h.1"),
    "llama": (transformers.LlamaForCausalLM, "model.layers.1"),
}
#: Forward flags fixed for the capture and the reference call alike (both models take them).
PRETRAINED_FIXED = {"return_dict": False, "use_cache": False}


def rotary_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Llama's non-persistent rotary tables (in no checkpoint file), computed on the CPU by a
    fresh rotary module of the model's config, under the names the model gives them."""
    with torch.device("cpu"):
        rotary = type(model.model.rotary_emb)(model.config)
    return {f"model.rotary_emb.{n}": b for n, b in rotary.named_buffers()}


def pretrained_checkpoint_runs(directories: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Each ``save_pretrained`` model of ``directories`` (``{"gpt2" | "llama": path}``) in turn on
    2 DeepSpeed stages of the same processes: built on meta from the saved config, partitioned,
    and loaded per rank with ``init_weights=from_pretrained(directory)``."""
    dialect = pipedialect.get_dialect("deepspeed")
    dialect.init_distributed()
    results = {}
    for name, directory in directories.items():
        model_cls, split = PRETRAINED[name]
        config_hf = transformers.AutoConfig.from_pretrained(directory)
        with torch.device("meta"):
            meta = model_cls._from_config(config_hf, attn_implementation="eager").train()
        batches = pretrained_batches()
        example = dict(zip(("input_ids", "attention_mask"), batches[0][0], strict=True))
        plan = partition(meta, [split], example_inputs=example, concrete_args=PRETRAINED_FIXED)
        buffers = rotary_buffers(meta) if name == "llama" else None
        config = _model_registry.ds_config("sgd", gas=4, micro=2, dp=1)
        results[name] = _train(
            dialect,
            plan,
            config,
            hf.token_loss,
            iter(copy.deepcopy(batches)),
            topology=dialect.make_topology(2, 1),
            init_weights=from_pretrained(Path(directory), plan=plan, buffers=buffers),
        )
    return results


def pretrained_batches() -> list[Any]:
    """The micro-batches of the Hugging Face runs, the same in every process: token ids of
    ``hf.VOCAB`` with a padding mask, which both models (same vocabulary) take."""
    gen = torch.Generator().manual_seed(3)
    return [hf._gpt2_batch(gen, 2) for _ in range(STEPS * 4)]
