"""Slapo 0.0.3's own codec, loaded as the reference for the codec tests and benchmark.

Slapo's package ``__init__`` fails under current torch and transformers, so only
``slapo/framework_dialect/deepspeed/pipeline.py`` is executed, its text unchanged, from the
published wheel, with its two relative imports (``..registry`` and ``...logger``) answered by
small stand-in modules under a private package name (a real ``slapo`` install is left alone).

The wheel is fetched once with ``pip download --no-deps slapo==0.0.3`` into
``$PIPEDIALECT_CACHE/slapo`` (default ``~/.cache/pipedialect/slapo``) and checked against its
published sha256. ``$PIPEDIALECT_SLAPO_WHEEL`` may name a local copy instead (offline machines).
Failing to get it raises :class:`SlapoUnavailableError`: the comparison tests then fail rather
than skip.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import types
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["SlapoUnavailableError", "load_pipeline", "wheel_path"]

VERSION = "0.0.3"
WHEEL_NAME = f"slapo-{VERSION}-py3-none-any.whl"
WHEEL_SHA256 = "47fa9a0289bec7751efd446cd1691653e309debdf55cafd9436e6b5ecd77ae77"
MODULE_PATH = "slapo/framework_dialect/deepspeed/pipeline.py"
_PACKAGE = "_pipedialect_slapo_reference"


class SlapoUnavailableError(RuntimeError):
    """Slapo 0.0.3's wheel could not be downloaded or verified."""


def cache_dir() -> Path:
    """Where the wheel is kept between runs."""
    root = os.environ.get("PIPEDIALECT_CACHE") or Path.home() / ".cache" / "pipedialect"
    return Path(root) / "slapo"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def wheel_path() -> Path:
    """Return the verified Slapo 0.0.3 wheel, downloading it on first use."""
    override = os.environ.get("PIPEDIALECT_SLAPO_WHEEL")
    target = Path(override) if override else cache_dir() / WHEEL_NAME
    if not target.is_file():
        if override:
            raise SlapoUnavailableError(f"PIPEDIALECT_SLAPO_WHEEL={override} is not a file")
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
            cmd += ["--only-binary", ":all:", f"slapo=={VERSION}", "-d", tmp]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            fetched = Path(tmp) / WHEEL_NAME
            if done.returncode or not fetched.is_file():
                raise SlapoUnavailableError(
                    f"could not download slapo=={VERSION} with {' '.join(cmd)}:\n"
                    f"{done.stdout}{done.stderr}\nThe codec tests compare against Slapo's own "
                    "code: give them network access to PyPI, or set PIPEDIALECT_SLAPO_WHEEL."
                )
            fetched.replace(target)
    digest = _sha256(target)
    if digest != WHEEL_SHA256:
        raise SlapoUnavailableError(
            f"{target} has sha256 {digest}, not the published {WHEEL_SHA256}; delete it"
        )
    return target


def _stand_ins() -> dict[str, types.ModuleType]:
    """Modules answering pipeline.py's relative imports with what it needs of them."""

    def register_framework_dialect(target: str, cls_type: str) -> Callable[[Any], Any]:
        return lambda obj: obj

    def get_logger(name: str = "Slapo", level: int = logging.INFO) -> logging.Logger:
        return logging.getLogger(f"{_PACKAGE}.{name}")

    modules = {}
    for name in ("", ".framework_dialect", ".framework_dialect.deepspeed"):
        package = types.ModuleType(_PACKAGE + name)
        package.__path__ = []
        modules[package.__name__] = package
    registry = types.ModuleType(f"{_PACKAGE}.framework_dialect.registry")
    registry.register_framework_dialect = register_framework_dialect  # type: ignore[attr-defined]
    logger = types.ModuleType(f"{_PACKAGE}.logger")
    logger.get_logger = get_logger  # type: ignore[attr-defined]
    logger.DEBUG = logging.DEBUG  # type: ignore[attr-defined]
    logger.INFO = logging.INFO  # type: ignore[attr-defined]
    modules[registry.__name__] = registry
    modules[logger.__name__] = logger
    return modules


@functools.cache
def load_pipeline() -> types.ModuleType:
    """Slapo 0.0.3's ``slapo.framework_dialect.deepspeed.pipeline``, executed as published."""
    wheel = wheel_path()
    with zipfile.ZipFile(wheel) as archive:
        source = archive.read(MODULE_PATH).decode()
    name = f"{_PACKAGE}.framework_dialect.deepspeed.pipeline"
    module = types.ModuleType(name)
    module.__package__ = f"{_PACKAGE}.framework_dialect.deepspeed"
    module.__file__ = f"{wheel}/{MODULE_PATH}"
    added = {**_stand_ins(), name: module}
    sys.modules.update(added)
    try:
        exec(compile(source, module.__file__, "exec"), module.__dict__)
    finally:
        for key in added:
            sys.modules.pop(key, None)
    return module
