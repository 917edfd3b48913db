"""The CPU's attention backend: the plain-torch reference (attention.py), with decodes in the
C++ paged decode kernel, a step's prefill chunks in the C++ prefill kernel and the KV write
in one C++ call once the kernels are built (cpu_kernels.py); until then (a first start while
the detached build runs) it is the reference, so an engine serves at once and speeds up
when the build is done."""
from __future__ import annotations

import torch

from . import cpu_kernels
from .attention import TorchAttention

SHORT_CHUNK = 16
"""A prefill chunk of at most this many tokens on a cached context (a speculative verify's
k + 1, a short turn after a cached prefix) runs as that many decode rows: the decode kernel
reads the context once per token, which at these lengths costs less than gathering it for
the reference (and there is no prefill kernel without AVX-512), and the whole step can run
in decode_layers."""


class CpuAttention(TorchAttention):
    """The reference, with decodes in the C++ paged decode kernel (fp32 or bf16: a bf16 pool
    is half the bytes to read): it reads the pool in place through the block tables instead
    of gathering each context into a copy. Prefill chunks, all of a step's in one call, in
    the C++ prefill kernel (AVX-512, head sizes a multiple of 16 up to 128; else torch's
    scaled_dot_product_attention once a chunk, the reference's): on one core 2.5-2.8x
    torch's fp32 at 32-256 tokens, 1.9-2.6x its bf16 while computing bf16 in float64 (so
    that it is the reference's numbers, see csrc/cpu_attention.cpp), and a cached prefix is
    read in place too."""
    name = "cpu"
    supported_dtypes = (torch.float32, torch.bfloat16)
    supports_decode_graphs = True
    """The kernel reads tables and lengths from tensors, so a captured decode step would
    replay right; the CPU has no graphs to capture into (CpuPlatform.supports_graphs), but
    the tests' replaying platform runs the graph plumbing through this backend."""

    def build(self, common):
        """The reference's, but the kernel reads the decodes' rows of the step's table in
        place (int64, contiguous, as it wants them), each only up to its length; and
        where every token is a decode (`rows`), their tables and lengths together."""
        meta = super().build(common)
        nd = common.num_decode
        if nd:
            meta.decode_block_tables = common.block_table[:nd]
        if cpu_kernels.kernels() is not None:
            if common.num_reqs == nd:
                meta.rows = (meta.decode_block_tables, meta.decode_lens)
            elif meta.prefill_rows is not None:
                tables, lens = meta.prefill_rows
                meta.rows = (torch.cat((common.block_table[:nd], tables)),
                             torch.cat((common.seq_lens[:nd], lens))) if nd else (tables, lens)
        return meta

    def build_prefill(self, meta, common) -> None:
        """The kernel's inputs (views of the step's tensors), or one decode row per token
        where every chunk is short on a cached context (SHORT_CHUNK); the reference's
        gathered contexts only while the kernel is not built."""
        nd = common.num_decode
        if cpu_kernels.kernels() is not None and all(
                e - s <= SHORT_CHUNK and ctx > e - s for s, e, ctx in meta.prefills):
            sizes = torch.tensor([e - s for s, e, _ in meta.prefills])
            meta.prefill_rows = (
                common.block_table[nd:].repeat_interleave(sizes, 0),
                torch.cat([torch.arange(ctx - (e - s) + 1, ctx + 1) for s, e, ctx in meta.prefills]))
            return
        meta.prefill_block_tables = common.block_table[nd:]
        meta.prefill_query_start = common.query_start_loc[nd:] - nd
        meta.prefill_lens = common.seq_lens[nd:]
        if self._prefill_kernel() is None:
            super().build_prefill(meta, common)

    def _prefill_kernel(self):
        k = cpu_kernels.kernels()
        if k is None or not hasattr(k, "paged_prefill_attention") \
                or self.head_dim % 16 or self.head_dim > 128:
            return None
        return k.paged_prefill_attention

    def prefill(self, q, k, v, k_cache, v_cache, meta, scale: float) -> list:
        if not meta.prefills:
            return []
        if meta.prefill_rows is not None:
            return [cpu_kernels.kernels().paged_decode_attention(q, k_cache, v_cache,
                                                                 *meta.prefill_rows, scale)]
        kernel = self._prefill_kernel()
        if kernel is None:
            return super().prefill(q, k, v, k_cache, v_cache, meta, scale)
        return [kernel(q, k_cache, v_cache, meta.prefill_block_tables,
                       meta.prefill_query_start, meta.prefill_lens, scale)]

    def build_decode(self, meta, tables, lens) -> None:
        meta.decode_lens = lens
        if cpu_kernels.kernels() is None:       # still building: the reference's gather inputs
            super().build_decode(meta, tables, lens)

    def write_kv(self, k_cache, v_cache, k, v, slot_mapping) -> None:
        k_ = cpu_kernels.kernels()
        if k_ is None:
            return super().write_kv(k_cache, v_cache, k, v, slot_mapping)
        k_.write_kv(k_cache, v_cache, k, v, slot_mapping)           # one C++ call for K and V

    def decode(self, q, k_cache, v_cache, meta, scale: float):
        k = cpu_kernels.kernels()
        if k is None:
            return super().decode(q, k_cache, v_cache, meta, scale)
        return k.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables,
                                        meta.decode_lens, scale)
