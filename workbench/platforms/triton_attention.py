"""Paged attention in Triton: every query reads its K/V straight from the block pool.

Two kernels, one launch each per layer: `paged_decode_attention` for the step's decodes (plus
a small merge launch when a small batch splits its contexts, below) and
`paged_prefill_attention` for all of its prefill chunks at once (ragged, causal, over the
cached prefix and the chunk itself). The prefill kernel runs after the chunks' K/V are
written to the pool (`write_kv_cache`), so prefix-cache hits and chunked prefill need nothing
special: a chunk's context is just the first ctx_len slots of its block table. The decode
kernel writes its own token's K/V (a pure decode step has no write launch): the token's
program takes them from the projection, not the pool, and stores them for later steps.

Decode:
One program per (request, KV head). It loads the G query heads that share that KV head as
one [G, D] tile and walks the request's context in tiles of BLOCK_N tokens: each token's
pool slot comes from the block table (block_table[n // block_size] * block_size +
n % block_size), so any block size works and nothing is gathered into a new tensor. Softmax
is computed online (running max and sum, rescaled per tile), in fp32; an fp32 cache is
multiplied in full fp32 ("ieee"), not tf32, so fp32 runs match the reference closely.

Split context (flash-decoding): a small batch gives too few (request, KV head) programs to
fill the GPU, each walking its whole context alone. Then each request's context is cut into
num_splits ranges of whole tiles, one more grid axis; a program folds its range as above and
writes fp32 partials (running max, sum, unnormalised output; an empty range writes -inf, 0,
0), and a second small kernel merges them per query head. The ranges are computed in the
kernel from the length, and num_splits on the host from the batch size, KV heads and SM
count only (`decode_splits`), so one grid serves every length.

Shapes are fixed per batch size (the table is [B, max_blocks], lengths are read on the
device), so the kernel can be captured in a CUDA graph and replayed with new tables and
lengths. Runs on CUDA; under TRITON_INTERPRET=1 it also runs on CPU tensors, which is how
the CPU test suite checks it against the plain-torch reference.

Prefill: the chunks' query tokens are cut into tiles of BLOCK_Q tokens (a tile never spans
two chunks); one program per (tile, KV head) loads the tile's BLOCK_Q x G query rows as one
[BLOCK_M, D] matrix and walks the context up to its last query's position, masking the
causal diagonal. The tile map is built before the launch (`plan_prefill`, a few small device ops from the
step's query_start_loc), so the kernel does no searching.

Pool layout per layer: [num_kv_heads, num_blocks, block_size, head_dim] (head-major), as in
the reference (`workbench/platforms/attention.py`). `TritonAttention` is the backend that
plugs these kernels into the engine.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .attention import AttentionBackend, AttentionMetadata, CommonAttentionMetadata


@triton.jit
def _attend_kv_tile(q, m, denom, acc, k_ptr, v_ptr, table, kv_head, start, end, pos, d, d_ok,
                    scale, k_new, v_new, new_pos, CAUSAL: tl.constexpr, HAS_NEW: tl.constexpr,
                    D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                    PRECISION: tl.constexpr):
    """One BLOCK_N-token tile of context [start, end) for a [rows, D] query tile: find each
    token's slot through the block table, load K and V from the pool, and fold the tile
    into the online softmax (running max m, sum denom, output acc). CAUSAL masks tokens past
    each row's own position (pos). HAS_NEW: the token at new_pos is not read from the pool
    but is k_new, v_new [D] (a decode's own token, which this launch writes to the pool)."""
    n = start + tl.arange(0, BLOCK_N)
    n_ok = n < end
    block = tl.load(table + n // BLOCK_SIZE, mask=n_ok, other=0)
    slot = block.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE
    offs = kv_head + slot[:, None] * D + d[None, :]
    kv_mask = n_ok[:, None] & d_ok[None, :]
    if HAS_NEW:
        is_new = (n == new_pos)[:, None]
        kv_mask = kv_mask & (n != new_pos)[:, None]
    k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0)
    if HAS_NEW:
        k = tl.where(is_new, k_new[None, :], k)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
    ok = n_ok[None, :]
    if CAUSAL:
        ok = ok & (n[None, :] <= pos[:, None])
    s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_new = tl.where(m_new == float("-inf"), 0.0, m_new)     # a row that sees nothing yet
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m - m_new)
    denom = denom * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0)
    if HAS_NEW:
        v = tl.where(is_new, v_new[None, :], v)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
    return m_new, denom, acc


