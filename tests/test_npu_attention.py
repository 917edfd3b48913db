"""The NPU attention backend, fused ops and graphs, driven on the CPU by stand-ins for
torch_npu's ops.

No Ascend hardware is reachable from here, and torch_npu cannot even be installed without
CANN. The stand-ins below compute what the ops' documentation says they compute (and check
the argument rules it states: int32 slots and tables, host-side context lengths, TND
cumulative query ends, sparse_mode 3, the 2048 x 2048 mask, the norms' and SwiGLU's return
values). So these tests check our side: the block-major pool layout, the slots, tables and
lengths we pass, the split between decode and prefill, the graph-update protocol; they
cannot check the ops themselves.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import random_prompts
from workbench import Engine, EngineConfig, SamplingParams
from workbench.platforms.cpu import CpuPlatform
from workbench.platforms.npu import NpuPlatform
from workbench.platforms.npu_attention import (NpuAttention, block_major_shape,
                                               check_npu_config)
from workbench.platforms.npu_ops import NpuOps


def _attend(q, keys, values, scale, causal_offset=None):
    """q [n, H, D] over keys/values [L, kvH, D]; causal aligned to the end when asked."""
    n, L = q.shape[0], keys.shape[0]
    mask = None
    if causal_offset is not None:
        mask = torch.arange(L)[None, :] <= (torch.arange(n)[:, None] + L - n)
    return F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1),
                                          values.transpose(0, 1), attn_mask=mask, scale=scale,
                                          enable_gqa=True).transpose(0, 1)


class DocumentedOps:
    """torch_npu's attention and cache ops as documented, on CPU tensors."""

    def __init__(self):
        self.calls = {"cache": 0, "paged": 0, "fia": 0, "rms_norm": 0, "add_rms_norm": 0,
                      "swiglu": 0}
        self.replay_context_lens = None
        """Set while a stand-in graph replays: the lengths its last update() handed the
        recorded paged-attention calls (a real NPUGraph keeps the captured host values
        unless updated)."""

    def _npu_reshape_and_cache(self, key, value, key_cache, value_cache, slot_indices):
        assert slot_indices.dtype == torch.int32 and key.is_contiguous()
        nb, bs, kvh, d = key_cache.shape
        key_cache.view(nb * bs, kvh, d)[slot_indices.long()] = key
        value_cache.view(nb * bs, kvh, d)[slot_indices.long()] = value
        self.calls["cache"] += 1

    def _npu_paged_attention(self, query, key_cache, value_cache, num_kv_heads, num_heads,
                             scale_value, block_table, context_lens, out):
        nb, bs, kvh, d = key_cache.shape
        assert block_table.dtype == torch.int32 and context_lens.dtype == torch.int32
        assert context_lens.device.type == "cpu", "context_lens is a host tensor"
        assert bs % 16 == 0 and bs * d <= 128 * 128 and d <= 256
        assert (num_kv_heads, num_heads) == (kvh, query.shape[1])
        if self.replay_context_lens is not None:
            context_lens = self.replay_context_lens
            assert context_lens.dtype == torch.int32 and len(context_lens) == query.shape[0]
        for i, length in enumerate(context_lens.tolist()):
            blocks = block_table[i, :math.ceil(length / bs)].long()
            keys = key_cache[blocks].reshape(-1, kvh, d)[:length]
            values = value_cache[blocks].reshape(-1, kvh, d)[:length]
            out[i] = _attend(query[i:i + 1], keys, values, scale_value)[0]
        self.calls["paged"] += 1

    def npu_fused_infer_attention_score(self, q, k, v, *, atten_mask, actual_seq_lengths,
                                        actual_seq_lengths_kv, block_table, num_heads, scale,
                                        input_layout, num_key_value_heads, sparse_mode,
                                        block_size):
        assert input_layout == "TND" and sparse_mode == 3
        assert atten_mask.shape == (2048, 2048) and atten_mask.dtype == torch.bool
        assert all(isinstance(x, int) for x in actual_seq_lengths + actual_seq_lengths_kv)
        assert actual_seq_lengths[-1] == q.shape[0] and block_table.dtype == torch.int32
        nb, bs, width = k.shape
        kvh = num_key_value_heads
        d = width // kvh
        assert bs == block_size and num_heads == q.shape[1]
        out, start = torch.empty_like(q), 0
        for i, (end, length) in enumerate(zip(actual_seq_lengths, actual_seq_lengths_kv)):
            blocks = block_table[i, :math.ceil(length / bs)].long()
            keys = k[blocks].reshape(-1, kvh, d)[:length]
            values = v[blocks].reshape(-1, kvh, d)[:length]
            out[start:end] = _attend(q[start:end], keys, values, scale, causal_offset=True)
            start = end
        self.calls["fia"] += 1
        return out, torch.zeros(1)


    def npu_rms_norm(self, x, gamma, epsilon=1e-6):
        assert gamma.shape == x.shape[-1:]
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
        self.calls["rms_norm"] += 1
        return (xf * rstd * gamma.float()).to(x.dtype), rstd

    def npu_add_rms_norm(self, x1, x2, gamma, epsilon=1e-6):
        s = x1 + x2
        y, rstd = self.npu_rms_norm(s, gamma, epsilon)
        self.calls["rms_norm"] -= 1
        self.calls["add_rms_norm"] += 1
        return y, rstd, s

    def npu_swiglu(self, x, dim=-1):
        a, b = x.chunk(2, dim=dim)
        self.calls["swiglu"] += 1
        return F.silu(a) * b


