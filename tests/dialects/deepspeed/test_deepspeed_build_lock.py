"""A DeepSpeed op build killed midway leaves a lock; later runs say so instead of hanging.

The real extensions cache is shared by everything on this machine, so the tests work on a copy
of it (``TORCH_EXTENSIONS_DIR``) and never touch the original.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pipedialect import ExtensionBuildError
from pipedialect.dialects.deepspeed._extensions import check_build_locks, extensions_root
from pipedialect.runtime.launch import free_port

JOIN = (
    "import pipedialect\n"
    "pipedialect.get_dialect('deepspeed').init_distributed()\n"
    "print('joined the process group')\n"
)
HOUR = 3600.0


def _stale_lock(root: Path, op: str = "deepspeed_shm_comm", age: float = 2 * HOUR) -> Path:
    (root / op).mkdir(parents=True, exist_ok=True)
    lock = root / op / "lock"
    lock.touch()
    then = time.time() - age
    os.utime(lock, (then, then))
    return lock


def _join(extensions: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "TORCH_EXTENSIONS_DIR": str(extensions),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "CUDA_VISIBLE_DEVICES": "",
    }
    return subprocess.run(
        [sys.executable, "-c", JOIN], env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.distributed
def test_a_stale_lock_stops_init_distributed_with_the_file_to_delete(tmp_path: Path) -> None:
    """Before the fix this process waited forever in DeepSpeed's op build (the timeout fired)."""
    extensions = tmp_path / "extensions"
    cached = extensions_root() / "deepspeed_shm_comm"
    if cached.is_dir():  # reuse the built op: the success run below then takes seconds
        shutil.copytree(cached, extensions / "deepspeed_shm_comm")
    lock = _stale_lock(extensions)
    start = time.monotonic()
    proc = _join(extensions, timeout=60)
    assert time.monotonic() - start < 60
    assert proc.returncode != 0
    assert "ExtensionBuildError" in proc.stderr and f"rm {lock}" in proc.stderr, proc.stderr
    lock.unlink()  # what the message says to do
    proc = _join(extensions, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "joined the process group" in proc.stdout


def test_a_lock_a_live_build_holds_is_left_to_deepspeed(tmp_path: Path) -> None:
    lock = _stale_lock(tmp_path)
    fd = os.open(lock, os.O_RDONLY)  # what torch's builder keeps open while it builds
    try:
        check_build_locks(tmp_path, grace=1.0)
    finally:
        os.close(fd)
    with pytest.raises(ExtensionBuildError) as info:
        check_build_locks(tmp_path, grace=1.0)
    assert info.value.path == str(lock)
    assert "no process on this machine has it open" in str(info.value)


def test_a_young_lock_nobody_holds_is_waited_for(tmp_path: Path) -> None:
    lock = _stale_lock(tmp_path, op="fused_adam", age=0.0)
    threading.Timer(1.0, lock.unlink).start()  # a build finishing
    start = time.monotonic()
    check_build_locks(tmp_path, grace=30.0)
    assert 0.9 < time.monotonic() - start < 10
    _stale_lock(tmp_path, op="fused_adam", age=0.0)
    start = time.monotonic()
    with pytest.raises(ExtensionBuildError, match="fused_adam"):
        check_build_locks(tmp_path, grace=1.5)  # nobody takes or removes it: stale
    assert 1.0 < time.monotonic() - start < 10
