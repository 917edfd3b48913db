"""Block pool: allocation, ref counts, prefix-cache hits and the accounting that must balance.
The pool hands out block ids and hashes; it never writes into a sequence (the scheduler
does), so these tests hold plain lists."""
from __future__ import annotations

import pytest

from workbench.core.block_manager import NULL_BLOCK, BlockManager, chain_hash


def held(bm: BlockManager, num_tokens: int, table: list[int] | None = None) -> list[int]:
    """A block table grown to hold num_tokens (asserting the pool had room)."""
    table = [] if table is None else table
    new = bm.allocate_slots(len(table), num_tokens)
    assert new is not None
    return table + new


def computed(bm: BlockManager, tokens, table: list[int]) -> list[int]:
    """Register a fully computed sequence's full blocks; their hashes."""
    return bm.cache_full_blocks(list(tokens), table, [], len(tokens))


def test_allocate_and_free_balance():
    bm = BlockManager(8, 4)
    table = held(bm, 10)
    assert len(table) == 3 and bm.num_used_blocks == 3
    assert bm.allocate_slots(3, 12) == []            # 12 tokens still fit in 3 blocks
    table = held(bm, 13, table)                      # 13 -> 4 blocks
    assert len(table) == 4
    bm.free(table)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 7     # 8, less the null block


def test_the_null_block_is_never_handed_out():
    """Block 0 is reserved: a drained pool hands out every other block, once each, and
    neither counts it as used nor free; the snapshot names it."""
    bm = BlockManager(6, 4)
    table = held(bm, 20)
    assert sorted(table) == [1, 2, 3, 4, 5] and NULL_BLOCK not in table
    assert bm.allocate_slots(5, 21) is None
    st = bm.stats()
    assert (st.num_blocks, st.used, st.free) == (6, 5, 0)
    snap = bm.snapshot({"r": table})
    assert snap.null_block == NULL_BLOCK and snap.ref_counts[NULL_BLOCK] == 0
    bm.free(table)
    bm.reset_prefix_cache()
    assert NULL_BLOCK not in held(bm, 20) and bm.num_free_blocks == 0


def test_allocation_fails_cleanly_when_full():
    bm = BlockManager(2, 4)
    assert bm.allocate_slots(0, 12) is None
    assert bm.num_free_blocks == 1


def test_prefix_hit_shares_blocks_and_leaves_one_token_to_compute():
    bm = BlockManager(16, 4)
    a = held(bm, 10)
    assert len(computed(bm, range(10), a)) == 2      # tokens 0..7; the third block is partial
    hashes: list[int] = []
    hit = bm.match_prefix(list(range(8)) + [99, 98], hashes)
    assert hit.num_queried == 2                      # two full prompt blocks looked up
    assert hit.block_ids == a[:2] and hit.block_hashes == hashes and len(hashes) == 2
    assert bm.blocks[a[0]].ref_count == 1            # a lookup changes nothing ...
    new = bm.allocate_slots(0, 10, computed=hit.block_ids)
    assert len(new) == 1 and bm.blocks[a[0]].ref_count == 2    # ... the allocation commits it
    # A prompt that is entirely cached still computes its last block.
    assert len(bm.match_prefix(list(range(8))).block_ids) == 1


def test_cached_free_blocks_serve_hits_then_get_evicted_last():
    bm = BlockManager(5, 4)                          # 4 usable blocks
    first = held(bm, 8)
    computed(bm, range(8), first)
    bm.free(first)
    st = bm.stats()
    assert (st.used, st.free, st.cached) == (0, 4, 2)
    # New unrelated work takes the plain free blocks first.
    x = held(bm, 4)
    assert x[0] not in first
    hit = bm.match_prefix(list(range(8)) + [7])
    assert hit.block_ids == first and bm.stats().cached == 2     # looked up, still free
    # Holding the two hit blocks leaves one free block: a request that needs two more is
    # refused and changes nothing; one that needs one more gets it.
    assert bm.allocate_slots(0, 16, computed=hit.block_ids) is None
    assert bm.stats().cached == 2 and bm.num_free_blocks == 3
    new = bm.allocate_slots(0, 12, computed=hit.block_ids)
    assert len(new) == 1 and new[0] not in first and bm.stats().cached == 0
    bm.free(hit.block_ids + new), bm.free(x)
    assert bm.num_used_blocks == 0


def test_a_lookup_remembers_its_hashes(monkeypatch):
    """A request that waits is looked up again each step: its blocks are hashed once."""
    import workbench.core.block_manager as mod
    bm = BlockManager(8, 4)
    computed(bm, range(8), held(bm, 8))
    calls = []
    real = mod.chain_hash
    monkeypatch.setattr(mod, "chain_hash", lambda p, t: calls.append(t) or real(p, t))
    hashes: list[int] = []
    for _ in range(3):
        assert len(bm.match_prefix(list(range(12)), hashes).block_ids) == 2
    assert len(calls) == 2


def test_hash_collision_is_caught_by_token_check(monkeypatch):
    import workbench.core.block_manager as mod
    monkeypatch.setattr(mod, "chain_hash", lambda parent, tokens: 42)   # everything collides
    bm = BlockManager(8, 4)
    computed(bm, range(8), held(bm, 8))
    assert bm.match_prefix([9, 9, 9, 9, 9]).block_ids == []


def test_eviction_drops_hash():
    bm = BlockManager(3, 4)
    a = held(bm, 8)
    computed(bm, range(8), a)
    bm.free(a)
    held(bm, 8)                                      # reuses both cached blocks
    assert bm.match_prefix(list(range(8)) + [1]).block_ids == []


def test_prefix_caching_off_never_hashes():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a = held(bm, 8)
    assert computed(bm, range(8), a) == []
    bm.free(a)
    assert bm.stats().cached == 0
    assert bm.match_prefix(list(range(9))).num_queried == 0


def test_chain_hash_depends_on_parent():
    assert chain_hash(None, (1, 2)) != chain_hash(chain_hash(None, (0,)), (1, 2))


@pytest.mark.parametrize("n", [0, 1])
def test_a_pool_without_a_usable_block_is_rejected(n):
    with pytest.raises(ValueError, match="num_kv_blocks: must be >= 2, one of them the reserved"):
        BlockManager(n, 16)
