"""Pure functions from logits to sampling distributions; shared by drafting, verification and plain decoding.

Plain and speculative decoding must turn logits into probabilities the same way, or speculation
would change the output distribution: everything goes through `probs_from_logits`.
"""
from __future__ import annotations

import torch
from torch import Tensor


def mask_tokens(logits: Tensor, token_ids: list[int], rows: Tensor) -> Tensor:
    """Set logits[rows, token_ids] to -inf (used to hold back EOS/stop tokens before min_tokens)."""
    if token_ids and bool(rows.any()):
        logits = logits.clone()
        ids = torch.tensor(token_ids, device=logits.device)
        logits[rows.nonzero()[:, :1], ids[None, :]] = float("-inf")
    return logits


def probs_from_logits(logits: Tensor, temperature: float, top_k: int = -1, top_p: float = 1.0) -> Tensor:
    """logits [N, V] -> probabilities [N, V] after temperature, top-k, top-p (all rows share the params).

    temperature 0 gives a one-hot at the argmax (greedy as a distribution).
    """
    if temperature == 0.0:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: Tensor, generator: torch.Generator | None) -> int:
    """One token from probs [V]."""
    return int(torch.multinomial(probs, 1, generator=generator))
