"""The completions and chat answers on their own (deployments/serving_completion.py, serving_chat.py):
a call's deltas in, OpenAI's chunks and whole answers out, with no server and no engine. The deltas
are written here as the engine would send them; SmolLM2's tokenizer makes the logprobs' text."""
import json

import pytest

from deployments.logprobs import LogprobFormatter
from deployments.requests import Choice, Completion, PreparedRequest
from deployments.serving_chat import ChatFormat
from deployments.serving_completion import CompletionFormat
from deployments.tool_calls import ToolCalls
from engine.config import SamplingParams
from engine.core import TokenizedPrompt
from engine.models.loading import load_tokenizer, resolve_model
from engine.output_processor import RequestDelta
from engine.step import TokenLogprob
from engine.tool_parsers import tool_format


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct"))


@pytest.fixture(scope="module")
def fmt(tokenizer):
    return LogprobFormatter(tokenizer)


def prepared(kind, n=1, echo="", stream=True, **extra) -> PreparedRequest:
    params = SamplingParams(max_tokens=16, logprobs=extra.pop("logprobs", None))
    choices = [Choice(i, TokenizedPrompt("hi", [1, 2]), params, echo) for i in range(n)]
    return PreparedRequest("req-1", kind, choices, stream=stream, include_usage=False, **extra)


def deltas_of(tokenizer, pieces: list[str], finish="stop", logprobs=False) -> list[RequestDelta]:
    """One delta per piece of text (its tokens with made-up log-probabilities), the last finishing."""
    out = []
    for i, piece in enumerate(pieces):
        ids = tokenizer.encode(piece, add_special_tokens=False)
        lps = [TokenLogprob(-0.5, 1, [(t, -0.5)]) for t in ids] if logprobs else None
        out.append(RequestDelta("r", ids, piece, finish if i == len(pieces) - 1 else None, logprobs=lps))
    return out


def whole(deltas: list[RequestDelta]) -> Completion:
    lps = [e for d in deltas for e in d.logprobs] if deltas[0].logprobs is not None else None
    return Completion([t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas), deltas[-1], [1, 2], lps)


def streamed(call, deltas: list[RequestDelta], k: int = 0) -> list[dict]:
    events = call.opening([deltas[0]])
    for d in deltas:
        events += call.events(k, d)
    json.dumps(events)  # every chunk is JSON as it is
    return events


def test_a_streamed_completion_echoes_first_and_its_logprob_offsets_run_on_from_the_echo(tokenizer, fmt):
    p = prepared("completion", echo="Once upon", logprobs=1)
    deltas = deltas_of(tokenizer, [" a time", " there was", " a cat"], finish="length", logprobs=True)
    events = streamed(CompletionFormat(p, "m", fmt, 0), deltas)
    texts = [e["choices"][0]["text"] for e in events]
    assert texts == ["Once upon", " a time", " there was", " a cat"]
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, None, None, "length"]
    assert all(e["object"] == "text_completion" and e["id"] == "req-1" for e in events)
    offsets = [o for e in events[1:] for o in e["choices"][0]["logprobs"]["text_offset"]]
    tokens = [t for e in events[1:] for t in e["choices"][0]["logprobs"]["tokens"]]
    assert offsets[0] == len("Once upon") and "".join(tokens) == " a time there was a cat"
    assert all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], tokens))
    # the whole answer says the same as the stream
    answer = CompletionFormat(p, "m", fmt, 0).answer([whole(deltas)])
    (choice,) = answer["choices"]
    assert choice["text"] == "".join(texts) and choice["logprobs"]["text_offset"] == offsets
    assert answer["usage"] == {"prompt_tokens": 2, "completion_tokens": len(whole(deltas).token_ids),
                               "total_tokens": 2 + len(whole(deltas).token_ids)}


def test_an_aborted_or_failed_choice_finishes_as_stop_on_the_wire(tokenizer, fmt):
    for reason in ("abort", "error"):
        deltas = deltas_of(tokenizer, ["hello"], finish=reason)
        (event,) = CompletionFormat(prepared("completion"), "m", fmt, 0).events(0, deltas[0])
        assert event["choices"][0]["finish_reason"] == "stop"


def test_a_chat_stream_opens_with_each_choices_role_and_ends_with_its_finish_reason(tokenizer, fmt):
    p = prepared("chat", n=2)
    call = ChatFormat(p, "m", fmt, 0)
    opening = call.opening([None, None])
    assert [e["choices"][0] for e in opening] == [
        {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        for i in range(2)]
    deltas = deltas_of(tokenizer, ["Hi", " there"])
    events = [e for d in deltas for e in call.events(1, d)]
    assert [e["choices"][0]["delta"] for e in events] == [{"content": "Hi"}, {"content": " there"}]
    assert events[-1]["choices"][0]["finish_reason"] == "stop" and events[-1]["choices"][0]["index"] == 1
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    answer = call.answer([whole(deltas), whole(deltas)])
    assert answer["object"] == "chat.completion"
    assert [c["message"]["content"] for c in answer["choices"]] == ["Hi there"] * 2


def test_with_a_reasoning_parser_the_thinking_streams_apart_even_with_its_tag_cut_in_pieces(tokenizer, fmt):
    p = prepared("chat", reasoning=("deepseek_r1", True))
    pieces = ["Let me think", " about it.</th", "ink>The answer", " is 4."]
    events = streamed(ChatFormat(p, "m", fmt, 0), deltas_of(tokenizer, pieces))[1:]
    thinking = "".join(e["choices"][0]["delta"].get("reasoning_content", "") for e in events)
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert (thinking, content) == ("Let me think about it.", "The answer is 4.")
    assert not any("</th" in json.dumps(e) for e in events)
    (choice,) = ChatFormat(p, "m", fmt, 0).answer([whole(deltas_of(tokenizer, pieces))])["choices"]
    assert (choice["message"]["reasoning_content"], choice["message"]["content"]) == (thinking, content)


def test_tool_calls_stream_as_calls_never_as_text_and_the_whole_answer_has_the_same_call(tokenizer, fmt):
    p = prepared("chat", tool_calls=ToolCalls("auto", format=tool_format("pythonic")))
    pieces = ["[get_weather(ci", "ty='Paris', days=", "2)]"]
    deltas = deltas_of(tokenizer, pieces)
    events = streamed(ChatFormat(p, "m", fmt, 0), deltas)[1:]
    assert not any(e["choices"][0]["delta"].get("content") for e in events)
    calls = [c for e in events for c in e["choices"][0]["delta"].get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"]
    arguments = "".join(c["function"].get("arguments", "") for c in calls)
    assert json.loads(arguments) == {"city": "Paris", "days": 2}
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    (choice,) = ChatFormat(p, "m", fmt, 0).answer([whole(deltas)])["choices"]
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == \
        {"city": "Paris", "days": 2}
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None


def test_chat_logprobs_go_with_their_tokens(tokenizer, fmt):
    p = prepared("chat", logprobs=1)
    deltas = deltas_of(tokenizer, ["Hello", " world"], logprobs=True)
    events = streamed(ChatFormat(p, "m", fmt, 0), deltas)[1:]
    tokens = [t["token"] for e in events for t in e["choices"][0]["logprobs"]["content"]]
    assert "".join(tokens) == "Hello world"
    (choice,) = ChatFormat(p, "m", fmt, 0).answer([whole(deltas)])["choices"]
    assert [t["token"] for t in choice["logprobs"]["content"]] == tokens
