"""Paged KV blocks: a free list, reference counts and a prefix cache of full blocks.

A block holds the K/V of `block_size` consecutive tokens of one sequence. Blocks are found by
id through a sequence's block table; a token at position p lives in slot
`block_table[p // block_size] * block_size + p % block_size` of the KV pool.

Prefix caching: once a block is full, its content is identified by a hash chained over every
block before it (so equal hashes mean equal prefixes, not just equal blocks). A new sequence
whose leading blocks hash the same reuses those blocks (ref count + 1) instead of recomputing
them. A hash hit is confirmed by comparing the block's token ids, so a hash collision can
never hand a request someone else's K/V. When a cached block's last user finishes, the block
keeps its content and becomes "cached free": it still serves hits, and is the last kind of
free block to be reused (least recently freed first).

Pure Python over token ids and block ids: nothing here touches a tensor, and nothing here
writes into a sequence. The pool hands out what it allocated (block ids, a PrefixHit, new
hashes); the scheduler records them in its sequences.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from ..utils import cdiv



@dataclass(slots=True)
class PrefixHit:
    """What `match_prefix` found: cached blocks, not yet held (allocate_slots takes them)."""
    block_ids: list[int]
    block_hashes: list[int]
    num_queried: int
    """Full prompt blocks looked up (for `count_lookup`)."""


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class BlockStats:
    num_blocks: int
    used: int
    """Blocks referenced by at least one live sequence."""
    free: int
    """Blocks no sequence references (cached ones included)."""
    cached: int
    """Free blocks that still hold a reusable prefix."""
    hits: int
    """Blocks served from the prefix cache since start."""
    queries: int
    """Full prompt blocks looked up in the prefix cache since start."""


@dataclass(slots=True)
class KVBlockSnapshot:
    """The pool block by block, for a block map: who holds what, and what is cached."""
    num_blocks: int
    block_size: int
    ref_counts: list[int]
    cached: list[bool]
    """The block holds a full block registered in the prefix cache (a used block that later
    requests may share, or a free one that still serves hits)."""
    block_tables: dict[str, list[int]]
    """Each live request's block table, in position order."""
    step: int = -1
    """Engine step after which it was taken (-1: before any)."""
    null_block: int | None = None
    """The pool's reserved block (None in traces recorded before it existed)."""

    def owners(self) -> list[list[str]]:
        """Request ids holding each block (several for a shared prefix block)."""
        out: list[list[str]] = [[] for _ in range(self.num_blocks)]
        for rid, table in self.block_tables.items():
            for b in table:
                out[b].append(rid)
        return out


def chain_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent, token_ids))


