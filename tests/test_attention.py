"""Paged attention: the reference path against dense attention, and the fused CPU kernel
against the reference, on random pools with shuffled block tables."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workbench.platforms import get_platform
from workbench.platforms.attention import decode_attention, pool_rows, prefill_attention, write_kv
from workbench.platforms import cpu_kernels
from workbench.platforms.cpu_attention import CpuAttention


def random_case(b=6, kv_heads=2, g=3, d=32, bs=16, nb=64, max_len=150, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(kv_heads, nb, bs, d, generator=gen)
    v_cache = torch.randn(kv_heads, nb, bs, d, generator=gen)
    lens = torch.randint(1, max_len, (b,), generator=gen)
    max_blocks = -(-int(lens.max()) // bs)
    tables = torch.stack([torch.randperm(nb, generator=gen)[:max_blocks] for _ in range(b)])
    q = torch.randn(b, kv_heads * g, d, generator=gen)
    return q, k_cache, v_cache, tables, lens


def reference_inputs(tables, lens, kv_heads, nb, bs):
    """The gather path's pool rows and padding bias (what TorchAttention.build makes)."""
    pad = torch.arange(tables.shape[1] * bs)[None, :] >= lens[:, None]
    bias = torch.zeros(pad.shape).masked_fill_(pad, float("-inf")).unsqueeze(1).repeat(kv_heads, 1, 1)
    return pool_rows(tables, kv_heads, nb), bias


def test_reference_decode_matches_dense_attention():
    q, kc, vc, tables, lens = random_case()
    kv_heads, nb, bs, d = kc.shape
    out = decode_attention(q, kc, vc, *reference_inputs(tables, lens, kv_heads, nb, bs), 0.2)
    for i in range(len(lens)):
        n = int(lens[i])
        k = kc[:, tables[i]].reshape(kv_heads, -1, d)[:, :n]
        v = vc[:, tables[i]].reshape(kv_heads, -1, d)[:, :n]
        dense = F.scaled_dot_product_attention(q[i][:, None], k, v, scale=0.2, enable_gqa=True)[:, 0]
        torch.testing.assert_close(out[i], dense, rtol=1e-5, atol=1e-5)


def test_write_kv_lands_in_the_right_slots():
    kc = torch.zeros(2, 4, 8, 3)
    vc = torch.zeros(2, 4, 8, 3)
    k = torch.randn(5, 2, 3)
    slots = torch.tensor([0, 9, 17, 31, 8])
    write_kv(kc, vc, k, -k, slots)
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(kc[:, s // 8, s % 8], k[i]) and torch.equal(vc[:, s // 8, s % 8], -k[i])


@pytest.mark.parametrize("seed,g,bs", [(0, 3, 16), (1, 1, 8), (2, 4, 64)])
def test_cpu_kernel_matches_reference(seed, g, bs):
    backend = get_platform("cpu").attention_backend(torch.float32)
    if not isinstance(backend, CpuAttention) or cpu_kernels.kernels() is None:
        pytest.skip("no C++ compiler: the CPU kernel could not be built")
    kernel = cpu_kernels.kernels().paged_decode_attention
    q, kc, vc, tables, lens = random_case(g=g, bs=bs, seed=seed)
    kv_heads, nb, bs, d = kc.shape
    ref = decode_attention(q, kc, vc, *reference_inputs(tables, lens, kv_heads, nb, bs), 0.17)
    out = kernel(q, kc, vc, tables, lens, 0.17)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def prefill_case(dtype, g, bs, d, seed, kv_heads=2, nb=160,
                 chunks=((37, 0), (16, 80), (1, 5), (70, 33), (130, 0), (3, 0))):
    """A step's prefill chunks (n new tokens after a cached prefix of s) over a random pool
    with shuffled block tables; the pool already holds every chunk's K/V, as the kernel
    finds it. Returns the kernel's inputs and, per chunk, float64 dense causal attention
    over the same numbers."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(kv_heads, nb, bs, d, generator=gen).to(dtype)
    v_cache = torch.randn(kv_heads, nb, bs, d, generator=gen).to(dtype)
    lens = torch.tensor([n + s for n, s in chunks])
    width = -(-int(lens.max()) // bs)
    tables = torch.stack([torch.randperm(nb, generator=gen)[:width] for _ in chunks])
    starts = torch.tensor([0] + torch.cumsum(torch.tensor([n for n, _ in chunks]), 0).tolist())
    q = torch.randn(int(starts[-1]), kv_heads * g, d, generator=gen).to(dtype)
    scale = d ** -0.5
    dense = []
    for r, (n, s) in enumerate(chunks):
        k = k_cache[:, tables[r]].reshape(kv_heads, -1, d)[:, :n + s].double()
        v = v_cache[:, tables[r]].reshape(kv_heads, -1, d)[:, :n + s].double()
        mask = torch.arange(n + s)[None, :] <= torch.arange(s, n + s)[:, None]
        qr = q[starts[r]:starts[r + 1]].double().transpose(0, 1)
        dense.append(F.scaled_dot_product_attention(qr, k, v, attn_mask=mask, scale=scale,
                                                    enable_gqa=True).transpose(0, 1))
    return (q, k_cache, v_cache, tables, starts, lens, scale), chunks, dense


def reference_prefill(inputs, chunks):
    """The plain-torch path's output for the same chunks (what TorchAttention.prefill runs)."""
    q, k_cache, v_cache, tables, starts, lens, scale = inputs
    kv_heads, nb, bs, d = k_cache.shape
    out = []
    for r, (n, s) in enumerate(chunks):
        rows = pool_rows(tables[r, :-(-(n + s) // bs)], kv_heads, nb)
        ctx = (rows, torch.arange(n + s)[None, :] <= torch.arange(s, n + s)[:, None]) if s else None
        own = [c[:, tables[r]].reshape(kv_heads, -1, d)[:, s:n + s].transpose(0, 1)
               for c in (k_cache, v_cache)]                            # [n, kvH, D]
        out.append(prefill_attention(q[starts[r]:starts[r + 1]], *own, k_cache, v_cache, s, ctx,
                                     scale))
    return torch.cat(out)


@pytest.mark.parametrize("seed,g,bs,d", [(0, 3, 16, 64), (1, 1, 8, 48), (2, 4, 64, 32),
                                         (3, 2, 16, 16), (4, 7, 32, 128), (5, 3, 16, 80)])
def test_cpu_prefill_kernel_matches_dense_attention(seed, g, bs, d):
    """Every chunk of a step in one call, read from the pool: chunks with and without a
    cached prefix, of one token, ending mid-block, past a 16-position tile; GQA groups
    of 1-7; against float64 and the plain-torch path."""
    k = cpu_kernels.kernels()
    if k is None or not hasattr(k, "paged_prefill_attention"):
        pytest.skip("no C++ compiler or no AVX-512: the CPU prefill kernel is not built")
    inputs, chunks, dense = prefill_case(torch.float32, g, bs, d, seed)
    out = k.paged_prefill_attention(*inputs)
    assert out.shape == inputs[0].shape
    torch.testing.assert_close(out.double(), torch.cat(dense), rtol=0, atol=1e-5)
    torch.testing.assert_close(out, reference_prefill(inputs, chunks), rtol=0, atol=1e-5)
