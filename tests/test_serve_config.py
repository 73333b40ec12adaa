"""The shipped serve_config.yaml, the default app (Qwen2.5-Coder 1.5B drafted by its 0.5B sibling, one
tokenizer, adaptive K, hermes tool calls), started as a user starts it (`serve run serve_config.yaml`):
the checks every shipped config passes (serve_config_checks.py), then the pair's own: code greedy through
speculation equal to plain decoding, drafts that are accepted, and tool calls in auto mode.

The config is the shipped file with only its two ports moved to free ones, and the test checks that
the processes answering on them belong to the `serve run` it started (a server already on 8000
must not be tested in its place)."""
import json
import re
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from conftest import QWEN_CODER
from serve_config_checks import *  # noqa: F401,F403  the checks every shipped config passes
from serve_config_checks import ServedConfig
from browser import ARTIFACTS, answer, browser_page, fill, run, spans, sse_events
from servers import serve_run
from engine import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve_run(ROOT / "serve_config.yaml", tmp_path_factory.mktemp("serve")) as (base, grpc_port):
        yield ServedConfig(base, grpc_port, QWEN_CODER)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(api_key="EMPTY", base_url=f"{server.base}/v1")


@pytest.fixture(scope="module")
def plain():
    return LLM(model=QWEN_CODER, max_model_len=1024)


def test_lists_the_pair(server):
    models = httpx.get(f"{server.base}/v1/models").json()["data"]
    assert [m["id"] for m in models] == [QWEN_CODER]


CODE = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]


def test_code_chat_through_speculation_equals_plain_and_drafts_are_accepted(server, client, plain):
    """A code answer in Qwen's chat format, greedy, 96 tokens: the served text (draft proposing, target
    verifying, adaptive K) is the text offline plain decoding writes, and the server's own counters
    say most drafts were accepted (the reason this pair is the default)."""
    def counter(name):
        text = httpx.get(f"{server.base}/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))

    drafted, accepted = counter("tandem:spec_decode_num_draft_tokens_total"), \
        counter("tandem:spec_decode_num_accepted_tokens_total")
    # 256 tokens: a long request alone drafts even after the earlier checks' short ones closed the
    # adaptive gate (on some CPUs they do)
    served = client.chat.completions.create(model=QWEN_CODER, messages=CODE, max_tokens=256, temperature=0)
    offline = plain.chat(CODE, SamplingParams(temperature=0, max_tokens=256))[0].outputs[0]
    assert served.choices[0].message.content == offline.text
    assert served.usage.completion_tokens == len(offline.token_ids)
    drafted = counter("tandem:spec_decode_num_draft_tokens_total") - drafted
    accepted = counter("tandem:spec_decode_num_accepted_tokens_total") - accepted
    assert drafted > 0 and accepted / drafted > 0.5, (accepted, drafted)


WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather forecast for a city",
                                           "parameters": WEATHER}}]


