"""Sampling with speculation is lossless: the distribution of the first two generated tokens
equals the target's own (chi-squared, fixed seeds, ALPHA in stats.py).

Target and draft are two different random tiny models (vocab 48).
"""
import pytest

from engine import LLM, SamplingParams
from stats import ALPHA, chi_squared_pvalue, exact_first_two

TARGET, DRAFT = "random:tiny-llama:1", "random:tiny-llama:2"
PROMPT = "the cat"
N = 4000


@pytest.fixture(scope="module")
def plain():
    return LLM(model=TARGET, max_num_seqs=64)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("draft_sample_method", ["greedy", "probabilistic"])
@pytest.mark.parametrize("method", ["standard", "block"])
def test_first_two_tokens_follow_target(plain, temperature, draft_sample_method, method):
    llm = LLM(model=TARGET, max_num_seqs=64, seed=1,
              speculative_config={"model": DRAFT, "num_speculative_tokens": 3,
                                  "draft_sample_method": draft_sample_method, "rejection_sample_method": method})
    params = [SamplingParams(temperature=temperature, max_tokens=2, ignore_eos=True, seed=s) for s in range(N)]
    outs = llm.generate([PROMPT] * N, params)
    first = [o.outputs[0].token_ids[0] for o in outs]
    second = [o.outputs[0].token_ids[1] for o in outs]
    p1, p2 = exact_first_two(plain, plain.get_tokenizer().encode(PROMPT), temperature)
    assert chi_squared_pvalue(first, p1) > ALPHA
    assert chi_squared_pvalue(second, p2) > ALPHA
    stats = llm.spec_decode_stats
    assert 0.0 < stats.acceptance_rate < 1.0  # both branches (accept, recover) were exercised


def test_a_draft_head_of_frequent_tokens_stays_lossless(plain):
    """FR-Spec: the draft samples from 20 of its 48 tokens (q renormalised over them); the target's
    distribution still comes out, including the tokens the draft can never propose."""
    llm = LLM(model=TARGET, max_num_seqs=64, seed=1,
              speculative_config={"model": DRAFT, "num_speculative_tokens": 3, "draft_head_tokens": 20,
                                  "draft_sample_method": "probabilistic"})
    params = [SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True, seed=s) for s in range(N)]
    outs = llm.generate([PROMPT] * N, params)
    p1, p2 = exact_first_two(plain, plain.get_tokenizer().encode(PROMPT), 1.0)
    assert chi_squared_pvalue([o.outputs[0].token_ids[0] for o in outs], p1) > ALPHA
    assert chi_squared_pvalue([o.outputs[0].token_ids[1] for o in outs], p2) > ALPHA
    assert 0.0 < llm.spec_decode_stats.acceptance_rate < 1.0


def test_chi_squared_detects_a_wrong_distribution(plain):
    """Guard: the same check rejects samples from the draft model instead of the target."""
    draft = LLM(model=DRAFT, max_num_seqs=64)
    params = [SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True, seed=s) for s in range(N)]
    first = [o.outputs[0].token_ids[0] for o in draft.generate([PROMPT] * N, params)]
    p1, _ = exact_first_two(plain, plain.get_tokenizer().encode(PROMPT), 1.0)
    assert chi_squared_pvalue(first, p1) < ALPHA
