"""Shared test configuration.

- One intra-op thread: the machine has two cores shared with every spawned rank, and tiny ops on
  many threads are slower (thread contention) than on one.
- The cuda tier skips itself where no CUDA device exists.
"""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (cuda tier)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
