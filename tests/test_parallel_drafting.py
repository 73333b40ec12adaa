"""Parallel drafting (PARD, `parallel_drafting: true`): one draft forward proposes all K tokens from
the context and K-1 mask tokens. Whatever the draft predicts, the output is the target's: greedy
identity and chi-squared; the draft's cache holds only real tokens (its proposals every step equal
a fresh forward over the whole context); a draft without a mask token is refused by name."""
from types import SimpleNamespace

import pytest
import torch

from engine.kv_cache import static_tables
from engine import LLM, SamplingParams
from engine.config import parallel_drafting_token
from engine.models.loading import resolve_model
from engine.worker import ModelWorker
from stats import ALPHA, chi_squared_pvalue, exact_first_two
from tli_models import draft_pieces, target_pieces, write_model

TARGET, DRAFT = "random:tiny-llama:1", "random:tiny-llama-pard:2"
PROMPTS = ["the cat", "hello world 12", "a"]
N = 4000


def pard(k: int, **extra) -> dict:
    return {"model": DRAFT, "num_speculative_tokens": k, "parallel_drafting": True, **extra}


@pytest.fixture(scope="module")
def plain():
    return LLM(model=TARGET, max_num_seqs=64)


@pytest.fixture(scope="module")
def greedy_reference(plain):
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    return [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)]


def test_the_mask_token_comes_from_the_drafts_config():
    assert parallel_drafting_token(SimpleNamespace(vocab_size=10, pard_token=7)) == 7
    assert parallel_drafting_token(SimpleNamespace(vocab_size=10, ptd_token_id=3)) == 3
    assert parallel_drafting_token(SimpleNamespace(vocab_size=10, dflash_config={"mask_token_id": 0})) == 0
    with pytest.raises(ValueError, match="outside its vocabulary"):
        parallel_drafting_token(SimpleNamespace(vocab_size=10, pard_token=10))


def test_a_draft_without_a_mask_token_is_refused_before_loading():
    with pytest.raises(ValueError, match="'pard_token', 'ptd_token_id', 'dflash_config.mask_token_id'"):
        LLM(model=TARGET, speculative_config={"model": "random:tiny-llama:2", "num_speculative_tokens": 3,
                                              "parallel_drafting": True})


@pytest.mark.parametrize("k, extra", [(1, {}), (3, {}), (5, {}), (3, {"rejection_sample_method": "block"}),
                                      (4, {"adaptive": True}), (3, {"draft_sample_method": "probabilistic"})])
def test_greedy_output_equals_plain_decoding(greedy_reference, k, extra):
    llm = LLM(model=TARGET, max_num_seqs=4, speculative_config=pard(k, **extra))
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == greedy_reference
    assert llm.spec_decode_stats.num_draft_tokens > 0


def test_self_draft_accepts_its_first_proposal():
    """The draft with the target's own weights: its proposal at the last real token is the target's
    argmax, so every step accepts at least one draft (masks make the later ones guesses)."""
    llm = LLM(model=TARGET, speculative_config=pard(3) | {"model": "random:tiny-llama-pard:1"})
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    stats = llm.spec_decode_stats
    assert stats.num_accepted_tokens_per_pos[0] == stats.num_drafts


@pytest.mark.parametrize("draft_sample_method, method", [("greedy", "standard"), ("probabilistic", "standard"),
                                                         ("probabilistic", "block")])
def test_first_two_tokens_follow_target(plain, draft_sample_method, method):
    llm = LLM(model=TARGET, max_num_seqs=64, seed=1,
              speculative_config=pard(3, draft_sample_method=draft_sample_method, rejection_sample_method=method))
    params = [SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True, seed=s) for s in range(N)]
    outs = [o.outputs[0].token_ids for o in llm.generate(["the cat"] * N, params)]
    p1, p2 = exact_first_two(plain, plain.get_tokenizer().encode("the cat"), 1.0)
    assert chi_squared_pvalue([o[0] for o in outs], p1) > ALPHA
    assert chi_squared_pvalue([o[1] for o in outs], p2) > ALPHA
    assert 0.0 < llm.spec_decode_stats.acceptance_rate < 1.0


def test_the_draft_cache_keeps_only_real_tokens():
    """Every draft accepted (synthetic rates 1.0): each step's K proposals must equal the draft's
    argmax over [context, mask x (K-1)] computed from scratch; a mask left in the cache where a real
    token belongs would change them. The bonus token is the target's argmax after the drafts."""
    K = 3
    llm = LLM(model=TARGET, speculative_config=pard(K, rejection_sample_method="synthetic",
                                                    synthetic_acceptance_rates=[1.0, 1.0, 1.0]))
    prompt = llm.get_tokenizer().encode("the cat sat")
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0, max_tokens=8 * (K + 1), ignore_eos=True))[0].outputs[0].token_ids
    draft = ModelWorker(resolve_model(DRAFT), num_blocks=9, block_size=16, dtype=torch.float32)
    target = ModelWorker(resolve_model(TARGET), num_blocks=9, block_size=16, dtype=torch.float32)
    table = static_tables(1, 128, 16)
    mask = parallel_drafting_token(draft.hf_config)
    context = list(prompt)
    for step in range(len(out) // (K + 1)):
        block = out[step * (K + 1): (step + 1) * (K + 1)]
        logits = draft.forward(table, [0], [context + [mask] * (K - 1)])[0]
        assert logits[len(context) - 1:].argmax(-1).tolist() == block[:K], f"step {step}"
        assert int(target.forward(table, [0], [context + block[:K]])[0, -1].argmax()) == block[K]
        context += block


def test_with_token_level_intersection(tmp_path):
    """A draft of another tokenizer that declares a mask token: cross-vocabulary PARD stays exact."""
    target = write_model(tmp_path / "target", target_pieces(), "▁", seed=11)
    draft = write_model(tmp_path / "draft", draft_pieces(), "Ġ", seed=12, pard_token=3)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = ["the cat sat on", "a big red"]
    ref = [o.outputs[0].token_ids for o in LLM(model=str(target)).generate(prompts, params)]
    llm = LLM(model=str(target), speculative_config={"model": str(draft), "num_speculative_tokens": 3,
                                                     "parallel_drafting": True, "use_heterogeneous_vocab": True})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == ref
    assert llm.spec_decode_stats.num_draft_tokens > 0
