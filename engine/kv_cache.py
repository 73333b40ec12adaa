"""Paged KV cache on a worker: per layer, keys and values [num_blocks, kv_heads, block_size, head_dim].

A sequence's position p lives in block tables[b][p // block_size] at offset p % block_size; the
scheduler owns the tables (engine/kv/). The cache keeps no lengths: every forward names the
positions it writes, so rollback after a rejected draft is just writing the next step at the
committed length. Positions past it hold stale keys (rejected drafts, padding); attention never
reads them, because a query sees only keys at or before its own position, and every position up
to that one was written by this step or an earlier one. Block 0 is the null block: table padding
points there, and padded rows' writes land there.
"""
from __future__ import annotations

import mmap

import torch
from torch import Tensor


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        # one tensor of its own per layer and per keys / values: no two alias (a compiled step mutates
        # them, and torch.compile proves each write can't touch another's memory at no cost)
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        self._buffers = []
        self.k = [self._allocate(shape, dtype, device) for _ in range(num_layers)]
        self.v = [self._allocate(shape, dtype, device) for _ in range(num_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size

    def _allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device) -> Tensor:
        if torch.device(device).type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=device)
        # anonymous memory: zero pages the OS maps on first write, so a large cache costs
        # resident memory only for the blocks sequences have used
        nbytes = max(1, torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size())
        self._buffers.append(mmap.mmap(-1, nbytes))
        return torch.frombuffer(self._buffers[-1], dtype=dtype).view(shape)

    def update(self, layer: int, tables: Tensor, positions: Tensor, k: Tensor, v: Tensor,
               key_len: int, read: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Write k, v [B, Hkv, T, D] at positions [B, T] of the rows whose block tables are `tables`
        [B, blocks]; return keys and values [B, Hkv, key_len, D] of those rows (positions 0..).
        `read`: `self.read_blocks(tables, key_len)`, computed once per forward."""
        kc, vc = self.k[layer], self.v[layer]
        bs = self.block_size
        blocks, offsets = tables.gather(1, positions // bs), positions % bs
        # advanced indices around a slice: the indexed view is [B, T, Hkv, D]
        kc[blocks, :, offsets] = k.transpose(1, 2)
        vc[blocks, :, offsets] = v.transpose(1, 2)
        read = self.read_blocks(tables, key_len) if read is None else read
        return self._gather(kc, read, key_len), self._gather(vc, read, key_len)

    def read_blocks(self, tables: Tensor, key_len: int) -> Tensor:
        return tables[:, : -(-key_len // self.block_size)]

    @staticmethod
    def _gather(cache: Tensor, blocks: Tensor, key_len: int) -> Tensor:
        B, n = blocks.shape
        _, Hkv, bs, D = cache.shape
        rows = cache[blocks]  # [B, n, Hkv, bs, D]
        return rows.permute(0, 2, 1, 3, 4).reshape(B, Hkv, n * bs, D)[:, :, :key_len]


def static_tables(rows: int, tokens: int, block_size: int) -> list[list[int]]:
    """Block tables for `rows` sequences of up to `tokens` positions, each owning consecutive blocks
    from block 1 on (for a cache used without a scheduler: benchmarks, parity tests). The cache
    needs rows * ceil(tokens / block_size) + 1 blocks."""
    per_row = -(-tokens // block_size)
    return [list(range(1 + r * per_row, 1 + (r + 1) * per_row)) for r in range(rows)]
