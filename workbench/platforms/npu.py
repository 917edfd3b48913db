"""Ascend NPU through torch_npu, imported only when this platform is asked for.

torch_npu hooks itself into `import torch` and fails without the CANN runtime, so it is never
a hard dependency: the engine only looks for it (`find_spec`) when choosing a device, and
imports it when the NPU platform is actually selected. Attention runs on torch_npu's fused
ops (`npu_attention.py`), written from their documented signatures; nothing here has run on
NPU hardware yet.

Graphs are torch.npu.NPUGraph, captured with auto_dispatch_capture=True: torch_npu then
records each `_npu_paged_attention` call so that `graph.update(cpu_update_input=...)` can
hand it new host-side context lengths, which a replay would otherwise keep as they were at
capture (see replay_graph). Piecewise graphs (graph_mode 'full') hold no attention and
need no update.
"""
from __future__ import annotations

import importlib.util

import torch

from .base import AcceleratorPlatform

INSTALL_HINT = ("device 'npu' needs Ascend's torch_npu matched to your torch version and a "
                "sourced CANN toolkit: `source /usr/local/Ascend/ascend-toolkit/set_env.sh` "
                "then `pip install -e \".[npu]\"` (see README, Ascend NPU)")


def import_torch_npu():
    """Import torch_npu, turning any failure into one clear message."""
    if importlib.util.find_spec("torch_npu") is None:
        raise ValueError(f"{INSTALL_HINT}; torch_npu is not installed")
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except Exception as e:   # missing CANN libraries raise OSError/RuntimeError, not ImportError
        raise ValueError(f"{INSTALL_HINT}; importing torch_npu failed: {e}") from e
    return torch_npu


class NpuPlatform(AcceleratorPlatform):
    name = "npu"
    default_block_size = 128      # the fused prefill's paging unit (npu_attention.BLOCK_SIZE)
    supports_graphs = True
    graph_class = "NPUGraph"
    capture_kwargs = {"auto_dispatch_capture": True}

    def __init__(self):
        self.torch_npu = import_torch_npu()

    @classmethod
    def is_available(cls) -> bool:
        """Cheap and safe for device='auto': False unless torch_npu imports and sees a device."""
        if importlib.util.find_spec("torch_npu") is None:
            return False
        try:
            import_torch_npu()
            return bool(torch.npu.is_available())
        except ValueError:
            return False

    def replay_graph(self, graph, context_lens: torch.Tensor | None = None) -> None:
        # One update dict applies to every recorded op (each layer's paged attention);
        # torch_npu re-issues them on its update stream, and each captured attention waits
        # on its event until its update has landed.
        if context_lens is not None:
            graph.update(cpu_update_input=[{"context_lens": context_lens}])
        graph.replay()

    def model_ops(self, dtype):
        from .npu_ops import NpuOps
        return NpuOps(self.torch_npu)

    def kv_cache_shape(self, num_layers, kv_heads, num_blocks, block_size, head_dim):
        from .npu_attention import block_major_shape
        return block_major_shape(num_layers, kv_heads, num_blocks, block_size, head_dim)

    def attention_backend(self, dtype):
        from .npu_attention import NpuAttention
        return NpuAttention(self.torch_npu)

    def check_config(self, config) -> None:
        from .npu_attention import check_npu_config
        check_npu_config(config)
