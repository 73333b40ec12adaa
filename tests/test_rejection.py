"""The verification functions alone: greedy, standard (lossless), synthetic."""
import numpy as np
import pytest
import torch

from engine.rejection import (ahead_block_continues, block_sample, recovered_distribution, rejection_sample,
                              synthetic_sample, verify_greedy, verify_standard, verify_synthetic)
from engine.sampling import probs_from_logits
from stats import ALPHA, chi_squared_pvalue

V = 12


def dist(seed, temp=1.0):
    g = torch.Generator().manual_seed(seed)
    return probs_from_logits(torch.randn(1, V, generator=g) * 2, temp)[0]


def _rows(sample, p: torch.Tensor, drafts: torch.Tensor, extra, gen: torch.Generator):
    """One batched step of n identical rows: target distributions p [k+1, V] for every row, drafts
    [n, k], `extra` the draft distributions [k, V] (or None, or synthetic rates)."""
    n, k = drafts.shape
    if isinstance(extra, torch.Tensor) and extra.dim() == 2:
        extra = extra.repeat(n, 1)
    tokens, accepted = sample(p.repeat(n, 1), drafts.reshape(-1), [k] * n, extra,
                              torch.rand(n, max(k, 1), generator=gen), torch.rand(n, generator=gen))
    return tokens, accepted


def test_greedy_accepts_matching_prefix_then_argmax():
    logits = torch.full((4, V), -1.0)
    for pos, best in enumerate([3, 5, 7, 9]):
        logits[pos, best] = 1.0
    assert verify_greedy(logits, [3, 5, 7]) == [3, 5, 7, 9]  # all accepted + bonus
    assert verify_greedy(logits, [3, 4, 7]) == [3, 5]  # stop at first mismatch, take the argmax
    assert verify_greedy(logits[:1], []) == [3]  # plain decoding


def test_standard_single_draft_output_is_target_distribution():
    """With any q, the first emitted token is distributed as p (accepted draft or recovered)."""
    p, q = dist(1), dist(2)
    gen = torch.Generator().manual_seed(0)
    draws = torch.multinomial(q, 20000, replacement=True, generator=torch.Generator().manual_seed(1))
    tokens, _ = _rows(rejection_sample, torch.stack([p, p]), draws[:, None], q[None], gen)
    assert chi_squared_pvalue(tokens[:, 0].tolist(), p.numpy()) > ALPHA


def test_standard_would_fail_if_recovered_came_from_p():
    """The same experiment with recovery from p (a common bug) is detectably biased."""
    p, q = dist(1), dist(2)
    gen = torch.Generator().manual_seed(0)
    draws = torch.multinomial(q, 20000, replacement=True, generator=torch.Generator().manual_seed(1)).tolist()
    wrong = []
    for d in draws:
        if float(torch.rand((), generator=gen)) * float(q[d]) < float(p[d]):
            wrong.append(d)
        else:
            wrong.append(int(torch.multinomial(p, 1, generator=gen)))
    assert chi_squared_pvalue(wrong, p.numpy()) < ALPHA


def test_recovered_distribution_is_normalised_residual():
    p, q = dist(3), dist(4)
    r = recovered_distribution(p, q, draft=0)
    expected = (p - q).clamp(min=0)
    assert torch.allclose(r, expected / expected.sum())
    one_hot = recovered_distribution(p, None, draft=5)
    assert one_hot[5] == 0 and torch.isclose(one_hot.sum(), torch.tensor(1.0))
    assert torch.allclose(one_hot[:5], p[:5] / (1 - p[5]))


def test_standard_greedy_drafter_treats_q_as_one_hot():
    """q=None (greedy drafting): the draft is accepted with probability p(d)."""
    p = dist(5)
    d = int(p.argmax())
    gen = torch.Generator().manual_seed(7)
    n = 20000
    _, accepted = _rows(rejection_sample, torch.stack([p, p]), torch.full((n, 1), d), None, gen)
    rate = float(accepted.float().mean())
    assert abs(rate - float(p[d])) < 4 * (float(p[d]) * (1 - float(p[d])) / n) ** 0.5


def test_standard_bonus_token_from_last_position():
    p0 = torch.zeros(V); p0[2] = 1.0
    p1 = dist(6)
    gen = torch.Generator().manual_seed(0)
    tokens, accepted = _rows(rejection_sample, torch.stack([p0, p1]), torch.full((20000, 1), 2), None, gen)
    assert bool((accepted == 1).all())  # p0 is one-hot at the draft: always accepted, then the bonus
    assert chi_squared_pvalue(tokens[:, 1].tolist(), p1.numpy()) > ALPHA


def test_synthetic_acceptance_rates_are_unconditional():
    """vLLM's semantics: rates[i] = P(the first i+1 drafts are all accepted); accepted drafts are emitted."""
    p = dist(8)
    gen = torch.Generator().manual_seed(0)
    rates = [0.8, 0.5, 0.5]
    drafts = torch.tensor([0, 1, 2]).repeat(20000, 1)
    tokens, accepted = _rows(synthetic_sample, torch.stack([p] * 4), drafts, torch.tensor(rates), gen)
    counts = np.bincount(accepted.numpy(), minlength=4) / len(accepted)
    expected = np.array([0.2, 0.3, 0.0, 0.5])
    assert np.abs(counts - expected).max() < 0.02  # 20000 draws: 4 sigma is < 0.015
    emitted = torch.arange(3)[None, :] < accepted[:, None]
    assert bool((tokens[:, :3][emitted] == drafts[emitted]).all())
    # the one-row wrapper the engine's references use draws from the same function
    outs = [verify_synthetic(torch.stack([p] * 4), [0, 1, 2], rates, gen) for _ in range(200)]
    assert all(o[:-1] == [0, 1, 2][: len(o) - 1] for o in outs)


