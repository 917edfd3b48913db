"""The CPU platform with CUDA's attention backend and fused ops: what a CUDA engine runs,
driven on CPU tensors by Triton's interpreter (TRITON_INTERPRET=1). Used by the subprocess
checks of test_fused_ops.py and test_prefill_kernel.py (their PYTHONPATH has tests/)."""
from __future__ import annotations

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
    group too), started at once (through background.spawn: niced when a background job
    starts it), so that two runs of single-threaded numpy share the two cores: `output()`
    waits for it; `stop()` ends it and its group, run or not."""

    def __init__(self, cmd: list[str], timeout: float):
        import os
        import subprocess

        import background
        here = os.path.dirname(os.path.abspath(__file__))
        self.timeout = timeout
        self.proc = background.spawn(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "TRITON_INTERPRET": "1",
                 "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])})

    def output(self) -> str:
        """Its stdout (stripped), waiting up to `timeout` s from this call; a failing run
        fails the calling test with the end of its stderr."""
        import subprocess
        try:
            out, err = self.proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        assert self.proc.returncode == 0, err[-3000:]
        return out.strip()

    def stop(self) -> None:
        import os
        import signal
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.communicate()
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
