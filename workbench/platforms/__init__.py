"""Device platforms: the only place that names a device API.

`get_platform("auto")` picks npu (when torch_npu is installed and sees a device), then cuda,
then cpu. Each platform says which torch device and default dtype to use, how to synchronize,
how much memory is in use and which fused kernels it has.
"""
from __future__ import annotations

from ..config import DEVICES
from .base import Platform
from .cpu import CpuPlatform
from .cuda import CudaPlatform
from .npu import NpuPlatform

_PLATFORMS = {"cpu": CpuPlatform, "cuda": CudaPlatform, "npu": NpuPlatform}


def get_platform(name: str = "auto") -> Platform:
    if name == "auto":
        name = next(n for n in DEVICES if n != "auto" and _PLATFORMS[n].is_available())
    if name not in _PLATFORMS:
        raise ValueError(f"device: must be 'auto' or one of {sorted(_PLATFORMS)} (got {name!r})")
    platform = _PLATFORMS[name]
    if name == "npu":
        return platform()   # its constructor explains exactly what is missing
    if not platform.is_available():
        raise ValueError(f"device: {name!r} was asked for but torch cannot use it here")
    return platform()


__all__ = ["Platform", "get_platform"]
