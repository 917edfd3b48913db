from __future__ import annotations

import torch

from .base import Platform


class CudaPlatform(Platform):
    name = "cuda"
    default_dtype = torch.bfloat16

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def peak_memory_bytes(self) -> int:
        return torch.cuda.max_memory_allocated()

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats()
