"""Paged attention in plain torch: the reference backend (CPU, tests, any device).

The runner flattens a step into one token stream: decode tokens first (one per decoding
request), then each prefill chunk. `AttentionMetadata` says where each token's K/V goes in the
pool and which context each query sees. It is built once per step and passed down through
`forward` (no global context), then reused by every layer.

KV pool layout, per layer: `[num_blocks, block_size, num_kv_heads, head_dim]`, so a block is
one contiguous row of `block_size * num_kv_heads * head_dim` values and a step can copy whole
blocks with one `index_select` instead of one small copy per token.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSpan:
    """One prefill chunk: query tokens [q_start, q_end) at positions [start, start + n)."""
    q_start: int
    q_end: int
    start: int
    block_ids: torch.Tensor | None
    """Blocks holding the context [0, start + n); None when start == 0 (the chunk's own K/V
    is the whole context and attention needs no pool read)."""
    mask: torch.Tensor | None
    """[n, start + n] bool, True where a query may look: causal, offset by the cached start."""


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """[num_tokens] pool slot each token's K/V is written to."""
    num_decode: int
    """The first num_decode tokens are decodes, one per request."""
    decode_block_tables: torch.Tensor | None
    """[num_decode, max_blocks] block ids, padded with block 0 (masked out)."""
    decode_bias: torch.Tensor | None
    """[num_decode, 1, max_blocks * block_size] added to the scores: 0 for real context
    positions, -inf for the padding of shorter requests."""
    prefills: list[PrefillSpan]
    decode_scratch: tuple[torch.Tensor, torch.Tensor] | None = None
    """Two [num_decode * max_blocks, block_size * kv_heads * head_dim] buffers that every layer
    gathers K and V into. Allocated once per step: a fresh multi-MB tensor per layer costs
    more in page faults than the copy itself."""


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V ([T, kv_heads, D]) into their pool slots."""
    kv_heads, d = k.shape[1], k.shape[2]
    k_cache.view(-1, kv_heads, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, d).index_copy_(0, slot_mapping, v)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy whole blocks out of the pool: [*block_ids.shape, block_size, kv_heads, D]."""
    flat = cache.view(cache.shape[0], -1)
    idx = block_ids.reshape(-1)
    flat = flat.index_select(0, idx) if out is None else torch.index_select(flat, 0, idx, out=out)
    return flat.view(*block_ids.shape, *cache.shape[1:])


@functools.lru_cache(maxsize=16)
def _gqa_layout(h: int, kv_heads: int, scale: float, dtype: torch.dtype, device: torch.device):
    """Per-head KV group index [1, H, 1, 1] and the scaled block-diagonal selector [1, H, kvH, 1]."""
    head_group = torch.arange(h, device=device) // (h // kv_heads)
    sel = head_group[:, None] == torch.arange(kv_heads, device=device)[None, :]
    return head_group.view(1, h, 1, 1), (sel.to(dtype) * scale).view(1, h, kv_heads, 1)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, bias: torch.Tensor, scale: float,
                     scratch: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One query per request over its paged context. q: [B, H, D] -> [B, H, D].

    Grouped-query attention without repeating K/V: each request's context is gathered as one
    contiguous [L, kv_heads * D] matrix, and the queries are laid out block-diagonally
    ([H, kv_heads * D], zero outside a head's own KV group), so scores and output are two
    plain batched matmuls. The zeros cost kv_heads-times the (tiny) attention FLOPs but
    avoid a strided copy of the context, which is what bounds this step on a CPU.
    """
    b, h, d = q.shape
    kv_heads = k_cache.shape[2]
    head_group, sel = _gqa_layout(h, kv_heads, scale, q.dtype, q.device)
    k_out, v_out = scratch if scratch is not None else (None, None)
    k = _gather(k_cache, block_tables, k_out).view(b, -1, kv_heads * d)   # [B, L, kvH*D]
    v = _gather(v_cache, block_tables, v_out).view(b, -1, kv_heads * d)
    q_bd = (q.view(b, h, 1, d) * sel).view(b, h, kv_heads * d)
    scores = torch.baddbmm(bias, q_bd, k.transpose(1, 2))                    # [B, H, L]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.bmm(probs, v).view(b, h, kv_heads, d)                        # [B, H, kvH, D]
    return out.gather(2, head_group.expand(b, h, 1, d)).view(b, h, d)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, span: PrefillSpan,
                      scale: float) -> torch.Tensor:
    """Causal attention for one chunk. q: [n, H, D], k/v: [n, kvH, D] (the chunk's own)."""
    n = q.shape[0]
    qt = q.transpose(0, 1)
    if span.block_ids is None:
        return F.scaled_dot_product_attention(
            qt, k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale,
            enable_gqa=True).transpose(0, 1)
    ctx = span.start + n
    kc = _gather(k_cache, span.block_ids).flatten(0, 1)[:ctx]               # [ctx, kvH, D]
    vc = _gather(v_cache, span.block_ids).flatten(0, 1)[:ctx]
    return F.scaled_dot_product_attention(
        qt, kc.transpose(0, 1), vc.transpose(0, 1), attn_mask=span.mask, scale=scale,
        enable_gqa=True).transpose(0, 1)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Write this step's K/V to the pool, then attend. q: [T, H, D] -> [T, H, D]."""
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    parts = []
    nd = meta.num_decode
    if nd:
        parts.append(decode_attention(q[:nd], k_cache, v_cache, meta.decode_block_tables,
                                      meta.decode_bias, scale, meta.decode_scratch))
    for span in meta.prefills:
        s, e = span.q_start, span.q_end
        parts.append(prefill_attention(q[s:e], k[s:e], v[s:e], k_cache, v_cache, span, scale))
    return parts[0] if len(parts) == 1 else torch.cat(parts, 0)
