"""Decode steps as captured graphs (graph_mode 'decode', vLLM-Ascend's FULL_DECODE_ONLY).

At start-up the model's decode forward is captured once per size in the capture list, into
one shared memory pool, reading its inputs from static buffers: token ids, positions, KV
slots, block tables and context lengths. A decode step of b requests then copies its inputs
into the first b rows of those buffers, fills the rows up to the next captured size B with
padding, and replays graph B; the first b rows of the captured logits are the answer.

Padding rows must not disturb anyone: each feeds token 0 at position 0, writes its K/V to
a scratch block that no request owns (the pool has one block more than the block manager
hands out), and attends over that one slot. Their logits are computed and ignored.

Capture and replay are the platform's (torch.cuda.CUDAGraph, torch.npu.NPUGraph); a
decode batch larger than every captured size, and every step with a prefill in it, runs
eager.
"""
from __future__ import annotations

from typing import Callable

import torch

from .attention import AttentionMetadata
from .graphs import padded_size


class DecodeGraphs:
    def __init__(self, model, layer_caches, platform, kernel: Callable, sizes: list[int],
                 max_blocks: int, scratch_block: int, block_size: int):
        dev = platform.device
        self.model = model
        self.layer_caches = layer_caches
        self.platform = platform
        self.kernel = kernel
        self.sizes = sorted(sizes)
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.max_blocks = max_blocks
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), scratch_block * block_size, dtype=torch.long, device=dev)
        self.tables = torch.full((n, max_blocks), scratch_block, dtype=torch.long, device=dev)
        self.lens = torch.ones(n, dtype=torch.long, device=dev)
        self.rows = torch.arange(n, dtype=torch.long, device=dev)
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(slot_mapping=self.slots[:size], num_decode=size,
                                 decode_rows=None, decode_bias=None, prefills=[],
                                 decode_kernel=self.kernel,
                                 decode_block_tables=self.tables[:size],
                                 decode_lens=self.lens[:size])
        return self.model(self.input_ids[:size], self.positions[:size], self.layer_caches, meta,
                          self.rows[:size])

    @torch.inference_mode()
    def capture(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Capture every size, largest first (so smaller graphs reuse its pool memory)."""
        self.pool = self.platform.graph_pool()
        for i, size in enumerate(reversed(self.sizes)):
            self.graphs[size], self.outputs[size] = self.platform.capture_graph(
                lambda s=size: self._forward(s), self.pool)
            if progress is not None:
                progress(i + 1, len(self.sizes))

    def size_for(self, batch: int) -> int | None:
        return padded_size(batch, self.sizes)

    @torch.inference_mode()
    def run(self, input_ids: list[int], positions: list[int], slots: list[int],
            tables: list[list[int]], lens: list[int]) -> tuple[torch.Tensor, int]:
        """Replay for one decode batch; returns its logits [b, vocab] and the size replayed."""
        b = len(input_ids)
        size = self.size_for(b)
        assert size is not None, "batch larger than every captured size"
        width = self.max_blocks
        rows = [t + [self.scratch_block] * (width - len(t)) for t in tables]
        pad = size - b
        host = dict(
            input_ids=torch.tensor(input_ids + [0] * pad, dtype=torch.long),
            positions=torch.tensor(positions + [0] * pad, dtype=torch.long),
            slots=torch.tensor(slots + [self.scratch_block * self.block_size] * pad, dtype=torch.long),
            tables=torch.tensor(rows + [[self.scratch_block] * width] * pad, dtype=torch.long),
            lens=torch.tensor(lens + [1] * pad, dtype=torch.long))
        for name, t in host.items():
            getattr(self, name)[:size].copy_(t, non_blocking=True)
        self.graphs[size].replay()
        return self.outputs[size][:b], size
