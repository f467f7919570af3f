"""A DeepSpeed op build killed midway must not make every later run hang without a word.

[Note: stale build lock]
On a CPU, ``deepspeed.init_distributed`` builds (the first time) or loads the
``deepspeed_shm_comm`` op through torch's ``cpp_extension``, and so may ``deepspeed.initialize``
for other ops. Builders of one op take turns through a lock file, ``<build dir>/lock``, created
when a build starts and deleted when it ends; whoever finds it waits, polling, until it is gone.
A build that is killed (Ctrl-C during the first run, a job's time limit) leaves the file, and
every later DeepSpeed process then waits forever, printing nothing.

The lock file holds nothing, but its builder keeps it open for the whole build. So before
DeepSpeed starts, every lock under the extensions root is examined: one that a process on this
machine has open belongs to a live build and is left to DeepSpeed; one that nobody has open and
that is older than :data:`GRACE_SECONDS` (so that a build on another machine sharing the
directory has had time to finish) was left by a killed build and raises
:class:`~pipedialect.errors.ExtensionBuildError` naming the file to delete. A young lock nobody
holds is waited for until it goes, is taken, or grows stale. Where the open files of some
process cannot be read (no ``/proc``, another user's processes), only a lock older than
:data:`UNKNOWN_OWNER_SECONDS` counts as stale.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from pipedialect.errors import ExtensionBuildError

__all__ = ["check_build_locks", "extensions_root", "held_files"]

#: Age after which a lock no process on this machine has open counts as left by a killed build.
GRACE_SECONDS = 60.0
#: Age after which a lock counts as stale when the open files of some process cannot be read.
UNKNOWN_OWNER_SECONDS = 1800.0
_POLL_SECONDS = 0.5


def extensions_root() -> Path:
    """Where torch's ``cpp_extension`` builds ops: ``$TORCH_EXTENSIONS_DIR``, else its default.

    The default is ``~/.cache/torch_extensions/<py311>_<cpu|cu124|rocm...>``, as torch names it.
    """
    given = os.environ.get("TORCH_EXTENSIONS_DIR")
    if given:
        return Path(given)
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accelerator = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accelerator = "cu" + torch.version.cuda.replace(".", "")
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


def held_files(paths: Iterable[Path]) -> set[Path] | None:
    """Those of ``paths`` some process on this machine has open; None if that cannot be known."""
    wanted = {os.path.realpath(p): Path(p) for p in paths}
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    held: set[Path] = set()
    complete = True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except FileNotFoundError:
            continue  # the process ended meanwhile
        except PermissionError:
            complete = False
            continue
        for fd in fds:
            try:
                target = str(fd.readlink())
            except OSError:
                continue
            if target in wanted:
                held.add(wanted[target])
    if not complete and len(held) < len(wanted):
        return None
    return held


def _age(path: Path) -> float | None:
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None


def check_build_locks(
    root: Path | None = None,
    *,
    grace: float = GRACE_SECONDS,
    unknown_owner: float = UNKNOWN_OWNER_SECONDS,
) -> None:
    """Raise if a killed op build left a lock under ``root``; see [Note: stale build lock].

    Returns at once when there is no lock or every lock belongs to a live build; waits while a
    lock nobody holds is younger than ``grace`` seconds.

    Raises:
        ExtensionBuildError: a lock was left by a build that is gone; the message names it.
    """
    root = extensions_root() if root is None else root
    while True:
        locks = [lock for lock in sorted(root.glob("*/lock")) if lock.is_file()]
        if not locks:
            return
        held = held_files(locks)
        waiting = False
        for lock in locks:
            if held is not None and lock in held:
                continue  # a live build: DeepSpeed waits for it, as it should
            age = _age(lock)
            if age is None:
                continue  # released meanwhile
            limit = grace if held is not None else unknown_owner
            if age >= limit:
                raise _stale(lock, age, known=held is not None)
            waiting = True
        if not waiting:
            return
        time.sleep(_POLL_SECONDS)


def _stale(lock: Path, age: float, *, known: bool) -> ExtensionBuildError:
    owner = (
        "no process on this machine has it open"
        if known
        else "its owner cannot be seen from this process"
    )
    return ExtensionBuildError(
        f"the C++ op build lock {lock} was left behind by a build that was stopped before it "
        f"finished ({owner}; created {age / 60:.0f} min ago). DeepSpeed would wait for it "
        f"forever. Delete it (rm {lock}) and run again: the op is then built anew (about 30 s "
        f"on a CPU). If that build fails, delete the whole directory {lock.parent}.",
        path=str(lock),
    )
