"""Micro-batches by name: dicts keyed by the model's inputs and "labels", on every dialect.

A Hugging Face collator yields ``{"input_ids": ..., "attention_mask": ..., "labels": ...}``;
every dialect takes such a dict as a micro-batch, puts the inputs in ``forward``'s order by
name and trains exactly as on the ``((ids, mask), labels)`` tuples, which equal the unsplit
model trained by a plain loop (``_batches_workers.reference``). A key too many or too few is a
named error before the first step, and an input that cannot be what stage 0 does with it (the
``(mask, ids)`` mix-up of ``forward(ids, mask)``) is refused by name rather than trained on.
"""

from __future__ import annotations

from typing import Any

import _batches_workers as workers
import pytest
import torch
from _compare import ATOL, RTOL, assert_tensor_close

import pipedialect
from pipedialect import DataError
from pipedialect.models import cross_entropy_loss
from pipedialect.runtime.launch import launch

STEPS = 3


def _assert_trains_as_the_unsplit_model(result: dict[str, Any]) -> None:
    losses, params = workers.reference(STEPS)
    for kind in ("tuples", "dicts"):
        got = result[kind]
        assert got["losses"] == pytest.approx(losses, rel=RTOL, abs=ATOL), kind
        for name, value in got["params"].items():
            assert_tensor_close(value, params[name], f"{kind}: {name}")
    # Dicts are the same micro-batches: not close, equal.
    assert result["dicts"]["losses"] == result["tuples"]["losses"]
    assert result["dicts"]["eval"] == result["tuples"]["eval"]
    for name, value in result["dicts"]["params"].items():
        assert torch.equal(value, result["tuples"]["params"][name]), name


def _assert_missing_key_refused(result: dict[str, Any]) -> None:
    assert "it lacks 'mask'" in result["error"], result["error"]
    assert "['ids', 'mask', 'labels']" in result["error"], result["error"]
    assert result["unchanged"]


def test_local_trains_on_dicts_as_on_tuples_and_as_the_unsplit_model() -> None:
    result = workers.run("local", STEPS)
    _assert_trains_as_the_unsplit_model(result)
    _assert_missing_key_refused(result)


@pytest.mark.distributed
def test_deepspeed_trains_on_dicts_as_on_tuples_and_as_the_unsplit_model() -> None:
    results = launch(workers.run, 2, "deepspeed", STEPS, timeout=600)
    assert len(results) == 2
    for result in results:  # each rank holds one stage: together, every parameter
        _assert_trains_as_the_unsplit_model(result)
        _assert_missing_key_refused(result)
    names = {n for r in results for n in r["dicts"]["params"]}
    assert names == {n for n, _ in workers.Tagger().named_parameters()}


@pytest.mark.distributed
def test_torch_trains_on_dicts_as_on_tuples_and_as_the_unsplit_model() -> None:
    results = launch(workers.run, 2, "torch", STEPS, timeout=600)
    assert len(results) == 2
    for result in results:
        _assert_trains_as_the_unsplit_model(result)
        _assert_missing_key_refused(result)
    names = {n for r in results for n in r["dicts"]["params"]}
    assert names == {n for n, _ in workers.Tagger().named_parameters()}


def _local_engine(plan: Any) -> Any:
    dialect = pipedialect.get_dialect("local")
    module = dialect.pipe_engine(plan, config=workers.config(), loss_fn=cross_entropy_loss)
    return dialect.runtime_engine(module)


def _fx_plan() -> Any:
    return pipedialect.partition(workers.Tagger(), split_points=list(workers.SPLIT))


def _export_plan() -> Any:
    (ids, mask), _ = workers.micro_batches(1)[0]
    return pipedialect.partition(
        workers.Tagger(),
        split_points=list(workers.SPLIT),
        example_inputs={"ids": ids, "mask": mask},
    )


def _params(plan: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for stage in plan.stages for n, p in stage.named_parameters()}


def _refused(plan: Any, batches: list[Any]) -> str:
    """The DataError ``train_batch`` raises; nothing may have changed."""
    engine = _local_engine(plan)
    before = _params(plan)
    with pytest.raises(DataError) as info:
        engine.train_batch(iter(batches))
    after = _params(plan)
    assert all(torch.equal(before[n], after[n]) for n in before)
    return str(info.value)


