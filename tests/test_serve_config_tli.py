"""serve_config_tli.yaml (Gemma 3 270M drafted by SmolLM2-135M, whose tokenizer differs: TLI), started
as a user starts it (`serve run serve_config_tli.yaml`): the checks every shipped config passes
(serve_config_checks.py), then what is Gemma's own: pythonic tool calls, an agent framework's tool
loop, a BOS token once.

The config is the shipped file with only its two ports moved to free ones, and the test checks that
the processes answering on them belong to the `serve run` it started (a server already on 8000
must not be tested in its place)."""
from pathlib import Path

import httpx
import openai
import pytest

from conftest import GEMMA3
from serve_config_checks import *  # noqa: F401,F403  the checks every shipped config passes
from serve_config_checks import ServedConfig
from servers import serve_run
from engine import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve_run(ROOT / "serve_config_tli.yaml", tmp_path_factory.mktemp("serve")) as (base, grpc_port):
        yield ServedConfig(base, grpc_port, GEMMA3)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(api_key="EMPTY", base_url=f"{server.base}/v1")


@pytest.fixture(scope="module")
def plain():
    return LLM(model=GEMMA3, max_model_len=1024)


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150}}}


def test_json_schema_and_tool_calls(client, plain):
    """Gemma 3 target, SmolLM2 draft through TLI, adaptive K: schema answers that
    validate, sampled and greedy, greedy equal to plain decoding under the same schema, and a named
    tool call whose arguments follow the tool's parameters."""
    import json

    import jsonschema

    messages = [{"role": "user", "content": "Alice is 30 years old. Reply with her as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for seed in range(4):
        chat = client.chat.completions.create(model=GEMMA3, messages=messages, max_tokens=64, temperature=1.0,
                                              seed=seed, response_format=fmt)
        assert chat.choices[0].finish_reason == "stop"  # the schema bounds every value: it always ends
        jsonschema.validate(json.loads(chat.choices[0].message.content), PERSON)
    prompt = "Alice is 30 years old. As JSON:\n"
    served = client.completions.create(model=GEMMA3, prompt=prompt, max_tokens=64, temperature=0,
                                       extra_body={"structured_outputs": {"json": PERSON}}).choices[0].text
    offline = plain.generate(
        prompt, SamplingParams(temperature=0, max_tokens=64, structured_outputs={"json": PERSON}))[0].outputs[0].text
    assert served == offline
    jsonschema.validate(json.loads(served), PERSON)
    tools = [{"type": "function", "function": {"name": "add_person", "parameters": PERSON}}]
    call = client.chat.completions.create(model=GEMMA3, messages=messages, max_tokens=64, temperature=0, tools=tools,
                                          tool_choice={"type": "function", "function": {"name": "add_person"}})
    assert call.choices[0].finish_reason == "tool_calls"
    (tool_call,) = call.choices[0].message.tool_calls
    assert tool_call.function.name == "add_person"
    jsonschema.validate(json.loads(tool_call.function.arguments), PERSON)


def test_auto_tool_calls_are_lossless(client, plain):
    """tool_choice 'auto' on the TLI config (pythonic calls): a call forced by a logit_bias on '['
    names a tool and validates against its schema; greedy, it is the call offline plain decoding of
    the same conversation makes (LLM.chat with the same tools and parser): speculation through TLI
    drafts checked against the lazy grammar changes nothing."""
    import json

    import jsonschema

    weather = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
               "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": weather}}]
    messages = [{"role": "user", "content": "What's the weather in Rome for the next 2 days?"}]
    [bracket] = plain.get_tokenizer().encode("[", add_special_tokens=False)
    served = client.chat.completions.create(model=GEMMA3, messages=messages, tools=tools, temperature=0, max_tokens=40,
                                            logit_bias={str(bracket): 30}).choices[0]
    assert served.finish_reason == "tool_calls" and served.message.content is None
    (call,) = served.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), weather)
    offline = plain.chat(messages, SamplingParams(temperature=0, max_tokens=40, logit_bias={bracket: 30}), tools=tools,
                         tool_parser="pythonic")[0].outputs[0]
    assert offline.tool_calls == [{"name": call.function.name, "arguments": call.function.arguments}]
    unforced = client.chat.completions.create(model=GEMMA3, messages=messages, tools=tools, temperature=0,
                                              max_tokens=24).choices[0]
    text = plain.chat(messages, SamplingParams(temperature=0, max_tokens=24), tools=tools,
                      tool_parser="pythonic")[0].outputs[0]
    assert (unforced.message.content, [c.function.name for c in unforced.message.tool_calls or []]) == \
        (text.content, [c["name"] for c in text.tool_calls])