NULL_BLOCK = 0
"""The pool's reserved block (vLLM's null block): never handed out, never freed. Whatever
must be written somewhere but belongs to no request goes there: the padding rows of a
replayed decode graph write their K/V into it, and block tables are padded with its id."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_kv_blocks: must be >= 2, one of them the reserved null "
                             f"block (got {num_blocks})")
        self.num_blocks = num_blocks
        """Blocks in the pool, the null block included."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_plain: deque[int] = deque(b for b in range(num_blocks) if b != NULL_BLOCK)
        self.num_usable_blocks = len(self._free_plain)
        """Blocks requests can hold: all but the null block."""
        self._free_cached: OrderedDict[int, None] = OrderedDict()   # LRU order: oldest first
        self._hash_to_block: dict[int, int] = {}
        self.hits = 0
        self.queries = 0

    # ---- counters -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    def stats(self) -> BlockStats:
        return BlockStats(self.num_blocks, self.num_used_blocks, self.num_free_blocks,
                          len(self._free_cached), self.hits, self.queries)

    def snapshot(self, block_tables: dict[str, list[int]], step: int = -1) -> KVBlockSnapshot:
        return KVBlockSnapshot(self.num_blocks, self.block_size,
                               [b.ref_count for b in self.blocks],
                               [b.hash is not None for b in self.blocks], block_tables, step,
                               NULL_BLOCK)

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ---- allocation -----------------------------------------------------------------------
    def _take_free_block(self) -> int:
        if self._free_plain:
            block_id = self._free_plain.popleft()
        else:
            block_id, _ = self._free_cached.popitem(last=False)
            block = self.blocks[block_id]
            if self._hash_to_block.get(block.hash) == block_id:
                del self._hash_to_block[block.hash]
            block.hash, block.token_ids = None, ()
        self.blocks[block_id].ref_count = 1
        return block_id

    def match_prefix(self, token_ids: list[int], hashes: list[int] | None = None) -> PrefixHit:
        """The cached blocks of the longest cached prefix of token_ids. A lookup changes
        nothing: `allocate_slots(..., computed=hit.block_ids)` takes the blocks when the
        request is admitted (a request that stays waiting holds nothing). `hashes`, kept by
        the caller, remembers the chained hash of each full block already hashed, so a
        request looked up again (it waits for room) is not hashed again.

        At least one token is always left to compute, since the step that computes it
        produces the logits for the next token.
        """
        hit = PrefixHit([], [], 0)
        if not self.enable_prefix_caching:
            return hit
        bs = self.block_size
        hit.num_queried = (len(token_ids) - 1) // bs
        hashes = [] if hashes is None else hashes
        for i in range(hit.num_queried):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            if i == len(hashes):
                hashes.append(chain_hash(hashes[-1] if hashes else None, tokens))
            block_id = self._hash_to_block.get(hashes[i])
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hit.block_ids.append(block_id)
            hit.block_hashes.append(hashes[i])
        return hit

    def fork(self, block_ids: list[int]) -> list[int]:
        """Share held blocks with one more holder (another of n choices of one prompt, which
        starts on the prompt's computed blocks instead of computing them again); returns them."""
        for block_id in block_ids:
            assert self.blocks[block_id].ref_count > 0, f"block {block_id} is not held"
            self.blocks[block_id].ref_count += 1
        return list(block_ids)

    def count_lookup(self, queried: int, hit: int) -> None:
        """Add one admitted request's prefix lookup to the hit counters (a request that waits
        and is matched again later is counted once, when it is admitted)."""
        self.queries += queried
        self.hits += hit

    def allocate_slots(self, num_held_blocks: int, num_tokens: int,
                       computed: list[int] = ()) -> list[int] | None:
        """Commit in one call what a holder of num_held_blocks needs to hold num_tokens
        tokens: the `computed` blocks of a prefix hit (held from now on, after the ones it
        holds) and the new blocks past them, which it returns (maybe none). None, changing
        nothing, when the pool is too full."""
        need = max(self.blocks_needed(num_tokens) - num_held_blocks - len(computed), 0)
        # A hit block that sits free in the cache is free no longer once it is held.
        if need > self.num_free_blocks - sum(self.blocks[b].ref_count == 0 for b in computed):
            return None
        for block_id in computed:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free_cached[block_id]
            block.ref_count += 1
        return [self._take_free_block() for _ in range(need)]

    def cache_full_blocks(self, token_ids: list[int], block_table: list[int],
                          block_hashes: list[int], num_computed_tokens: int) -> list[int]:
        """Register the blocks that became full (and computed) since block_hashes in the
        prefix cache; returns their hashes, to append to block_hashes."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        num_full = min(num_computed_tokens // bs, len(block_table))
        parent = block_hashes[-1] if block_hashes else None
        new: list[int] = []
        for i in range(len(block_hashes), num_full):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, tokens)
            block = self.blocks[block_table[i]]
            block.hash, block.token_ids = h, tokens
            self._hash_to_block[h] = block.block_id
            new.append(h)
            parent = h
        return new

    def free(self, block_table: list[int]) -> None:
        """Drop one reference to each block. Tail blocks are freed first so that, among
        cached free blocks, a prefix's later blocks are evicted before its head."""
        for block_id in reversed(block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                if block.hash is not None and self._hash_to_block.get(block.hash) == block_id:
                    self._free_cached[block_id] = None
                else:
                    block.hash, block.token_ids = None, ()
                    self._free_plain.append(block_id)

    def reset_prefix_cache(self) -> None:
        """Forget every cached-free block (used blocks keep their content)."""
        for block_id in self._free_cached:
            block = self.blocks[block_id]
            self._hash_to_block.pop(block.hash, None)
            block.hash, block.token_ids = None, ()
            self._free_plain.append(block_id)
        self._free_cached.clear()
