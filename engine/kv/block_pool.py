"""A pool of fixed-size KV blocks for one model: reference counts, prefix hashes, LRU eviction.

As vLLM v1's block_pool.py: a block is free when no sequence holds it. A free block whose hash is
known keeps its keys and values until the pool hands it out again, so a later request with the same
token chain reuses it. Free blocks are handed out least recently freed first; blocks that hold
nothing reusable (never hashed) go first of all. Block 0 is the null block: padding in block tables
points at it, it is never handed out, and whatever is written there is never read as a real key.
"""
from __future__ import annotations

from collections import OrderedDict

NULL_BLOCK = 0


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> the block that holds it
        # free blocks, eviction order first (an OrderedDict: O(1) removal when a cached one is hit)
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        """Share of the usable blocks that sequences hold (vLLM's kv_cache_usage_perc, 0..1)."""
        return 1.0 - len(self.free) / (self.num_blocks - 1)

    def allocate(self, n: int) -> list[int] | None:
        """n blocks for one sequence (evicting cached free blocks, oldest first); None if fewer are free."""
        if n > len(self.free):
            return None
        out = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            h = self.block_hash[block]
            if h is not None:
                self.block_hash[block] = None
                if self.cached.get(h) == block:
                    del self.cached[h]
                self.evictions += 1
            self.ref_count[block] = 1
            out.append(block)
        return out

    def take(self, blocks: list[int]) -> None:
        """Share cached blocks (a prefix hit): one more holder each; a free one leaves the free queue."""
        for block in blocks:
            if self.ref_count[block] == 0:
                del self.free[block]
            self.ref_count[block] += 1

    def release(self, blocks: list[int]) -> None:
        """One holder fewer each. Given a sequence's blocks in order, its tail is evicted before its
        head (a shared prefix outlives the turn that extended it)."""
        for block in reversed(blocks):
            self.ref_count[block] -= 1
            assert self.ref_count[block] >= 0, f"block {block} released more often than taken"
            if self.ref_count[block] == 0:
                self.free[block] = None
                if self.block_hash[block] is None:  # nothing to reuse: hand it out first
                    self.free.move_to_end(block, last=False)

    def cache(self, block: int, block_hash: bytes) -> None:
        """Record that a held block holds the full, committed block whose chain hash is block_hash."""
        if self.block_hash[block] is not None:
            return
        self.block_hash[block] = block_hash
        self.cached.setdefault(block_hash, block)  # a duplicate of a cached block stays private

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of a chain of hashes."""
        out = []
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def reset(self) -> None:
        """Forget every cached block (after the model groups were rebuilt: their caches are new)."""
        assert all(c == 0 for c in self.ref_count), "reset with blocks still held"
        self.__init__(self.num_blocks)
