"""The CPU's C++ kernels (csrc/*.cpp): built once per machine and toolchain (`kernel_key`),
cached, loaded; on a first start, built in a detached process of its own that finishes
whatever the process that started it does (`build_in_background`), while the engine serves
on the plain-torch reference; `kernels()` picks the module up once that build is done."""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger("workbench")
_CSRC = [Path(__file__).parent / "csrc" / name for name in ("bindings.cpp", "cpu_attention.cpp",
                                                             "cpu_ops.cpp", "cpu_quant.cpp",
                                                             "cpu_a8.cpp")]
_HEADERS = [Path(__file__).parent / "csrc" / name for name in ("cpu_dtype.h", "cpu_torch.h", "cpu_packed.h")]
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


_OPS = "workbench_cpu"
"""The operators' namespace (csrc/bindings.cpp's TORCH_LIBRARY): torch.ops.workbench_cpu."""


def _import_built(path: Path):
    """Load the built library (its TORCH_LIBRARY registers the operators) and return their
    namespace, whose attributes are the kernels (hasattr says which this CPU has)."""
    if not hasattr(getattr(torch.ops, _OPS), "rms_norm"):     # not loaded in this process yet
        torch.ops.load_library(str(path))
    return getattr(torch.ops, _OPS)


def load_cpu_kernels():
    """Build the C++ CPU kernels once per `kernel_key()` (about 30 s on 2 cores) and
    return the module, or None if no compiler is available.

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
                                "version, about 30 s on 2 cores)…")
                    (build / "lock").unlink(missing_ok=True)
                    from torch.utils.cpp_extension import load
                    load(name=_NAME, sources=[str(p) for p in _CSRC], extra_cflags=_CFLAGS,
                         build_directory=str(build), verbose=False, is_python_module=False)
                    _kernels = _import_built(build / f"{_NAME}.so")
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
        log("building the CPU kernel (once per machine and torch version; about 30 s on 2 cores)…")
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
    (`load_cpu_kernels`), so concurrent starts build once. Engines made meanwhile run the reference
    until `kernels()` picks the module up, once the build's marker appears."""
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
                    [sys.executable, "-c", "from workbench.platforms.cpu_kernels import _build_main; "
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
    there. What the CPU backend and ops call on every use."""
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


def build_failed() -> bool:
    """This process tried to build or load the module and could not (no compiler, no ninja)."""
    return _kernels is False


def kernel_is_building() -> bool:
    """A build this process started is still running (`kernels()` loads it once it is done)."""
    return _kernels is None and _builder is not None and _builder.poll() is None
