"""One model's KV cache as the scheduler sees it: each sequence's block table, prefix-cache hits,
growth as the sequence lengthens, and hashing of committed blocks (vLLM v1's kv_cache_manager.py).

Target and draft each have one (the draft's in its own token ids under TLI). A block is hashed only
once every one of its positions holds a committed token: drafts that were never accepted are never
hashed, and a hashed block is never written again (a sequence writes only past what it computed).
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field

from engine.kv.block_pool import NULL_BLOCK, BlockPool


@dataclass
class SeqCache:
    """One sequence in one model's cache."""

    blocks: list[int] = field(default_factory=list)  # its block table: position p is in blocks[p // block_size]
    computed: int = 0  # leading tokens whose keys and values are in the cache
    hashes: list[bytes] = field(default_factory=list)  # chain hashes of its first full blocks of tokens
    hashed: int = 0  # of its blocks, how many are registered in the pool's cache


@dataclass
class CacheCounters:
    queries: int = 0  # prompt tokens looked up in the prefix cache
    hits: int = 0  # of those, tokens found
    preemptions: int = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.prefix_caching = enable_prefix_caching
        self.counters = CacheCounters()

    @property
    def capacity_tokens(self) -> int:
        return (self.pool.num_blocks - 1) * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _extend_hashes(self, seq: SeqCache, token_ids: list[int], upto: int, salt: str | None) -> None:
        """Chain hashes of every full block of token_ids[:upto] (parent hash, salt, the block's ids)."""
        bs = self.block_size
        for i in range(len(seq.hashes), upto // bs):
            h = hashlib.blake2b(digest_size=16)
            h.update(seq.hashes[-1] if seq.hashes else (salt or "").encode())
            h.update(array("q", token_ids[i * bs:(i + 1) * bs]).tobytes())
            seq.hashes.append(h.digest())

    def admit(self, seq: SeqCache, token_ids: list[int], computable: int, salt: str | None,
              use_cache: bool = True) -> bool:
        """Give a sequence that holds nothing blocks for all of token_ids,
        reusing cached full blocks of its prefix. On success seq.computed says how many tokens the
        cache already holds (a multiple of the block size); False, holding nothing: no room now."""
        assert not seq.blocks, "admit a sequence that holds no blocks"
        hit: list[int] = []
        if self.prefix_caching and use_cache:
            self._extend_hashes(seq, token_ids, computable, salt)
            hit = self.pool.lookup(seq.hashes[: computable // self.block_size])
        need = self.blocks_for(len(token_ids)) - len(hit)
        # blocks a hit shares are taken first: those that were free no longer count as free
        free_after = self.pool.num_free - sum(1 for b in hit if self.pool.ref_count[b] == 0)
        if need > free_after:
            return False
        self.pool.take(hit)
        seq.blocks = hit + (self.pool.allocate(need) or [])
        seq.computed = len(hit) * self.block_size
        seq.hashed = len(hit)
        if use_cache and self.prefix_caching:
            self.counters.queries += computable
            self.counters.hits += seq.computed
        return True

    def grow(self, seq: SeqCache, num_tokens: int) -> bool:
        """Blocks for positions [0, num_tokens); False (nothing taken) when the pool is short."""
        need = self.blocks_for(num_tokens) - len(seq.blocks)
        if need <= 0:
            return True
        got = self.pool.allocate(need)
        if got is None:
            return False
        seq.blocks.extend(got)
        return True

    def can_grow(self, seq: SeqCache, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(seq.blocks) <= self.pool.num_free

    def commit(self, seq: SeqCache, token_ids: list[int], salt: str | None, upto: int) -> None:
        """Register the full blocks of token_ids[:upto] in the prefix cache: upto <= seq.computed,
        committed tokens only, none that a later step writes again."""
        if not self.prefix_caching:
            return
        full = min(upto, seq.computed, len(token_ids)) // self.block_size
        if full <= seq.hashed:
            return
        self._extend_hashes(seq, token_ids, full * self.block_size, salt)
        for i in range(seq.hashed, full):
            self.pool.cache(seq.blocks[i], seq.hashes[i])
        seq.hashed = full

    def free(self, seq: SeqCache) -> None:
        """Return a sequence's blocks (finished, aborted or preempted); its hashes stay valid."""
        self.pool.release(seq.blocks)
        seq.blocks, seq.computed, seq.hashed = [], 0, 0

    def table(self, seq: SeqCache, num_tokens: int) -> list[int]:
        """The block table covering positions [0, num_tokens), the null block past what it holds."""
        n = self.blocks_for(num_tokens)
        return seq.blocks[:n] + [NULL_BLOCK] * max(0, n - len(seq.blocks))

    def reset(self) -> None:
        self.pool.reset()
