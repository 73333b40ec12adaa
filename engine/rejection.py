"""Verification of draft tokens for a whole step: pure tensor functions, no host reads.

Layout (vLLM's): the step's drafts are flat, `drafts` [num_draft_tokens] with row b owning
`num_drafts[b]` of them in order; the target's distributions are flat too, `p`
[num_draft_tokens + B, V], row b owning k_b + 1 positions (p[i] is the target's distribution for the
token after draft i-1; the last follows all k_b drafts: the bonus position), dense or sparse
(`sampling.Probs`: a CPU step's nuclei, so nothing here reads the whole vocabulary). `q`
[num_draft_tokens, V] holds the draft distributions, or None for a greedy drafter (q one-hot at each
draft). Randomness comes in as tensors drawn from each request's own generator: `uniforms` [B, K]
for the acceptance tests and `final` [B] for the one token each row samples (recovered or bonus:
exactly one per row), so a seeded request draws the same numbers whatever shares its step.

Each function returns tokens [B, K+1] (the accepted drafts, then one target token; -1 after a row's
end) and num_accepted [B]. Greedy rows are one-hot p with uniforms 0: they accept exactly while
the draft is the target's argmax and then emit the argmax.
"""
from __future__ import annotations

import torch
from torch import Tensor

from engine.sampling import Probs


class _Layout:
    """Index tensors for the padded [B, K] view of a flat step."""

    def __init__(self, p: Probs, drafts: Tensor, num_drafts: list[int]):
        dev = p.values.device
        self.B, self.K = len(num_drafts), max(num_drafts, default=0)
        self.k = torch.tensor(num_drafts, dtype=torch.long, device=dev)  # [B]
        self.p_start = torch.cumsum(self.k + 1, 0) - (self.k + 1)  # [B] row b's first position in p
        steps = torch.arange(self.K + 1, device=dev)
        self.pos = self.p_start[:, None] + torch.minimum(steps[None, :], self.k[:, None])  # [B, K+1]
        self.valid = steps[None, : self.K] < self.k[:, None]  # [B, K] drafts that exist
        d_start = torch.cumsum(self.k, 0) - self.k
        last = max(drafts.numel() - 1, 0)
        self.d_idx = (d_start[:, None] + steps[None, : self.K]).clamp(max=last)  # [B, K] index into drafts
        self.drafts = torch.where(self.valid, drafts[self.d_idx], 0) if drafts.numel() else \
            torch.zeros(self.B, self.K, dtype=torch.long, device=dev)

    def q_on(self, rows: Probs, q: Tensor | None, at: Tensor) -> Tensor:
        """Each row's draft distribution at draft position at[b], read on `rows`' tokens (one-hot without q)."""
        if q is not None:
            return rows.read(q[self.d_idx.gather(1, at[:, None]).squeeze(1)])
        return rows.one_hot(self.drafts.gather(1, at[:, None]).squeeze(1))

    def finish(self, accepted: Tensor, last: Tensor) -> tuple[Tensor, Tensor]:
        tokens = torch.cat([self.drafts, self.drafts.new_zeros(self.B, 1)], 1)
        tokens = tokens.scatter(1, accepted[:, None], last[:, None])
        beyond = torch.arange(self.K + 1, device=tokens.device)[None, :] > accepted[:, None]
        return tokens.masked_fill(beyond, -1), accepted


def _draft_probs(layout: _Layout, p: Probs, q: Tensor | None) -> tuple[Tensor, Tensor]:
    """p(d_i) and q(d_i) for every draft, [B, K] each."""
    p_d = p.prob_of(layout.pos[:, : layout.K], layout.drafts)
    q_d = torch.ones_like(p_d) if q is None else q[layout.d_idx, layout.drafts]
    return p_d, q_d


