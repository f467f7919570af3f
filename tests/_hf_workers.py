"""Unmodified transformers models for the HF tests, and what each rank runs in the DeepSpeed ones.

Every model is built from a small config with random weights (no download: the hub is switched
off before transformers is imported), dropout 0 and the eager attention implementation. Weights
come from the global RNG seeded inside ``fork_rng``, so every process that builds a model gets
identical weights without disturbing the caller's RNG. A case knows its plan inputs, the
arguments it fixes, its split points and a deterministic micro-batch generator yielding
``(inputs, labels)`` with ``inputs`` in the plan's input order.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import pipedialect
from pipedialect import PipelinePlan, partition

try:
    import transformers
except ImportError as exc:  # a missing extra is an error here, never a silent skip
    raise ImportError(
        "the Hugging Face tests need transformers: pip install -e '.[hf]' (pins the tested version)"
    ) from exc

transformers.logging.set_verbosity_error()

VOCAB = 64
SEQ = 8
DATA_SEED = 100
EXAMPLE_SEED = 7  # the example inputs the capture sees are not a training micro-batch

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


def token_loss(outputs: Any, labels: torch.Tensor) -> torch.Tensor:
    """Cross entropy of the first output (the logits) against token labels; -100 is ignored."""
    logits = outputs[0]
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def _padding_mask(gen: torch.Generator, batch: int, seq: int) -> torch.Tensor:
    """Ones with a random run of trailing zeros (right padding) in every other row."""
    mask = torch.ones(batch, seq, dtype=torch.long)
    for row in range(1, batch, 2):
        keep = int(torch.randint(seq // 2, seq, (1,), generator=gen))
        mask[row, keep:] = 0
    return mask


#: What the in-process cases change in a family's config (:func:`family_config`): the eager
#: attention, no cache, and for GPT-2 and BERT four layers over 16 positions.
_EAGER = {"attn_implementation": "eager"}
_NO_CACHE = {"use_cache": False}


def _gpt2() -> nn.Module:
    config = family_config("gpt2", n_layer=4, n_positions=16, **_NO_CACHE, **_EAGER)
    return transformers.GPT2LMHeadModel(config)


def _gpt2_batch(gen: torch.Generator, batch: int) -> Batch:
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=gen)
    mask = _padding_mask(gen, batch, SEQ)
    labels = torch.randint(0, VOCAB, (batch, SEQ), generator=gen)
    return (ids, mask), labels


def _bert() -> nn.Module:
    config = family_config(
        "bert", num_hidden_layers=4, max_position_embeddings=16, type_vocab_size=2, **_EAGER
    )
    return transformers.BertForMaskedLM(config)


def _bert_batch(gen: torch.Generator, batch: int) -> Batch:
    ids = torch.randint(1, VOCAB, (batch, SEQ), generator=gen)
    mask = _padding_mask(gen, batch, SEQ)
    types = (torch.arange(SEQ) >= SEQ // 2).long().expand(batch, SEQ).clone()
    labels = torch.randint(0, VOCAB, (batch, SEQ), generator=gen)
    masked = torch.rand(batch, SEQ, generator=gen) < 0.4
    labels[~masked] = -100
    labels[0, 0] = 7  # every micro-batch has at least one label
    return (ids, mask, types), labels


def _t5() -> nn.Module:
    return transformers.T5ForConditionalGeneration(family_config("t5", **_NO_CACHE, **_EAGER))


def _t5_batch(gen: torch.Generator, batch: int) -> Batch:
    ids = torch.randint(2, VOCAB, (batch, SEQ), generator=gen)
    mask = _padding_mask(gen, batch, SEQ)
    decoder_ids = torch.randint(2, VOCAB, (batch, SEQ - 2), generator=gen)
    labels = torch.randint(2, VOCAB, (batch, SEQ - 2), generator=gen)
    return (ids, mask, decoder_ids), labels


class _Fed:
    """What a case and a family share: a model whose weights depend only on a seed, the example
    micro-batch the capture sees, and the unsplit model called as transformers users call it.
    A subclass has ``input_names``, ``fixed``, ``micro_batches`` and ``_construct``."""

    input_names: tuple[str, ...]
    #: forward arguments fixed for the capture and for the reference call alike
    fixed: dict[str, Any]

    def _construct(self) -> nn.Module:
        raise NotImplementedError

    def micro_batches(
        self, count: int, *, batch_size: int = 2, seed: int = DATA_SEED
    ) -> Iterator[Batch]:
        raise NotImplementedError

    def build(self, seed: int = 0) -> nn.Module:
        """The model with weights drawn from ``seed``; the caller's RNG is left alone."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = self._construct()
        return model.train()

    def example_inputs(self, batch_size: int = 2) -> dict[str, torch.Tensor]:
        inputs, _ = next(self.micro_batches(1, batch_size=batch_size, seed=EXAMPLE_SEED))
        return dict(zip(self.input_names, inputs, strict=True))

    def forward(self, model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> Any:
        """The unsplit model, called as transformers users call it (keyword inputs)."""
        return model(**dict(zip(self.input_names, inputs, strict=True)), **self.fixed)


@dataclass(frozen=True)
class HFCase(_Fed):
    """One transformers model, how to partition it and what to feed it."""

    name: str
    factory: Callable[[], nn.Module]
    input_names: tuple[str, ...]
    split_points: dict[int, tuple[str, ...]]
    make_batch: Callable[[torch.Generator, int], Batch]
    #: forward arguments fixed for the capture and for the reference call alike
    fixed: dict[str, Any] = field(default_factory=dict)
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] = token_loss

    def _construct(self) -> nn.Module:
        return self.factory()

    def micro_batches(
        self, count: int, *, batch_size: int = 2, seed: int = DATA_SEED
    ) -> Iterator[Batch]:
        gen = torch.Generator().manual_seed(seed)
        for _ in range(count):
            yield self.make_batch(gen, batch_size)

    def partition(self, model: nn.Module, num_stages: int, batch_size: int = 2) -> PipelinePlan:
        """What a user writes: split points, one example micro-batch, the fixed flags."""
        return partition(
            model,
            split_points=self.split_points[num_stages],
            example_inputs=self.example_inputs(batch_size),
            concrete_args=self.fixed,
        )


