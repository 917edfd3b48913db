"""Steps as captured graphs: whole decode steps (DecodeGraphs, graph_mode 'decode') and,
for graph_mode 'full', prefill and mixed steps piecewise (PiecewiseGraphs).

DecodeGraphs (vLLM-Ascend's FULL_DECODE_ONLY). At start-up the model's decode forward is
captured once per size in the capture list, into the engine's one graph memory pool,
reading its inputs from static buffers: token ids, positions, KV slots, block tables and
context lengths. A decode step of b requests then copies its inputs into the first b rows
of those buffers, fills the rows up to the next captured size B with padding, and replays
graph B; the first b rows of the captured logits are the answer.

Padding rows must not disturb anyone: each feeds token 0 at position 0, writes its K/V to
the block pool's null block, which is never handed out (core.block_manager.NULL_BLOCK), and
attends over that one slot. Their logits are computed and ignored.

Capture and replay are the platform's (torch.cuda.CUDAGraph, torch.npu.NPUGraph). A decode
batch larger than every captured size runs eager; so does a step with a prefill in it,
unless graph_mode is 'full' and its token count fits a piecewise bucket.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..core.block_manager import NULL_BLOCK
from ..platforms.attention import AttentionMetadata, CommonAttentionMetadata
from .graphs import padded_size


class DecodeGraphs:
    """Decode steps as graphs, with the backend's paged attention inside. The backend says
    how it wants the tables and lengths it reads: their dtype (CUDA's Triton kernel: int64;
    torch_npu's ops: int32) and whether the lengths are read from host memory (torch_npu's:
    they reach each replay through platform.replay_graph)."""

    def __init__(self, model, layer_caches, platform, backend, sizes: list[int],
                 max_blocks: int, block_size: int):
        dev = platform.device
        self.model = model
        self.layer_caches = layer_caches
        self.platform = platform
        self.backend = backend
        self.sizes = sorted(sizes)
        self.block_size = block_size
        self.max_blocks = max_blocks
        n = self.sizes[-1]
        index = backend.index_dtype
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), NULL_BLOCK * block_size, dtype=torch.long, device=dev)
        self.tables = torch.full((n, max_blocks), NULL_BLOCK, dtype=index, device=dev)
        self.host_lens = backend.lens_on_host
        """Whether the attention reads context lengths from host memory. Then a replay
        would reuse the ones seen at capture: they go to platform.replay_graph instead of
        being copied into `lens`."""
        self.lens = torch.ones(n, dtype=index, device="cpu" if self.host_lens else dev)
        self.rows = torch.arange(n, dtype=torch.long, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=index, device=dev)
        """One token a row: what a decode step's query_start_loc always is."""
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _forward(self, size: int) -> torch.Tensor:
        # Built inside the capture: whatever the backend derives reads the static buffers.
        lens = self.lens[:size]
        meta = self.backend.build(CommonAttentionMetadata(
            self.query_start_loc[:size + 1], lens, self.tables[:size], self.slots[:size], size,
            seq_lens_cpu=lens if self.host_lens else None))
        return self.model(self.input_ids[:size], self.positions[:size], self.layer_caches, meta,
                          self.rows[:size])

    @torch.inference_mode()
    def capture(self, pool, progress: Callable[[int, int], None] | None = None) -> None:
        """Capture every size into `pool`, largest first (so smaller graphs reuse its
        memory). Each graph's logits are read right after its replay, before any other
        graph of the pool replays, which is what makes sharing one pool safe."""
        for i, size in enumerate(reversed(self.sizes)):
            self.graphs[size], self.outputs[size] = self.platform.capture_graph(
                lambda s=size: self._forward(s), pool)
            if progress is not None:
                progress(i + 1, len(self.sizes))

    def size_for(self, batch: int) -> int | None:
        return padded_size(batch, self.sizes)

    @torch.inference_mode()
    def run(self, step, b: int, input_ids: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, int]:
        """Replay for one decode batch of b requests; returns its logits [b, vocab] and the
        size replayed. step: the runner's StepInputs, padded to a captured size (padding rows
        as the module says), already on the device: its arrays are copied into the static
        buffers there. input_ids: the step's ids on the device (async scheduling: the
        previous step's sampled ids), copied without a round trip through the host."""
        common = step.common
        size = common.num_reqs
        assert size in self.graphs, "a decode step padded to a captured size"
        self.positions[:size].copy_(step.positions)
        self.slots[:size].copy_(common.slot_mapping)
        # Only the table columns this batch uses are copied: the kernels read no entry past
        # a row's context length, and a padding row's length is 1 (the null block).
        self.tables[:size, :common.block_table.shape[1]].copy_(common.block_table)
        if input_ids is not None:
            self.input_ids[:b].copy_(input_ids)
            self.input_ids[b:size].zero_()
        else:
            self.input_ids[:size].copy_(step.input_ids)
        lens = None
        if self.host_lens:
            lens = common.seq_lens_cpu.to(self.lens.dtype)
        else:
            self.lens[:size].copy_(common.seq_lens)
        self.platform.replay_graph(self.graphs[size], lens)
        return self.outputs[size][:b], size