def test_auto_tool_call_through_the_hermes_parser_is_lossless(server, client, plain):
    """tool_choice 'auto' (OpenAI's default with tools): Qwen's own template renders the tools and asks
    for <tool_call> blocks. Qwen2.5-Coder 1.5B, unsteered, writes the call as a markdown JSON block
    instead (text, as the first assertion shows: the parser invents no call), so the test steers it as a
    user would, with a logit_bias on the <tool_call> token: the hermes parser returns OpenAI's
    tool_calls with arguments that validate (the grammar holds the call once begun), the call offline
    plain decoding makes, greedy, and the same arguments streamed as deltas; the tool's result sent
    back gets a text answer."""
    messages = [{"role": "user", "content": "What's the weather in Rome for the next 2 days?"}]
    unsteered = client.chat.completions.create(model=QWEN_CODER, messages=messages, tools=TOOLS, temperature=0,
                                               max_tokens=64).choices[0]
    offline_text = plain.chat(messages, SamplingParams(temperature=0, max_tokens=64), tools=TOOLS,
                              tool_parser="hermes")[0].outputs[0]
    assert (unsteered.message.content, unsteered.message.tool_calls) == (offline_text.content, None)
    [tag] = httpx.post(f"{server.base}/tokenize", json={"prompt": "<tool_call>", "add_special_tokens": False}
                       ).json()["tokens"]
    steer = {str(tag): 30}
    served = client.chat.completions.create(model=QWEN_CODER, messages=messages, tools=TOOLS, temperature=0,
                                            max_tokens=64, logit_bias=steer, parallel_tool_calls=False).choices[0]
    assert served.finish_reason == "tool_calls", served.message.content
    (call,) = served.message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER)
    assert arguments["city"] == "Rome"
    offline = plain.chat(messages, SamplingParams(temperature=0, max_tokens=64, logit_bias={tag: 30}), tools=TOOLS,
                         tool_parser="hermes", parallel_tool_calls=False)[0].outputs[0]
    assert offline.tool_calls == [{"name": call.function.name, "arguments": call.function.arguments}]
    deltas = [c.choices[0].delta for c in client.chat.completions.create(
        model=QWEN_CODER, messages=messages, tools=TOOLS, temperature=0, max_tokens=64, logit_bias=steer,
        parallel_tool_calls=False, stream=True) if c.choices]
    streamed = "".join(t.function.arguments or "" for d in deltas for t in d.tool_calls or [])
    assert streamed == call.function.arguments
    answer = client.chat.completions.create(model=QWEN_CODER, temperature=0, max_tokens=32, tools=TOOLS, messages=[
        *messages, served.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C, both days."}]).choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.content


def test_the_playground_in_a_browser_shows_what_speculation_did(server, client):
    """The playground against the default app in headless Chromium, as a user runs it: a greedy code chat
    streams, its text is the API's, one coloured span per accepted draft (the count the stream's own
    counters report), hovering a token lights its round; then the side-by-side run shows the same text
    without speculation and says so. A screenshot goes to the test artifacts (docs/serving/playground.md
    shows one)."""
    prompt, max_tokens = CODE[0]["content"], 48
    with browser_page() as page:
        page.goto(f"{server.base}/")  # redirected to the page
        assert page.url == f"{server.base}/playground"
        page.wait_for_selector(f"#model option[value='{QWEN_CODER}']", state="attached")
        fill(page, mode="chat", prompt=prompt, max_tokens=max_tokens, temperature=0)
        with page.expect_response(lambda r: r.url.endswith("/v1/chat/completions")) as streamed:
            run(page)
        events = sse_events(streamed.value.text())
        [stats] = [c["spec_trace"]["stats"] for e in events for c in e["choices"] if "stats" in c.get("spec_trace", {})]
        api = client.chat.completions.create(model=QWEN_CODER, messages=CODE, max_tokens=max_tokens, temperature=0)
        assert answer(page) == api.choices[0].message.content
        assert spans(page, kind="draft") == stats["num_accepted_tokens"] > 0
        assert spans(page, kind="draft") + spans(page, kind="target") == api.usage.completion_tokens
        assert page.text_content("#m-drafts") == str(stats["num_accepted_tokens"])
        assert page.text_content("#m-mal") == f"{stats['mean_acceptance_length']:.2f}"
        assert int(page.text_content("#m-k")) >= 1 and page.text_content("#m-ttft").endswith("ms")
        first = page.locator("#answer-spec .tok.draft").filter(has_text=re.compile(r"\w")).first  # visible text
        first.hover()
        round_size = page.locator(f"#answer-spec .tok[data-round='{first.get_attribute('data-round')}']").count()
        assert page.locator("#answer-spec .tok.lit").count() == round_size >= 2  # its drafts and the target's token
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        run(page, "compare")
        assert answer(page, "plain") == answer(page, "spec") == api.choices[0].message.content
        assert spans(page, "plain", "draft") == 0 and spans(page, "plain", "target") == api.usage.completion_tokens
        assert page.text_content("#compare-note").startswith("Identical text (greedy")
        assert page.text_content("#time-spec").endswith(" s") and page.text_content("#time-plain").endswith(" s")
        page.screenshot(path=str(ARTIFACTS / "playground.png"), full_page=True)


def test_model_text_is_shown_as_text_never_run(server, client):
    """A completion that makes the model write a <script> element (it continues the pattern): the page
    shows the characters; no element is made of them and nothing runs."""
    prompt = "".join(f"<script>window.pwned = {i}</script>\n" for i in range(1, 5)) + "<script>window.pwned ="
    api = client.completions.create(model=QWEN_CODER, prompt=prompt, max_tokens=24, temperature=0)
    assert "</script>" in api.choices[0].text  # the model did write markup
    with browser_page() as page:
        page.goto(f"{server.base}/playground")
        page.wait_for_selector(f"#model option[value='{QWEN_CODER}']", state="attached")
        fill(page, mode="completion", prompt=prompt, max_tokens=24, temperature=0)
        run(page)
        assert answer(page) == api.choices[0].text
        assert page.locator("#answer-spec script, #answer-spec *:not(span)").count() == 0
        assert page.evaluate("() => window.pwned === undefined")
