"""Pure functions from logits to sampling distributions, for a whole step at once.

Every row carries its own parameters as tensors (vLLM's layout): one step mixes greedy and sampled
rows, temperatures, top-k and top-p in a few tensor ops, on the logits' device. Plain decoding,
drafting and verification all turn logits into probabilities here, so speculation cannot change the
output distribution.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.config import SamplingParams


@dataclass
class SamplingTensors:
    """Per-row parameters of N logit rows, on one device. top_k <= 0 and top_p >= 1 disable them."""

    temperature: Tensor  # [N] float; 0 = greedy
    top_k: Tensor  # [N] long
    top_p: Tensor  # [N] float
    max_top_k: int = 0  # known on the host, so no device read decides which ops run
    any_top_p: bool = False
    all_greedy: bool = False
    any_greedy: bool = False

    @classmethod
    def build(cls, params: list[SamplingParams], device, repeats: list[int] | None = None) -> "SamplingTensors":
        """One entry per row, or row b repeated repeats[b] times (one per position of a row)."""
        if repeats is not None:
            params = [p for p, r in zip(params, repeats) for _ in range(r)]
        top_k = [max(0, min(p.top_k, 1 << 30)) if not p.greedy else 0 for p in params]
        return cls(torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
                   torch.tensor(top_k, dtype=torch.long, device=device),
                   torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
                   max(top_k, default=0), any(p.top_p < 1.0 and not p.greedy for p in params),
                   all(p.greedy for p in params), any(p.greedy for p in params))


def mask_tokens(logits: Tensor, pairs: list[tuple[int, int]]) -> Tensor:
    """logits with logits[row, token] = -inf for each pair (EOS/stop tokens held back before min_tokens)."""
    if not pairs:
        return logits
    index = torch.tensor(pairs, dtype=torch.long, device=logits.device)
    logits = logits.clone()
    logits[index[:, 0], index[:, 1]] = float("-inf")
    return logits


def held_back_pairs(batch_sampling, first_positions: list[int], counts: list[int], offset: int = 0,
                    to_ids=lambda ids: list(ids)) -> list[tuple[int, int]]:
    """(flat position, token id) pairs to mask: EOS/stop ids at the positions of a row that come
    before min_tokens. Row b's positions are first_positions[b] + j, j < counts[b], which are step
    positions offset + j."""
    pairs = []
    for row, first, n in zip(batch_sampling, first_positions, counts):
        for j in range(max(0, min(n, row.hold_back_until - offset))):
            pairs.extend((first + j, t) for t in to_ids(row.held_back_ids))
    return pairs


def probs_from_logits(logits: Tensor, temperature: float, top_k: int = -1, top_p: float = 1.0) -> Tensor:
    """logits [N, V] -> probabilities [N, V], every row with the same parameters."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    return batch_probs(logits, SamplingTensors.build([params] * logits.shape[0], logits.device))


def batch_probs(logits: Tensor, st: SamplingTensors) -> Tensor:
    """logits [N, V] -> probabilities [N, V] after each row's temperature, top-k, top-p.

    Temperature 0 gives a one-hot at the argmax (greedy as a distribution). At 262k tokens a fresh
    [N, V] tensor costs more than the arithmetic on it (page faults on a CPU), so after the one
    allocation every step works in place, and each runs only where some row needs it.
    """
    vocab = logits.shape[-1]
    if st.all_greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    greedy = st.temperature == 0.0
    probs = logits / torch.where(greedy, 1.0, st.temperature)[:, None]  # the one allocation
    if 0 < st.max_top_k < vocab:
        use_k = (st.top_k > 0) & (st.top_k < vocab)
        kth = torch.topk(probs, st.max_top_k, dim=-1).values.gather(-1, (st.top_k.clamp(1, st.max_top_k) - 1)[:, None])
        probs.masked_fill_(use_k[:, None] & (probs < kth), float("-inf"))
    probs.sub_(probs.amax(-1, keepdim=True)).exp_()  # softmax, in place
    probs.div_(probs.sum(-1, keepdim=True))
    if st.any_top_p:  # renormalise the nucleus (the same as a softmax over the kept logits)
        probs.masked_fill_(probs < _top_p_threshold(probs, st.top_p)[:, None], 0.0)
        probs.div_(probs.sum(-1, keepdim=True))
    if st.any_greedy:
        rows = greedy.nonzero()[:, 0] if probs.device.type == "cpu" else torch.arange(len(greedy), device=probs.device)
        one_hot = torch.zeros(len(rows), vocab, dtype=probs.dtype, device=probs.device)
        one_hot.scatter_(-1, logits[rows].argmax(-1, keepdim=True), 1.0)
        probs[rows] = torch.where(greedy[rows, None], one_hot, probs[rows])
    return probs


def _top_p_threshold(probs: Tensor, top_p: Tensor, candidates: int = 1024) -> Tensor:
    """[N]: the smallest probability each row keeps. A token is kept unless the probability mass
    before it (in descending order) already reaches its row's top_p; the top token always stays;
    tokens tied with the last kept one stay too. Rows without top-p keep everything (0).

    Exact without sorting the vocabulary: sorts only the top `candidates` tokens, then 16x more,
    then everything, for rows whose nucleus is larger (a full sort of 262k probabilities costs
    ~10 ms per row on a CPU; on an accelerator it is cheap and checking the candidates would cost
    a host read, so it sorts everything at once)."""
    vocab = probs.shape[-1]
    threshold = torch.zeros(probs.shape[0], dtype=probs.dtype, device=probs.device)
    cpu = probs.device.type == "cpu"
    sizes = [min(c, vocab) for c in (candidates, 16 * candidates)] + [vocab] if cpu else [vocab]
    rows = torch.arange(probs.shape[0], device=probs.device)
    if cpu:
        rows = rows[top_p < 1.0]
    for k in dict.fromkeys(sizes):  # in order, without repeats
        if rows.numel() == 0:
            break
        top = torch.topk(probs if len(rows) == len(probs) else probs[rows], k, dim=-1).values  # descending
        mass_before = top.cumsum(-1) - top
        limit = top_p[rows, None]
        covered = (mass_before[:, -1:] + top[:, -1:] >= limit)[:, 0] | (k == vocab)
        kept = (mass_before < limit).sum(-1).clamp_(min=1)  # how many of the top tokens stay
        cut = top.gather(1, (kept - 1)[:, None])[:, 0]
        threshold[rows[covered]] = torch.where(top_p[rows[covered]] < 1.0, cut[covered], 0.0)
        rows = rows[~covered]
    return threshold


def invalid_rows(probs: Tensor) -> Tensor:
    """[N] bool: rows that are not a distribution (non-finite, or no mass)."""
    mass = probs.sum(-1)
    return ~torch.isfinite(mass) | (mass <= 0)


INVALID_DISTRIBUTION = ("the model produced no valid probability distribution for this request's sampling "
                        "parameters (non-finite or all-zero probabilities)")


def sample_inverse_cdf(probs: Tensor, uniforms: Tensor) -> Tensor:
    """One token per row from probs [N, V] (unnormalised is fine) and one uniform [N] in [0, 1) each:
    the first token whose cumulative mass passes u * total. One random number per row instead of V
    (an exponential race draws 262k per row for Gemma); no host read. A one-hot row gives its token
    whatever u is, so greedy rows pass u = 0."""
    cdf = probs.cumsum(-1)
    target = (uniforms * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)

