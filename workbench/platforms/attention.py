"""Attention backends: one object per platform that owns everything attention needs.

A backend (vLLM's `AttentionBackend`, builder and impl in one) says
- the KV pool's layout and shape (`kv_cache_shape`), and allocates it (`bind`);
- the dtypes and block sizes its kernels take (`supported_dtypes`, `supported_block_sizes`:
  the knob domains a device narrows, read by `check_config` and the knob panel);
- how a step's attention inputs become its own metadata (`build`, once per step, reused by
  every layer);
- the KV write and the decode and prefill attention (`forward`, once per layer);
- whether whole decode steps can be captured in a graph (`supports_decode_graphs`), and how a
  graph feeds it tables and lengths (`index_dtype`, `lens_on_host`).

`platform.attention_backend(dtype, choice)` hands out the device's backend:
`TorchAttention` here (plain torch, any device: the reference), `CpuAttention` (the C++
decode kernel, platforms/cpu.py), `TritonAttention` (platforms/triton_attention.py) and
`NpuAttention` (torch_npu's fused ops, platforms/npu_attention.py).

The runner flattens a step into one token stream: decode tokens first (one per decoding
request), then each prefill chunk, and describes it in a `CommonAttentionMetadata` of
tensors (vLLM v1's shape: `query_start_loc`, `seq_lens`, one block table, `slot_mapping`),
built once per step, already on the device. A backend's `build` only converts what it reads
(dtype, layout, a slice of the table) and derives its own extras on the device: it makes no
host-to-device copy of its own (executor/staging.py says why). Block tables are padded with
the block pool's null block (`core.block_manager.NULL_BLOCK`): it is never handed out, so
padding rows of a replayed decode graph write their K/V there.

Reference KV layout, per layer and for K and V alike: `[num_kv_heads, num_blocks,
block_size, head_dim]` (head-major). One head's block is a contiguous `block_size * head_dim`
row, so a request's context is copied out with one `index_select` over (head, block) rows and
lands as `[kv_heads, L, head_dim]`: the layout attention consumes, with no transpose copy.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..config import BLOCK_SIZES
from ..utils import cdiv


@dataclass(slots=True)
class CommonAttentionMetadata:
    """A step's attention inputs in vLLM v1's shape, built once per step by the runner (or
    read from a decode graph's static buffers) and handed to `AttentionBackend.build`, whose
    only work is to convert dtype, device and layout. Rows are requests, decodes first (one
    token each), then prefill chunks. Every tensor is int64 (what the CPU kernels read);
    a backend that wants int32 converts on the device.

    The tensors are views of the runner's staging buffers (executor/staging.py): valid for
    this step, overwritten two steps later. A backend keeps nothing of them past its step
    but what it copied."""
    query_start_loc: torch.Tensor
    """[num_reqs + 1]: where each request's tokens start in the step's token stream (the
    last entry is num_tokens)."""
    seq_lens: torch.Tensor
    """[num_reqs]: each request's context length once this step's tokens are in (cached
    prefix + its new tokens)."""
    block_table: torch.Tensor
    """[num_reqs, width] block ids, width the step's longest table, each row padded with
    the pool's null block (core.block_manager.NULL_BLOCK: never handed out, so what a
    padding entry points at belongs to no one)."""
    slot_mapping: torch.Tensor
    """[num_tokens] pool slot (block * block_size + offset) each token's K/V goes to."""
    num_decode: int
    """The first num_decode requests are decodes, one token each."""
    query_start_loc_cpu: torch.Tensor | None = None
    """query_start_loc on the host, for a backend that needs the chunk bounds as numbers
    (loops, op arguments); None inside a captured decode graph."""
    seq_lens_cpu: torch.Tensor | None = None
    """seq_lens on the host (torch_npu's paged attention reads them there); None inside a
    captured decode graph whose backend reads lengths on the device."""

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    def prefill_bounds(self) -> list[tuple[int, int, int]]:
        """Per prefill chunk, from the host tensors: (q_start, q_end) in the prefill tokens
        (the step's tokens after the decodes), and its context length."""
        nd = self.num_decode
        qsl = (self.query_start_loc_cpu[nd:] - nd).tolist()
        return list(zip(qsl[:-1], qsl[1:], self.seq_lens_cpu[nd:].tolist()))


