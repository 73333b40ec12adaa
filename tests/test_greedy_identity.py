"""Greedy decoding with speculation gives the tokens plain decoding gives, token for token."""
import pytest

from conftest import SMOLLM2
from engine import LLM, SamplingParams

PROMPTS = ["The future of AI is", "def fibonacci(n):", "List three colors:\n1."]
TINY_PROMPTS = ["hello world", "the cat sat on", "a"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_plain):
    return [o.outputs[0].token_ids for o in smollm2_plain.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_self_draft_identity_and_full_acceptance(k, smollm2_reference):
    llm = LLM(model=SMOLLM2, max_model_len=512,
              speculative_config={"model": SMOLLM2, "num_speculative_tokens": k})
    outs = llm.generate(PROMPTS, GREEDY)
    for out, ref in zip(outs, smollm2_reference):
        assert len(out.outputs[0].token_ids) == 48
        assert out.outputs[0].token_ids == ref
    # the draft is the target: (almost) every draft is accepted
    assert llm.spec_decode_stats.mean_acceptance_length >= k


@pytest.fixture(scope="module")
def tiny_reference():
    llm = LLM(model="random:tiny-llama:1")
    return [o.outputs[0].token_ids for o in llm.generate(TINY_PROMPTS, GREEDY)]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_different_random_draft_identity(k, tiny_reference):
    llm = LLM(model="random:tiny-llama:1",
              speculative_config={"model": "random:tiny-llama:2", "num_speculative_tokens": k})
    outs = llm.generate(TINY_PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == tiny_reference
    stats = llm.spec_decode_stats
    assert stats.num_drafts > 0 and stats.acceptance_rate < 1.0  # a real, imperfect draft