def test_pydantic_ai_agent_runs_a_tool_loop(server):
    """An agent framework, unmodified (pydantic-ai: typed tools from Python functions, OpenAI's wire
    format, the loop run for you; pinned in the test extra), against the TLI config's app: the model calls
    the tool, the framework runs it and sends the result back as a tool message, the model answers.
    Gemma 3 270M does not call tools unprompted, and once shown a call it calls again and again, so
    the test's HTTP transport steers it with a logit_bias on '[' (pythonic calls begin with it): for
    it in the first request, against it once a tool result is in the conversation. The framework
    sees an ordinary server."""
    import asyncio
    import json
    from typing import Literal

    from pydantic_ai import Agent
    from pydantic_ai.messages import ToolCallPart, ToolReturnPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    [bracket] = httpx.post(f"{server.base}/tokenize", json={"prompt": "[", "add_special_tokens": False}).json()["tokens"]
    bodies: list[dict] = []

    class FirstCallBiased(httpx.AsyncHTTPTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            body = json.loads(request.content)
            bodies.append(body)
            answered = any(m.get("role") == "tool" for m in body.get("messages", []))
            if body.get("messages") is not None:
                body["logit_bias"] = {str(bracket): -100 if answered else 30}
                content = json.dumps(body).encode()
                request = httpx.Request(request.method, request.url, content=content,
                                        headers={**request.headers, "content-length": str(len(content))})
            return await super().handle_async_request(request)

    calls: list[str] = []

    async def run():
        async with httpx.AsyncClient(transport=FirstCallBiased(), timeout=300) as http:
            model = OpenAIChatModel(GEMMA3, provider=OpenAIProvider(base_url=f"{server.base}/v1", api_key="EMPTY",
                                                                    http_client=http))
            agent = Agent(model, model_settings={"temperature": 0, "max_tokens": 40, "parallel_tool_calls": False})

            @agent.tool_plain  # an enum, so the bias on '[' can't fill a string argument
            def get_weather(city: Literal["Paris", "Rome", "Tokyo"]) -> str:
                """The weather in a city."""
                calls.append(city)
                return f"Sunny and 21 C in {city}."

            return await agent.run("What's the weather in Paris?")

    result = asyncio.run(run())
    assert len(calls) == 1 and calls[0] in ("Paris", "Rome", "Tokyo")  # the tool ran once, with the model's argument
    parts = [p for m in result.all_messages() for p in m.parts]
    assert any(isinstance(p, ToolCallPart) and p.tool_name == "get_weather" for p in parts)
    assert any(isinstance(p, ToolReturnPart) and "Sunny" in str(p.content) for p in parts)
    assert isinstance(result.output, str)
    assert bodies[0]["tools"][0]["function"]["name"] == "get_weather" and len(bodies) == 2
    assert [m["role"] for m in bodies[1]["messages"]][-2:] == ["assistant", "tool"]


def test_tokenized_prompt_completes_as_the_text_with_one_bos(server, client):
    """A remote-tokenizer client (lm-evaluation-harness's) reads /tokenizer_info, tokenizes through
    /tokenize and sends token ids: it gets the text's greedy completion, with Gemma's BOS once."""
    info = httpx.get(f"{server.base}/tokenizer_info").json()
    assert info["tokenizer_class"] and info["eos_token"] == "<eos>" and info["add_bos_token"] is True

    def tokenize(text: str, special: bool) -> list[int]:
        body = {"model": GEMMA3, "prompt": text, "add_special_tokens": special}
        return httpx.post(f"{server.base}/tokenize", json=body).json()["tokens"]

    [bos] = tokenize(info["bos_token"], False)
    text = "The capital of France is"
    ids = tokenize(text, True)
    assert ids == [bos, *tokenize(text, False)] and ids.count(bos) == 1
    as_text = client.completions.create(model=GEMMA3, prompt=text, max_tokens=16, temperature=0)
    as_ids = client.completions.create(model=GEMMA3, prompt=ids, max_tokens=16, temperature=0)
    assert as_ids.choices[0].text == as_text.choices[0].text
    assert as_ids.usage.prompt_tokens == as_text.usage.prompt_tokens == len(ids)
