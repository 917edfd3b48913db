"""Paged attention in plain torch: the reference backend (CPU, tests, any device).

The runner flattens a step into one token stream: decode tokens first (one per decoding
request), then each prefill chunk. `AttentionMetadata` says where each token's K/V goes in the
pool and which context each query sees. It is built once per step and passed down through
`forward` (no global context), then reused by every layer.

KV pool layout, per layer and for K and V alike: `[num_kv_heads, num_blocks, block_size,
head_dim]` (head-major). One head's block is a contiguous `block_size * head_dim` row, so a
request's context is copied out with one `index_select` over (head, block) rows and lands as
`[kv_heads, L, head_dim]`: the layout attention consumes, with no transpose copy after it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSpan:
    """One prefill chunk: query tokens [q_start, q_end) at positions [start, start + n)."""
    q_start: int
    q_end: int
    start: int
    rows: torch.Tensor | None
    """Pool rows (head * num_blocks + block) holding the context [0, start + n), head-major;
    None when start == 0 (the chunk's own K/V is the whole context: no pool read)."""
    mask: torch.Tensor | None
    """[n, start + n] bool, True where a query may look: causal, offset by the cached start."""


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """[num_tokens] pool slot (block * block_size + offset) each token's K/V is written to."""
    num_decode: int
    """The first num_decode tokens are decodes, one per request."""
    decode_rows: torch.Tensor | None
    """[kv_heads * num_decode * max_blocks] pool rows of the decodes' contexts, head-major,
    padded with block 0 (masked out by decode_bias)."""
    decode_bias: torch.Tensor | None
    """[kv_heads * num_decode, 1, max_blocks * block_size] added to the scores: 0 for real
    context positions, -inf for the padding of shorter requests."""
    prefills: list[PrefillSpan]
    decode_scratch: tuple[torch.Tensor, torch.Tensor] | None = None
    """Two buffers that every layer gathers decode K and V into. Allocated once per step: a
    fresh multi-MB tensor per layer costs more in page faults than the copy itself."""
    decode_kernel: Callable | None = None
    """A platform's fused paged decode attention; when set, decodes use it with
    decode_block_tables / decode_lens instead of the gather path above."""
    write_kernel: Callable | None = None
    """A platform's fused KV write, called as write_kv is; None uses write_kv."""
    decode_block_tables: torch.Tensor | None = None
    """[num_decode, max_blocks] block ids (for decode_kernel)."""
    decode_lens: torch.Tensor | None = None
    """[num_decode] context length of each decode, the new token included (for decode_kernel)."""
    backend: Callable | None = None
    """A platform's whole attention (KV write, decode and prefill, in its own pool layout),
    called as backend(q, k, v, k_cache, v_cache, meta, scale) instead of the code below;
    the runner calls backend.prepare(meta) once per step first."""
    prefill_block_tables: list[list[int]] | None = None
    """Each prefill chunk's block table, in span order (for backends that page prefill)."""
    backend_state: object = None
    """What the backend's prepare(meta) derived once per step, for every layer to reuse."""
    prefill_kernel: Callable | None = None
    """A platform's ragged paged prefill attention: all prefill chunks in one call per layer,
    reading their context (cached prefix and the chunk) from the pool through prefill_plan,
    instead of the per-chunk loop below."""
    prefill_plan: object = None
    """What prefill_kernel.plan(...) built for this step's chunks."""


def slot(block_table: list[int], pos: int, block_size: int) -> int:
    """The pool slot (block * block_size + offset) holding the K/V of position pos."""
    return block_table[pos // block_size] * block_size + pos % block_size


def block_table_array(tables: list[list[int]], width: int, fill: int,
                      rows: int | None = None) -> torch.Tensor:
    """Block tables as one int64 CPU tensor [rows, width], each padded with `fill` (rows past
    len(tables) are all fill). Filled through numpy row slices: at batch 256 that is about
    4x faster than torch.tensor on padded nested lists, and this runs every decode step."""
    out = np.full((len(tables) if rows is None else rows, width), fill, dtype=np.int64)
    for i, t in enumerate(tables):
        out[i, :len(t)] = t
    return torch.from_numpy(out)


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
                     meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One query per request over its paged context. q: [B, H, D] -> [B, H, D].

    Grouped-query attention as batched matmuls over (kv head, request) pairs: the G query
    heads that share a KV head form a [G, D] matrix against that head's [L, D] context.
    """
    if meta.decode_kernel is not None:
        return meta.decode_kernel(q, k_cache, v_cache, meta.decode_block_tables,
                                  meta.decode_lens, scale)
    b, h, d = q.shape
    kv_heads = k_cache.shape[0]
    g = h // kv_heads
    k_out, v_out = meta.decode_scratch if meta.decode_scratch is not None else (None, None)
    k = _gather(k_cache, meta.decode_rows, k_out).view(kv_heads * b, -1, d)   # [kvH*B, L, D]
    v = _gather(v_cache, meta.decode_rows, v_out).view(kv_heads * b, -1, d)
    qg = (q * scale).view(b, kv_heads, g, d).transpose(0, 1).reshape(kv_heads * b, g, d)
    scores = torch.baddbmm(meta.decode_bias, qg, k.transpose(1, 2))          # [kvH*B, G, L]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.bmm(probs, v)                                                # [kvH*B, G, D]
    return out.view(kv_heads, b, g, d).transpose(0, 1).reshape(b, h, d)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, span: PrefillSpan,
                      scale: float) -> torch.Tensor:
    """Causal attention for one chunk. q: [n, H, D], k/v: [n, kvH, D] (the chunk's own)."""
    n = q.shape[0]
    qt = q.transpose(0, 1)
    if span.rows is None:
        return F.scaled_dot_product_attention(
            qt, k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale,
            enable_gqa=True).transpose(0, 1)
    kv_heads, d = k_cache.shape[0], k_cache.shape[-1]
    ctx = span.start + n
    kc = _gather(k_cache, span.rows).view(kv_heads, -1, d)[:, :ctx]          # [kvH, ctx, D]
    vc = _gather(v_cache, span.rows).view(kv_heads, -1, d)[:, :ctx]
    return F.scaled_dot_product_attention(qt, kc, vc, attn_mask=span.mask, scale=scale,
                                          enable_gqa=True).transpose(0, 1)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Write this step's K/V to the pool, then attend. q: [T, H, D] -> [T, H, D]."""
    if meta.backend is not None:
        return meta.backend(q, k, v, k_cache, v_cache, meta, scale)
    (meta.write_kernel or write_kv)(k_cache, v_cache, k, v, meta.slot_mapping)
    parts = []
    nd = meta.num_decode
    if nd:
        parts.append(decode_attention(q[:nd], k_cache, v_cache, meta, scale))
    if meta.prefill_kernel is not None and meta.prefills:
        parts.append(meta.prefill_kernel(q[nd:], k_cache, v_cache, meta.prefill_plan, scale))
        return parts[0] if len(parts) == 1 else torch.cat(parts, 0)
    for span in meta.prefills:
        s, e = span.q_start, span.q_end
        parts.append(prefill_attention(q[s:e], k[s:e], v[s:e], k_cache, v_cache, span, scale))
    return parts[0] if len(parts) == 1 else torch.cat(parts, 0)
