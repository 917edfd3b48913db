from __future__ import annotations

import hashlib
import logging
import os
import platform
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from ..utils import cdiv
from .attention import TorchAttention
from .base import Platform

log = logging.getLogger("workbench")
_CSRC = [Path(__file__).parent / "csrc" / name for name in ("cpu_attention.cpp", "cpu_ops.cpp",
                                                             "cpu_quant.cpp", "cpu_a8.cpp")]
_HEADERS = [Path(__file__).parent / "csrc" / "cpu_dtype.h"]
"""Included by the sources: part of what the module depends on (kernel_key), not compiled."""
_kernels = None
# -ffast-math lets gcc vectorise expf (libmvec); the kernel never sees inf or NaN inputs.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]


_NAME = "workbench_cpu_attention"


def _compiler() -> str:
    """The compiler torch's extension builder will call, as `c++ --version` names it."""
    import os
    import subprocess
    cxx = os.environ.get("CXX", "c++")
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True,
                              timeout=30).stdout.split("\n", 1)[0]
    except (OSError, subprocess.SubprocessError):
        return f"{cxx} (not found)"


def kernel_key() -> str:
    """What the built module depends on, and nothing else (not where the venv is): the source
    and flags, the compiler, torch's and Python's ABI, and the CPU (-march=native)."""
    import sys
    import sysconfig

    try:
        info = Path("/proc/cpuinfo").read_text()
        flags = next((ln for ln in info.splitlines() if ln.startswith("flags")), "")
        model = next((ln for ln in info.splitlines() if ln.startswith("model name")), "")
    except OSError:
        flags = model = ""
    text = "|".join([platform.machine(), model, flags, torch.__version__,
                     str(torch.version.git_version), sys.version, str(sysconfig.get_config_var("EXT_SUFFIX")),
                     _compiler(), repr(_CFLAGS), *(p.read_text() for p in _CSRC + _HEADERS)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def kernel_dir() -> Path:
    """Where this machine's kernel (for `kernel_key()`) is built and cached."""
    from ..cache import cache_root
    return cache_root() / "kernels" / kernel_key()


def _import_built(path: Path):
    import importlib.machinery
    import importlib.util
    loader = importlib.machinery.ExtensionFileLoader(_NAME, str(path))
    spec = importlib.util.spec_from_file_location(_NAME, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def load_cpu_kernels():
    """Build the C++ CPU kernels once per `kernel_key()` (about 25-40 s) and return the module,
    or None if no compiler is available.

    A built module is imported directly, without asking torch's builder (whose ninja file
    names this venv's paths, so two venvs would rebuild each other's module). The build runs
    under an fcntl lock that dies with its holder; torch's own `lock` file, which a killed
    build leaves behind and which would make every later build wait forever, is removed
    under it."""
    global _kernels
    if _kernels is None:
        from ..cache import cache_lock
        build = kernel_dir()
        done = build / "built"        # written once the module loaded: a killed link leaves none
        try:
            with cache_lock(build / ".build.lock"):
                if done.is_file():
                    _kernels = _import_built(build / f"{_NAME}.so")
                else:
                    log.warning("building the CPU attention kernel (once per machine and torch "
                                "version, about 25-40 s)…")
                    (build / "lock").unlink(missing_ok=True)
                    from torch.utils.cpp_extension import load
                    _kernels = load(name=_NAME, sources=[str(p) for p in _CSRC], extra_cflags=_CFLAGS,
                                    build_directory=str(build), verbose=False)
                    tmp = build / "built.tmp"            # the marker appears whole or not at all
                    tmp.write_text(f"{_NAME}.so\n")
                    os.replace(tmp, done)
        except Exception as e:   # no compiler / ninja: the plain-torch path still works
            log.warning("CPU attention kernel unavailable (%s); using the plain-torch path",
                        str(e).splitlines()[0] if str(e) else type(e).__name__)
            _kernels = False
    return _kernels or None


def kernel_is_built() -> bool:
    return (kernel_dir() / "built").is_file()


def ensure_kernel_built(log=None) -> bool:
    """Build the kernel now, in this thread, if it is not built (or wait for the build another
    process holds the lock for); `log` hears one line before and one after. What `workbench
    build-kernels` and the benchmarks call, so that nothing is measured on the fallback.
    Returns whether the kernel is available."""
    import time
    if _kernels is not None or kernel_is_built():
        return load_cpu_kernels() is not None
    t = time.perf_counter()
    if log is not None:
        log("building the CPU kernel (once per machine and torch version; about 25-40 s)…")
    ok = load_cpu_kernels() is not None
    if log is not None:
        log(f"CPU kernel {'built' if ok else 'unavailable'} in {time.perf_counter() - t:.0f} s")
    return ok


BUILD_TIMEOUT_S = 1800
"""A detached build that has not finished in this long kills itself and its compiler (a hung
toolchain must not outlive everyone)."""
_build_lock = threading.Lock()
_builder: subprocess.Popen | None = None
"""The build process this process started, if any."""
_built_marker: Path | None = None
_next_check = 0.0


def build_in_background() -> subprocess.Popen:
    """Start building the kernel in a process of its own (once per process), detached: in a
    session of its own, at nice 10, with its output in the build folder's `build.log`. It
    finishes whatever this process does (a `workbench generate` that is done in 2 s, a test,
    a Ctrl-C), so a short-lived process leaves a built kernel behind instead of a half-built
    one that the next process starts over. The build itself takes the existing lock
    (`load_cpu_kernels`), so concurrent starts build once. Engines made meanwhile decode with
    `decode_when_built`, which picks the module up once the build's marker appears."""
    global _builder, _built_marker
    with _build_lock:
        if _builder is None:
            build = kernel_dir()
            build.mkdir(parents=True, exist_ok=True)
            _built_marker = build / "built"
            root = str(Path(__file__).resolve().parents[2])     # where `workbench` imports from
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
            with open(build / "build.log", "ab") as out:
                _builder = subprocess.Popen(
                    [sys.executable, "-c", "from workbench.platforms.cpu import _build_main; "
                     "_build_main()"], env=env, cwd=root,
                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True, preexec_fn=_low_priority)
        return _builder


def _low_priority() -> None:
    import contextlib
    with contextlib.suppress(OSError, AttributeError):
        os.nice(10)


def kernels():
    """The loaded module, or None; while a build this process started runs elsewhere, look
    for its marker (at most every half second, a stat) and load the module once it is
    there. What the `*_when_built` fallbacks call on every use."""
    global _next_check
    if _kernels is None and _built_marker is not None:
        now = time.monotonic()
        if now >= _next_check:
            _next_check = now + 0.5
            if _builder is not None:
                _builder.poll()                              # reap it once it has exited
            if _built_marker.is_file():
                load_cpu_kernels()
    return _kernels or None


def wait_for_kernel(timeout: float) -> bool:
    """Block until the kernel is loaded (a build this process started included); whether it
    is. For tests and scripts that want the kernel's speed, not the fallback's."""
    global _next_check
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _next_check = 0.0
        if kernels() is not None:
            return True
        if _builder is not None and _builder.poll() is not None and not kernel_is_built():
            return False                                     # the build failed: see build.log
        time.sleep(0.2)
    return kernels() is not None


def _build_main() -> None:
    """The detached build's process (build_in_background), bounded by BUILD_TIMEOUT_S
    (then it kills its own session: the compiler and ninja with it)."""
    import signal
    signal.signal(signal.SIGALRM, lambda *_: os.killpg(0, signal.SIGKILL))
    signal.alarm(BUILD_TIMEOUT_S)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    ok = load_cpu_kernels() is not None
    print(f"workbench CPU kernel {'built' if ok else 'unavailable'}: {kernel_dir()}", flush=True)
    raise SystemExit(0 if ok else 1)


def decode_when_built(q, k_cache, v_cache, block_tables, context_lens, scale):
    """The kernel's signature, for an engine built while the kernel was still compiling: plain
    torch (one request at a time) until the build is done, the C++ kernel from then on. This
    is what lets the first start on a machine serve at once instead of after 25-40 s."""
    k = kernels()
    if k:
        return k.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    import torch.nn.functional as F
    kv_heads, _, bs, d = k_cache.shape
    out = torch.empty_like(q)
    for i, n in enumerate(context_lens.tolist()):
        blocks = block_tables[i, :cdiv(n, bs)].long()
        k = k_cache[:, blocks].reshape(kv_heads, -1, d)[:, :n]          # [kvH, n, D]
        v = v_cache[:, blocks].reshape(kv_heads, -1, d)[:, :n]
        qi = q[i].view(kv_heads, -1, d)                                 # [kvH, G, D]
        out[i] = F.scaled_dot_product_attention(qi, k, v, scale=scale).reshape(q.shape[1:])
    return out


class CpuPlatform(Platform):
    name = "cpu"
    packed_weights = True

    @classmethod
    def is_available(cls) -> bool:
        return True

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
        from .cpu_ops import CpuOps                 # fused fp32 and bf16 ops, packed weights
        return CpuOps()

    def attention_backend(self, dtype, choice: str = "auto"):
        if choice != "auto" or dtype not in CpuAttention.supported_dtypes:
            return super().attention_backend(dtype, choice)
        if _kernels is None and not kernel_is_built():
            build_in_background()             # first start on this machine: don't wait for it
            return CpuAttention(dtype, decode_when_built)
        mod = load_cpu_kernels()
        if mod is None:
            return super().attention_backend(dtype, choice)
        return CpuAttention(dtype, mod.paged_decode_attention)

    @classmethod
    def attention_backend_classes(cls) -> tuple[type, ...]:
        return (*super().attention_backend_classes(), CpuAttention)


class CpuAttention(TorchAttention):
    """The reference, with decodes in the C++ paged decode kernel (fp32 or bf16: a bf16 pool
    is half the bytes to read): it reads the pool in place through the block tables instead
    of gathering each context into a copy. Prefill stays the reference's (torch's CPU flash
    attention, scaled_dot_product_attention)."""
    name = "cpu"
    supported_dtypes = (torch.float32, torch.bfloat16)
    supports_decode_graphs = True
    """The kernel reads tables and lengths from tensors, so a captured decode step would
    replay right; the CPU has no graphs to capture into (CpuPlatform.supports_graphs), but
    the tests' replaying platform runs the graph plumbing through this backend."""

    def __init__(self, dtype, kernel):
        super().__init__(dtype)
        self.kernel = kernel
        """paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)."""

    def build(self, common):
        """The reference's, but the kernel reads the decodes' rows of the step's table in
        place (int64, contiguous, as it wants them), each only up to its length."""
        meta = super().build(common)
        if common.num_decode:
            meta.decode_block_tables = common.block_table[:common.num_decode]
        return meta

    def build_decode(self, meta, tables, lens) -> None:
        meta.decode_lens = lens

    def write_kv(self, k_cache, v_cache, k, v, slot_mapping) -> None:
        from .cpu_ops import write_kv_when_built      # one C++ call for K and V
        write_kv_when_built(k_cache, v_cache, k, v, slot_mapping)

    def decode(self, q, k_cache, v_cache, meta, scale: float):
        return self.kernel(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_lens,
                           scale)
