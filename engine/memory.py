"""How many sequences fit: each device's KV cache budget after its weights, in slots of max_model_len.

Every rank reports, once its weights are loaded, what one more sequence costs it (a slot: keys and
values of every layer for max_model_len tokens, for each model on that device) and what it may
still spend: on a GPU gpu_memory_utilization of the device minus what is in use now (weights, the
CUDA context, other processes), on a CPU kv_cache_memory_bytes (no budget: max_num_seqs slots, as
before). The engine takes the slots the tightest device allows, at most max_num_seqs, and says so
as vLLM does ("Maximum concurrency for N tokens per request"). Too little for one sequence is an
error that names the numbers.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)
GiB = float(1 << 30)


@dataclass(frozen=True)
class DeviceMemory:
    """One rank's report (for a colocated draft: the target and draft caches on its device together)."""

    slot_bytes: int  # one sequence's KV cache on this device
    budget_bytes: int | None  # what the caches may take here; None: no limit
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


def plan_slots(reports: list[DeviceMemory], max_num_seqs: int, slot_tokens: int,
               gpu_memory_utilization: float) -> int:
    """Slots every device can hold, at most max_num_seqs; ValueError if a device can't hold one."""
    slots = max_num_seqs
    for r in reports:
        if r.budget_bytes is None:
            continue
        fits = r.budget_bytes // max(1, r.slot_bytes)
        if fits < 1:
            raise ValueError(
                f"not enough memory for the KV cache on {r.where}: one sequence ({slot_tokens} tokens: "
                f"max_model_len and a verify step's room) needs {r.slot_bytes / GiB:.3f} GiB, {r.budget_bytes / GiB:.3f} GiB is left "
                f"(gpu_memory_utilization={gpu_memory_utilization}, weights {r.weight_bytes / GiB:.2f} GiB); lower "
                f"max_model_len, raise gpu_memory_utilization or kv_cache_memory_bytes, or add tensor parallelism")
        slots = min(slots, fits)
    concurrency = min((r.budget_bytes // max(1, r.slot_bytes) for r in reports if r.budget_bytes is not None),
                      default=None)
    per_rank = max(r.slot_bytes for r in reports) * slots
    log.info("KV cache: %d slots of %d tokens (%.3f GiB on the largest rank); maximum concurrency for %d tokens "
             "per request: %s", slots, slot_tokens, per_rank / GiB, slot_tokens,
             f"{concurrency}x" if concurrency is not None else f"{slots}x (max_num_seqs; no memory budget set)")
    if slots < max_num_seqs:
        log.warning("max_num_seqs %d lowered to %d: the KV cache budget holds no more sequences of %d tokens",
                    max_num_seqs, slots, slot_tokens)
    return slots
