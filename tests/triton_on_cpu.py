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
    nothing), the shapes taking the candidate configs in turn."""
    from workbench.platforms import triton_gemv
    from workbench.platforms.triton_ops import TritonOps

    class Ops(TritonOps):
        def prepare(self, model, platform):
            shapes = triton_gemv.linear_weights(model)
            self.gemv_plan = {s: triton_gemv.CONFIGS[i % len(triton_gemv.CONFIGS)]
                              for i, s in enumerate(shapes)}
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


def run_interpreted(code: str | None = None, script=None, *args: str, timeout: float = 900) -> str:
    """Run `code` (python -c) or `script` with args in a fresh interpreter under Triton's
    interpreter (TRITON_INTERPRET=1 must be set before triton is imported, hence a subprocess),
    with tests/ on its path so it can import this module. Returns its stdout (stripped); a
    failing run fails the calling test with the end of its stderr."""
    import os
    import subprocess
    import sys

    import pytest
    pytest.importorskip("triton")
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [sys.executable, "-c", code] if code is not None else [sys.executable, str(script)]
    r = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "TRITON_INTERPRET": "1",
                            "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])})
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip()
