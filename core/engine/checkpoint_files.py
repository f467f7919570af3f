"""Crash-safe checkpoint directories, shared by every dialect's ``save_checkpoint``.

[Note: crash-safe checkpoints] A save never writes into ``save_dir/<tag>`` itself. Every rank
writes its files into a staging directory ``save_dir/.<tag>.partial`` (rank 0 empties a stale one
first); after a barrier over the default process group, rank 0 hashes every staged file into
``MANIFEST.json`` (sha256 and size per file, written last), then publishes:

1. if ``<tag>`` exists (a reused tag), it is renamed to ``<tag>.old`` (a stale ``.old`` is
   removed first, but only while ``<tag>`` itself exists);
2. the staging directory is renamed to ``<tag>``;
3. ``latest`` is rewritten atomically (``latest.tmp`` then ``os.replace``), if asked;
4. ``<tag>.old`` is removed.

A process killed at any point leaves a loadable checkpoint: before step 2 the previous ``<tag>``
(or its ``.old``) is intact and ``latest`` unchanged; after it the new one is complete. The
recovery rule, applied on load: if ``<tag>`` is missing but ``<tag>.old`` exists, the old one is
loaded. Loading verifies every file of the manifest (present, same size, same sha256) and names
the file that is not; a directory without a manifest is refused as incomplete or foreign.

Each rank also saves its random number generators (torch CPU and CUDA, Python ``random``, NumPy
when importable) in ``rng_rank<r>.pt``, restored on load, so dropout continues exactly.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CheckpointError

__all__ = [
    "LATEST_FILE",
    "MANIFEST_FILE",
    "latest_tag",
    "load_rng_state",
    "publish",
    "resolve",
    "save_rng_state",
    "stage",
    "staging_dir",
]

logger = logging.getLogger(__name__)

MANIFEST_FILE = "MANIFEST.json"
LATEST_FILE = "latest"
_FORMAT = "pipedialect-checkpoint/1"
#: Test hook: ``"<rank>:<point>"`` makes that rank SIGKILL itself at that point of a save
#: (``written``: after its files are staged; ``aside``: rank 0, after the old tag was renamed
#: aside and before the new one is in place). Used by the crash tests only.
_KILL_ENV = "PIPEDIALECT_TEST_KILL_IN_SAVE"
_CHUNK = 1 << 20


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _crash_point(point: str) -> None:
    """SIGKILL this process here if the test hook asks for it (see ``_KILL_ENV``)."""
    wanted = os.environ.get(_KILL_ENV)
    if wanted and wanted == f"{_rank()}:{point}":
        os.kill(os.getpid(), signal.SIGKILL)


def staging_dir(save_dir: str | Path, tag: str) -> Path:
    """Where the ranks write a checkpoint before it is published as ``save_dir/tag``."""
    return Path(save_dir) / f".{tag}.partial"


def stage(save_dir: str | Path, tag: str) -> Path:
    """Create an empty staging directory for ``tag`` (collective); return it."""
    _check_tag(tag)
    staged = staging_dir(save_dir, tag)
    if _rank() == 0:
        if staged.exists():
            shutil.rmtree(staged)
        staged.mkdir(parents=True)
    _barrier()
    return staged


def publish(save_dir: str | Path, tag: str, *, save_latest: bool) -> Path:
    """Hash what every rank staged and publish it as ``save_dir/tag`` (collective).

    Call it once every rank has written its files into :func:`stage`'s directory.
    """
    root = Path(save_dir)
    staged, final, old = staging_dir(root, tag), root / tag, root / f"{tag}.old"
    _crash_point("written")
    _barrier()
    if _rank() == 0:
        _write_manifest(staged)
        if final.exists():
            if old.exists():
                shutil.rmtree(old)
            final.replace(old)
            _crash_point("aside")
        staged.replace(final)
        if save_latest:
            tmp = root / f"{LATEST_FILE}.tmp"
            tmp.write_text(tag)
            tmp.replace(root / LATEST_FILE)
        if old.exists():
            shutil.rmtree(old)
    _barrier()
    return final


def latest_tag(load_dir: str | Path, tag: str | None) -> tuple[str, bool] | None:
    """``(tag, from_latest)``: ``tag`` itself, or the one ``load_dir/latest`` records.

    None (logged) when no tag is given and there is no ``latest`` file: DeepSpeed's
    ``load_checkpoint`` then returns ``(None, None)``, and so do ours.
    """
    if tag is not None:
        return str(tag), False
    latest = Path(load_dir) / LATEST_FILE
    if not latest.is_file():
        logger.warning("no checkpoint tag given and no %s file in %s", LATEST_FILE, load_dir)
        return None
    return latest.read_text().strip(), True


def resolve(load_dir: str | Path, tag: str, *, from_latest: bool) -> Path:
    """The verified directory of checkpoint ``tag`` (``tag.old`` if a save died publishing it).

    Raises :class:`~pipedialect.CheckpointError` naming the missing, truncated or corrupted file.
    """
    root = Path(load_dir)
    path = root / tag
    if not path.is_dir() and (root / f"{tag}.old").is_dir():
        logger.warning(
            "checkpoint %s is missing; loading %s.old, left by an interrupted save", path, tag
        )
        path = root / f"{tag}.old"
    if not path.is_dir():
        named = f" (named by {root / LATEST_FILE})" if from_latest else ""
        raise CheckpointError(
            f"no checkpoint tag {tag!r}{named} in {root}: {path} does not exist; pass the tag "
            "of a checkpoint that was saved, or fix the latest file"
        )
    verify(path)
    return path


def verify(path: Path) -> None:
    """Check every file ``path/MANIFEST.json`` lists: present, same size, same sha256."""
    manifest = path / MANIFEST_FILE
    if not manifest.is_file():
        raise CheckpointError(
            f"checkpoint {path} has no {MANIFEST_FILE}: its save never finished, or it was not "
            "written by pipedialect's save_checkpoint; load another tag"
        )
    try:
        record = json.loads(manifest.read_text())
        files: Mapping[str, Mapping[str, Any]] = record["files"]
        if record.get("format") != _FORMAT:
            raise ValueError(f"format {record.get('format')!r}")
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"checkpoint manifest {manifest} cannot be read ({exc}); the checkpoint is corrupted "
            "or foreign, load another tag"
        ) from exc
    for name, entry in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(
                f"checkpoint file {file} is missing (its manifest lists it); load another tag"
            )
        size = file.stat().st_size
        if size != int(entry["size"]):
            raise CheckpointError(
                f"checkpoint file {file} cannot be read as saved: it has {size} bytes, the "
                f"manifest records {entry['size']}; the file is empty or truncated. Load another "
                "tag"
            )
        if _sha256(file) != entry["sha256"]:
            raise CheckpointError(
                f"checkpoint file {file} is corrupted: its sha256 differs from the one recorded "
                "when it was saved; load another tag"
            )


def save_rng_state(directory: Path) -> None:
    """Write this rank's random number generator states into ``directory``."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is optional
        pass
    else:
        numpy_state: tuple[Any, ...] = tuple(np.random.get_state(legacy=True))
        kind, keys, pos, has_gauss, gauss = numpy_state
        state["numpy"] = (
            str(kind),
            torch.from_numpy(np.asarray(keys).astype("int64")),
            int(pos),
            int(has_gauss),
            float(gauss),
        )
    torch.save(state, directory / _rng_file(_rank()))


