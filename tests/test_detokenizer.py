"""Incremental detokenization (engine/detokenizer.py) on the embedded models' tokenizers: the text
equals a full decode at every step, split UTF-8 and special tokens included; stop strings are found
across token boundaries and never reach a client in part."""
import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.models.loading import load_tokenizer, resolve_model

TEXTS = ["Hello, world! The café costs 3€ — naïve résumé. 日本語のテキスト 🎉🎉 done.",
         "  leading spaces\n\nnew lines\ttabs and a very long word: pneumonoultramicroscopicsilicovolcanoconiosis",
         "def f(x):\n    return x ** 2  # squares 🐍"]


@pytest.fixture(scope="module", params=["google/gemma-3-270m", "HuggingFaceTB/SmolLM2-135M-Instruct"])
def tokenizer(request):
    return load_tokenizer(resolve_model(request.param))


@pytest.mark.parametrize("text", TEXTS)
def test_the_text_is_a_full_decode_at_every_token(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    for n, token in enumerate(ids, 1):
        detok.add(token)
        full = tokenizer.decode(ids[:n], skip_special_tokens=True)
        # a token whose character still misses bytes is held back (a full decode shows U+FFFD there)
        rest = full[len(detok.text):]
        assert full.startswith(detok.text) and (rest == "" or "\ufffd" in rest)
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=True)


def test_an_emoji_split_across_byte_tokens_appears_whole(tokenizer):
    ids = tokenizer.encode("🎉", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    seen = []
    for token in ids:
        detok.add(token)
        seen.append(detok.text)
    assert all("\ufffd" not in s for s in seen) and seen[-1].endswith("🎉")


def test_special_tokens_are_skipped(tokenizer):
    special = [t for t in (tokenizer.bos_token_id, tokenizer.eos_token_id) if t is not None]
    ids = special + tokenizer.encode("plain words", add_special_tokens=False) + special
    detok = IncrementalDetokenizer(tokenizer)
    for token in ids:
        detok.add(token)
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_stop_string_across_tokens_ends_the_text_before_it_and_is_never_visible(tokenizer):
    ids = tokenizer.encode("alpha beta STOPWORD gamma", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=["STOPWORD", "zzz"])
    shown = ""
    for token in ids:
        hit = detok.add(token)
        shown = detok.text[:detok.visible(finished=hit is not None)]
        assert "STOP" not in shown
        if hit:
            break
    assert hit == "STOPWORD" and detok.text == "alpha beta " and shown == "alpha beta "


def test_held_back_text_is_only_what_may_begin_a_stop_string(tokenizer):
    ids = tokenizer.encode("one two thr", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=["three", "xyz"])
    for token in ids:
        detok.add(token)
    assert detok.text == "one two thr" and detok.text[:detok.visible(finished=False)] == "one two "
    assert detok.visible(finished=True) == len(detok.text)
