"""The CPU platform with CUDA's attention backend and fused ops: what a CUDA engine runs,
driven on CPU tensors by Triton's interpreter (TRITON_INTERPRET=1). Used by the subprocess
checks of test_fused_ops.py and test_prefill_kernel.py (their PYTHONPATH has tests/)."""
from __future__ import annotations

import threading
from contextlib import contextmanager

from workbench.platforms.cpu import CpuPlatform


class TritonOnCpu(CpuPlatform):
    def __init__(self, gemv: bool = True):
        self.gemv = gemv

    def attention_backend(self, dtype, choice="auto"):
        from workbench.platforms.triton_attention import TritonAttention
        return TritonAttention(dtype)

    def model_ops(self, dtype):
        if not self.gemv:                           # cuBLAS's part: torch's linear layers
            from workbench.platforms.triton_ops import TritonOps
            return TritonOps()
        return TritonOpsWithGemv()


def TritonOpsWithGemv():
    """CUDA's fused ops with the batch-1 GEMV on for every weight shape of the model (CUDA
    turns it on per shape by timing it against cuBLAS; the interpreter's timings mean
    nothing), the shapes taking the candidate configs in turn, from the last: the widest
    tiles, the fewest programs, which is what the interpreter's time goes by (it runs a
    launch's programs one after another; CONFIGS[0] takes 16 times as many as the last).
    test_fused_ops.py's CODE checks every config against torch, configs 0-5 with the
    fused norm and SiLU-and-mul too (6-8 run those in its engines, through this plan)."""
    from workbench.platforms import triton_gemv
    from workbench.platforms.triton_ops import TritonOps

    class Ops(TritonOps):
        def prepare(self, model, platform):
            shapes = triton_gemv.linear_weights(model)
            configs = triton_gemv.CONFIGS[::-1]
            self.gemv_plan = {s: configs[i % len(configs)] for i, s in enumerate(shapes)}
    return Ops()


@contextmanager
def triton_on_cpu(gemv: bool = True):
    """Engines built inside get the TritonOnCpu platform (gemv=False: without the GEMV)."""
    import workbench.engine.build as engine_build
    orig = engine_build.get_platform
    engine_build.get_platform = lambda name: TritonOnCpu(gemv)
    try:
        yield
    finally:
        engine_build.get_platform = orig


class Interpreted:
    """A script running under Triton's interpreter in a subprocess of its own (process
    group too), started at once: `output()` waits for it; `stop()` ends it and its group,
    run or not. Its output is read by whichever thread waits first (the queue below, or a
    test), once."""

    def __init__(self, cmd: list[str], timeout: float):
        import os
        import subprocess
        import threading
        import time

        here = os.path.dirname(os.path.abspath(__file__))
        self.deadline = time.monotonic() + timeout
        self.lock = threading.Lock()
        self.result: tuple[int, str, str] | None = None
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
            env={**os.environ, "TRITON_INTERPRET": "1",
                 "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])})

    def wait(self) -> tuple[int, str, str]:
        """(return code, stdout, stderr), once it has ended (killed at its deadline)."""
        import subprocess
        import time
        with self.lock:
            if self.result is None:
                try:
                    out, err = self.proc.communicate(
                        timeout=max(self.deadline - time.monotonic(), 1))
                except subprocess.TimeoutExpired:
                    self.stop()
                    out, err = "", f"killed after its deadline: {self.proc.args[:2]}"
                self.result = (self.proc.returncode, out, err)
            return self.result

    def output(self) -> str:
        """Its stdout (stripped); a failing run fails the calling test with the end of its
        stderr."""
        code, out, err = self.wait()
        assert code == 0, err[-3000:]
        return out.strip()

    def stop(self) -> None:
        import os
        import signal
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        try:                                   # nothing of its group may be left either
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start_interpreted(code: str | None = None, script=None, *args: str,
                      timeout: float = 900) -> Interpreted:
    """Start `code` (python -c) or `script` with args in a fresh interpreter under Triton's
    interpreter (TRITON_INTERPRET=1 must be set before triton is imported, hence a
    subprocess), with tests/ on its path so it can import this module."""
    import sys

    import pytest
    pytest.importorskip("triton")
    cmd = [sys.executable, "-c", code] if code is not None else [sys.executable, str(script)]
    return Interpreted([*cmd, *args], timeout)


def run_interpreted(code: str | None = None, script=None, *args: str, timeout: float = 900) -> str:
    """start_interpreted, then its output."""
    run = start_interpreted(code, script, *args, timeout=timeout)
    try:
        return run.output()
    finally:
        run.stop()


# ---- the session's queue of interpreted runs -------------------------------------------------
# Each run is one single-threaded Python process (Triton's interpreter runs a launch's programs
# one after another in numpy) taking 10-90 s, and a test that waits for one leaves the other
# core idle. So a test module registers its runs at import (`register`), its tests carry
# @pytest.mark.interpreted(key, ...), and the first test that asks for one (`interpreted`)
# starts a queue that runs every selected run one at a time in the background while the
# suite goes on; a test whose run the queue has not reached yet starts it at once. conftest.py
# tells the queue which runs the session selected and stops what is left at its end.
_REGISTERED: dict[str, tuple] = {}
_SELECTED: set[str] | None = None
"""The keys of the selected tests' runs (None: not told, so every registered one)."""
_RUNS: dict[str, Interpreted] = {}
_STATE: dict[str, threading.Thread | None] = {"queue": None}
_LOCK = threading.RLock()


def register(key: str, code: str | None = None, script=None, *args: str,
             timeout: float = 900) -> None:
    """A run a test of this session may ask for by `key` (at a module's import)."""
    _REGISTERED[key] = (code, script, args, timeout)


def select(keys: set[str]) -> None:
    global _SELECTED
    _SELECTED = set(keys)


def _start(key: str) -> Interpreted:
    with _LOCK:
        run = _RUNS.get(key)
        if run is None:
            code, script, args, timeout = _REGISTERED[key]
            run = _RUNS[key] = start_interpreted(code, script, *args, timeout=timeout)
        if _STATE["queue"] is None:
            _STATE["queue"] = threading.Thread(target=_queue, name="interpreted-queue",
                                               daemon=True)
            _STATE["queue"].start()
        return run


def _queue() -> None:
    for key in list(_REGISTERED):
        if (_SELECTED is None or key in _SELECTED) and key not in _RUNS:
            try:                                 # (one a test started runs beside it)
                with _LOCK:                      # not after stop_all has listed the runs
                    if _STATE["queue"] is None:
                        return
                    run = _start(key)
                run.wait()
            except BaseException:                # no triton (a skip): the tests say so
                return


def interpreted(key: str) -> Interpreted:
    """The registered run `key`: done, running, or started now."""
    return _start(key)


def stop_all() -> None:
    """End every run of the session, and the queue."""
    with _LOCK:
        _STATE["queue"] = None
        runs = list(_RUNS.values())
    for run in runs:
        run.stop()

