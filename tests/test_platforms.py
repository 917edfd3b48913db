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
    with pytest.raises(ValueError, match=r"torch_npu is not installed.*|.*CANN"):
        get_platform("npu")


def test_npu_whose_import_fails_is_a_clear_error(monkeypatch):
    # A torch_npu that is present but cannot load its CANN libraries.
    monkeypatch.setattr(npu.importlib.util, "find_spec", lambda name: types.SimpleNamespace())
    monkeypatch.setitem(sys.modules, "torch_npu", None)   # makes `import torch_npu` raise
    with pytest.raises(ValueError, match="importing torch_npu failed"):
        get_platform("npu")
    assert not npu.NpuPlatform.is_available()              # and auto just skips it
    assert get_platform("auto").name == "cpu"