@dataclass(slots=True)
class AttentionMetadata:
    """What a backend built for one step; backends subclass it with their own fields."""
    backend: "AttentionBackend"
    slot_mapping: torch.Tensor
    num_decode: int


@dataclass(slots=True)
class TorchMetadata(AttentionMetadata):
    prefills: list[tuple[int, int, int]] = field(default_factory=list)
    """Per prefill chunk: (q_start, q_end) in the prefill tokens, and its context length
    (CommonAttentionMetadata.prefill_bounds)."""
    decode_rows: torch.Tensor | None = None
    """[kv_heads * num_decode * width] pool rows of the decodes' contexts, head-major."""
    decode_bias: torch.Tensor | None = None
    """[kv_heads * num_decode, 1, width * block_size]: 0 on context positions, -inf on the
    padding of shorter requests."""
    decode_scratch: tuple[torch.Tensor, torch.Tensor] | None = None
    """Two buffers every layer gathers decode K and V into, allocated once per step: a fresh
    multi-MB tensor per layer costs more in page faults than the copy itself."""
    decode_block_tables: torch.Tensor | None = None
    """Instead of rows and bias, for a decode kernel (CpuAttention): the block tables ..."""
    decode_lens: torch.Tensor | None = None
    """... and the context lengths."""
    prefill_block_tables: torch.Tensor | None = None
    """For a prefill kernel (CpuAttention), instead of prefill_context: the chunks' block
    tables, ..."""
    prefill_query_start: torch.Tensor | None = None
    """... where each chunk's tokens start among the prefill tokens ([chunks + 1]) ..."""
    prefill_lens: torch.Tensor | None = None
    """... and their context lengths."""
    prefill_context: list[tuple[torch.Tensor, torch.Tensor] | None] = field(default_factory=list)
    """Per chunk: the pool rows holding its context [0, ctx_len) and its [n, ctx_len] causal
    mask, or None for a chunk with no cached prefix (its own K/V is the whole context)."""
    prefill_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    """For a decode kernel (CpuAttention), where every chunk is a few tokens on cached context
    (a speculative verify step's k + 1): one row per chunk token, its chunk's block table
    and its own causal length ([tokens, width], [tokens]), so each token is a decode."""
    rows: tuple[torch.Tensor, torch.Tensor] | None = None
    """The decode rows and prefill_rows together, one per token of the step, where every
    token is a decode (CpuAttention; what decode_layers runs the whole step on); None
    otherwise."""


