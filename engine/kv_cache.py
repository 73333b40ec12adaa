"""Slot-based KV cache: one slot per running sequence.

The cache keeps no lengths: every forward names the positions it writes, and the scheduler
holds each sequence's committed length, so rollback after a rejected draft is just starting the
next write at the committed length. Positions past it hold stale keys (rejected drafts, padding);
attention never reads them, because a query sees only keys at or before its own position, and
every position up to that one was written by this step or an earlier one.
"""
from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots, self.max_len = num_slots, max_len

    def update(self, layer: int, slots: Tensor, positions: Tensor, k: Tensor, v: Tensor,
               key_len: int, read: slice | Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Write k, v [B, Hkv, T, D] at positions [B, T] of `slots` [B]; return the keys and values
        [B, Hkv, key_len, D] of those slots. `read`: `slot_rows(slots)`, computed once per forward."""
        kc, vc = self.k[layer], self.v[layer]
        rows = slots[:, None]
        # advanced indices around a slice: the indexed view is [B, T, Hkv, D]
        kc[rows, :, positions] = k.transpose(1, 2)
        vc[rows, :, positions] = v.transpose(1, 2)
        read = slot_rows(slots) if read is None else read
        return kc[read, :, :key_len], vc[read, :, :key_len]


def slot_rows(slots: Tensor) -> slice | Tensor:
    """How to index the cache for `slots`: a slice (a view, no copy of every key) when they are
    consecutive, else the index tensor."""
    ids = slots.tolist()
    return slice(ids[0], ids[0] + len(ids)) if ids == list(range(ids[0], ids[0] + len(ids))) else slots
