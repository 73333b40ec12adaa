"""Slot-based KV cache: one slot per running sequence; rollback is setting the slot's length.

Positions past a slot's length hold stale keys (rejected drafts, padding); attention never reads
them, because a query only sees keys at or before its own position and every position up to
that one was written by this or an earlier step.
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
        self.max_len = max_len
        self.lengths = [0] * num_slots  # committed tokens per slot
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free KV cache slot")
        slot = self._free.pop()
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        self.lengths[slot] = 0
        self._free.append(slot)

    def set_length(self, slot: int, length: int) -> None:
        if not 0 <= length <= self.max_len:
            raise ValueError(f"slot length {length} outside [0, {self.max_len}]")
        self.lengths[slot] = length

    def update(self, layer: int, slots: Tensor, positions: Tensor, k: Tensor, v: Tensor,
               key_len: int) -> tuple[Tensor, Tensor]:
        """Write k, v [B, Hkv, T, D] at positions [B, T] of `slots` [B]; return keys and values
        [B, Hkv, key_len, D] of those slots."""
        kc, vc = self.k[layer], self.v[layer]
        rows = slots[:, None]
        # advanced indices around a slice: the indexed view is [B, T, Hkv, D]
        kc[rows, :, positions] = k.transpose(1, 2)
        vc[rows, :, positions] = v.transpose(1, 2)
        return kc[slots, :, :key_len], vc[slots, :, :key_len]
