"""The CPU's sparse sampling path (each row's nucleus among its candidate tokens) against the dense
one: the same distributions, the same tokens from the same uniforms, the same verification results;
and it steps aside (dense) whenever a nucleus may reach beyond its candidates."""
import pytest
import torch

from engine.config import SamplingParams
from engine.rejection import block_sample, rejection_sample
from engine.sampling import Probs, SamplingTensors, batch_probs, step_probs

V = 65536  # above MAX_CANDIDATES, so a flat row cannot go sparse
MIXED = [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=1.2, top_k=40),
         SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=100, top_p=0.5),
         SamplingParams(temperature=1.0, top_p=0.95), SamplingParams(temperature=0.5, top_k=7)]


def peaked_logits(rows: int, seed: int) -> torch.Tensor:
    """Text-like rows: a few dozen likely tokens, a long tail (the nucleus is small)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, V, generator=g) * 2.0
    for r in range(rows):
        logits[r, torch.randperm(V, generator=g)[:60]] += torch.rand(60, generator=g) * 14
    return logits


def dense_of(p: Probs) -> torch.Tensor:
    if p.tokens is None:
        return p.values
    return torch.zeros(p.values.shape[0], V).scatter_(1, p.tokens.clamp(min=0), p.values * (p.tokens >= 0))


def test_sparse_distributions_equal_dense():
    logits = peaked_logits(4 * len(MIXED), seed=0)
    st = SamplingTensors.build(MIXED * 4, "cpu")
    dense = batch_probs(logits, st)
    p, bad = step_probs(logits.clone(), st)
    assert p.tokens is not None and p.values.shape[1] < V // 4  # took the sparse path
    assert not bad.any()
    assert torch.allclose(dense_of(p), dense, atol=1e-6, rtol=0)
    assert ((dense_of(p) > 0) == (dense > 0)).all()  # the same nucleus, token for token
    assert torch.allclose(p.values.sum(-1), torch.ones(len(p.values)), atol=1e-5)


def test_a_flat_nucleus_goes_dense_and_stays_exact():
    """Random-looking logits: top-p 0.9 keeps tens of thousands of tokens, beyond the candidates."""
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1)) * 0.1
    st = SamplingTensors.build([SamplingParams(temperature=1.0, top_p=0.9)] * 3, "cpu")
    p, bad = step_probs(logits.clone(), st)
    assert p.tokens is None and not bad.any()
    assert torch.allclose(p.values, batch_probs(logits, st), atol=1e-7)


def test_an_untruncated_row_makes_the_step_dense():
    logits = peaked_logits(2, seed=2)
    st = SamplingTensors.build([SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=1.0)], "cpu")
    assert step_probs(logits, st)[0].tokens is None


def test_non_finite_rows_are_reported_alone():
    logits = peaked_logits(4, seed=3)
    logits[1, 5] = float("nan")
    logits[2] = float("-inf")
    p, bad = step_probs(logits, SamplingTensors.build([SamplingParams(temperature=1.0, top_p=0.9)] * 4, "cpu"))
    assert bad.tolist() == [False, True, True, False]
    assert torch.isfinite(p.values).all()  # the step's tensor ops still run


@pytest.mark.parametrize("verify", [rejection_sample, block_sample])
@pytest.mark.parametrize("probabilistic_draft", [False, True])
def test_verification_gives_the_same_tokens_sparse_or_dense(verify, probabilistic_draft):
    """Same uniforms -> same accepted drafts and the same sampled token, 6 rows x 200 trials: a seeded
    request gives the same text whether its step went sparse or dense (its batch decides that)."""
    B, K = len(MIXED), 3
    logits = peaked_logits(B * (K + 1), seed=4)
    st = SamplingTensors.build(MIXED, "cpu", repeats=[K + 1] * B)
    dense = Probs(batch_probs(logits, st))
    sparse, _ = step_probs(logits.clone(), st)
    assert sparse.tokens is not None
    g = torch.Generator().manual_seed(5)
    q = None
    if probabilistic_draft:
        draft_logits = logits.view(B, K + 1, V)[:, :K].reshape(B * K, V) + torch.randn(B * K, V, generator=g)
        q = batch_probs(draft_logits, SamplingTensors.build(MIXED, "cpu", repeats=[K] * B))
    for _ in range(200):
        # drafts from the target's likely tokens (sometimes accepted) or anywhere (rejected)
        likely = dense.values.view(B, K + 1, V)[:, :K].reshape(B * K, V).multinomial(1, generator=g)[:, 0]
        drafts = torch.where(torch.rand(B * K, generator=g) < 0.7, likely, torch.randint(0, V, (B * K,), generator=g))
        uniforms, final = torch.rand(B, K, generator=g), torch.rand(B, generator=g)
        a = verify(dense, drafts, [K] * B, q, uniforms, final)
        b = verify(sparse, drafts, [K] * B, q, uniforms, final)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_a_rows_logprobs_do_not_depend_on_the_rows_beside_it():
    """processed_logprobs of a row alone (a 1-token step) and among others (a verify step): the
    same bits, as the logits are (vocabularies of 262k, 49k and an odd size)."""
    from engine.sampling import processed_logprobs

    for vocab in (262144, 49152, 1001):
        logits = torch.randn(9, vocab, generator=torch.Generator().manual_seed(vocab)) * 8
        params = [SamplingParams(temperature=0.0)] * 4 + [SamplingParams(temperature=0.7, top_p=0.9)] * 5
        together = processed_logprobs(logits.clone(), params)
        for i in range(9):
            alone = processed_logprobs(logits[i:i + 1].clone(), params[i:i + 1])
            assert torch.equal(alone[0], together[i]), f"vocab {vocab}, row {i}"
