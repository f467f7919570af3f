"""What a new user meets on the first day, each refused by name before any work.

- the deepspeed dialect under plain ``python``: DeepSpeed would look for an MPI job and fail in
  ``mpi4py``; the dialect names the launchers instead;
- a ``loss_fn`` that does not take ``(outputs, labels)``: a raw TypeError at the first step,
  after the whole start-up; the shared ``pipe_engine`` refuses it on every dialect first;
- the documentation's configs: an Adam without ``torch_adam`` makes DeepSpeed compile its
  FusedAdam C++ op (minutes on a CPU, in a cache every environment shares), so every config the
  pages and examples show uses torch's Adam, and the DeepSpeed page says where ops are cached.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _doc_examples as docs
import pytest
import torch
from torch import nn

import pipedialect
from pipedialect import ConfigError
from pipedialect.models import cross_entropy_loss, get_model

ROOT = Path(__file__).resolve().parents[2]


def test_the_deepspeed_dialect_outside_a_launcher_names_the_launchers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert not torch.distributed.is_initialized()
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError) as info:
        pipedialect.get_dialect("deepspeed").init_distributed()
    text = str(info.value)
    assert "not started by a launcher" in text
    for launcher in (
        "torchrun --nproc_per_node N",
        "deepspeed --num_gpus N",
        "pipedialect.runtime.launch",
    ):
        assert launcher in text
    assert not torch.distributed.is_initialized()


def _gpt_plan() -> Any:
    spec = get_model("gpt")
    return pipedialect.partition(spec.build(), split_points=list(spec.split_points_for(2)))


_CONFIG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def _one_argument(outputs: torch.Tensor) -> torch.Tensor:
    return outputs.sum()


def _three_arguments(outputs: torch.Tensor, labels: torch.Tensor, weight: float) -> torch.Tensor:
    return cross_entropy_loss(outputs, labels) * weight


def _keyword_only(outputs: torch.Tensor, labels: torch.Tensor, *, weight: float) -> torch.Tensor:
    return cross_entropy_loss(outputs, labels) * weight


@pytest.mark.parametrize("dialect_name", ["local", "torch", "deepspeed"])
@pytest.mark.parametrize(
    ("loss_fn", "name"),
    [
        (_one_argument, "loss_fn _one_argument(outputs) cannot"),
        (_three_arguments, "loss_fn _three_arguments(outputs, labels, weight) cannot"),
        (_keyword_only, "loss_fn _keyword_only(outputs, labels, *, weight) cannot"),
        (
            functools.partial(_three_arguments, weight=1.0, labels=None),
            "loss_fn functools.partial(_three_arguments, ...)(outputs, *, labels=None, weight=1.0)",
        ),
        (nn.Identity(), "loss_fn Identity(input) cannot"),
    ],
)
def test_a_loss_fn_that_cannot_take_outputs_and_labels_is_refused_first(
    dialect_name: str, loss_fn: Callable[..., Any], name: str
) -> None:
    """No process group here: the check runs before the dialect needs one."""
    dialect = pipedialect.get_dialect(dialect_name)
    with pytest.raises(
        ConfigError, match="cannot be called as loss_fn\\(outputs, labels\\)"
    ) as info:
        dialect.pipe_engine(
            _gpt_plan(), config=_CONFIG, loss_fn=loss_fn, topology=dialect.make_topology(2)
        )
    assert name in str(info.value)


class _CallableLoss:
    def __call__(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return cross_entropy_loss(outputs, labels)


def _scaled(outputs: torch.Tensor, labels: torch.Tensor, scale: float) -> torch.Tensor:
    return cross_entropy_loss(outputs, labels) * scale


class _FlatCrossEntropy(nn.CrossEntropyLoss):
    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return super().forward(input.flatten(0, 1), target.flatten())


@pytest.mark.parametrize(
    "loss_fn",
    [
        cross_entropy_loss,
        lambda outputs, labels, scale=1.0: cross_entropy_loss(outputs, labels) * scale,
        lambda *args: cross_entropy_loss(*args),
        functools.partial(_scaled, scale=1.0),
        _CallableLoss(),
        _FlatCrossEntropy(),
    ],
)
def test_a_loss_fn_that_takes_outputs_and_labels_trains(loss_fn: Callable[..., Any]) -> None:
    plan = _gpt_plan()
    dialect = pipedialect.get_dialect("local")
    engine = dialect.runtime_engine(dialect.pipe_engine(plan, config=_CONFIG, loss_fn=loss_fn))
    ids, labels = next(get_model("gpt").micro_batches(1))
    with torch.no_grad():
        expected = cross_entropy_loss(plan.graph(ids), labels).item()
    assert engine.train_batch(iter([(ids, labels)])).item() == pytest.approx(expected, rel=1e-6)


def _adam_without_torch_adam(code: str) -> list[int]:
    """Lines of ``code`` whose optimizer section is an Adam that DeepSpeed would compile."""
    found = []
    for node in ast.walk(ast.parse(code)):
        if not isinstance(node, ast.Dict):
            continue
        items = {
            k.value: v
            for k, v in zip(node.keys, node.values, strict=True)
            if isinstance(k, ast.Constant)
        }
        kind = items.get("type")
        if not (isinstance(kind, ast.Constant) and kind.value in ("Adam", "AdamW")):
            continue
        params = items.get("params")
        literal = ast.literal_eval(params) if isinstance(params, ast.Dict) else {}
        if literal.get("torch_adam") is not True:
            found.append(node.lineno)
    return found


def test_no_documented_config_makes_deepspeed_compile_fused_adam() -> None:
    programs = [(e.id, e.code) for e in docs.collect().examples if e.mode != "shell"]
    programs += [
        (str(p.relative_to(ROOT)), p.read_text()) for p in (ROOT / "examples").glob("*.py")
    ]
    assert any(where == "examples/quickstart.py" for where, _ in programs)
    offending = [
        (where, lines) for where, code in programs if (lines := _adam_without_torch_adam(code))
    ]
    assert not offending, offending


def test_the_deepspeed_page_says_where_ops_are_built_and_how_to_move_them() -> None:
    text = docs.visible_text(ROOT / "docs" / "deepspeed.rst")  # lower case
    assert "~/.cache/torch_extensions" in text
    assert "torch_extensions_dir" in text
