"""Token-Level Intersection: a draft with another tokenizer, exact all the same."""
import logging

import pytest
import torch

from conftest import GEMMA3, SMOLLM2
from engine import LLM, SamplingParams
from engine.models.loading import load_tokenizer, resolve_model
from engine.vocab_mapping import VocabMapping, fallback_id, token_bytes, word_start_marker
from stats import ALPHA, chi_squared_pvalue, exact_first_two
from tli_models import COMMON, VOCAB, write_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_pair(tmp_path_factory.mktemp("tli"))


@pytest.fixture(scope="module")
def tokenizers(pair):
    return [load_tokenizer(resolve_model(p)) for p in pair]


# -- mapping ------------------------------------------------------------------------------------

def test_markers_detected(tokenizers):
    target, draft = tokenizers
    assert word_start_marker(target) == "▁" and word_start_marker(draft) == "Ġ"


def test_real_pair_markers_and_intersection(caplog):
    gemma, smol = load_tokenizer(resolve_model(GEMMA3)), load_tokenizer(resolve_model(SMOLLM2))
    assert word_start_marker(gemma) == "▁" and word_start_marker(smol) == "Ġ"
    with caplog.at_level(logging.INFO, logger="engine.vocab_mapping"):
        m = VocabMapping(gemma, smol, 262144, 49152)
    assert "common tokens" in caplog.text
    assert 40000 < m.num_common < 49152
    # word-start tokens meet across marker styles
    the_t = gemma.convert_tokens_to_ids("▁the")
    the_d = smol.convert_tokens_to_ids("Ġthe")
    assert m.target_to_draft[the_t] == the_d and m.draft_to_target[the_d] == the_t
    # a byte-fallback piece <0x41> is b"A", but the regular token "A" is the one that maps
    a_t, byte_a = gemma.convert_tokens_to_ids("A"), gemma.convert_tokens_to_ids("<0x41>")
    assert token_bytes(gemma, 262144)[0][byte_a] == b"A"
    assert m.target_to_draft[a_t] == smol.convert_tokens_to_ids("A") and m.target_to_draft[byte_a] == -1
    # special tokens match only by role
    assert m.target_to_draft[gemma.eos_token_id] == smol.eos_token_id
    start_of_turn = gemma.convert_tokens_to_ids("<start_of_turn>")
    assert m.target_to_draft[start_of_turn] == -1
    assert m.draft_to_target[smol.convert_tokens_to_ids("<|im_start|>")] != gemma.convert_tokens_to_ids("<start_of_turn>")


def test_tables_are_one_to_one_and_mask_matches(tokenizers):
    target, draft = tokenizers
    m = VocabMapping(target, draft, VOCAB, VOCAB)
    assert m.num_common == len(COMMON) + 2  # the shared words, plus EOS and BOS by role
    both = m.draft_to_target[m.draft_mask]
    assert len(set(both.tolist())) == len(both)
    assert torch.equal(m.target_to_draft[both], torch.arange(VOCAB)[m.draft_mask])
    # the proposer's mask: exactly the draft tokens that have a target token
    assert torch.equal(m.draft_mask, m.draft_to_target >= 0) and int(m.draft_mask.sum()) == m.num_common


def test_byte_fallback_pieces_normalised(tokenizers):
    target, _ = tokenizers
    b, is_byte = token_bytes(target, VOCAB)
    i = target.convert_tokens_to_ids("<0x41>")
    assert b[i] == b"A" and is_byte[i]
    assert b[target.convert_tokens_to_ids("▁cat")] == b" cat"
    assert b[target.eos_token_id] is None  # special


def test_few_common_tokens_warn(tokenizers, caplog):
    with caplog.at_level(logging.WARNING, logger="engine.vocab_mapping"):
        VocabMapping(*tokenizers, VOCAB, VOCAB)
    assert f"only {len(COMMON) + 2} tokens in common (< 100)" in caplog.text


def test_fallback_unk_then_eos_then_error(tokenizers, caplog):
    _, draft = tokenizers
    assert fallback_id(draft, "draft") == draft.unk_token_id
    class NoUnk:
        unk_token_id, eos_token_id = None, 2
    with caplog.at_level(logging.WARNING, logger="engine.vocab_mapping"):
        assert fallback_id(NoUnk, "draft") == 2
    assert "map to EOS" in caplog.text
    class Neither:
        unk_token_id = eos_token_id = None
    with pytest.raises(ValueError, match="neither an unk nor an EOS"):
        fallback_id(Neither, "draft")


def test_token_outside_intersection_mid_prompt_is_retokenized():
    gemma, smol = load_tokenizer(resolve_model(GEMMA3)), load_tokenizer(resolve_model(SMOLLM2))
    m = VocabMapping(gemma, smol, 262144, 49152)
    text = "hello 日本語 world"
    ids = gemma.encode(text, add_special_tokens=False)
    assert any(m.target_to_draft[t] < 0 for t in ids)  # the CJK tokens are not in SmolLM2's vocabulary
    assert m.to_draft(ids) == smol.encode(text, add_special_tokens=False)  # same text, draft's tokens
    plain = m.to_draft(ids, retokenize=False)
    assert smol.unk_token_id in plain
    assert m.draft_prompt(None, gemma.encode(text)) == smol.encode(text)