def load_rng_state(directory: Path) -> None:
    """Restore this rank's random number generators from ``directory``, if it saved them."""
    file = directory / _rng_file(_rank())
    if not file.is_file():
        logger.warning(
            "checkpoint %s has no %s: random number generators not restored", directory, file.name
        )
        return
    state = torch.load(file, weights_only=True)
    torch.set_rng_state(state["torch"])
    random.setstate(_as_python_state(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:  # pragma: no cover - numpy is optional
            return
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))


def _as_python_state(value: Any) -> Any:
    """``random.getstate()``'s nested tuples (a loader may hand back lists)."""
    if isinstance(value, list | tuple):
        return tuple(_as_python_state(v) for v in value)
    return value


def _rng_file(rank: int) -> str:
    return f"rng_rank{rank}.pt"


def _check_tag(tag: str) -> None:
    if not tag or "/" in tag or tag.startswith(".") or tag.endswith((".old", ".tmp")):
        raise CheckpointError(
            f"checkpoint tag {tag!r} cannot be used: a tag is one non-empty path component that "
            "does not start with '.' nor end with '.old' or '.tmp'"
        )


def _write_manifest(directory: Path) -> None:
    files = {
        str(f.relative_to(directory)): {"size": f.stat().st_size, "sha256": _sha256(f)}
        for f in sorted(directory.rglob("*"))
        if f.is_file() and f.name != MANIFEST_FILE
    }
    tmp = directory / f"{MANIFEST_FILE}.tmp"
    tmp.write_text(json.dumps({"format": _FORMAT, "files": files}, indent=1, sort_keys=True))
    tmp.replace(directory / MANIFEST_FILE)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