def _final(layout: _Layout, p: Probs, q: Tensor | None, accepted: Tensor, final: Tensor,
           weight: Tensor | None = None) -> Tensor:
    """Each row's one sampled token: from normalise(max(0, w p - q)) at its first rejection, or
    from p at its bonus position. p == q leaves nothing to recover; a rejection then has
    probability 0, so any choice is exact."""
    rows = p.rows(layout.pos.gather(1, accepted[:, None]).squeeze(1))  # [B, C], a copy
    rejected = accepted < layout.k
    if q is None:
        # q one-hot at the draft d: max(0, w p - q) is w p without d (w p(d) <= 1), so the row's own
        # values with d zeroed, in place: no [B, V] temporaries on the dense path
        draft = layout.drafts.gather(1, accepted.clamp(max=layout.K - 1)[:, None])  # [B, 1]
        if rows.tokens is None:
            column, present = draft, torch.ones_like(draft, dtype=torch.bool)
        else:  # a sparse row may not hold the draft (then p(d) = 0: nothing to drop)
            match = rows.tokens == draft
            column, present = match.long().argmax(-1, keepdim=True), match.any(-1, keepdim=True)
        p_draft = rows.values.gather(1, column)
        rest = rows.values.sum(-1, keepdim=True) - p_draft * present
        drop = rejected[:, None] & present & (rest > 0)
        if weight is not None:
            drop &= weight[:, None] > 0
        rows.values.scatter_(1, column, torch.where(drop, 0.0, p_draft))
        return rows.sample(final)
    scaled = rows.values if weight is None else weight[:, None] * rows.values
    residual = (scaled - layout.q_on(rows, q, accepted.clamp(max=layout.K - 1))).clamp_(min=0.0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, rows.values)
    return rows.sample(final, torch.where(rejected[:, None], residual, rows.values))


def _as_probs(p: Tensor | Probs) -> Probs:
    return p if isinstance(p, Probs) else Probs(p)


def rejection_sample(p: Probs | Tensor, drafts: Tensor, num_drafts: list[int], q: Tensor | None,
                     uniforms: Tensor, final: Tensor) -> tuple[Tensor, Tensor]:
    """Lossless rejection sampling (Leviathan et al. 2023; Chen et al. 2023): draft i is accepted
    with probability min(1, p(d)/q(d)); at the first rejection the token comes from
    normalise(max(0, p - q)); after all k_b accepts, a bonus token from the last position."""
    p = _as_probs(p)
    L = _Layout(p, drafts, num_drafts)
    if L.K == 0:
        return L.finish(torch.zeros(L.B, dtype=torch.long, device=L.k.device), p.rows(L.p_start).sample(final))
    p_d, q_d = _draft_probs(L, p, q)
    ok = L.valid & (uniforms[:, : L.K] * q_d < p_d)
    accepted = ok.long().cumprod(1).sum(1)  # [B] accepted before the first rejection
    return L.finish(accepted, _final(L, p, q, accepted, final))


def block_sample(p: Probs | Tensor, drafts: Tensor, num_drafts: list[int], q: Tensor | None,
                 uniforms: Tensor, final: Tensor) -> tuple[Tensor, Tensor]:
    """Block verification (Sun et al. 2024, arXiv 2403.10444): judges the draft block as a whole
    instead of token by token. Lossless like `rejection_sample`, and accepts at least as many tokens
    in expectation.

    w_i = min(1, w_{i-1} p(X_i) / q(X_i)) is how much of the prefix X^i the target still supports;
    position i is kept as the end of the accepted prefix with probability
    h_i = r_i / (r_i + 1 - w_i), r_i = sum_x max(0, w_i p_i(x) - q_i(x)) (h_k = w_k), and the
    accepted length is the last such i. The next token comes from normalise(max(0, w_t p_t - q_t))
    at the accepted length t, or from p_k when the whole block is accepted.
    """
    p = _as_probs(p)
    L = _Layout(p, drafts, num_drafts)
    if L.K == 0:
        return rejection_sample(p, drafts, num_drafts, q, uniforms, final)
    dev = L.k.device
    p_d, q_d = _draft_probs(L, p, q)
    ratio = torch.where(q_d > 0, p_d / q_d.clamp(min=1e-30), 0.0)
    w = torch.ones(L.B, dtype=p_d.dtype, device=dev)
    weights = [w]
    accepted = torch.zeros(L.B, dtype=torch.long, device=dev)
    for i in range(1, L.K + 1):  # over positions, each a batched op: K is small
        w = torch.minimum(torch.ones_like(w), w * ratio[:, i - 1])
        weights.append(w)
        at_end = L.k == i
        if i < L.K:
            rows = p.rows(L.pos[:, i])
            at = torch.full((L.B,), i, dtype=torch.long, device=dev)
            r = (w[:, None] * rows.values - L.q_on(rows, q, at)).clamp_(min=0.0).sum(-1)
            h = torch.where(r > 0, r / (r + 1.0 - w), 0.0)
            h = torch.where(at_end, w, h)
        else:
            h = w
        keep = L.valid[:, i - 1] & (uniforms[:, i - 1] < h)
        accepted = torch.where(keep, i, accepted)
    w_t = torch.stack(weights, 1).gather(1, accepted[:, None])[:, 0]
    return L.finish(accepted, _final(L, p, q, accepted, final, weight=w_t))


