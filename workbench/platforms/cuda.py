"""CUDA GPUs: bf16 by default, a Triton paged decode-attention kernel, CUDA graphs."""
from __future__ import annotations

import importlib.util

import torch

from .base import Platform


class CudaPlatform(Platform):
    name = "cuda"
    default_dtype = torch.bfloat16

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    @property
    def supports_graphs(self) -> bool:
        return importlib.util.find_spec("triton") is not None

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def peak_memory_bytes(self) -> int:
        return torch.cuda.max_memory_allocated()

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes on the device."""
        return torch.cuda.mem_get_info()

    def decode_attention_kernel(self, dtype):
        if importlib.util.find_spec("triton") is None:
            return None
        from .triton_attention import paged_decode_attention
        return paged_decode_attention

    def graph_pool(self):
        return torch.cuda.graph_pool_handle()

    def capture_graph(self, fn, pool):
        # Warm up on a side stream (lazy inits, Triton compiles and autotunes happen here,
        # not inside the capture), then capture on it.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        torch.cuda.synchronize()
        return graph, out
