"""Pure functions from logits to sampling distributions; shared by drafting, verification and plain decoding.

Plain and speculative decoding must turn logits into probabilities the same way, or speculation
would change the output distribution: everything goes through `probs_from_logits`.
"""
from __future__ import annotations

import torch
from torch import Tensor

from engine.errors import RowError


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
        logits = _top_p_mask(logits, top_p)
    return logits.softmax(-1)


def _top_p_mask(logits: Tensor, top_p: float, candidates: int = 1024) -> Tensor:
    """Drop a token when the probability mass before it (in descending order) already reaches top_p;
    the top token always stays. Exact: sorts only the top `candidates` tokens and falls back to a
    full sort for rows whose nucleus is larger than that (a full sort of 262k logits costs ~10 ms)."""
    probs = logits.softmax(-1)
    k = min(candidates, logits.shape[-1])
    top_probs, top_ids = torch.topk(probs, k, dim=-1)  # sorted, descending
    mass_before = top_probs.cumsum(-1) - top_probs
    if k < logits.shape[-1] and bool((mass_before[..., -1] + top_probs[..., -1] < top_p).any()):
        top_probs, top_ids = torch.sort(probs, dim=-1, descending=True)
        mass_before = top_probs.cumsum(-1) - top_probs
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, top_ids, mass_before < top_p)
    return logits.masked_fill(~keep, float("-inf"))


def check_distribution(probs: Tensor) -> None:
    """probs [..., V]: raise RowError unless every row is finite with positive mass."""
    mass = probs.sum(-1)
    if not bool(torch.isfinite(mass).all()) or bool((mass <= 0).any()):
        raise RowError("the model produced no valid probability distribution for this request's sampling "
                       "parameters (non-finite or all-zero probabilities)")


def sample(probs: Tensor, generator: torch.Generator | None) -> int:
    """One token from probs [V]."""
    return int(torch.multinomial(probs, 1, generator=generator))