# A table's row stride is the step's widest table, which changes every step: not a value to
# compile a kernel variant for (Triton specialises ints divisible by 16 by default).
@triton.jit(do_not_specialize=["stride_tb"])
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr, part_m_ptr,
                         part_l_ptr, part_acc_ptr, k_new_ptr, v_new_ptr, slots_ptr, scale,
                         stride_qb, stride_qh, stride_kv_head, stride_tb, stride_ob, stride_oh,
                         stride_knb, stride_knh, stride_vnb, stride_vnh,
                         G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                         D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                         SPLITS: tl.constexpr, WRITE_NEW: tl.constexpr,
                         PRECISION: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
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
    if WRITE_NEW:
        # The step's own token: its K/V come from the projection, not the pool, and the
        # first split's program stores them in the pool at the token's slot for later
        # steps (no program of this launch reads that slot).
        k_new = tl.load(k_new_ptr + b * stride_knb + kvh * stride_knh + d, mask=d_ok, other=0.0)
        v_new = tl.load(v_new_ptr + b * stride_vnb + kvh * stride_vnh + d, mask=d_ok, other=0.0)
        dst = head + tl.load(slots_ptr + b).to(tl.int64) * D + d
        first = d_ok & ((d * 0 + split) == 0)
        tl.store(k_ptr + dst, k_new, mask=first)
        tl.store(v_ptr + dst, v_new, mask=first)
    else:
        k_new = tl.zeros([D_PAD], k_ptr.dtype.element_ty)
        v_new = k_new
    if SPLITS == 1:
        lo = 0
        hi = length
    else:
        # This program's share of the context: SPLITS ranges of whole tiles, sized from the
        # length here on the device (so one grid serves every length); trailing ones may be
        # empty.
        chunk = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, length)
    for start in range(lo, hi, BLOCK_N):
        m, denom, acc = _attend_kv_tile(q, m, denom, acc, k_ptr, v_ptr, tables_ptr + b * stride_tb,
                                        head, start, hi, m, d, d_ok, scale, k_new, v_new,
                                        length - 1, False, WRITE_NEW, D, BLOCK_SIZE, BLOCK_N,
                                        PRECISION)
    if SPLITS == 1:
        out = acc / denom[:, None]
        tl.store(out_ptr + b * stride_ob + (kvh * G + g)[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    else:
        # Partials of query head h: row (b * H + h) * SPLITS + split of the scratch tensors
        # (an empty range leaves m = -inf, sum = 0, acc = 0).
        row = (b * tl.num_programs(1) * G + kvh * G + g) * SPLITS + split
        tl.store(part_m_ptr + row, m, mask=g_ok)
        tl.store(part_l_ptr + row, denom, mask=g_ok)
        tl.store(part_acc_ptr + row[:, None] * D + d[None, :], acc,
                 mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_splits_kernel(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, stride_ob, stride_oh,
                         SPLITS: tl.constexpr, S_PAD: tl.constexpr, D: tl.constexpr,
                         D_PAD: tl.constexpr):
    """One program per (request, query head): rescale each split's sum and output to the
    largest running max and add them up (a fixed reduction, no atomics: deterministic)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    s_ok = s < SPLITS
    row = (b * tl.num_programs(1) + h) * SPLITS + s
    m = tl.load(part_m_ptr + row, mask=s_ok, other=float("-inf"))
    denom = tl.load(part_l_ptr + row, mask=s_ok, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * D + d[None, :],
                  mask=s_ok[:, None] & (d < D)[None, :], other=0.0)
    w = tl.exp(m - tl.max(m, 0))                     # split 0 is never empty: max is finite
    out = tl.sum(acc * w[:, None], 0) / tl.sum(denom * w, 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < D)


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


# Splitting the context pays when (request, KV head) programs are too few to fill the chip.
MAX_DECODE_SPLITS = 16
CPU_SM_COUNT = 8
"""What the split choice assumes for CPU tensors (Triton's interpreter): with it a batch-1
decode of a model with 2 KV heads splits, so CPU tests run the split path."""


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_splits(batch: int, kv_heads: int, device: torch.device) -> int:
    """How many ranges each request's context is cut into: enough for about one program per
    SM, at most MAX_DECODE_SPLITS; 1 (no split) once the batch fills the SMs by itself.
    Depends on shapes only, never on the lengths, so a captured graph stays valid."""
    return max(1, min(MAX_DECODE_SPLITS, _sm_count(device) // max(1, batch * kv_heads)))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, out: torch.Tensor | None = None,
                           num_splits: int | None = None,
                           new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                           ) -> torch.Tensor:
    """q [B, H, D]; k/v_cache [kvH, num_blocks, block_size, D]; block_tables [B, max_blocks];
    context_lens [B] (the new token included; >= 1). new_kv: (k [B, kvH, D], v [B, kvH, D],
    slots [B]): the new tokens' K/V, which this launch writes to the pool itself (one launch
    fewer than write_kv_cache first); without it they must already be in the pool.
    num_splits: context ranges per request (default: `decode_splits`)."""
    b, h, d = q.shape
    kv_heads, _, block_size, _ = k_cache.shape
    g = h // kv_heads
    if q.stride(-1) != 1:
        q = q.contiguous()                     # a head's row must be contiguous; rows may not
    out = torch.empty(b, h, d, dtype=q.dtype, device=q.device) if out is None else out
    if b == 0:
        return out
    splits = decode_splits(b, kv_heads, q.device) if num_splits is None else num_splits
    if splits > 1:
        # fp32 partials per (request, query head, split); under graph capture the graph's
        # pool owns them.
        part_m = torch.empty(b, h, splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(b, h, splits, d, dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out                      # not read
    if new_kv is not None:
        k_new, v_new, slots = new_kv
        if k_new.stride(-1) != 1 or v_new.stride(-1) != 1:
            k_new, v_new = k_new.contiguous(), v_new.contiguous()
    else:
        k_new = v_new = slots = q                             # not read
    # Context tiles span blocks (each token finds its own block), so the tile is sized for
    # the loads, not for block_size: tl.dot wants >= 16 on every side.
    block_n = 64 if d <= 128 else 32
    d_pad = max(16, triton.next_power_of_2(d))
    _paged_decode_kernel[(b, kv_heads, splits)](
        q, k_cache, v_cache, out, block_tables, context_lens, part_m, part_l, part_acc,
        k_new, v_new, slots, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), block_tables.stride(0),
        out.stride(0), out.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0),
        v_new.stride(1),
        G=g, G_PAD=max(16, triton.next_power_of_2(g)), D=d, D_PAD=d_pad,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, SPLITS=splits, WRITE_NEW=new_kv is not None,
        # fp32 stays fp32 (Triton would use tf32 for an fp32 dot); bf16/fp16 use the units.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    if splits > 1:
        _merge_splits_kernel[(b, h)](part_m, part_l, part_acc, out, out.stride(0), out.stride(1),
                                     SPLITS=splits, S_PAD=triton.next_power_of_2(splits), D=d,
                                     D_PAD=d_pad)
    return out


@triton.jit(do_not_specialize=["stride_tb"])
def _paged_prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, ctx_lens_ptr, q_starts_ptr,
                          tile_seq_ptr, tile_q_ptr, scale, stride_qt, stride_qh, stride_kv_head,
                          stride_tb, stride_ot, stride_oh, G: tl.constexpr, G_PAD: tl.constexpr,
                          D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                          BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.load(tile_seq_ptr + tile)                 # which chunk
    q0 = tl.load(tile_q_ptr + tile)                  # first query of the tile, in the chunk
    q_begin = tl.load(q_starts_ptr + s)
    q_len = tl.load(q_starts_ptr + s + 1) - q_begin
    ctx_len = tl.load(ctx_lens_ptr + s)              # cached prefix + the chunk
    first_pos = ctx_len - q_len                      # position of the chunk's first token
    # Row r of the tile is query token q0 + r // G_PAD, query head kvh * G + r % G_PAD.
    r = tl.arange(0, BLOCK_Q * G_PAD)
    qi = q0 + r // G_PAD
    g = r % G_PAD
    row_ok = (qi < q_len) & (g < G)
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    tok = (q_begin + qi).to(tl.int64)
    head = kvh * G + g
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    pos = first_pos + qi                             # each row's own position
    m = tl.full([BLOCK_Q * G_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_Q * G_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * G_PAD, D_PAD], tl.float32)
    kv_head = kvh.to(tl.int64) * stride_kv_head
    table = tables_ptr + s.to(tl.int64) * stride_tb
    # Keys up to the tile's last query position; the causal mask does the rest.
    end = tl.minimum(ctx_len, first_pos + q0 + BLOCK_Q)
    for start in range(0, end, BLOCK_N):
        m, denom, acc = _attend_kv_tile(q, m, denom, acc, k_ptr, v_ptr, table, kv_head, start,
                                        end, pos, d, d_ok, scale, d, d, 0, True, False, D,
                                        BLOCK_SIZE, BLOCK_N, PRECISION)
    out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def prefill_block_q(num_heads: int, kv_heads: int) -> int:
    """Query tokens per prefill tile: a tile is BLOCK_Q tokens x the G_PAD query heads that
    share a KV head, 64 rows in all (tl.dot wants at least 16)."""
    g_pad = triton.next_power_of_2(num_heads // kv_heads)
    return max(64 // g_pad, 1) if g_pad <= 16 else 1


@dataclass(slots=True)
class PrefillPlan:
    """One step's prefill chunks, as the prefill kernel reads them (all on the device)."""
    block_tables: torch.Tensor
    """[chunks, width] int32 block ids of each chunk's request (the step's table from the
    first chunk's row on, as a fresh tensor: a view would start wherever the decodes' rows
    end, and Triton compiles a kernel variant per pointer alignment)."""
    ctx_lens: torch.Tensor
    """[chunks] int32: cached prefix + the chunk's tokens."""
    q_starts: torch.Tensor
    """[chunks + 1] int32: where each chunk's queries start in the prefill token stream."""
    tile_seq: torch.Tensor
    """[tiles] int32: the chunk each query tile belongs to."""
    tile_q: torch.Tensor
    """[tiles] int32: the tile's first query, counted within its chunk."""
    block_q: int


def plan_prefill(common: CommonAttentionMetadata, block_q: int) -> PrefillPlan:
    """The tile map for `paged_prefill_attention`, from the step's metadata: derived on the
    device from query_start_loc (the tile count alone comes from the host copy, so that
    repeat_interleave needs no sync), with no host-to-device copy of its own."""
    nd = common.num_decode
    qsl_cpu = common.query_start_loc_cpu[nd:]
    total = int(((qsl_cpu[1:] - qsl_cpu[:-1] + block_q - 1) // block_q).sum())
    q_starts = common.query_start_loc[nd:] - nd
    n = q_starts.shape[0] - 1
    dev = q_starts.device
    tiles = (q_starts[1:] - q_starts[:-1] + block_q - 1) // block_q
    tile_seq = torch.repeat_interleave(torch.arange(n, device=dev), tiles, output_size=total)
    first = torch.cumsum(tiles, 0) - tiles                # each chunk's first tile
    tile_q = (torch.arange(total, device=dev)
              - torch.repeat_interleave(first, tiles, output_size=total)) * block_q
    i32 = torch.int32
    return PrefillPlan(common.block_table[nd:].to(i32), common.seq_lens[nd:].to(i32),
                       q_starts.to(i32), tile_seq.to(i32), tile_q.to(i32), block_q)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            plan: PrefillPlan, scale: float,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D]: every prefill chunk's queries, in plan order; k/v_cache [kvH, num_blocks,
    block_size, D], holding each chunk's K/V already. One launch for all chunks."""
    t, h, d = q.shape
    kv_heads, _, block_size, _ = k_cache.shape
    g = h // kv_heads
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(t, h, d, dtype=q.dtype, device=q.device) if out is None else out
    tiles = plan.tile_seq.shape[0]
    if t == 0 or tiles == 0:
        return out
    fp32 = q.dtype == torch.float32
    _paged_prefill_kernel[(tiles, kv_heads)](
        q, k_cache, v_cache, out, plan.block_tables, plan.ctx_lens, plan.q_starts,
        plan.tile_seq, plan.tile_q, scale, q.stride(0), q.stride(1), k_cache.stride(0),
        plan.block_tables.stride(0), out.stride(0), out.stride(1),
        G=g, G_PAD=triton.next_power_of_2(g), D=d, D_PAD=max(16, triton.next_power_of_2(d)),
        BLOCK_SIZE=block_size, BLOCK_Q=plan.block_q, BLOCK_N=32 if fp32 or d > 128 else 64,
        PRECISION="ieee" if fp32 else "tf32", num_warps=4, num_stages=2)
    return out


@dataclass(slots=True)
class TritonMetadata(AttentionMetadata):
    decode_block_tables: torch.Tensor | None = None
    """[num_decode, width] int64 on the device."""
    decode_lens: torch.Tensor | None = None
    """[num_decode] int64 on the device."""
    prefill_plan: PrefillPlan | None = None


class TritonAttention(AttentionBackend):
    """CUDA's backend, reading the head-major pool in place: per layer, one Triton launch
    for the decodes, which writes their K/V too (two when a small batch splits its
    contexts), and, in a step with prefill chunks, one to write the chunks' K/V and one for
    all of their attention. Decode steps can be captured (tables and lengths are device
    tensors the kernels read)."""
    name = "triton"
    supports_decode_graphs = True

    def build(self, common: CommonAttentionMetadata) -> TritonMetadata:
        """Views of the step's tensors (already on the device, int64, which the kernels
        take) and, with prefill chunks, their tile map."""
        nd = common.num_decode
        meta = TritonMetadata(self, common.slot_mapping, nd)
        if nd:
            meta.decode_block_tables = common.block_table[:nd]
            meta.decode_lens = common.seq_lens[:nd]
        if common.num_reqs > nd:
            meta.prefill_plan = plan_prefill(common, prefill_block_q(self.num_heads,
                                                                     self.kv_heads))
        return meta

    def forward(self, q, k, v, k_cache, v_cache, meta: TritonMetadata, scale: float):
        # The decodes' K/V are written by the decode kernel itself; the prefill chunks' first,
        # by the write kernel (the prefill kernel reads each chunk's own tokens from the pool).
        nd = meta.num_decode
        slots = meta.slot_mapping
        if meta.prefill_plan is None:
            return paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables,
                                          meta.decode_lens, scale, new_kv=(k, v, slots))
        write_kv_cache(k_cache, v_cache, k[nd:], v[nd:], slots[nd:])
        out = torch.empty_like(q)
        if nd:
            paged_decode_attention(q[:nd], k_cache, v_cache, meta.decode_block_tables,
                                   meta.decode_lens, scale, out=out[:nd],
                                   new_kv=(k[:nd], v[:nd], slots[:nd]))
        paged_prefill_attention(q[nd:], k_cache, v_cache, meta.prefill_plan, scale,
                                out=out[nd:])
        return out
