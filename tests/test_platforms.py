"""Device selection: auto order, the lazy torch_npu import and its clear failure."""
from __future__ import annotations

import subprocess
import sys
import types

import pytest

from workbench.platforms import get_platform, npu


def test_auto_picks_cpu_here():
    assert get_platform("auto").name == "cpu"


def test_import_workbench_never_imports_torch_npu_or_server_deps():
    code = ("import sys, workbench; from workbench import Engine; "
            "print(sorted(m for m in ('torch_npu', 'fastapi', 'ipywidgets', 'plotly') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_npu_without_torch_npu_is_a_clear_error():
    with pytest.raises(ValueError, match=r"needs Ascend's torch_npu .*; torch_npu is not installed$"):
        get_platform("npu")


def test_npu_whose_import_fails_is_a_clear_error(monkeypatch):
    # A torch_npu that is present but cannot load its CANN libraries.
    monkeypatch.setattr(npu.importlib.util, "find_spec", lambda name: types.SimpleNamespace())
    monkeypatch.setitem(sys.modules, "torch_npu", None)   # makes `import torch_npu` raise
    with pytest.raises(ValueError, match="importing torch_npu failed"):
        get_platform("npu")
    assert not npu.NpuPlatform.is_available()              # and auto just skips it
    assert get_platform("auto").name == "cpu"


def test_kv_pool_sized_from_device_memory(monkeypatch):
    """On a device that reports its memory, the pool fits in gpu_memory_utilization of it
    beside what is already in use, leaves room for a step's activations, and grows with
    the utilization; too little room is a clear error. (Bounds on behaviour, not the
    formula: any sizing rule that keeps these promises passes.)"""
    import workbench.engine.build
    from workbench import Engine
    from workbench.platforms.cpu import CpuPlatform
    GiB = 2**30

    class Reporting(CpuPlatform):
        def memory_info(self):
            return (3 * GiB, 4 * GiB)            # 1 GiB already in use

    monkeypatch.setattr(workbench.engine.build, "get_platform", lambda name: Reporting())

    def pool_bytes(**kw):
        return Engine(model="random:tiny", max_num_batched_tokens=512, **kw).telemetry.memory.kv_cache_bytes

    half, most = pool_bytes(gpu_memory_utilization=0.5), pool_bytes(gpu_memory_utilization=0.9)
    assert 0.25 * GiB < half <= 0.5 * 4 * GiB - 1 * GiB - 256 * 2**20   # leaves an activation reserve
    assert most - half >= 0.4 * 4 * GiB * 0.95                           # the extra 40% goes to KV
    assert most <= 0.9 * 4 * GiB - 1 * GiB
    per_block = Engine(model="random:tiny").telemetry.memory.kv_bytes_per_block
    assert 0.01 * GiB - 2 * per_block <= pool_bytes(kv_cache_memory_gb=0.01) <= 0.01 * GiB + per_block
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        Engine(model="random:tiny", gpu_memory_utilization=0.1)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        Engine(model="random:tiny", gpu_memory_utilization=1.5)
