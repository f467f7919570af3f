"""The distribution as a user gets it: a built wheel installed into a fresh virtual environment.

The rest of the suite runs against the editable install; this test proves the wheel carries every
module, the typing marker and the entry points, and works without deepspeed installed.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.packaging


def _sources() -> set[str]:
    """Every module the wheel must contain, as paths inside the wheel."""
    expected = {
        f"pipedialect/{p.relative_to(ROOT / 'core')}" for p in (ROOT / "core").rglob("*.py")
    }
    expected |= {
        f"pipedialect/dialects/{p.relative_to(ROOT / 'dialects')}"
        for p in (ROOT / "dialects").rglob("*.py")
    }
    return {e for e in expected if "__pycache__" not in e} | {"pipedialect/py.typed"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(out),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (found,) = out.glob("pipedialect-*.whl")
    return found


def test_wheel_contains_every_module_and_entry_point(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        missing = _sources() - names
        assert not missing, f"modules missing from the wheel: {sorted(missing)}"
        (ep_file,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        entry_points = zf.read(ep_file).decode()
    assert "[pipedialect.dialects]" in entry_points
    assert "deepspeed = pipedialect.dialects.deepspeed" in entry_points
    assert "local = pipedialect.dialects.local" in entry_points
    assert "torch = pipedialect.dialects.torch" in entry_points
    assert "pipedialect = pipedialect.cli:main" in entry_points
    assert "[pytest11]" in entry_points


def test_wheel_works_in_a_fresh_venv(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    pip = [str(py), "-m", "pip", "install", "--quiet"]
    # torch first, pinned, as the README does: pip must never choose a torch build itself.
    subprocess.run([*pip, "torch==2.13.0"], check=True, capture_output=True)
    subprocess.run([*pip, str(wheel)], check=True, capture_output=True)
    code = (
        "import sys, pipedialect, pipedialect.dialects.deepspeed, pipedialect.dialects.local\n"
        "names = sorted(i.name for i in pipedialect.list_dialects())\n"
        "print(pipedialect.__file__)\n"
        "print(names, 'deepspeed' in sys.modules)\n"
    )
    proc = subprocess.run([str(py), "-c", code], capture_output=True, text=True, check=True)
    location, listing = proc.stdout.splitlines()
    assert location.startswith(str(venv)), location
    assert listing == "['deepspeed', 'local', 'torch'] False"
    cli = subprocess.run(
        [str(venv / "bin" / "pipedialect"), "list"], capture_output=True, text=True, check=True
    )
    assert "deepspeed" in cli.stdout and "pipedialect" in cli.stdout