# -- end to end -----------------------------------------------------------------------------------

REAL_PROMPTS = [
    "The history of the printing press begins",
    "def quicksort(items):\n",
    "Shopping list:\n1. eggs\n2.",
    "La capitale de la France est",
    "<start_of_turn>user\nWrite a haiku about the sea.<end_of_turn>\n<start_of_turn>model\n",
]


@pytest.fixture(scope="module")
def gemma_reference():
    llm = LLM(model=GEMMA3, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(REAL_PROMPTS, params)]


@pytest.mark.parametrize("k", [1, 3])
def test_real_pair_greedy_identity(k, gemma_reference):
    llm = LLM(model=GEMMA3, max_model_len=256,
              speculative_config={"model": SMOLLM2, "num_speculative_tokens": k, "use_heterogeneous_vocab": True})
    outs = llm.generate(REAL_PROMPTS, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    for out, ref in zip(outs, gemma_reference):
        assert len(out.outputs[0].token_ids) == 64
        assert out.outputs[0].token_ids == ref
    assert llm.spec_decode_stats.num_accepted_tokens > 0


N = 4000


@pytest.mark.parametrize("draft_sample_method", ["greedy", "probabilistic"])
def test_cross_vocab_sampling_is_lossless(pair, draft_sample_method):
    target, draft = pair
    llm = LLM(model=target, max_num_seqs=64, seed=3,
              speculative_config={"model": draft, "num_speculative_tokens": 3, "use_heterogeneous_vocab": True,
                                  "draft_sample_method": draft_sample_method})
    prompt = llm.get_tokenizer().encode("the cat sat on")
    params = [SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True, seed=s) for s in range(N)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * N, params)
    p1, p2 = exact_first_two(llm, prompt, 1.0)
    assert chi_squared_pvalue([o.outputs[0].token_ids[0] for o in outs], p1) > ALPHA
    assert chi_squared_pvalue([o.outputs[0].token_ids[1] for o in outs], p2) > ALPHA
    assert llm.spec_decode_stats.num_accepted_tokens > 0


def test_heterogeneous_vocab_required_for_different_tokenizers():
    with pytest.raises(ValueError, match="same vocabulary size"):
        LLM(model=GEMMA3, speculative_config={"model": SMOLLM2, "num_speculative_tokens": 2})


def test_text_longer_in_draft_tokens_than_the_cache_still_decodes(gemma_reference):
    """Thai costs the SmolLM2 draft ~6 tokens per Gemma token: a prompt that fits the target but not
    the draft's cache is decoded without drafting (it used to overflow the draft's KV cache), exactly
    as plain decoding would."""
    thai = "ภาษาไทยเป็นภาษาที่มีวรรณยุกต์ " * 12
    llm = LLM(model=GEMMA3, max_model_len=256,
              speculative_config={"model": SMOLLM2, "num_speculative_tokens": 3, "use_heterogeneous_vocab": True})
    n_target = len(llm.get_tokenizer().encode(thai))
    n_draft = len(llm.core.scheduler.vocab_mapping.draft_prompt(thai, []))
    assert n_target + 16 < 256 < n_draft
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    out = llm.generate(thai, params)[0].outputs[0]
    plain = LLM(model=GEMMA3, max_model_len=256).generate(thai, params)[0].outputs[0]
    assert out.finish_reason == "length" and out.token_ids == plain.token_ids


def test_real_pair_with_prefix_hits_and_preemption_gives_plain_greedy_tokens(gemma_reference):
    """TLI with the paged cache: the draft's blocks are in its own token ids. A second pass over the
    same prompts hits both models' prefix caches; a cache of 13 blocks preempts. Tokens as plain (a
    cache hit or a preemption's recompute cuts a prompt into other chunks: on int8 every chunking
    writes the same keys and values, tests/test_chunked_prefill.py)."""
    spec = {"model": SMOLLM2, "num_speculative_tokens": 3, "use_heterogeneous_vocab": True}
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    llm = LLM(model=GEMMA3, max_model_len=256, speculative_config=spec)
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in llm.generate(REAL_PROMPTS, params)] == gemma_reference
    sched = llm.core.scheduler
    assert sched.target_kv.counters.hits > 0 and sched.draft_kv.counters.hits > 0
    block = sum(r.worker.block_bytes() for r in (llm.core.executor.target, llm.core.executor.draft))
    small = LLM(model=GEMMA3, max_model_len=144, kv_cache_memory_bytes=14 * block, speculative_config=spec)
    assert [o.outputs[0].token_ids for o in small.generate(REAL_PROMPTS, params)] == gemma_reference
    assert small.core.scheduler.target_kv.counters.preemptions > 0
    assert small.spec_decode_stats.num_accepted_tokens > 0