class AttentionBackend:
    """What every backend has: its knob domains, graph traits, the pool and the config check.
    Subclasses build their metadata and run the attention."""
    name = "base"
    """What Engine.info().attention reports."""
    supported_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    supported_block_sizes = BLOCK_SIZES
    default_block_size = 16
    """block_size when the config leaves it to the device (None)."""
    supports_decode_graphs = False
    """Whether whole decode steps can be captured: the attention reads the pool in place
    through static tables and lengths (graph_runner.DecodeGraphs)."""
    index_dtype = torch.int64
    """The dtype of the block tables and lengths a decode graph keeps for it."""
    lens_on_host = False
    """The attention reads decode context lengths from host memory (a replayed graph would
    keep the captured ones: they go to platform.replay_graph instead)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    # ---- the pool ---------------------------------------------------------------------------
    def kv_cache_shape(self, num_layers: int, kv_heads: int, num_blocks: int, block_size: int,
                       head_dim: int) -> tuple[int, ...]:
        """[layers, K/V, ...], one layer's K (or V) as this backend reads it."""
        return (num_layers, 2, kv_heads, num_blocks, block_size, head_dim)

    def bind(self, num_layers: int, num_heads: int, kv_heads: int, head_dim: int,
             num_blocks: int, block_size: int, device) -> torch.Tensor:
        """Allocate the KV pool (one tensor; layer i's K is [i][0], V [i][1]) for a model of
        this shape, and remember the shape for `build`."""
        self.num_heads, self.kv_heads, self.head_dim = num_heads, kv_heads, head_dim
        self.num_blocks, self.block_size, self.device = num_blocks, block_size, device
        shape = self.kv_cache_shape(num_layers, kv_heads, num_blocks, block_size, head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=device)

    def check_config(self, config, device: str) -> None:
        """Refuse knob values this backend's kernels cannot run (ValueError naming the knob)."""
        if self.dtype not in self.supported_dtypes:
            names = " or ".join(str(d).replace("torch.", "") for d in self.supported_dtypes)
            raise ValueError(f"dtype: {device}'s attention ({self.name}) takes {names} "
                             f"(got {str(self.dtype).replace('torch.', '')})")
        if config.block_size not in self.supported_block_sizes:
            raise ValueError(f"block_size: {device}'s attention pages KV in blocks of "
                             f"{' or '.join(map(str, self.supported_block_sizes))} tokens "
                             f"(got {config.block_size})")

    def build(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        """This step's metadata (once per step; every layer reuses it)."""
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Write this step's K/V ([T, kv_heads, D]) to the pool, then attend:
        q [T, H, D] -> [T, H, D]."""
        raise NotImplementedError


class TorchAttention(AttentionBackend):
    """Plain-torch paged attention: the reference every fused backend is tested against,
    and what runs where a device has no kernels (or `attention_backend='reference'`)."""
    name = "reference"

    def build(self, common: CommonAttentionMetadata) -> TorchMetadata:
        nd = common.num_decode
        meta = TorchMetadata(self, common.slot_mapping, nd)
        if nd:
            tables = common.block_table[:nd]
            if common.seq_lens_cpu is not None:
                # The gather path reads every column: not the prefill chunks' wider ones.
                tables = tables[:, :cdiv(int(common.seq_lens_cpu[:nd].max()), self.block_size)]
            self.build_decode(meta, tables, common.seq_lens[:nd])
        if common.num_reqs == nd:
            return meta
        meta.prefills = common.prefill_bounds()
        self.build_prefill(meta, common)
        return meta

    def build_prefill(self, meta: TorchMetadata, common: CommonAttentionMetadata) -> None:
        """Per prefill chunk with a cached prefix, the pool rows of its context and its
        causal mask (TorchMetadata.prefill_context)."""
        nd, dev = common.num_decode, common.block_table.device
        for i, (q_start, q_end, ctx) in enumerate(meta.prefills):
            start = ctx - (q_end - q_start)
            if start == 0:
                meta.prefill_context.append(None)
                continue
            blocks = common.block_table[nd + i, :cdiv(ctx, self.block_size)]
            q_pos = torch.arange(start, ctx, device=dev)
            mask = torch.arange(ctx, device=dev)[None, :] <= q_pos[:, None]
            meta.prefill_context.append((self.pool_rows(blocks), mask))

    def build_decode(self, meta: TorchMetadata, tables: torch.Tensor, lens: torch.Tensor) -> None:
        """The gather path's decode inputs, made on the tables' device: pool rows, a padding
        bias, two scratch buffers."""
        kv_heads, bs = self.kv_heads, self.block_size
        pad = torch.arange(tables.shape[1] * bs, device=lens.device)[None, :] >= lens[:, None]
        bias = torch.zeros(pad.shape, dtype=self.dtype, device=lens.device)
        bias.masked_fill_(pad, float("-inf"))
        meta.decode_bias = bias.unsqueeze(1).repeat(kv_heads, 1, 1)
        rows = self.pool_rows(tables)
        meta.decode_scratch = tuple(torch.empty(len(rows), bs * self.head_dim, dtype=self.dtype,
                                                device=self.device) for _ in range(2))
        meta.decode_rows = rows

    def pool_rows(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Row ids, head-major, of the given blocks in a [kv_heads * num_blocks, ...] view."""
        return pool_rows(block_ids, self.kv_heads, self.num_blocks)

    def forward(self, q, k, v, k_cache, v_cache, meta: TorchMetadata, scale: float) -> torch.Tensor:
        self.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        nd = meta.num_decode
        parts = [self.decode(q[:nd], k_cache, v_cache, meta, scale)] if nd else []
        parts += self.prefill(q[nd:], k[nd:], v[nd:], k_cache, v_cache, meta, scale)
        return parts[0] if len(parts) == 1 else torch.cat(parts, 0)

    def write_kv(self, k_cache, v_cache, k, v, slot_mapping) -> None:
        write_kv(k_cache, v_cache, k, v, slot_mapping)

    def decode(self, q, k_cache, v_cache, meta: TorchMetadata, scale: float) -> torch.Tensor:
        return decode_attention(q, k_cache, v_cache, meta.decode_rows, meta.decode_bias, scale,
                                meta.decode_scratch)

    def prefill(self, q, k, v, k_cache, v_cache, meta: TorchMetadata, scale: float) -> list:
        """One output per chunk (q, k, v: the prefill tokens only)."""
        out = []
        for (s, e, ctx), context in zip(meta.prefills, meta.prefill_context):
            out.append(prefill_attention(q[s:e], k[s:e], v[s:e], k_cache, v_cache,
                                         ctx - (e - s), context, scale))
        return out


def pool_rows(block_ids: torch.Tensor, kv_heads: int, num_blocks: int) -> torch.Tensor:
    """Row ids, head-major, of the given blocks in a [kv_heads * num_blocks, ...] pool view."""
    heads = torch.arange(kv_heads, device=block_ids.device).view(-1, *[1] * block_ids.dim())
    return (heads * num_blocks + block_ids).reshape(-1)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V ([T, kv_heads, D]) into their pool slots."""
    kv_heads, d = k.shape[1], k.shape[2]
    k_cache.view(kv_heads, -1, d).index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_cache.view(kv_heads, -1, d).index_copy_(1, slot_mapping, v.transpose(0, 1))


def _gather(cache: torch.Tensor, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy (head, block) rows out of the pool: [len(rows), block_size * head_dim]."""
    flat = cache.view(-1, cache.shape[-2] * cache.shape[-1])
    return flat.index_select(0, rows) if out is None else torch.index_select(flat, 0, rows, out=out)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     rows: torch.Tensor, bias: torch.Tensor, scale: float,
                     scratch: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One query per request over its paged context. q: [B, H, D] -> [B, H, D]; rows and
    bias: TorchMetadata.decode_rows and decode_bias.

    Grouped-query attention as batched matmuls over (kv head, request) pairs: the G query
    heads that share a KV head form a [G, D] matrix against that head's [L, D] context.
    """
    b, h, d = q.shape
    kv_heads = k_cache.shape[0]
    g = h // kv_heads
    k_out, v_out = scratch if scratch is not None else (None, None)
    k = _gather(k_cache, rows, k_out).view(kv_heads * b, -1, d)              # [kvH*B, L, D]
    v = _gather(v_cache, rows, v_out).view(kv_heads * b, -1, d)
    qg = (q * scale).view(b, kv_heads, g, d).transpose(0, 1).reshape(kv_heads * b, g, d)
    scores = torch.baddbmm(bias, qg, k.transpose(1, 2))          # [kvH*B, G, L]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.bmm(probs, v)                                                # [kvH*B, G, D]
    return out.view(kv_heads, b, g, d).transpose(0, 1).reshape(b, h, d)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, start: int,
                      context: tuple[torch.Tensor, torch.Tensor] | None,
                      scale: float) -> torch.Tensor:
    """Causal attention for one chunk at positions [start, start + n). q: [n, H, D], k/v:
    [n, kvH, D] (the chunk's own); context: the pool rows and mask of its whole context, or
    None when start is 0.

    On the CPU, bf16 and fp16 are computed in float64 and rounded once: attention to the
    nearest bf16, which the C++ prefill kernel (csrc/cpu_attention.cpp) computes too. In
    fp32, as torch computes a bf16 prefill, any other order of the sums rounds about 3 in
    10,000 outputs to the neighbouring bf16 number, and where two logits tie in bf16 that
    changes the greedy token."""
    wide = torch.float64 if q.device.type == "cpu" and q.element_size() < 4 else q.dtype
    qt = q.transpose(0, 1).to(wide)
    if context is None:
        kc, vc, mask = k.transpose(0, 1), v.transpose(0, 1), None
    else:
        rows, mask = context
        kv_heads, d = k_cache.shape[0], k_cache.shape[-1]
        ctx = start + q.shape[0]
        kc = _gather(k_cache, rows).view(kv_heads, -1, d)[:, :ctx]           # [kvH, ctx, D]
        vc = _gather(v_cache, rows).view(kv_heads, -1, d)[:, :ctx]
    out = F.scaled_dot_product_attention(qt, kc.to(wide), vc.to(wide), attn_mask=mask,
                                         is_causal=mask is None, scale=scale, enable_gqa=True)
    return out.to(q.dtype).transpose(0, 1)