class PiecewiseGraphs:
    """Any step whose token count fits a bucket, as L + 1 captured pieces with attention
    run eager between them (see graphs.py for why).

    Piece 0 embeds the tokens and runs layer 0 up to attention; piece i (1..L-1) finishes
    layer i-1 after attention (o_proj, residual add, MLP) and runs layer i up to attention;
    piece L finishes the last layer. Every piece reads and writes static buffers sized for
    the largest bucket (token ids, positions, RoPE rows, hidden states and the residual
    stream, q/k/v and attention output), so all buckets and layers share them, and a step
    only copies its inputs in.

    A step of t tokens replays the pieces of the smallest bucket T >= t. Rows t..T hold
    whatever an earlier step left there: every captured op works row by row, so they never
    touch the real rows, and attention and the logits only read rows [0, t).
    """

    def __init__(self, model, layer_caches, platform, sizes: list[int]):
        dev = platform.device
        self.model = model
        self.layer_caches = layer_caches
        self.platform = platform
        self.sizes = sorted(sizes)
        n = self.sizes[-1]
        dtype = next(model.parameters()).dtype
        attn = model.layers[0].self_attn
        heads, kv_heads, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.cos = torch.zeros(n, 1, d, dtype=model.rope_cos.dtype, device=dev)
        self.sin = torch.zeros_like(self.cos)
        self.hidden = torch.zeros(n, model.config.hidden_size, dtype=dtype, device=dev)
        self.residual = torch.zeros_like(self.hidden)
        self.q = torch.zeros(n, heads, d, dtype=dtype, device=dev)
        self.k = torch.zeros(n, kv_heads, d, dtype=dtype, device=dev)
        self.v = torch.zeros_like(self.k)
        self.attn_out = torch.zeros_like(self.q)
        self.graphs: dict[int, list] = {}

    @property
    def num_pieces(self) -> int:
        return self.model.num_layers + 1

    def _piece(self, i: int, t: int) -> None:
        m, ops = self.model, self.model.ops
        if i == 0:
            x, cos, sin = m.embed(self.input_ids[:t], self.positions[:t])
            self.cos[:t].copy_(cos)
            self.sin[:t].copy_(sin)
            residual = None
        else:
            x, residual = m.layers[i - 1].after_attention(ops, self.attn_out[:t],
                                                          self.residual[:t])
        if i < m.num_layers:
            q, k, v, residual = m.layers[i].before_attention(ops, x, residual, self.cos[:t],
                                                             self.sin[:t])
            self.q[:t].copy_(q)
            self.k[:t].copy_(k)
            self.v[:t].copy_(v)
        else:
            self.hidden[:t].copy_(x)
        self.residual[:t].copy_(residual)

    @torch.inference_mode()
    def capture(self, pool, progress: Callable[[int, int], None] | None = None) -> None:
        """Capture every bucket into `pool`, largest first, its pieces in the order they
        replay (a piece's temporaries then never overlap what an earlier piece of its
        bucket left for it; the pieces' results live in the static buffers anyway)."""
        total, done = len(self.sizes) * self.num_pieces, 0
        for size in reversed(self.sizes):
            pieces = []
            for i in range(self.num_pieces):
                graph, _ = self.platform.capture_graph(lambda i=i, t=size: self._piece(i, t),
                                                       pool)
                pieces.append(graph)
                done += 1
                if progress is not None:
                    progress(done, total)
            self.graphs[size] = pieces

    def size_for(self, num_tokens: int) -> int | None:
        return padded_size(num_tokens, self.sizes)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            logits_indices: torch.Tensor) -> tuple[torch.Tensor, int]:
        """One step (inputs as ModelRunner.prepare makes them); returns its logits and the
        bucket replayed."""
        t = input_ids.shape[0]
        size = self.size_for(t)
        assert size is not None, "step larger than every captured bucket"
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        pieces, m = self.graphs[size], self.model
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(m.layers, self.layer_caches)):
            pieces[i].replay()
            o = meta.backend.forward(self.q[:t], self.k[:t], self.v[:t], k_cache, v_cache, meta,
                                     layer.self_attn.scale)
            self.attn_out[:t].copy_(o)
        pieces[-1].replay()
        return m.compute_logits(self.hidden[:t], self.residual[:t], logits_indices), size