def synthetic_sample(p: Probs | Tensor, drafts: Tensor, num_drafts: list[int], rates: Tensor,
                     uniforms: Tensor, final: Tensor) -> tuple[Tensor, Tensor]:
    """Benchmark mode, vLLM's semantics: rates [K] are unconditional, rates[i] = P(the first i+1 drafts
    are all accepted), whatever the tokens and the temperature. One uniform per row decides how many:
    accepted = #{i < k_b: u < rates[i]}. The accepted drafts are emitted as drafted, then one target
    token. NOT lossless: never outside benchmarks."""
    p = _as_probs(p)
    L = _Layout(p, drafts, num_drafts)
    if L.K == 0:
        return rejection_sample(p, drafts, num_drafts, None, uniforms, final)
    accepted = (L.valid & (uniforms[:, :1] < rates[None, : L.K].to(L.k.device))).long().sum(1)
    return L.finish(accepted, p.rows(L.pos.gather(1, accepted[:, None]).squeeze(1)).sample(final))


def ahead_block_continues(bonus: int, first: int, k: int, rates: list[float] | None, uniform: float) -> bool:
    """Whether a draft-ahead block, proposed from the last draft before the round was verified, goes on
    from the round's last token: when all k drafts were accepted and the target's bonus token is the
    block's first proposal. Synthetic acceptance (`rates`, benchmarks) has no tokens to compare: the
    block's first proposal is accepted as a draft at position k + 1 would be, with probability
    rates[k] / rates[k - 1] (past the schedule's end, its last conditional rate), decided by `uniform`."""
    if rates is None:
        return bonus == first
    if k < len(rates) and rates[k - 1] > 0:
        p = rates[k] / rates[k - 1]
    else:
        p = rates[-1] / rates[-2] if len(rates) > 1 and rates[-2] > 0 else rates[0]
    return uniform < p


def verify_greedy(target_logits: Tensor, drafts: list[int]) -> list[int]:
    """target_logits [k+1, V]: accept while the draft equals the target's argmax, then the argmax
    (the reference the batched path must equal for greedy rows)."""
    best = target_logits.argmax(-1).tolist()
    out = []
    for i, d in enumerate(drafts):
        if d != best[i]:
            break
        out.append(d)
    out.append(best[len(out)])
    return out


# -- one row, for tests and references: the batched functions with B = 1 ----------------------------

def _one_row(fn, p: Tensor, drafts: list[int], extra, generator: torch.Generator | None) -> list[int]:
    k = len(drafts)
    uniforms = torch.rand(1, max(k, 1), generator=generator)
    final = torch.rand(1, generator=generator)
    tokens, accepted = fn(p, torch.tensor(drafts, dtype=torch.long), [k], extra, uniforms, final)
    return tokens[0, : int(accepted[0]) + 1].tolist()


def verify_standard(p: Tensor, drafts: list[int], q: Tensor | None, generator: torch.Generator | None) -> list[int]:
    return _one_row(rejection_sample, p, drafts, q, generator)


def verify_block(p: Tensor, drafts: list[int], q: Tensor | None, generator: torch.Generator | None) -> list[int]:
    return _one_row(block_sample, p, drafts, q, generator)


def verify_synthetic(p: Tensor, drafts: list[int], rates: list[float], generator: torch.Generator | None) -> list[int]:
    return _one_row(synthetic_sample, p, drafts, torch.tensor(rates, dtype=p.dtype), generator)


def recovered_distribution(p: Tensor, q: Tensor | None, draft: int) -> Tensor:
    """normalise(max(0, p - q)) for one position; q None means one-hot at `draft` (a reference)."""
    if q is None:
        residual = p.clone()
        residual[draft] = 0.0
    else:
        residual = (p - q).clamp(min=0.0)
    total = float(residual.sum())
    return residual / total if total > 0.0 else p