def test_an_unknown_key_is_named_with_the_expected_ones() -> None:
    batches = [
        {"ids": ids, "attention_mask": mask, "labels": labels}
        for (ids, mask), labels in workers.micro_batches(2)
    ]
    text = _refused(_fx_plan(), batches)
    assert "the model takes no input 'attention_mask'" in text
    assert "it lacks 'mask'" in text
    assert "['ids', 'mask', 'labels']" in text


def test_a_dict_without_labels_is_named() -> None:
    batches = [{"ids": ids, "mask": mask} for (ids, mask), _ in workers.micro_batches(2)]
    text = _refused(_fx_plan(), batches)
    assert "it lacks 'labels'" in text


def test_swapped_inputs_are_refused_by_the_layer_they_go_into() -> None:
    """fx capture: ``ids`` goes into an Embedding, so a float there is the mask in its place."""
    swapped = [((mask, ids), labels) for (ids, mask), labels in workers.micro_batches(2)]
    text = _refused(_fx_plan(), swapped)
    assert "input 'ids' (position 0 of ['ids', 'mask'])" in text
    assert "must be an integer tensor (stage 0 passes it to Embedding 'embed')" in text
    assert "yield a dict keyed by name" in text


def test_swapped_inputs_are_refused_by_the_example_inputs_and_named_as_swapped() -> None:
    """torch.export capture: both inputs' dtypes are known, so the swap is named as one."""
    swapped = [((mask, ids), labels) for (ids, mask), labels in workers.micro_batches(2)]
    text = _refused(_export_plan(), swapped)
    assert "input 'ids' (position 0 of ['ids', 'mask']) is a torch.float32 tensor" in text
    assert "it fits 'mask' and 'mask''s value fits 'ids': are they swapped?" in text


def test_a_dict_trains_an_exported_plan_as_tuples_do() -> None:
    batches = workers.micro_batches(2 * workers.GAS)
    losses = {}
    for kind, data in (("tuples", batches), ("dicts", workers.as_dicts(batches))):
        engine = _local_engine(_export_plan())
        stream = iter(data)
        losses[kind] = [float(engine.train_batch(stream)) for _ in range(2)]
    assert losses["dicts"] == losses["tuples"]
    assert losses["tuples"] == pytest.approx(workers.reference(2)[0], rel=RTOL, abs=ATOL)


def test_a_labels_input_goes_to_the_model_and_to_the_loss() -> None:
    """A model that takes ``labels`` itself (as Hugging Face models do) gets them, and so does
    ``loss_fn``."""

    class TakesLabels(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = workers.Tagger()

        def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.inner(ids, (labels >= 0).float())
            return out

    plan = pipedialect.partition(TakesLabels(), split_points=["inner.blocks.0"])
    assert plan.input_names == ("ids", "labels")
    engine = _local_engine(plan)
    batches = workers.micro_batches(workers.GAS)
    pairs = [((ids, labels), labels) for (ids, _), labels in batches]
    dicts = [{"ids": ids, "labels": labels} for (ids, _), labels in batches]
    by_pairs = float(engine.eval_batch(iter(pairs)))
    assert float(engine.eval_batch(iter(dicts))) == by_pairs


def test_tuples_stay_positional_and_one_input_may_be_bare() -> None:
    """What worked before still does: a bare tensor for a one-input model."""
    model = pipedialect.models.TinyGPT(vocab=16, dim=16, max_len=8, num_blocks=2)
    plan = pipedialect.partition(model, split_points=["blocks.0"])
    dialect = pipedialect.get_dialect("local")
    module = dialect.pipe_engine(plan, config=workers.config(), loss_fn=cross_entropy_loss)
    engine = dialect.runtime_engine(module)
    ids = torch.randint(0, 16, (2, 8))
    bare = float(engine.eval_batch(iter([(ids, ids)] * workers.GAS)))
    named = float(engine.eval_batch(iter([{"input_ids": ids, "labels": ids}] * workers.GAS)))
    assert bare == named
