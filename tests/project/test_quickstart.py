"""The README's example is a real program: it runs under torchrun and the README quotes it.

The README also says that swapping ``"deepspeed"`` for ``"torch"`` or ``"local"`` changes
nothing else: each swap runs as the README says (``local`` under plain ``python``) and prints
the losses of the unsplit model, trained here by hand with the config's DeepSpeed meaning.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _fresh import torchrun
from _reference import steps_from, train_unsplit

from pipedialect.demo import demo_batches
from pipedialect.models import TinyGPT, cross_entropy_loss

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "quickstart.py"
STEPS, GAS = 20, 4
#: The losses are printed with 4 decimals.
PRINTED = 5e-5 + 1e-6


@functools.cache
def unsplit_losses() -> list[float]:
    """The example's model and data, trained in one process as its config means.

    ``"type": "Adam"`` with ``torch_adam`` (and ``adam_w_mode`` left true) is torch's AdamW
    with torch's defaults (``weight_decay`` 0.01); ``gradient_clipping`` defaults to 1.0; each
    micro-batch loss is divided by ``gradient_accumulation_steps``.
    """
    model = TinyGPT(vocab=48, dim=32, max_len=16, num_blocks=8)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)
    steps = steps_from([iter(demo_batches(STEPS * GAS, replica=0))], STEPS, GAS)
    return train_unsplit(model, optimizer, steps, cross_entropy_loss, clip=1.0).losses


def printed_losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"loss (\d+\.\d{4})", stdout)]


def assert_unsplit_losses(stdout: str, ranks: int) -> None:
    losses = printed_losses(stdout)
    assert len(losses) == ranks * STEPS, stdout[-3000:]  # every rank reports every step
    expected = sorted(unsplit_losses() * ranks)
    for got, want in zip(sorted(losses), expected, strict=True):
        assert abs(got - want) <= PRINTED, (got, want)


def swapped(dialect: str, tmp_path: Path) -> Path:
    """The example with ``"deepspeed"`` swapped for ``dialect``, and nothing else changed."""
    source = EXAMPLE.read_text()
    assert source.count('"deepspeed"') == 1
    program = tmp_path / f"quickstart_{dialect}.py"
    program.write_text(source.replace('"deepspeed"', f'"{dialect}"'))
    return program


def test_readme_quotes_the_example_verbatim() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL)
    assert EXAMPLE.read_text() in blocks


@pytest.mark.distributed
def test_example_trains_under_torchrun() -> None:
    proc = torchrun(EXAMPLE, ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_unsplit_losses(proc.stdout, ranks=2)


@pytest.mark.distributed
def test_the_local_swap_runs_under_plain_python(tmp_path: Path) -> None:
    """Before init_distributed() did nothing on 'local', this stopped: RANK not set.

    One intra-op thread, as torchrun gives each rank of the other runs: on two shared cores the
    20 steps took 50 s on two threads (contention) and 5 s on one.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, str(swapped("local", tmp_path))],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_unsplit_losses(proc.stdout, ranks=1)


@pytest.mark.distributed
def test_the_torch_swap_trains_under_torchrun(tmp_path: Path) -> None:
    proc = torchrun(swapped("torch", tmp_path), tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_unsplit_losses(proc.stdout, ranks=2)


def test_a_multi_process_dialect_without_a_launcher_says_how_to_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pipedialect

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(pipedialect.ConfigError, match="torchrun --nproc_per_node N") as info:
        pipedialect.get_dialect("torch").init_distributed()
    assert "'local' dialect" in str(info.value)
    pipedialect.get_dialect("local").init_distributed()  # nothing to join