class StandInNpuPlatform(CpuPlatform):
    """The NPU platform's layout and backend, on the CPU, with the documented stand-ins."""
    default_block_size = 128

    def __init__(self):
        self.ops = DocumentedOps()

    def kv_cache_shape(self, *shape):
        return block_major_shape(*shape)

    def attention_backend(self, dtype):
        return NpuAttention(self.ops)

    def model_ops(self, dtype):
        return NpuOps(self.ops)

    def check_config(self, config):
        check_npu_config(config)


class StandInNpuGraph:
    """An NPUGraph captured with auto_dispatch_capture, as far as our side can tell: replay
    reruns the captured work on the static buffers, and the paged-attention calls see the
    context lengths from the last update(), never the host tensor passed at capture."""

    def __init__(self, fn, out, ops):
        self.fn, self.out, self.ops, self.lens, self.updates = fn, out, ops, None, 0

    def update(self, cpu_update_input):
        (changes,) = cpu_update_input             # one dict: applies to every recorded op
        self.lens = changes["context_lens"]
        self.updates += 1

    def replay(self):
        self.ops.replay_context_lens = self.lens
        try:
            out = self.fn()
            if self.out is not None:
                self.out.copy_(out)
        finally:
            self.ops.replay_context_lens = None


class StandInNpuGraphPlatform(StandInNpuPlatform):
    supports_graphs = True
    replay_graph = NpuPlatform.replay_graph       # the real update-then-replay

    def graph_pool(self):
        return None

    def capture_graph(self, fn, pool):
        out = fn()
        return StandInNpuGraph(fn, out, self.ops), out


@pytest.mark.parametrize("mode", ["decode", "full"])
def test_npu_graphs_update_host_lengths_and_match_the_reference(tiny_checkpoints, monkeypatch,
                                                                mode):
    """Decode graphs on the NPU path: int32 static tables, KV writes into the scratch block
    for padding, and each replay hands the host-side lengths over through NPUGraph.update.
    'full' adds piecewise graphs around the fused prefill."""
    import workbench.engine
    path, _ = tiny_checkpoints["qwen3"]
    platform = StandInNpuGraphPlatform()
    monkeypatch.setattr(workbench.engine, "get_platform", lambda name: platform)
    kw = dict(model=str(path), num_kv_blocks=24, max_num_seqs=6, max_num_batched_tokens=160,
              enable_prefix_caching=True)
    npu = Engine(**kw, graph_mode=mode, cudagraph_capture_sizes=[1, 2, 4, 6])
    assert npu.graph_mode == mode and not npu.notices
    prompts = random_prompts(5, 5, 300, 1000, seed=4)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (20, 3, 11, 14, 7)]
    got = [o.token_ids for o in npu.generate(prompts, params)]
    monkeypatch.undo()
    ref = Engine(**kw, device="cpu", attention_backend="reference", block_size=128)
    assert got == [o.token_ids for o in ref.generate(prompts, params)]
    steps = npu.telemetry.snapshot()[0]
    full = [s for s in steps if s.graph_kind == "full"]
    assert full and all(s.phase == "decode" for s in full)
    assert {s.graph_size for s in full} >= {4, 2, 1} and any(s.graph_size > s.num_decode_tokens
                                                             for s in full)
    updates = sum(g.updates for g in npu.runner.graphs.graphs.values())
    assert updates == len(full)
    piecewise = [s for s in steps if s.graph_kind == "piecewise"]
    assert bool(piecewise) == (mode == "full")
    assert all(s.num_prefill_tokens for s in piecewise)


def test_npu_backend_tokens_equal_the_reference(tiny_checkpoints, monkeypatch):
    import workbench.engine
    path, _ = tiny_checkpoints["qwen3"]
    platform = StandInNpuPlatform()
    monkeypatch.setattr(workbench.engine, "get_platform", lambda name: platform)
    kw = dict(model=str(path), num_kv_blocks=24, max_num_seqs=6,
              max_num_batched_tokens=160, enable_prefix_caching=True)
    prompts = random_prompts(5, 5, 300, 1000, seed=4)
    prompts.append(prompts[2][:260] + [7, 8, 9])            # a cached prefix, then a chunk
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    npu = Engine(**kw)                                       # block_size: the device's 128
    assert npu.config.block_size == 128
    assert npu.runner.kv_cache.shape[2:4] == (25, 128)      # [L, 2, blocks + scratch, bs, ...]
    with pytest.raises(ValueError, match="block_size"):
        Engine(**kw, block_size=16)
    got = [o.token_ids for o in npu.generate(prompts[:5], params)]
    got += [o.token_ids for o in npu.generate(prompts[5:], params)]
    monkeypatch.undo()
    ref = Engine(**kw, device="cpu", attention_backend="reference", block_size=128)
    assert Engine(model="random:tiny", device="cpu", num_kv_blocks=4).config.block_size == 16
    want = [o.token_ids for o in ref.generate(prompts[:5], params)]
    want += [o.token_ids for o in ref.generate(prompts[5:], params)]
    assert got == want
    steps = npu.telemetry.snapshot()[0]
    assert any(s.phase == "mixed" for s in steps) and any(s.num_cached_tokens for s in steps)
    assert all(n > 0 for n in platform.ops.calls.values()), platform.ops.calls


def test_npu_config_rules():
    with pytest.raises(ValueError, match="block_size"):
        check_npu_config(EngineConfig(block_size=16))
    with pytest.raises(ValueError, match="dtype"):
        check_npu_config(EngineConfig(block_size=128, dtype="float32"))
    with pytest.raises(ValueError, match="attention_backend"):
        check_npu_config(EngineConfig(block_size=128, attention_backend="reference"))
    check_npu_config(EngineConfig(block_size=128))
