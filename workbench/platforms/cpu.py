from __future__ import annotations

import resource

from .base import Platform


class CpuPlatform(Platform):
    name = "cpu"

    @classmethod
    def is_available(cls) -> bool:
        return True

    def peak_memory_bytes(self) -> int:
        # ru_maxrss is in KiB on Linux: the process's peak resident set, weights included.
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
