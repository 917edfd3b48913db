"""Device platforms: the only place that names a device API.

`get_platform("auto")` picks cuda when torch sees a GPU, else cpu. Each platform says which
torch device and default dtype to use, how to synchronize and how much memory is in use.
"""
from __future__ import annotations

from .base import Platform
from .cpu import CpuPlatform
from .cuda import CudaPlatform

_PLATFORMS = {"cpu": CpuPlatform, "cuda": CudaPlatform}


def get_platform(name: str = "auto") -> Platform:
    if name == "auto":
        name = "cuda" if CudaPlatform.is_available() else "cpu"
    if name not in _PLATFORMS:
        raise ValueError(f"device: must be 'auto' or one of {sorted(_PLATFORMS)} (got {name!r})")
    platform = _PLATFORMS[name]
    if not platform.is_available():
        raise ValueError(f"device: {name!r} was asked for but torch cannot use it here")
    return platform()


__all__ = ["Platform", "get_platform"]
