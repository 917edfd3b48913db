"""Ascend NPU through torch_npu, imported only when this platform is asked for.

torch_npu hooks itself into `import torch` and fails without the CANN runtime, so it is never
a hard dependency: the engine only looks for it (`find_spec`) when choosing a device, and
imports it when the NPU platform is actually selected. Attention runs on torch_npu's fused
ops (`npu_attention.py`), written from their documented signatures; nothing here has run on
NPU hardware yet. NPUGraph capture is not in this build: graph modes run eager and say so.
"""
from __future__ import annotations

import importlib.util

import torch

from .base import Platform

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


class NpuPlatform(Platform):
    name = "npu"
    default_dtype = torch.bfloat16
    default_block_size = 128      # the fused prefill's paging unit (npu_attention.BLOCK_SIZE)

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

    def synchronize(self) -> None:
        torch.npu.synchronize()

    def peak_memory_bytes(self) -> int:
        return torch.npu.max_memory_allocated()

    def reset_peak_memory(self) -> None:
        torch.npu.reset_peak_memory_stats()

    def memory_info(self) -> tuple[int, int]:
        return torch.npu.mem_get_info()

    def kv_cache_shape(self, num_layers, kv_heads, num_blocks, block_size, head_dim):
        from .npu_attention import block_major_shape
        return block_major_shape(num_layers, kv_heads, num_blocks, block_size, head_dim)

    def attention_backend(self, dtype):
        from .npu_attention import NpuAttention
        return NpuAttention(self.torch_npu)

    def check_config(self, config) -> None:
        from .npu_attention import check_npu_config
        check_npu_config(config)
