"""Device platforms: the only place that names a device API.

`get_platform("auto")` picks npu (when torch_npu is installed and sees a device), then cuda,
then cpu. Each platform says which torch device and default dtype to use, how to synchronize,
how much memory is in use and which fused kernels it has.
"""
from __future__ import annotations

from ..config import DEVICES, GRAPH_MODES
from .base import Platform
from .cpu import CpuPlatform
from .cuda import CudaPlatform
from .npu import NpuPlatform

_PLATFORMS = {"cpu": CpuPlatform, "cuda": CudaPlatform, "npu": NpuPlatform}


def available_devices() -> list[str]:
    """The devices this machine can run, 'auto' first, then in the order 'auto' tries them
    (npu, cuda, cpu); NPU: torch_npu imports and sees a device."""
    return ["auto", *(n for n in DEVICES if n != "auto" and _PLATFORMS[n].is_available())]


def auto_device() -> str:
    """What device='auto' means, the one rule for it: the first available device."""
    return available_devices()[1]


def get_platform(name: str = "auto") -> Platform:
    if name == "auto":
        name = auto_device()
    if name not in _PLATFORMS:
        raise ValueError(f"device: must be 'auto' or one of {sorted(_PLATFORMS)} (got {name!r})")
    platform = _PLATFORMS[name]
    if name == "npu":
        return platform()   # its constructor explains exactly what is missing
    if not platform.is_available():
        raise ValueError(f"device: {name!r} was asked for but torch cannot use it here")
    return platform()


def platform_class(name: str) -> type[Platform]:
    """The class of platform `name` ('cpu', 'cuda', 'npu'), without building it: its rules
    (graph sizes, block sizes) for a modelled device that follows them."""
    return _PLATFORMS[name]


def block_sizes(device: str) -> tuple[int, ...]:
    """The KV block sizes `device`'s attention backends take (the knob's domain there), read
    off their classes: no platform is built. 'auto': those of the device it picks."""
    if device == "auto":
        device = auto_device()
    if device not in _PLATFORMS:
        raise ValueError(f"device: must be 'auto' or one of {sorted(_PLATFORMS)} (got {device!r})")
    sizes = {b for cls in _PLATFORMS[device].attention_backend_classes()
             for b in cls.supported_block_sizes}
    return tuple(sorted(sizes))


def graph_modes(device: str) -> tuple[str, ...]:
    """The graph modes `device` runs as asked (the knob's domain there): config.GRAPH_MODES
    where its platform captures graphs, else 'eager' alone (the others would run eager)."""
    if device == "auto":
        device = auto_device()
    if device not in _PLATFORMS:
        raise ValueError(f"device: must be 'auto' or one of {sorted(_PLATFORMS)} (got {device!r})")
    return GRAPH_MODES if _PLATFORMS[device].supports_graphs else ("eager",)


__all__ = ["Platform", "auto_device", "available_devices", "block_sizes", "get_platform",
           "platform_class",
           "graph_modes"]
