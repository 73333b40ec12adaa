"""The offline API: the seed's example shape, stop conditions, seeds, bad input."""
import pytest

from conftest import SMOLLM2
from engine import LLM, SamplingParams

TINY = "random:tiny-llama:1"


@pytest.fixture(scope="module")
def tiny():
    return LLM(model=TINY, max_model_len=64,
               speculative_config={"model": "random:tiny-llama:2", "num_speculative_tokens": 3})


def test_seed_offline_example_shape(smollm2_plain):
    # seed §2, with the embedded models; only the import line differs from vLLM
    llm = LLM(model=SMOLLM2, tensor_parallel_size=1, max_model_len=256,
              speculative_config={"model": SMOLLM2, "num_speculative_tokens": 5, "method": "draft_model"})
    outputs = llm.generate(["The future of AI is"], SamplingParams(temperature=0.8, top_p=0.95))
    out = outputs[0]
    assert out.prompt == "The future of AI is"
    assert isinstance(out.outputs[0].text, str) and out.outputs[0].text
    assert 1 <= len(out.outputs[0].token_ids) <= 16  # vLLM's default max_tokens
    assert out.outputs[0].finish_reason in ("stop", "length")


def test_max_tokens_and_eos(smollm2_plain):
    out = smollm2_plain.generate("The future of AI is", SamplingParams(temperature=0, max_tokens=5))[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"
    # this prompt ends on its own, greedy, on int8 activations (67 tokens) and on float32 (61)
    long = smollm2_plain.generate("Water boils at", SamplingParams(temperature=0, max_tokens=200))[0]
    eos = smollm2_plain.get_tokenizer().eos_token_id
    assert long.outputs[0].finish_reason == "stop" and long.outputs[0].token_ids[-1] == eos
    assert "<|im_end|>" not in long.outputs[0].text


def test_stop_string_truncates_text(tiny):
    free = tiny.generate("hello", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    text = free.outputs[0].text
    stop = text[10:12]
    out = tiny.generate("hello", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.outputs[0].text == text[: text.index(stop)]


def test_stop_token_ids(tiny):
    free = tiny.generate("hello", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    ids = free.outputs[0].token_ids
    stop_id = ids[7]
    out = tiny.generate("hello", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                stop_token_ids=[stop_id]))[0]
    assert out.outputs[0].token_ids == ids[: ids.index(stop_id) + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_id


def test_min_tokens_holds_back_stop_tokens(tiny):
    free = tiny.generate("hello", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    first = free.outputs[0].token_ids[0]
    out = tiny.generate("hello", SamplingParams(temperature=0, max_tokens=30, min_tokens=10, ignore_eos=True,
                                                stop_token_ids=[first]))[0]
    ids = out.outputs[0].token_ids
    assert first not in ids[:10] and len(ids) >= 10


def test_seeded_requests_reproduce(tiny):
    params = SamplingParams(temperature=1.0, max_tokens=20, seed=123, ignore_eos=True)
    a = tiny.generate(["hello", "abc"], params)
    b = tiny.generate(["abc", "hello", "zzz"], params)  # other batch mates, other order
    assert a[0].outputs[0].token_ids == b[1].outputs[0].token_ids
    assert a[1].outputs[0].token_ids == b[0].outputs[0].token_ids


def test_token_id_prompts(tiny):
    ids = tiny.get_tokenizer().encode("hello")
    a = tiny.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=8))[0]
    b = tiny.generate("hello", SamplingParams(temperature=0, max_tokens=8))[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.prompt is None


def test_max_model_len_stops_generation(tiny):
    out = tiny.generate("hello", SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 64
    assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("prompt, match", [("", "empty"), ({"prompt_token_ids": []}, "empty"),
                                           ("x" * 80, "maximum context length is 64"),
                                           ({"prompt_token_ids": [1, 999]}, "token ids")])
def test_bad_prompts(tiny, prompt, match):
    with pytest.raises(ValueError, match=match):
        tiny.generate(prompt, SamplingParams())


def test_bad_input_leaves_engine_usable(tiny):
    with pytest.raises(ValueError):
        tiny.generate(["hello", ""], SamplingParams(max_tokens=4))
    assert len(tiny.generate("hello", SamplingParams(max_tokens=4, ignore_eos=True))[0].outputs[0].token_ids) == 4


def test_unknown_model_path():
    with pytest.raises(ValueError, match="unknown model 'no/such-model'"):
        LLM(model="no/such-model")
    with pytest.raises(ValueError, match="unknown model"):
        LLM(model=TINY, speculative_config={"model": "/nonexistent/draft", "num_speculative_tokens": 2})


def test_unknown_random_preset():
    with pytest.raises(ValueError, match="unknown random preset"):
        LLM(model="random:nope")


def test_vocab_size_mismatch_refused():
    with pytest.raises(ValueError, match="Target and draft model should have the same vocabulary size"):
        LLM(model=TINY, speculative_config={"model": "random:smollm2-135m", "num_speculative_tokens": 2})
