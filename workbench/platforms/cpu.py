"""The CPU platform: its name, memory, fused ops (cpu_ops.py) and attention backend
(cpu_attention.py), both on the C++ kernels of cpu_kernels.py once they are built."""
from __future__ import annotations

import os
import platform
import resource
from pathlib import Path

import torch

from . import cpu_kernels
from .base import Platform
from .cpu_attention import CpuAttention
from .cpu_ops import CpuOps


class CpuPlatform(Platform):
    name = "cpu"
    packed_weights = True

    @classmethod
    def is_available(cls) -> bool:
        return True

    def streams_bf16c(self) -> bool:
        k = cpu_kernels.kernels()
        return k is not None and hasattr(k, "bf16c_fast")

    def device_name(self) -> str:
        try:
            info = Path("/proc/cpuinfo").read_text()
            model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                          if ln.startswith("model name")), "")
        except OSError:
            model = ""
        return f"{model or platform.processor() or platform.machine()}, " \
               f"{len(os.sched_getaffinity(0))} cores"

    def peak_memory_bytes(self) -> int:
        # ru_maxrss is in KiB on Linux: the process's peak resident set, weights included.
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def model_ops(self, dtype):
        if dtype not in (torch.float32, torch.bfloat16):
            return super().model_ops(dtype)
        return CpuOps()                             # fused fp32 and bf16 ops, packed weights

    def attention_backend(self, dtype, choice: str = "auto"):
        if choice != "auto" or dtype not in CpuAttention.supported_dtypes:
            return super().attention_backend(dtype, choice)
        if cpu_kernels.build_failed():
            return super().attention_backend(dtype, choice)
        if cpu_kernels.kernels() is None and not cpu_kernels.kernel_is_built():
            cpu_kernels.build_in_background()    # first start on this machine: don't wait for it
        elif cpu_kernels.load_cpu_kernels() is None:
            return super().attention_backend(dtype, choice)          # no compiler
        return CpuAttention(dtype)

    @classmethod
    def attention_backend_classes(cls) -> tuple[type, ...]:
        return (*super().attention_backend_classes(), CpuAttention)
