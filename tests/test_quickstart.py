"""The README's example is a real program: it runs under torchrun and the README quotes it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipedialect.testing.launcher import free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "quickstart.py"


def test_readme_quotes_the_example_verbatim() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL)
    assert EXAMPLE.read_text() in blocks


@pytest.mark.distributed
def test_example_trains_under_torchrun() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            str(EXAMPLE),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        # Unbuffered: each print is one write, so the two ranks' lines never splice.
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d{4})", proc.stdout)]
    assert len(losses) == 2 * 20  # both ranks report every step
    assert losses[-1] < losses[0] - 0.5
