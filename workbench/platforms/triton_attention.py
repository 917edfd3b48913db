"""Paged decode attention in Triton: each query reads its K/V straight from the block pool.

One program per (request, KV head). It loads the G query heads that share that KV head as
one [G, D] tile and walks the request's context in tiles of BLOCK_N tokens: each token's
pool slot comes from the block table (block_table[n // block_size] * block_size +
n % block_size), so any block size works and nothing is gathered into a new tensor. Softmax
is computed online (running max and sum, rescaled per tile), in fp32; an fp32 cache is
multiplied in full fp32 ("ieee"), not tf32, so fp32 runs match the reference closely.

Shapes are fixed per batch size (the table is [B, max_blocks], lengths are read on the
device), so the kernel can be captured in a CUDA graph and replayed with new tables and
lengths. Runs on CUDA; under TRITON_INTERPRET=1 it also runs on CPU tensors, which is how
the CPU test suite checks it against the plain-torch reference.

Pool layout per layer: [num_kv_heads, num_blocks, block_size, head_dim] (head-major), as in
`workbench/attention.py`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr, scale,
                         stride_qb, stride_qh, stride_kv_head, stride_tb, stride_ob, stride_oh,
                         G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                         D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                         PRECISION: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    length = tl.load(lens_ptr + b)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    g_ok = g < G
    d_ok = d < D
    q = tl.load(q_ptr + b * stride_qb + (kvh * G + g)[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    head = kvh.to(tl.int64) * stride_kv_head
    for start in range(0, length, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < length
        block = tl.load(tables_ptr + b * stride_tb + n // BLOCK_SIZE, mask=n_ok, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE
        offs = head + slot[:, None] * D + d[None, :]
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        denom = denom * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v,
                                            input_precision=PRECISION).to(tl.float32)
        m = m_new
    out = acc / denom[:, None]
    tl.store(out_ptr + b * stride_ob + (kvh * G + g)[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, stride_kt, stride_kh,
                     stride_vt, stride_vh, stride_cache_head, D: tl.constexpr,
                     D_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, D_PAD)
    ok = d < D
    slot = tl.load(slots_ptr + t).to(tl.int64)
    dst = h * stride_cache_head + slot * D + d
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=ok), mask=ok)
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=ok), mask=ok)


def write_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """What attention.write_kv does (k/v [T, kvH, D], any strides with a unit last one, into
    the head-major pool at their slots), as one kernel for K and V together instead of two
    index_copy_ calls."""
    t, kv_heads, d = k.shape
    if t:
        _write_kv_kernel[(t, kv_heads)](k, v, k_cache, v_cache, slot_mapping, k.stride(0),
                                        k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0),
                                        D=d, D_PAD=triton.next_power_of_2(d))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D]; k/v_cache [kvH, num_blocks, block_size, D]; block_tables [B, max_blocks];
    context_lens [B] (the new token included, which must already be in the cache)."""
    b, h, d = q.shape
    kv_heads, _, block_size, _ = k_cache.shape
    g = h // kv_heads
    if q.stride(-1) != 1:
        q = q.contiguous()                     # a head's row must be contiguous; rows may not
    out = torch.empty(b, h, d, dtype=q.dtype, device=q.device) if out is None else out
    if b == 0:
        return out
    # Context tiles span blocks (each token finds its own block), so the tile is sized for
    # the loads, not for block_size: tl.dot wants >= 16 on every side.
    block_n = 64 if d <= 128 else 32
    _paged_decode_kernel[(b, kv_heads)](
        q, k_cache, v_cache, out, block_tables, context_lens, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), block_tables.stride(0),
        out.stride(0), out.stride(1),
        G=g, G_PAD=max(16, triton.next_power_of_2(g)), D=d, D_PAD=max(16, triton.next_power_of_2(d)),
        BLOCK_SIZE=block_size, BLOCK_N=block_n,
        # fp32 stays fp32 (Triton would use tf32 for an fp32 dot); bf16/fp16 use the units.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    return out
