"""docs/planning.rst's worked example prints what the page shows, line for line.

The planner's prediction from counted FLOPs does not depend on the machine, so the page can
quote its output; this test runs the page's first Python block and compares.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "planning.rst"


def _blocks(language: str) -> list[str]:
    """The page's ``code-block:: language`` blocks, dedented."""
    lines = PAGE.read_text().splitlines()
    found = []
    for i, line in enumerate(lines):
        if re.fullmatch(rf"\s*\.\. code-block:: {language}\s*", line):
            body = []
            for follow in lines[i + 1 :]:
                if follow.strip() and not follow.startswith("   "):
                    break
                body.append(follow)
            found.append(textwrap.dedent("\n".join(body)).strip("\n"))
    return found


@pytest.mark.distributed
def test_the_worked_example_prints_the_table_on_the_page(tmp_path: Path) -> None:
    program = tmp_path / "example.py"
    program.write_text(_blocks("python")[0])
    proc = subprocess.run(
        [sys.executable, str(program)], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip("\n").splitlines() == _blocks("text")[0].splitlines()
