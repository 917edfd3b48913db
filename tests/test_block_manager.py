"""Block manager: allocation, ref counts, prefix-cache hits and the accounting that must balance."""
from __future__ import annotations

import pytest

from workbench.core.block_manager import BlockManager, chain_hash
from workbench.core.sampling_params import SamplingParams
from workbench.core.sequence import Sequence


def seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams())


def test_allocate_and_free_balance():
    bm = BlockManager(8, 4)
    s = seq(range(10))
    assert bm.allocate_slots(s, 10)
    assert len(s.block_table) == 3 and bm.num_used_blocks == 3
    s.num_computed_tokens = 10
    assert bm.allocate_slots(s, 2)          # 12 tokens still fit in 3 blocks
    assert len(s.block_table) == 3
    assert bm.allocate_slots(s, 3)          # 13 -> 4 blocks
    assert len(s.block_table) == 4
    bm.free(s)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 8


def test_allocation_fails_cleanly_when_full():
    bm = BlockManager(2, 4)
    s = seq(range(12))
    assert not bm.allocate_slots(s, 12)
    assert s.block_table == [] and bm.num_free_blocks == 2


def test_prefix_hit_shares_blocks_and_leaves_one_token_to_compute():
    bm = BlockManager(16, 4)
    a = seq(range(10), "a")
    bm.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)
    assert len(a.block_hashes) == 2          # tokens 0..7; the third block is partial
    b = seq(list(range(8)) + [99, 98], "b")
    assert bm.match_prefix(b) == 2           # two full prompt blocks looked up
    assert b.block_table == a.block_table[:2] and b.num_computed_tokens == 8
    assert bm.blocks[a.block_table[0]].ref_count == 2
    # A prompt that is entirely cached still computes its last block.
    c = seq(range(8), "c")
    bm.match_prefix(c)
    assert c.num_computed_tokens == 4 and len(c.block_table) == 1


def test_cached_free_blocks_serve_hits_then_get_evicted_last():
    bm = BlockManager(4, 4)
    a = seq(range(8), "a")
    bm.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    first = list(a.block_table)
    bm.free(a)
    st = bm.stats()
    assert (st.used, st.free, st.cached) == (0, 4, 2)
    # New unrelated work takes the plain free blocks first.
    x = seq([50, 51, 52, 53], "x")
    bm.allocate_slots(x, 4)
    assert x.block_table[0] not in first
    b = seq(list(range(8)) + [7], "b")
    bm.match_prefix(b)
    assert b.block_table == first and b.num_cached_tokens == 8
    assert bm.stats().cached == 0
    bm.free(b), bm.free(x)
    assert bm.num_used_blocks == 0


def test_hash_collision_is_caught_by_token_check(monkeypatch):
    import workbench.core.block_manager as mod
    monkeypatch.setattr(mod, "chain_hash", lambda parent, tokens: 42)   # everything collides
    bm = BlockManager(8, 4)
    a = seq(range(8), "a")
    bm.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    b = seq([9, 9, 9, 9, 9], "b")
    bm.match_prefix(b)
    assert b.num_computed_tokens == 0 and b.block_table == []


def test_eviction_drops_hash():
    bm = BlockManager(2, 4)
    a = seq(range(8), "a")
    bm.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    bm.free(a)
    y = seq(range(100, 108), "y")
    assert bm.allocate_slots(y, 8)            # reuses both cached blocks
    b = seq(list(range(8)) + [1], "b")
    bm.match_prefix(b)
    assert b.num_computed_tokens == 0


def test_prefix_caching_off_never_hashes():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a = seq(range(8))
    bm.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    bm.free(a)
    assert bm.stats().cached == 0 and a.block_hashes == []


def test_chain_hash_depends_on_parent():
    assert chain_hash(None, (1, 2)) != chain_hash(chain_hash(None, (0,)), (1, 2))


def test_zero_blocks_rejected():
    with pytest.raises(ValueError, match="num_kv_blocks"):
        BlockManager(0, 16)
