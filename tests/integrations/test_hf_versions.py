"""The Hugging Face tests against the oldest transformers and accelerate the ``hf`` extra admits.

``make test`` runs tests/integrations with what ``make setup`` installed: the newest releases
in the extra's range. This tier (``make compat``; marked ``compat`` and ``packaging``, not in
``make test``) builds a virtual environment of its own whose site-packages holds the oldest
transformers and accelerate (and whatever else that transformers release asks for that
``.venv`` lacks) and, behind them, ``.venv``'s packages (a ``.pth`` file adds
``.venv``'s site directory after its own): torch, deepspeed and pipedialect come from
``.venv`` and pip never installs torch. Then it runs every test of tests/integrations there.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: What pyproject's ``hf`` extra admits at the bottom (pip resolves what they need beside them
#: against .venv's packages, which the venv sees: torch is found installed, never fetched).
OLDEST = {"transformers": "5.24.0", "accelerate": "1.12.0"}


def test_the_oldest_versions_are_the_extras_lower_bounds() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    (extra,) = re.findall(r"^hf = \[(.*)\]$", text, flags=re.MULTILINE)
    for name, version in OLDEST.items():
        assert f'"{name}>={version},<' in extra, (name, extra)
    from pipedialect.integrations.transformers import SUPPORTED_TRANSFORMERS

    assert SUPPORTED_TRANSFORMERS[0] == OLDEST["transformers"]


def _venv(where: Path) -> Path:
    """A venv whose own packages come before .venv's; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
    python = where / "bin" / "python"
    own = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]
    (Path(own) / "zz_pipedialect_base.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    return python


@pytest.mark.packaging
@pytest.mark.compat
def test_the_hugging_face_tests_pass_with_the_oldest_supported_versions(tmp_path: Path) -> None:
    python = _venv(tmp_path / "venv")
    pins = [f"{name}=={version}" for name, version in OLDEST.items()]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", *pins],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    probe = subprocess.run(
        [
            str(python),
            "-c",
            "import torch, transformers, accelerate; "
            "print(transformers.__version__, accelerate.__version__, torch.__file__)",
        ],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    transformers_version, accelerate_version, torch_file = probe.stdout.split()
    assert (transformers_version, accelerate_version) == tuple(OLDEST.values())
    assert torch_file.startswith(sysconfig.get_paths()["purelib"])  # .venv's torch
    run = subprocess.run(
        [
            str(python),
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "not packaging",
            "tests/integrations",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=5400,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-6000:]
