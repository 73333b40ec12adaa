"""FR-Spec (`draft_head_tokens`, engine/frequent_tokens.py): the draft's LM head computes only its most
frequent tokens. The restricted head gives the full head's logits on its rows, bit for bit, in every
weight form; the subset keeps the tokens a chat needs and covers real text; greedy output is the
target's, and drafts come from the subset only."""
import numpy as np
import pytest
import torch
from torch import nn

from conftest import QWEN_CODER_DRAFT, needs_kernels
from engine import LLM, SamplingParams
from engine.config import SpeculativeConfig
from engine.frequent_tokens import FrequentTokenHead, frequency_order, frequent_token_ids
from engine.kernels import MAX_ROWS
from engine.models.gguf_blocks import Int8Blocks, PackedBlocks, decode
from engine.models.linear import BlockLinear, PackedLinear, dense_linear, take_rows
from engine.models.loading import load_tokenizer, resolve_model
from test_gguf_blocks import random_blocks

ROWS, COLS = 70, 256  # not a multiple of either layout's row group


def block_layer(type_name: str, form, kernels) -> BlockLinear:
    weight = decode(random_blocks(type_name, ROWS, COLS // 256 if type_name.endswith("_K") else COLS // 32,
                                  np.random.default_rng(3)), type_name)
    layer = BlockLinear(form.of(weight), bias=torch.randn(ROWS))
    layer.kernels = kernels
    return layer


@needs_kernels
@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("form", [Int8Blocks, PackedBlocks])
def test_restricted_rows_equal_the_full_heads_bit_for_bit(kernel, type_name, form):
    layer = block_layer(type_name, form, kernel)
    rows = torch.tensor([0, 5, 16, 17, 31, 40, 63, 69])
    sub = take_rows(layer, rows)
    assert sub.blocks.nbytes < layer.blocks.nbytes and sub.out_features == len(rows)
    assert torch.equal(sub.blocks.dequantize(), layer.blocks.dequantize(rows))
    for n in (1, 4, MAX_ROWS):
        x = torch.randn(n, COLS)
        assert torch.equal(sub(x), layer(x)[:, rows])


@needs_kernels
def test_restricted_float32_layers(kernel):
    full = dense_linear(torch.randn(ROWS, COLS), torch.randn(ROWS))
    rows = torch.tensor([1, 2, 30, 69])
    x = torch.randn(3, COLS)
    # our small-row kernel computes each row on its own: bit for bit
    skinny = PackedLinear(full, kernel, keep_dense=False)
    assert torch.equal(take_rows(skinny, rows)(x), skinny(x)[:, rows])
    # PyTorch's and oneDNN's GEMMs block by the output width: equal to rounding
    for layer in (full, PackedLinear(full, None, keep_dense=False)):
        torch.testing.assert_close(take_rows(layer, rows)(x), layer(x)[:, rows], rtol=1e-6, atol=1e-5)


def test_the_head_scores_its_rows_and_nothing_else():
    full = dense_linear(torch.randn(ROWS, COLS), None)
    ids = torch.tensor([3, 9, 12])
    logits = FrequentTokenHead(full, ids, ROWS)(torch.randn(2, 5, COLS))
    assert logits.shape == (2, 5, ROWS)
    assert torch.isfinite(logits[..., ids]).all()
    outside = torch.ones(ROWS, dtype=torch.bool)
    outside[ids] = False
    assert (logits[..., outside] == float("-inf")).all()


@pytest.fixture(scope="module")
def qwen_tokenizer():
    return load_tokenizer(resolve_model(QWEN_CODER_DRAFT))


def test_the_subset_keeps_chat_and_tool_tokens_and_covers_real_text(qwen_tokenizer):
    tok, vocab = qwen_tokenizer, 151936
    order, always = frequency_order(tok, vocab)
    assert sorted(order) == list(range(vocab))  # every id once
    ids = set(frequent_token_ids(tok, vocab, 32768).tolist())
    assert len(ids) == 32768
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>"):
        assert tok.convert_tokens_to_ids(special) in ids, special
    assert all(i in ids for i in range(256))  # the byte alphabet: any text stays spellable
    # the counts track frequency: the top 32k (a fifth of the vocabulary) hold over 90% of the tokens of
    # code and of prose (93-96% measured on these files)
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    for path in (root / "engine" / "scheduler.py", root / "README.md"):
        tokens = tok.encode(path.read_text(), add_special_tokens=False)
        covered = sum(t in ids for t in tokens) / len(tokens)
        assert covered > 0.90, (path.name, covered)


TINY = "random:tiny-llama:1"  # vocabulary 48: 3 specials, then characters
SUBSET = 20


def test_greedy_output_is_the_targets_and_drafts_come_from_the_subset():
    """The target drafts for itself through a head of 20 of its 48 tokens: a round stops early
    exactly where the target's token is outside the subset, and the text is plain decoding's."""
    prompts = ["hello world", "the cat sat on"]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, spec_trace=True)
    plain = LLM(model=TINY, max_model_len=128).generate(prompts, greedy)
    llm = LLM(model=TINY, max_model_len=128, speculative_config={
        "model": TINY, "num_speculative_tokens": 3, "draft_head_tokens": SUBSET})
    subset = set(frequent_token_ids(llm.get_tokenizer(), 48, SUBSET).tolist())
    outside = 0
    for ours, ref in zip(llm.generate(prompts, greedy), plain):
        o = ours.outputs[0]
        assert o.token_ids == ref.outputs[0].token_ids
        for token, origin in zip(o.token_ids, o.origins):
            if origin.draft:
                assert token in subset
            rounds = [x for x in o.origins if x.round == origin.round]
            accepted = sum(x.draft for x in rounds)
            if not origin.draft and origin.k > 0 and accepted < origin.k:
                assert token not in subset  # the draft is the target: it missed only what it can't score
            outside += token not in subset
    assert outside > 0  # the restriction was exercised
    stats = llm.spec_decode_stats
    assert 0 < stats.acceptance_rate < 1


def test_the_key_is_validated():
    with pytest.raises(ValueError, match="draft_head_tokens"):
        SpeculativeConfig(model=TINY, num_speculative_tokens=3, draft_head_tokens=0)