def test_seeded_verification_is_reproducible():
    p, q = dist(9), dist(10)
    run = lambda: [verify_standard(torch.stack([p, p, p]), [1, 2], torch.stack([q, q]),  # noqa: E731
                                   torch.Generator().manual_seed(s)) for s in range(50)]
    assert run() == run()


def test_top_k_top_p_temperature():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    assert probs_from_logits(logits, 1.0, top_k=2)[0, 2:].sum() == 0
    p = probs_from_logits(logits, 1.0, top_p=0.7)[0]
    full = logits.softmax(-1)[0]
    assert p[0] > 0 and p[1] > 0 and p[2:].sum() == 0 and full[0] < 0.7
    greedy = probs_from_logits(logits, 0.0)[0]
    assert greedy.tolist() == [1.0, 0.0, 0.0, 0.0]
    sharp = probs_from_logits(logits, 0.5)[0]
    assert sharp[0] > full[0]


def _tree(seed: int, vocab: int, depth: int) -> list[torch.Tensor]:
    """A distribution for every prefix up to `depth` tokens, a model small enough to enumerate:
    tree[n][code] is the distribution after the n-token prefix whose base-`vocab` digits are `code`."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(vocab ** n, vocab, generator=gen) * 1.5).softmax(-1) for n in range(depth + 1)]


def _first_two(sample, k: int, n: int = 30000, vocab: int = 4):
    """Run the batched `sample` on n rows of k drafts sampled from the draft tree, in one step; return
    the p-value of the first two output tokens (completed from the target when only one came out)
    against the target's joint distribution, and the mean accepted length."""
    P, Q = _tree(1, vocab, k + 1), _tree(2, vocab, k)
    gen = torch.Generator().manual_seed(0)
    drafts = torch.zeros(n, k, dtype=torch.long)
    codes = [torch.zeros(n, dtype=torch.long)]  # codes[j]: each row's first j drafts as one number
    for j in range(k):
        drafts[:, j] = torch.multinomial(Q[j][codes[j]], 1, generator=gen)[:, 0]
        codes.append(codes[j] * vocab + drafts[:, j])
    p = torch.stack([P[j][codes[j]] for j in range(k + 1)], 1).reshape(n * (k + 1), vocab)
    q = torch.stack([Q[j][codes[j]] for j in range(k)], 1).reshape(n * k, vocab)
    uniforms, final = torch.rand(n, k, generator=gen), torch.rand(n, generator=gen)
    tokens, accepted = sample(p, drafts.reshape(-1), [k] * n, q, uniforms, final)
    first = tokens[:, 0]
    second = torch.where(accepted > 0, tokens[:, 1], torch.multinomial(P[1][first], 1, generator=gen)[:, 0])
    exact = (P[0][0][:, None] * P[1]).reshape(-1).numpy()  # P(a) P(b | a), cell a * vocab + b
    return chi_squared_pvalue((first * vocab + second).tolist(), exact), float(accepted.float().mean())


@pytest.mark.parametrize("k", [2, 3])
def test_block_verification_is_lossless_and_accepts_more(k):
    """The joint distribution of the first two tokens equals the target's (16 cells), and block
    verification accepts at least as many drafts as token-by-token verification on the same trees."""
    p_block, acc_block = _first_two(block_sample, k)
    p_std, acc_std = _first_two(rejection_sample, k)
    assert p_block > ALPHA and p_std > ALPHA
    assert acc_block >= acc_std


def test_a_draft_ahead_block_goes_on_only_from_the_token_it_was_drafted_from():
    """Real acceptance: the block continues when the target's bonus token is its first proposal.
    Synthetic (vLLM's unconditional rates): the block's first proposal is accepted as a draft at
    position k + 1 would be, rates[k] / rates[k - 1], the schedule's last ratio past its end."""
    assert ahead_block_continues(7, 7, 3, None, 0.0)
    assert not ahead_block_continues(7, 8, 3, None, 0.0)
    rates = [1.0, 1.0, 0.5, 0.0]  # mean acceptance length 3.5 at K=4
    assert ahead_block_continues(1, 2, 1, rates, 0.999)  # position 2: 1.0 / 1.0
    assert ahead_block_continues(1, 2, 2, rates, 0.49) and not ahead_block_continues(1, 2, 2, rates, 0.51)
    assert not ahead_block_continues(1, 2, 3, rates, 0.0)  # 0.0 / 0.5
    assert not ahead_block_continues(1, 2, 4, rates, 0.0)  # past the end: 0.0 / 0.5
    assert ahead_block_continues(1, 2, 2, [1.0, 0.8], 0.79) and not ahead_block_continues(1, 2, 2, [1.0, 0.8], 0.81)
