"""The CPU's C++ kernels (csrc/*.cpp): built once per machine and toolchain (`kernel_key`),
cached, loaded; on a first start, built in a detached process of its own that finishes
whatever the process that started it does (`build_in_background`), while the engine serves
on the plain-torch reference; `kernels()` picks the module up once that build is done.

A build that fails (no compiler, a compiler that rejects a flag) leaves a record beside
where the module would be (`failed`, keyed like the module, with the error and the tail of
the compiler's output): said once in the log, in `engine.info()` / the notices and in
`workbench doctor --device cpu`, and not tried again until the compiler or the sources
change (a new key) or `workbench build-kernels` asks for it.

`WORKBENCH_CPU_MARCH` builds for another CPU than this one (`x86-64-v3`: AVX2 and FMA, no
AVX-512; `x86-64`: SSE2 only), into a cache folder of its own: how the fallbacks of the
AVX-512 paths are built and tested here."""
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
_HEADERS = [Path(__file__).parent / "csrc" / name
            for name in ("cpu_dtype.h", "cpu_torch.h", "cpu_packed.h", "cpu_small_m.h")]
"""Included by the sources: part of what the module depends on (kernel_key), not compiled."""
_kernels = None
MARCH_ENV = "WORKBENCH_CPU_MARCH"
"""The CPU to build for, as gcc's -march names it (default: native, this CPU)."""


def cflags(system: str | None = None, machine: str | None = None) -> list[str]:
    """The compiler flags of this machine's build. -ffast-math lets gcc vectorise expf
    (libmvec); the kernels never see inf or NaN inputs. Apple's clang takes OpenMP only as
    `-Xpreprocessor -fopenmp`, against the libomp torch ships (`ldflags`)."""
    system = system or platform.system()
    machine = machine or platform.machine()
    march = os.environ.get(MARCH_ENV, "native")
    if system == "Darwin":
        arch = [] if machine == "arm64" and march == "native" else [f"-march={march}"]
        return ["-O3", *arch, "-Xpreprocessor", "-fopenmp", "-ffast-math"]
    # gcc on aarch64 takes -march=native too (reads the CPU's features, as on x86).
    return ["-O3", f"-march={march}", "-fopenmp", "-ffast-math"]


def ldflags(system: str | None = None) -> list[str]:
    """Apple's clang has no OpenMP runtime of its own: link the one torch ships."""
    if (system or platform.system()) != "Darwin":
        return []
    lib = Path(torch.__file__).parent / "lib"
    return [f"-L{lib}", "-lomp", f"-Wl,-rpath,{lib}"]


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


def cpu_identity(cpuinfo: str | None = None) -> dict[str, str]:
    """The CPU as the build's -march=native sees it: its model and feature flags. x86's
    /proc/cpuinfo says `model name` and `flags`; aarch64's says `CPU implementer`, `CPU part`
    and `Features` instead (two Arm CPUs differ there, and a module built for one can stop
    on an illegal instruction on the other); macOS has no /proc (sysctl's brand string)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    out: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "flags", "CPU implementer", "CPU architecture", "CPU variant",
                   "CPU part", "Features") and key not in out:
            out[key] = value.strip()
    if not out and platform.system() == "Darwin":
        try:
            out["model name"] = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return out


def isa_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags (x86 `flags`, aarch64 `Features`), e.g. {'avx2', 'avx512f',
    'avx512_bf16', 'amx_bf16'} or {'asimd', 'bf16', 'sve'}."""
    ident = cpu_identity(cpuinfo)
    return set((ident.get("flags") or ident.get("Features") or "").split())


def kernel_key() -> str:
    """What the built module depends on, and nothing else (not where the venv is): the source
    and flags, the compiler, torch's and Python's ABI, and the CPU (-march=native)."""
    import sys
    import sysconfig

    ident = cpu_identity()
    text = "|".join([platform.machine(), *(f"{k}={v}" for k, v in sorted(ident.items())),
                     torch.__version__,
                     str(torch.version.git_version), sys.version, str(sysconfig.get_config_var("EXT_SUFFIX")),
                     _compiler(), repr(cflags()), repr(ldflags()),
                     *(p.read_text() for p in _CSRC + _HEADERS)])
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


def load_cpu_kernels(retry: bool = False):
    """Build the C++ CPU kernels once per `kernel_key()` (about 30 s on 2 cores) and
    return the module, or None where it cannot be built (recorded: `failure()`; not tried
    again for this key unless `retry`).

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
                elif failure() is not None and not retry:
                    _kernels = False
                else:
                    log.warning("building the CPU attention kernel (once per machine and torch "
                                "version, about 30 s on 2 cores)…")
                    (build / "failed").unlink(missing_ok=True)
                    (build / "lock").unlink(missing_ok=True)
                    from torch.utils.cpp_extension import load
                    load(name=_NAME, sources=[str(p) for p in _CSRC], extra_cflags=cflags(),
                         extra_ldflags=ldflags(), build_directory=str(build), verbose=False,
                         is_python_module=False)
                    _kernels = _import_built(build / f"{_NAME}.so")
                    tmp = build / "built.tmp"            # the marker appears whole or not at all
                    tmp.write_text(f"{_NAME}.so\n")
                    os.replace(tmp, done)
        except Exception as e:   # no compiler / ninja: the plain-torch path still works
            _record_failure(build, e)
            _kernels = False
        if _kernels is False:
            _say_failed()
    return _kernels or None


FAILED = "failed"
"""The failure record's name in the build folder: JSON {error, log_tail, compiler, flags}."""
LOG_TAIL_LINES = 25


