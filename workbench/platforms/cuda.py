"""CUDA GPUs: bf16 by default, Triton kernels (paged decode attention, fused norms,
SiLU-and-mul and RoPE), CUDA graphs."""
from __future__ import annotations

import importlib.util

import torch

from .base import AcceleratorPlatform


class CudaPlatform(AcceleratorPlatform):
    name = "cuda"
    graph_class = "CUDAGraph"
    runs_async = True

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    supports_graphs = True
    """CUDA graphs are torch's: piecewise capture needs no Triton. Whole decode-step graphs
    need the fused paged attention (Triton); graphs.plan_graphs decides."""

    def model_ops(self, dtype):
        if importlib.util.find_spec("triton") is None:
            return super().model_ops(dtype)
        from .triton_ops import TritonOps      # fused for bf16/fp16; fp32 stays on torch
        return TritonOps()

    def attention_backend(self, dtype, choice: str = "auto"):
        if choice != "auto" or importlib.util.find_spec("triton") is None:
            return super().attention_backend(dtype, choice)
        from .triton_attention import TritonAttention
        return TritonAttention(dtype)

    @classmethod
    def attention_backend_classes(cls) -> tuple[type, ...]:
        if importlib.util.find_spec("triton") is None:
            return super().attention_backend_classes()
        from .triton_attention import TritonAttention
        return (*super().attention_backend_classes(), TritonAttention)
