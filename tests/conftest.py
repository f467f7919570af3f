"""Shared test configuration.

- One intra-op thread: the machine has two cores shared with every spawned rank, and tiny ops on
  many threads are slower (thread contention) than on one.
- This environment's ``bin`` first on ``PATH``, for the test process and every process it starts,
  as for a user with the environment activated (and as tests/test_docs_examples.py runs the
  pages' examples). DeepSpeed builds its C++ ops with the first ``ninja`` on ``PATH``, and two
  ninjas (this environment's 1.13, the system's 1.11) hash the build commands differently: every
  switch between them rebuilt the cached ops (1-2 min on two cores), twice per run of the suite.
- The cuda tier skips itself where no CUDA device exists.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

_BIN = str(Path(sys.executable).parent)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _BIN:
    os.environ["PATH"] = f"{_BIN}{os.pathsep}{os.environ.get('PATH', '')}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (cuda tier)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