def _record_failure(build: Path, e: BaseException) -> None:
    """Write the failure record (whole or not at all): the error's first line and the last
    lines of what the compiler said (torch puts its output in the exception's text)."""
    import json
    text = str(e) or type(e).__name__
    lines = [ln for ln in text.splitlines() if ln.strip()]
    telling = [ln for ln in lines if any(w in ln for w in ("error:", "not found", "No such file",
                                                            "unrecognized", "unknown"))]
    first = (telling or lines or [type(e).__name__])[0].strip()
    record = {"error": first if len(first) <= 200 else first[:197] + "…",
              "log_tail": "\n".join(lines[-LOG_TAIL_LINES:]), "compiler": _compiler(),
              "flags": cflags(), "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        build.mkdir(parents=True, exist_ok=True)
        tmp = build / f"{FAILED}.tmp"
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, build / FAILED)
    except OSError:
        pass


def failure() -> dict | None:
    """This key's recorded failed build ({error, log_tail, compiler, flags, when}), or None."""
    import json
    try:
        return json.loads((kernel_dir() / FAILED).read_text())
    except (OSError, ValueError):
        return None


_said = False


def _say_failed() -> None:
    """One warning a process, with the reason and where the whole log is."""
    global _said
    if _said:
        return
    _said = True
    rec = failure()
    why = rec["error"] if rec else "the build did not finish"
    log.warning("CPU kernel unavailable (%s); serving on the plain-torch path. The build is "
                "not retried until the compiler or the sources change (`workbench "
                "build-kernels` retries it now); details: `workbench doctor --device cpu`, %s",
                why, kernel_dir())


def kernel_state() -> str:
    """'built' (loaded or on disk), 'building' (a build this process started runs),
    'failed: <error>' (recorded for this key) or 'not built'."""
    if _kernels or kernel_is_built():
        return "built"
    rec = failure()
    if rec is not None:
        return f"failed: {rec['error']}"
    if _builder is not None and _builder.poll() is None:
        return "building"
    return "not built"


def kernel_is_built() -> bool:
    return (kernel_dir() / "built").is_file()


def ensure_kernel_built(log=None, retry: bool = False) -> bool:
    """Build the kernel now, in this thread, if it is not built (or wait for the build another
    process holds the lock for); `log` hears one line before and one after. What `workbench
    build-kernels` and the benchmarks call, so that nothing is measured on the fallback.
    Returns whether the kernel is available; `retry` builds again after a recorded failure."""
    import time
    if _kernels is not None or kernel_is_built():
        return load_cpu_kernels() is not None
    if failure() is not None and not retry:
        return load_cpu_kernels() is not None        # recorded: says so once, no rebuild
    t = time.perf_counter()
    if log is not None:
        log("building the CPU kernel (once per machine and torch version; about 30 s on 2 cores)…")
    ok = load_cpu_kernels(retry) is not None
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
    session of its own, 10 below the priority of the process that starts it (`below_me`), with
    its output in the build folder's `build.log`. It
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
                    start_new_session=True, preexec_fn=below_me())
        return _builder


def below_me(by: int = 10):
    """A preexec_fn for a child in a session of its own (start_new_session) that runs it `by`
    nice levels below this process: its nice value and, where the kernel schedules by
    session (autogroups: on by default in most Linux distributions), its session's too. A
    nice value alone counts only against processes of the same session there, so a build
    in a session of its own would take half of a 2-core machine from the engine serving
    beside it, whatever its nice value; and it never outranks a starter that was niced."""
    import contextlib
    group = None
    with contextlib.suppress(OSError, ValueError, IndexError):   # "/autogroup-7 nice 0"
        group = int(Path("/proc/self/autogroup").read_text().split()[-1])

    def lower() -> None:                # in the child, after setsid: its own session
        with contextlib.suppress(OSError, AttributeError):
            os.nice(by)
        if group is not None:
            with contextlib.suppress(OSError):
                fd = os.open("/proc/self/autogroup", os.O_WRONLY)
                try:
                    os.write(fd, str(min(19, group + by)).encode())
                finally:
                    os.close(fd)
    return lower


def kernels():
    """The loaded module, or None; while a build this process started runs elsewhere, look
    for its marker (at most every half second, a stat) and load the module once it is
    there. What the CPU backend and ops call on every use."""
    global _next_check, _kernels
    if _kernels is None and _built_marker is not None:
        now = time.monotonic()
        if now >= _next_check:
            _next_check = now + 0.5
            exited = _builder is not None and _builder.poll() is not None   # reaps it
            if _built_marker.is_file():
                load_cpu_kernels()
            elif exited:            # failed (recorded) or killed: stop looking, say it once
                _kernels = False
                _say_failed()
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
        if _kernels is False:
            return False                                     # the build failed: failure()
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
    """This process tried to build or load the module and could not (no compiler, no ninja),
    or this key's build failed before (`failure()`), in this process or another."""
    global _kernels
    if _kernels is None and not kernel_is_built() and failure() is not None:
        _kernels = False                  # recorded by an earlier process: say it here too
        _say_failed()
    return _kernels is False


def kernel_is_building() -> bool:
    """A build this process started is still running (`kernels()` loads it once it is done)."""
    return _kernels is None and _builder is not None and _builder.poll() is None