CASES = {
    "gpt2": HFCase(
        name="gpt2",
        factory=_gpt2,
        input_names=("input_ids", "attention_mask"),
        split_points={
            2: ("transformer.h.1",),
            4: ("transformer.h.0", "transformer.h.1", "transformer.h.2"),
        },
        make_batch=_gpt2_batch,
        fixed={"return_dict": False, "use_cache": False},
    ),
    "bert": HFCase(
        name="bert",
        factory=_bert,
        input_names=("input_ids", "attention_mask", "token_type_ids"),
        split_points={
            2: ("bert.encoder.layer.1",),
            4: ("bert.encoder.layer.0", "bert.encoder.layer.1", "bert.encoder.layer.2"),
        },
        make_batch=_bert_batch,
        fixed={"return_dict": False},
    ),
    "t5": HFCase(
        name="t5",
        factory=_t5,
        input_names=("input_ids", "attention_mask", "decoder_input_ids"),
        split_points={
            2: ("decoder.block.0",),
            4: ("encoder.block.0", "decoder.block.0", "decoder.block.1"),
        },
        make_batch=_t5_batch,
        fixed={"return_dict": False, "use_cache": False},
    ),
}


# -- families as a new user meets them ----------------------------------------------------------


def _decoder_kwargs() -> dict[str, Any]:
    return {"vocab_size": VOCAB, "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 1}


def family_config(name: str, **overrides: Any) -> Any:
    """Family ``name``'s tiny config (2 layers, hidden 32) with every dropout off and the
    attention each model picks by default (sdpa wherever transformers has it), ``overrides``
    changed."""
    return _family_settings()[name](**overrides)


def _family_settings() -> dict[str, Callable[..., Any]]:
    t = transformers
    rotary = {
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "max_position_embeddings": 32,
        **_decoder_kwargs(),
    }
    return {
        "llama": partial(t.LlamaConfig, **rotary, tie_word_embeddings=True),
        "qwen2": partial(t.Qwen2Config, **rotary, tie_word_embeddings=True),
        "mistral": partial(t.MistralConfig, **rotary, head_dim=8),
        "gpt_neox": partial(
            t.GPTNeoXConfig,
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=32,
            rotary_pct=0.5,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            **_decoder_kwargs(),
        ),
        "gpt2": partial(
            t.GPT2Config,
            n_layer=2,
            n_embd=32,
            n_head=2,
            n_positions=32,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            vocab_size=VOCAB,
            bos_token_id=0,
            eos_token_id=0,
        ),
        "opt": partial(
            t.OPTConfig,
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            ffn_dim=64,
            word_embed_proj_dim=32,
            max_position_embeddings=32,
            dropout=0.0,
            attention_dropout=0.0,
            **_decoder_kwargs(),
        ),
        "bert": partial(
            t.BertConfig,
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=2,
            intermediate_size=64,
            vocab_size=VOCAB,
            max_position_embeddings=32,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            pad_token_id=0,
        ),
        "t5": partial(
            t.T5Config,
            num_layers=2,
            num_decoder_layers=2,
            d_model=32,
            d_kv=16,
            num_heads=2,
            d_ff=64,
            vocab_size=VOCAB,
            dropout_rate=0.0,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        ),
        "bart": partial(
            t.BartConfig,
            encoder_layers=2,
            decoder_layers=2,
            d_model=32,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=32,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            decoder_start_token_id=0,
            **_decoder_kwargs(),
        ),
    }


@dataclass(frozen=True)
class Family(_Fed):
    """One transformers family as a user brings it: a class, a config, where to cut it."""

    name: str
    #: The transformers model class.
    model_cls: type[Any]
    #: The module the first stage ends after (2 stages).
    split_point: str
    #: Whether forward takes ``decoder_input_ids`` (an encoder-decoder).
    encoder_decoder: bool = False
    #: Forward flags fixed for the capture and for the reference call alike.
    fixed: dict[str, Any] = field(
        default_factory=lambda: {"return_dict": False, "use_cache": False}
    )

    @property
    def input_names(self) -> tuple[str, ...]:
        names = ("input_ids", "attention_mask")
        return (*names, "decoder_input_ids") if self.encoder_decoder else names

    def config(self) -> Any:
        return family_config(self.name)

    def _construct(self) -> nn.Module:
        model: nn.Module = self.model_cls(self.config())
        return model

    def micro_batches(
        self, count: int, *, batch_size: int = 2, seed: int = DATA_SEED
    ) -> Iterator[Batch]:
        """Token ids with right padding in every other row (and decoder ids), token labels."""
        gen = torch.Generator().manual_seed(seed)
        for _ in range(count):
            ids = torch.randint(2, VOCAB, (batch_size, SEQ), generator=gen)
            inputs: tuple[torch.Tensor, ...] = (ids, _padding_mask(gen, batch_size, SEQ))
            length = SEQ
            if self.encoder_decoder:
                length = SEQ - 2
                inputs += (torch.randint(2, VOCAB, (batch_size, length), generator=gen),)
            yield inputs, torch.randint(2, VOCAB, (batch_size, length), generator=gen)


#: Every family the HF tests partition; the rotary ones (Llama, Qwen2, Mistral, GPT-NeoX) hold
#: a non-persistent ``inv_freq``, BERT its position and token type ids, T5 and BART a shared
#: embedding that the stages hold under other names.
FAMILIES = {
    f.name: f
    for f in (
        Family("llama", transformers.LlamaForCausalLM, "model.layers.0"),
        Family("qwen2", transformers.Qwen2ForCausalLM, "model.layers.0"),
        Family("mistral", transformers.MistralForCausalLM, "model.layers.0"),
        Family("gpt_neox", transformers.GPTNeoXForCausalLM, "gpt_neox.layers.0"),
        Family("gpt2", transformers.GPT2LMHeadModel, "transformer.h.0"),
        Family("opt", transformers.OPTForCausalLM, "model.decoder.layers.0"),
        Family(
            "bert",
            transformers.BertForMaskedLM,
            "bert.encoder.layer.0",
            fixed={"return_dict": False},
        ),
        Family("t5", transformers.T5ForConditionalGeneration, "decoder.block.0", True),
        Family("bart", transformers.BartForConditionalGeneration, "model.decoder.layers.0", True),
    )
}


# -- DeepSpeed ranks --------------------------------------------------------------------------


#: The optimizers the tests use: DeepSpeed's config entry and the torch optimizer it builds.
#: The in-process tests use Adam, whose per-element normalisation would amplify float noise:
#: there the pipeline runs the reference's operations in the reference's order. The multi-process
#: runs sum gradients in other orders (across boundaries, across ranks), and transformer
#: gradients are ill-conditioned in fp32: T5's own fp32 gradients differ from fp64 ones by up to
#: 2e-6 relative per tensor, and an attention key bias has a gradient that is zero in exact
#: arithmetic (softmax ignores a shift shared by all scores), so autograd returns noise of about
#: 1e-11 for it, which Adam turns into steps of 1e-3 * lr. SGD with momentum is linear in the
#: gradients and keeps two correct runs within float noise (measured: at most 1.2e-7 relative
#: per parameter tensor, T5 on DeepSpeed).
OPTIMIZERS: dict[str, tuple[dict[str, Any], Callable[[Any], torch.optim.Optimizer]]] = {
    "adam": (
        {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True, "adam_w_mode": False}},
        lambda params: torch.optim.Adam(params, lr=1e-2),
    ),
    "sgd": (
        {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    ),
}


def ds_config(gas: int, micro: int, optimizer: str) -> dict[str, Any]:
    """A DeepSpeed (and local dialect) config with one of :data:`OPTIMIZERS`, no clipping."""
    return {
        "train_batch_size": micro * gas,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "optimizer": OPTIMIZERS[optimizer][0],
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }


def _train(
    dialect: Any,
    plan: PipelinePlan,
    fed: _Fed,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    config: dict[str, Any],
    steps: int,
    micro: int,
    **pipe_kwargs: Any,
) -> tuple[Any, list[float]]:
    """This rank's engine for ``plan`` (``pipe_kwargs`` for ``pipe_engine``) after ``steps``
    steps on ``fed``'s micro-batches, and their losses."""
    module = dialect.pipe_engine(plan, config=config, loss_fn=loss_fn, **pipe_kwargs)
    engine = dialect.runtime_engine(module, config=config)
    data = fed.micro_batches(steps * config["gradient_accumulation_steps"], batch_size=micro)
    return engine, [float(engine.train_batch(data_iter=data)) for _ in range(steps)]


def _stage_params(plan: PipelinePlan, stages: list[int]) -> dict[str, torch.Tensor]:
    """Copies of the parameters of ``stages``, every tied name included."""
    return {
        n: p.detach().cpu().clone()
        for k in stages
        for n, p in plan.stages[k].named_parameters(remove_duplicate=False)
    }


def train_deepspeed(
    names: list[str], num_stages: int, optimizer: str, steps: int, gas: int, micro: int
) -> dict[str, Any]:
    """Train every named model on this rank's stage; losses and that stage's parameters."""
    dialect = pipedialect.get_dialect("deepspeed")
    dialect.init_distributed()
    config = ds_config(gas, micro, optimizer)
    results: dict[str, Any] = {}
    for name in names:
        case = CASES[name]
        plan = case.partition(case.build(0), num_stages, batch_size=micro)
        topology = dialect.make_topology(num_stages, 1)
        engine, losses = _train(
            dialect, plan, case, case.loss_fn, config, steps, micro, topology=topology
        )
        eval_loss = float(engine.eval_batch(case.micro_batches(gas, batch_size=micro)))
        (stage,) = dialect.local_stages(engine)
        results[name] = {
            "losses": losses,
            "eval_loss": eval_loss,
            "stage": stage,
            "params": _stage_params(plan, [stage]),
            "replicated": sorted(
                n
                for n, p in plan.stages[stage].named_parameters(remove_duplicate=False)
                if getattr(p, "ds_pipe_replicated", False)
            ),
        }
    return results


# -- torch.distributed.pipelining ranks -------------------------------------------------------


def train_torch(
    names: list[str],
    layouts: list[tuple[int, str]],
    optimizer: str,
    steps: int,
    gas: int,
    micro: int,
) -> dict[str, Any]:
    """For every ``(num_stages, schedule)`` and model, train with the torch dialect on this
    rank; results by ``"<num_stages>-<schedule>/<model>"``."""
    import torch.distributed as dist

    dialect = pipedialect.get_dialect("torch")
    dialect.init_distributed()
    config = ds_config(gas, micro, optimizer)
    results: dict[str, Any] = {}
    for num_stages, schedule in layouts:
        for name in names:
            case = CASES[name]
            plan = case.partition(case.build(0), num_stages, batch_size=micro)
            engine, losses = _train(
                dialect, plan, case, case.loss_fn, config, steps, micro, schedule=schedule
            )
            eval_loss = float(engine.eval_batch(case.micro_batches(gas, batch_size=micro)))
            stages = list(dialect.local_stages(engine))
            results[f"{num_stages}-{schedule}/{name}"] = {
                "losses": losses,
                "eval_loss": eval_loss,
                "stages": stages,
                "params": _stage_params(plan, stages),
            }
            dist.barrier()
    return results


# -- a pretrained directory through a meta plan on several ranks ------------------------------


def pretrained_roundtrip(
    directories: dict[str, str], dialect_name: str, out: str, steps: int, gas: int, micro: int
) -> dict[str, Any]:
    """For each family's ``save_pretrained`` directory: a meta model from its config, 2 stages
    with the default attention, each rank loading its stage with ``from_pretrained(dir,
    plan=plan)`` (no other argument), SGD steps, a portable checkpoint, and (rank 0) its
    ``export_hf`` into ``out/<name>/export``. Returns losses and this rank's parameters."""
    import torch.distributed as dist

    from pipedialect import checkpoint
    from pipedialect.plan.weights import from_pretrained

    dialect = pipedialect.get_dialect(dialect_name)
    dialect.init_distributed()
    config = ds_config(gas, micro, "sgd")
    results: dict[str, Any] = {}
    for name, directory in directories.items():
        family = FAMILIES[name]
        saved = family.model_cls.config_class.from_pretrained(directory)
        with torch.device("meta"):
            meta = family.model_cls._from_config(saved).train()
        plan = partition(
            meta,
            [family.split_point],
            example_inputs=family.example_inputs(micro),
            concrete_args=family.fixed,
        )
        kwargs: dict[str, Any] = {"init_weights": from_pretrained(directory, plan=plan)}
        if dialect_name == "deepspeed":
            kwargs["topology"] = dialect.make_topology(2, 1)
        else:
            kwargs["schedule"] = "1F1B"
        engine, losses = _train(dialect, plan, family, token_loss, config, steps, micro, **kwargs)
        stages = list(dialect.local_stages(engine))
        checkpoint.save(engine, f"{out}/{name}/ckpt")
        if dist.get_rank() == 0:
            checkpoint.export_hf(f"{out}/{name}/ckpt", f"{out}/{name}/export", config=saved)
        dist.barrier()
        results[name] = {"losses": losses, "stages": stages, "params": _stage_params(plan, stages)}
    return results


def tiny_llama() -> nn.Module:
    """A 4-layer Llama with tied embeddings and grouped-query attention, eager."""
    config = transformers.LlamaConfig(
        num_hidden_layers=4,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        tie_word_embeddings=True,
        use_cache=False,
        attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(config)
