"""How many KV blocks fit: each device's budget after its weights, in blocks of block_size tokens.

Every rank reports, once its weights are loaded, what one more block costs it (keys and values of
every layer for block_size tokens, for each model on that device: target and draft keep the same
number of blocks) and what it may still spend: on a GPU gpu_memory_utilization of the device minus
what is in use now (weights, the CUDA context, other processes); on a CPU kv_cache_memory_bytes, or
CPU_KV_CACHE_BYTES when it is unset (vLLM's CPU backend default, VLLM_CPU_KVCACHE_SPACE, is 4 GiB).
The engine takes the blocks the tightest device allows, never more than max_num_seqs sequences of
max_model_len could use, and says so as vLLM does ("Maximum concurrency for N tokens per request").
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)
GiB = float(1 << 30)
# The CPU default: a CPU cache's pages are mapped on first write (engine/kv_cache.py), so this is a
# ceiling on resident memory, reached only when the blocks have all been used (prefix caching keeps them).
CPU_KV_CACHE_BYTES = 4 << 30


@dataclass(frozen=True)
class DeviceMemory:
    """One rank's report (for a colocated draft: the target and draft caches on its device together)."""

    block_bytes: int  # one KV block on this device (each model's)
    budget_bytes: int | None  # what the caches may take here; None: the CPU default
    weight_bytes: int
    where: str  # "GPU 0 (80.0 GiB)", "CPU" (for messages)


def device_budget(device: str, gpu_memory_utilization: float, kv_cache_memory_bytes: int | None) -> tuple[int | None, str]:
    """(what the KV caches may take on this rank's device, its name), measured after the weights loaded."""
    if kv_cache_memory_bytes is not None:
        return kv_cache_memory_bytes, "kv_cache_memory_bytes"
    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        used = total - free
        name = f"GPU {torch.cuda.current_device()} ({total / GiB:.1f} GiB, {used / GiB:.2f} GiB in use)"
        return max(0, int(gpu_memory_utilization * total) - used), name
    return None, "CPU"


def plan_blocks(reports: list[DeviceMemory], block_size: int, max_model_len: int, max_num_seqs: int,
                gpu_memory_utilization: float) -> int:
    """Blocks every device can hold (the null block included); ValueError if a device can't hold two."""
    cap = max_num_seqs * -(-max_model_len // block_size) + 1  # more could never be used at once
    blocks = cap
    for r in reports:
        budget = CPU_KV_CACHE_BYTES if r.budget_bytes is None else r.budget_bytes
        fits = budget // max(1, r.block_bytes)
        if fits < 2:
            raise ValueError(
                f"not enough memory for the KV cache on {r.where}: one block of {block_size} tokens needs "
                f"{r.block_bytes / GiB:.4f} GiB, {budget / GiB:.3f} GiB is left (gpu_memory_utilization="
                f"{gpu_memory_utilization}, weights {r.weight_bytes / GiB:.2f} GiB); raise gpu_memory_utilization "
                f"or kv_cache_memory_bytes, or add tensor parallelism")
        blocks = min(blocks, fits)
    tokens = (blocks - 1) * block_size
    per_rank = max(r.block_bytes for r in reports) * blocks
    log.info("KV cache: %d blocks of %d tokens = %d tokens (%.3f GiB on the largest rank); maximum concurrency "
             "for %d tokens per request: %.2fx", blocks - 1, block_size, tokens, per_rank / GiB, max_model_len,
             tokens / max_model_len)
    return blocks
