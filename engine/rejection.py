"""Verification of draft tokens: pure functions, one sequence at a time.

Each takes the target's distributions at the k+1 verified positions (p[i] is the target's
distribution for the token after draft i-1; p[0] follows the last committed token) and returns
the tokens to append: the accepted drafts, then one token from the target (recovered or bonus).
So every call yields between 1 and k+1 tokens.
"""
from __future__ import annotations

import torch
from torch import Tensor

from engine.sampling import sample


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator))


def verify_greedy(target_logits: Tensor, drafts: list[int]) -> list[int]:
    """target_logits [k+1, V]: accept while the draft equals the target's argmax, then the argmax."""
    best = target_logits.argmax(-1).tolist()
    out = []
    for i, d in enumerate(drafts):
        if d != best[i]:
            break
        out.append(d)
    out.append(best[len(out)])
    return out


def verify_standard(p: Tensor, drafts: list[int], q: Tensor | None,
                    generator: torch.Generator | None) -> list[int]:
    """Lossless rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

    p [k+1, V] target probabilities; q [k, V] draft probabilities, or None for a greedy drafter
    (q is then one-hot at the draft). Draft i is accepted with probability min(1, p(d)/q(d)); at the
    first rejection the token comes from normalise(max(0, p - q)); after k accepts, a bonus from p[k].
    """
    out = []
    for i, d in enumerate(drafts):
        p_d = float(p[i, d])
        q_d = 1.0 if q is None else float(q[i, d])
        if _uniform(generator) * q_d < p_d:
            out.append(d)
            continue
        out.append(sample(recovered_distribution(p[i], q[i] if q is not None else None, d), generator))
        return out
    out.append(sample(p[len(drafts)], generator))
    return out


def recovered_distribution(p: Tensor, q: Tensor | None, draft: int) -> Tensor:
    """normalise(max(0, p - q)) for one position; q None means one-hot at `draft`."""
    if q is None:
        residual = p.clone()
        residual[draft] = 0.0
    else:
        residual = (p - q).clamp_(min=0.0)
    total = float(residual.sum())
    # p == q leaves nothing to recover; a rejection then has probability 0, so any choice is exact
    return residual / total if total > 0.0 else p


def verify_block(p: Tensor, drafts: list[int], q: Tensor | None,
                 generator: torch.Generator | None) -> list[int]:
    """Block verification (Sun et al. 2024, arXiv 2403.10444): judges the draft block as a whole
    instead of token by token. Lossless like `verify_standard`, and accepts at least as many tokens
    in expectation.

    w_i = min(1, w_{i-1} p(X_i) / q(X_i)) is how much of the prefix X^i the target still supports;
    position i is kept as the end of the accepted prefix with probability
    h_i = r_i / (r_i + 1 - w_i), r_i = sum_x max(0, w_i p_i(x) - q_i(x)) (h_k = w_k), and the
    accepted length is the last such i. The next token comes from normalise(max(0, w_t p_t - q_t))
    at the accepted length t, or from p_k when the whole block is accepted.
    """
    k = len(drafts)
    if q is None:  # greedy drafter: each draft distribution is one-hot at its draft
        q = torch.zeros(k, p.shape[-1], dtype=p.dtype)
        q[torch.arange(k), torch.tensor(drafts, dtype=torch.long)] = 1.0
    weights = [1.0]
    accepted = 0
    for i in range(1, k + 1):
        d = drafts[i - 1]
        q_d = float(q[i - 1, d])
        w = min(1.0, weights[-1] * float(p[i - 1, d]) / q_d) if q_d > 0 else 0.0
        weights.append(w)
        if i < k:
            r = float((w * p[i] - q[i]).clamp_(min=0.0).sum())
            h = r / (r + 1.0 - w) if r > 0.0 else 0.0
        else:
            h = w
        if _uniform(generator) < h:
            accepted = i
    out = list(drafts[:accepted])
    if accepted == k:
        out.append(sample(p[k], generator))
        return out
    residual = (weights[accepted] * p[accepted] - q[accepted]).clamp_(min=0.0)
    total = float(residual.sum())
    out.append(sample(residual / total if total > 0.0 else p[accepted], generator))
    return out


def verify_synthetic(p: Tensor, drafts: list[int], rates: list[float],
                     generator: torch.Generator | None) -> list[int]:
    """Benchmark mode: accept position i with conditional probability rates[i], whatever the tokens.

    Emitted tokens are sampled from the target at each position (not the drafts), so the text stays
    the target's kind of text, but the distribution is NOT exact. Never use outside benchmarks.
    """
    out = []
    for i in range(len(drafts)):
        if _uniform(generator) >= rates[i]:
            break
        out.append(sample(p[i], generator))
    out.append(sample(p[len(out)], generator))
    return out
