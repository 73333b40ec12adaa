"""The output processor (engine/output_processor.py) on its own: tokens in, stop conditions, text
and deltas out, on SmolLM2's tokenizer with hand-made token lists (no model runs)."""
import pytest

from engine.config import SamplingParams
from engine.errors import RequestFailure
from engine.models.loading import load_tokenizer, resolve_model
from engine.output_processor import OutputProcessor, StreamCursor
from engine.scheduler import Sequence
from engine.step import TokenLogprob

MAX_LEN = 64


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct"))


@pytest.fixture(scope="module")
def eos(tokenizer):
    return tokenizer.eos_token_id


def make(tokenizer, eos, **params):
    outputs = OutputProcessor(tokenizer, {eos}, MAX_LEN)
    seq = Sequence("r", "hi", [1, 2, 3], SamplingParams(**params), seed=0)
    outputs.track(seq)
    return outputs, seq


def ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_a_stop_string_across_tokens_ends_the_request_and_drops_what_follows(tokenizer, eos):
    outputs, seq = make(tokenizer, eos, stop=["END"], max_tokens=50)
    tokens = ids(tokenizer, "one two EN") + ids(tokenizer, "D three four")
    kept = outputs.append(seq, tokens)
    assert seq.finish_reason == "stop" and seq.stop_reason == "END"
    assert kept == len(seq.output_ids) < len(tokens)  # the tokens after the one completing END are dropped
    assert seq.text == "one two "


@pytest.mark.parametrize("ignore_eos, reason", [(False, "stop"), (True, None)])
def test_eos_stops_unless_ignored(tokenizer, eos, ignore_eos, reason):
    outputs, seq = make(tokenizer, eos, ignore_eos=ignore_eos, max_tokens=50)
    tokens = ids(tokenizer, "fine") + [eos] + ids(tokenizer, " more")
    outputs.append(seq, tokens)
    assert seq.finish_reason == reason
    assert seq.output_ids == (tokens[:tokens.index(eos) + 1] if reason else tokens)  # ignored: decoding goes on


def test_a_stop_token_is_the_stop_reason(tokenizer, eos):
    stop_id = ids(tokenizer, "!")[0]
    outputs, seq = make(tokenizer, eos, stop_token_ids=[stop_id], max_tokens=50)
    outputs.append(seq, ids(tokenizer, "hey! you"))
    assert (seq.finish_reason, seq.stop_reason, seq.output_ids[-1]) == ("stop", stop_id, stop_id)


def test_length_ends_at_max_tokens_and_at_max_model_len(tokenizer, eos):
    outputs, seq = make(tokenizer, eos, max_tokens=3)
    assert outputs.append(seq, ids(tokenizer, "a b c d e f")) == 3 and seq.finish_reason == "length"
    outputs, seq = make(tokenizer, eos, max_tokens=None)  # the context limit (3 prompt tokens)
    outputs.append(seq, [ids(tokenizer, " a")[0]] * 100)
    assert seq.finish_reason == "length" and seq.num_tokens == MAX_LEN


def test_deltas_carry_each_token_once_and_hold_back_a_possible_stop_string(tokenizer, eos):
    outputs, seq = make(tokenizer, eos, stop=["STOP"], max_tokens=50, logprobs=0)
    cursor = StreamCursor(arrived=0.0)
    first = ids(tokenizer, "go ST")
    outputs.append(seq, first, [TokenLogprob(-0.5, 1, ())] * len(first))
    d1 = outputs.delta(seq, cursor)
    assert d1.token_ids == first and d1.prompt_token_ids == [1, 2, 3] and len(d1.logprobs) == len(first)
    assert d1.text == "go " and d1.finish_reason is None  # "ST" may begin STOP: held back
    second = ids(tokenizer, "ay here")
    outputs.append(seq, second, [TokenLogprob(-0.5, 1, ())] * len(second))
    d2 = outputs.delta(seq, cursor)
    assert d2.token_ids == second and d2.prompt_token_ids == [] and d2.text == "STay here"
    assert d1.text + d2.text == seq.text and d2.stats is None
    outputs.append(seq, ids(tokenizer, " STOP now"))
    last = outputs.delta(seq, cursor)
    assert last.finish_reason == "stop" and last.stats is seq.stats and no_stop_text(d1, d2, last)
    assert outputs.delta(seq, cursor).token_ids == [] and outputs.delta(seq, cursor).text == ""


def no_stop_text(*deltas) -> bool:
    return all("STOP" not in d.text for d in deltas)


def test_a_refused_request_gets_one_typed_delta():
    failure = RequestFailure.invalid("max_tokens: too many", "max_tokens")
    delta = OutputProcessor.rejected("r", failure)
    assert (delta.finish_reason, delta.error, delta.failure.param) == ("rejected", "max_tokens: too many", "max_tokens")
