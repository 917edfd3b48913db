from __future__ import annotations

import torch


class Platform:
    """What the engine needs to know about a device. Subclasses fill in the specifics."""
    name = "base"
    default_dtype = torch.float32
    default_block_size = 16
    supports_graphs = False
    """Whether this platform can capture and replay step graphs (graph_mode 'decode'/'full')."""

    @classmethod
    def is_available(cls) -> bool:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return torch.device(self.name)

    def synchronize(self) -> None:
        """Wait for queued device work (no-op where ops run synchronously)."""

    def peak_memory_bytes(self) -> int:
        raise NotImplementedError

    def reset_peak_memory(self) -> None:
        """Start a new peak-memory window, where the device tracks one."""

    def memory_info(self) -> tuple[int, int] | None:
        """(free, total) device memory in bytes, or None where the device does not say (the
        CPU: its KV pool is sized by kv_cache_memory_gb or 1 GiB)."""
        return None

    def graph_pool(self):
        """A memory-pool handle that every captured graph of an engine shares."""
        raise NotImplementedError

    def capture_graph(self, fn, pool) -> tuple[object, object]:
        """Warm `fn` up, capture it into a graph using `pool`, and return (graph, output):
        `graph.replay()` reruns the captured work, refreshing `output` in place."""
        raise NotImplementedError

    def kv_cache_shape(self, num_layers: int, kv_heads: int, num_blocks: int, block_size: int,
                       head_dim: int) -> tuple[int, ...]:
        """The pool: [layers, K/V, ...] with one layer's K (or V) laid out as the attention
        code expects. Default head-major [kv_heads, num_blocks, block_size, head_dim]."""
        return (num_layers, 2, kv_heads, num_blocks, block_size, head_dim)

    def attention_backend(self, dtype):
        """A whole-attention backend for this device (KV write, decode and prefill in its own
        pool layout; see AttentionMetadata.backend), or None for the code in attention.py."""
        return None

    def check_config(self, config) -> None:
        """Refuse knob values this device's kernels cannot run (ValueError naming the knob)."""

    def decode_attention_kernel(self, dtype):
        """A fused paged decode-attention op for this device and dtype, or None to use the
        plain-torch reference in `workbench/attention.py`. Signature:
        (q [B,H,D], k_cache, v_cache, block_tables [B,max_blocks], context_lens [B], scale)."""
        return None
