"""The workbench's on-disk cache: converted models and built kernels, shared by every
environment on a machine and safe against a holder killed mid-fill."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path


def cache_root() -> Path:
    """Where converted models and built kernels are kept. Entries are keyed by what they are
    made from (file contents, versions), never by where the environment lives, so every
    virtual environment on a machine shares them."""
    return Path(os.environ.get("WORKBENCH_CACHE", Path.home() / ".cache" / "workbench"))


@contextlib.contextmanager
def cache_lock(path: Path):
    """Hold an exclusive lock on `path` (created if needed) while filling a cache entry. It is
    an fcntl lock: the kernel drops it when its holder dies, kill -9 included, so a crashed
    build or conversion never blocks the next start."""
    import fcntl
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def legacy_entries(root: Path | None = None) -> list[Path]:
    """Entries left by earlier versions, which keyed them by where their environment lived:
    converted models as `smollm2-135m-instruct-<10 hex>`, kernels as `kernels/<12 hex>`
    (today's keys are 16 hex digits of what they are made from). Nothing reads them now."""
    root = root or cache_root()
    models = [p for p in root.glob("smollm2-135m-instruct-*")
              if p.is_dir() and _is_hex(p.name.rsplit("-", 1)[1], 10)]
    kernels = [p for p in root.glob("kernels/*") if p.is_dir() and _is_hex(p.name, 12)]
    return models + kernels


def remove_legacy_entries(root: Path | None = None) -> list[Path]:
    """Delete `legacy_entries()` (each several hundred MB for a model); returns them."""
    import shutil
    old = legacy_entries(root)
    for p in old:
        shutil.rmtree(p, ignore_errors=True)
    return old


def _is_hex(text: str, n: int) -> bool:
    return len(text) == n and all(c in "0123456789abcdef" for c in text)
