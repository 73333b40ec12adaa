"""Sampling and verification for a whole step at once: rows with different parameters share a step
and each still gets exactly its own distribution; a seeded request's output does not depend on what
shares its batch; synthetic acceptance follows vLLM's definition, measured through the engine."""
import numpy as np
import pytest

from engine import LLM, SamplingParams
from stats import ALPHA, chi_squared_pvalue, exact_first_two

TARGET, DRAFT = "random:tiny-llama:1", "random:tiny-llama:2"
PROMPT = "the cat"
N = 4000
MIXED = [dict(temperature=1.0), dict(temperature=0.6, top_p=0.8), dict(temperature=1.3, top_k=5)]
# every row truncates: the CPU's sparse path (engine/sampling.py step_probs)
TRUNCATED = [dict(temperature=0.6, top_p=0.8), dict(temperature=1.3, top_k=5),
             dict(temperature=1.0, top_k=20, top_p=0.9)]


@pytest.fixture(scope="module")
def plain():
    return LLM(model=TARGET, max_num_seqs=64)


@pytest.mark.parametrize("draft_sample_method, method", [("greedy", "standard"), ("probabilistic", "standard"),
                                                         ("probabilistic", "block")])
def test_mixed_parameters_in_one_step_are_each_lossless(plain, draft_sample_method, method):
    """Rows of three sampling settings and greedy rows interleaved, 64 to a step: each setting's first
    two tokens follow the target's distribution for that setting; greedy rows give the greedy text."""
    check_mixed_batch(plain, draft_sample_method, method, MIXED)


@pytest.mark.parametrize("draft_sample_method, method", [("greedy", "standard"), ("probabilistic", "block")])
def test_truncated_rows_in_one_step_are_each_lossless(plain, draft_sample_method, method):
    """The same with every row truncated (top-p, top-k, greedy): the sparse path on a CPU."""
    check_mixed_batch(plain, draft_sample_method, method, TRUNCATED)


def check_mixed_batch(plain, draft_sample_method, method, settings):
    llm = LLM(model=TARGET, max_num_seqs=64, seed=3,
              speculative_config={"model": DRAFT, "num_speculative_tokens": 3,
                                  "draft_sample_method": draft_sample_method, "rejection_sample_method": method})
    kinds = [i % (len(settings) + 1) for i in range(N)]  # the last kind is greedy
    params = [SamplingParams(**(settings[k] if k < len(settings) else dict(temperature=0.0)), max_tokens=2,
                             ignore_eos=True, seed=s) for s, k in enumerate(kinds)]
    outs = [o.outputs[0].token_ids for o in llm.generate([PROMPT] * N, params)]
    ids = plain.get_tokenizer().encode(PROMPT)
    for k, kw in enumerate(settings):
        rows = [o for o, kind in zip(outs, kinds) if kind == k]
        p1, p2 = exact_first_two(plain, ids, kw["temperature"], kw.get("top_p", 1.0), kw.get("top_k", -1))
        assert chi_squared_pvalue([r[0] for r in rows], p1) > ALPHA, kw
        assert chi_squared_pvalue([r[1] for r in rows], p2) > ALPHA, kw
    greedy = plain.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0]
    assert {tuple(o) for o, kind in zip(outs, kinds) if kind == len(settings)} == {tuple(greedy.outputs[0].token_ids)}


@pytest.mark.parametrize("spec", [{"draft_sample_method": "greedy"}, {"draft_sample_method": "probabilistic"},
                                  {"draft_sample_method": "probabilistic", "rejection_sample_method": "block"}])
def test_seeded_request_is_the_same_alone_and_in_a_mixed_batch(spec):
    llm = LLM(model=TARGET, max_num_seqs=8, seed=5,
              speculative_config={"model": DRAFT, "num_speculative_tokens": 3, **spec})
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=40, ignore_eos=True, seed=1234)
    alone = llm.generate("hello world", seeded)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=1.5, top_k=3, max_tokens=50, ignore_eos=True),
              SamplingParams(temperature=0.7, max_tokens=20, ignore_eos=True, seed=9)]
    outs = llm.generate(["zebra", "numbers 1 2", "hello world", "a b c"], [others[0], others[1], seeded, others[2]])
    assert outs[2].outputs[0].token_ids == alone
    again = llm.generate(["a", "hello world"], [others[1], seeded])[1].outputs[0].token_ids
    assert again == alone


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("config", [{"synthetic_acceptance_rates": [0.9, 0.6, 0.3]},
                                    {"synthetic_acceptance_length": 2.6}])
def test_synthetic_acceptance_is_unconditional_at_every_temperature(temperature, config):
    """Measured per-position acceptance (accepted at position i / drafts) equals the configured
    unconditional rate, greedy included. 400 requests x ~12 steps: tolerance 0.04 (> 4 sigma)."""
    llm = LLM(model=TARGET, max_num_seqs=64, seed=7,
              speculative_config={"model": DRAFT, "num_speculative_tokens": 3,
                                  "rejection_sample_method": "synthetic", **config})
    rates = llm.config.speculative_config.synthetic_rates()
    params = [SamplingParams(temperature=temperature, max_tokens=40, ignore_eos=True, seed=s) for s in range(400)]
    llm.generate(["the cat"] * 400, params)
    stats = llm.spec_decode_stats
    # drafts with all K positions: the last step of a request may draft fewer (its token budget)
    measured = np.array(stats.num_accepted_tokens_per_pos) / stats.num_drafts
    assert np.abs(measured - np.array(rates)).max() < 0.04, (measured, rates)
