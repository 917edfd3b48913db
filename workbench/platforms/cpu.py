from __future__ import annotations

import hashlib
import logging
import platform
import resource
from pathlib import Path

from .base import Platform

log = logging.getLogger("workbench")
_CSRC = Path(__file__).parent / "csrc" / "cpu_attention.cpp"
_kernels = None
# -ffast-math lets gcc vectorise expf (libmvec); the kernel never sees inf or NaN inputs.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]


def _cpu_key() -> str:
    """The build is tuned for this CPU (-march=native): key the cache by what the CPU is."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        flags = next((ln for ln in info.splitlines() if ln.startswith("flags")), "")
        model = next((ln for ln in info.splitlines() if ln.startswith("model name")), "")
    except OSError:
        flags = model = ""
    import torch
    text = f"{platform.machine()}|{model}|{flags}|{torch.__version__}|{_CFLAGS}|{_CSRC.read_bytes()!r}"
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def load_cpu_kernels():
    """Build the C++ CPU kernels once (about 25 s; cached per CPU and torch version under the
    workbench cache) and return the module, or None if no compiler is available."""
    global _kernels
    if _kernels is None:
        from ..models.loader import cache_root
        from torch.utils.cpp_extension import load
        build = cache_root() / "kernels" / _cpu_key()
        build.mkdir(parents=True, exist_ok=True)
        if not any(build.glob("*.so")):
            log.warning("building the CPU attention kernel (once per machine, about 25 s)…")
        try:
            _kernels = load(name="workbench_cpu_attention", sources=[str(_CSRC)],
                            extra_cflags=_CFLAGS,
                            build_directory=str(build), verbose=False)
        except Exception as e:   # no compiler / ninja: the plain-torch path still works
            log.warning("CPU attention kernel unavailable (%s); using the plain-torch path",
                        str(e).splitlines()[0] if str(e) else type(e).__name__)
            _kernels = False
    return _kernels or None


class CpuPlatform(Platform):
    name = "cpu"

    @classmethod
    def is_available(cls) -> bool:
        return True

    def peak_memory_bytes(self) -> int:
        # ru_maxrss is in KiB on Linux: the process's peak resident set, weights included.
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def decode_attention_kernel(self, dtype):
        import torch
        if dtype != torch.float32:
            return None
        mod = load_cpu_kernels()
        return None if mod is None else mod.paged_decode_attention
