"""Rank functions for meta-device plans built with ``pipe_engine(..., init_weights=fn)``.

Each rank partitions a model built on the meta device, lets the dialect materialise the stages
it runs, trains, and returns its losses, its stages' parameters and which stages stayed on
meta; the tests compare these with the unsplit model trained in the test's own process.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import _ds_workers as ds
import _hf_workers as hf
import torch
import transformers

import pipedialect
from pipedialect import partition
from pipedialect.weights import from_pretrained, from_state_dict

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
    spec = ds.spec_for(MODEL)
    dialect = pipedialect.get_dialect(dialect_name)
    dialect.init_distributed()
    with torch.device("meta"):
        meta = spec.build(0)
    plan = partition(meta, spec.split_points_for(2))
    state = spec.build(0).state_dict()
    config = ds.ds_config("sgd", gas=GAS, micro=MICRO, dp=1)
    kwargs: dict[str, Any] = {"init_weights": from_state_dict(state, plan=plan)}
    if dialect_name == "deepspeed":
        kwargs["topology"] = dialect.make_topology(2, 1)
    else:
        kwargs["schedule"] = "1F1B"
    data = ds.data_stream(spec, STEPS * GAS, MICRO, 0)
    return _train(dialect, plan, config, spec.loss_fn, data, **kwargs)


def gpt2_checkpoint_run(directory: str) -> dict[str, Any]:
    """The save_pretrained GPT-2 in ``directory`` on 2 DeepSpeed stages, built on meta and
    loaded per rank with ``init_weights=from_pretrained(directory)``."""
    dialect = pipedialect.get_dialect("deepspeed")
    dialect.init_distributed()
    config_hf = transformers.AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        meta = transformers.GPT2LMHeadModel._from_config(
            config_hf, attn_implementation="eager"
        ).train()
    batches = gpt2_batches()
    example = dict(zip(("input_ids", "attention_mask"), batches[0][0], strict=True))
    plan = partition(
        meta, ["transformer.h.1"], example_inputs=example, concrete_args=hf.CASES["gpt2"].fixed
    )
    config = ds.ds_config("sgd", gas=4, micro=2, dp=1)
    return _train(
        dialect,
        plan,
        config,
        hf.token_loss,
        iter(copy.deepcopy(batches)),
        topology=dialect.make_topology(2, 1),
        init_weights=from_pretrained(Path(directory), plan=plan),
    )


def gpt2_batches() -> list[Any]:
    """The GPT-2 micro-batches of the run, the same in every process."""
    gen = torch.Generator().manual_seed(3)
    return [hf._gpt2_batch(gen, 2) for _ in range(STEPS * 4)]
