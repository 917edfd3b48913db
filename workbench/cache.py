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
