"""Structured outputs and tool calls over HTTP (the official openai client) and gRPC, against a real
server (Ray Serve on 127.0.0.1, its own free ports): response_format, vLLM's structured_outputs,
tool_choice 'required', named and 'auto' (pythonic calls), tool results in the conversation, and the
errors of each. The tiny random model's text is random,
but held to the grammar, which is what these tests check."""
import asyncio
import json
import re
import time

import grpc
import httpx
import jsonschema
import openai
import pytest

from servers import serve_app
from tandem_proto import tandem_pb2 as pb
from tandem_proto import tandem_pb2_grpc

TARGET, DRAFT = "random:tiny-llama-json:1", "random:tiny-llama-json:2"
M = "structured-suite"
MAX_MODEL_LEN = 1024
INTERNALS = re.compile(r"Traceback|File \"|\.py\b|site-packages|/root|/tmp/|/home/|RayTaskError")
MSG = [{"role": "user", "content": "give me json"}]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def server():
    args = {"model": TARGET, "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 4, "served_model_name": M,
            "speculative_config": {"model": DRAFT, "num_speculative_tokens": 3},
            "enable_auto_tool_choice": True, "tool_call_parser": "pythonic", "reasoning_parser": "qwen3"}
    with serve_app("structured", args) as (base, grpc_address):
        channel = grpc.insecure_channel(grpc_address)
        yield {"base": base, "stub": tandem_pb2_grpc.TandemServiceStub(channel)}
        channel.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(api_key="EMPTY", base_url=f"{server['base']}/v1", max_retries=0, timeout=120)


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def streamed_chat(client, **kw) -> tuple[str, str, list]:
    """(content, finish_reason, chunks) of a streamed chat completion."""
    chunks = list(client.chat.completions.create(model=M, messages=MSG, stream=True, **kw))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1, finish
    return content, finish[0], chunks


def bad_request(call) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    error = info.value.body
    assert not INTERNALS.search(json.dumps(error)), error
    return info.value


# -- response_format and structured_outputs ---------------------------------------------------

# few properties: the JSON grammar's default whitespace lets the random model pad every gap
SMALL = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
         "required": ["name", "ok"], "additionalProperties": False}


@pytest.mark.parametrize("seed", [0, 1])
def test_json_schema_response_format(client, seed):
    """response_format json_schema (the JSON grammar's default whitespace), streamed and not: the
    output is JSON that validates, and streaming it gives the same text."""
    kw = dict(response_format=json_schema_format(SMALL), temperature=1, seed=seed, max_tokens=600)
    chat = client.chat.completions.create(model=M, messages=MSG, **kw)
    assert chat.choices[0].finish_reason == "stop", chat.choices[0].message.content
    text = chat.choices[0].message.content
    jsonschema.validate(json.loads(text), SMALL)
    content, finish, _ = streamed_chat(client, **kw)
    assert (content, finish) == (text, "stop")


@pytest.mark.parametrize("seed", [3, 4, 5, 6])
def test_json_schema_without_whitespace(client, seed):
    """vLLM's structured_outputs (extra_body), on chat and completions: compact JSON that validates."""
    so = {"json": PERSON, "disable_any_whitespace": True}
    chat = client.chat.completions.create(model=M, messages=MSG, temperature=1, seed=seed, max_tokens=200,
                                          extra_body={"structured_outputs": so})
    text = chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)
    assert json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False) == text  # no whitespace
    done = client.completions.create(model=M, prompt="json:", temperature=1, seed=seed, max_tokens=200,
                                     extra_body={"structured_outputs": so})
    assert done.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(done.choices[0].text), PERSON)


def test_response_format_on_completions(client):
    done = client.completions.create(model=M, prompt="json:", temperature=1, seed=7, max_tokens=600,
                                     extra_body={"response_format": json_schema_format(SMALL)})
    assert done.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(done.choices[0].text), SMALL)


def test_greedy_with_a_schema_is_reproducible(client):
    kw = dict(model=M, messages=MSG, temperature=0, max_tokens=200,
              extra_body={"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}})
    first = client.chat.completions.create(**kw).choices[0].message.content
    assert client.chat.completions.create(**kw).choices[0].message.content == first
    jsonschema.validate(json.loads(first), PERSON)


def test_json_object(client):
    """Any JSON object; the random model may nest without end, so some seeds run out of tokens: those
    that finish are objects, and at least one does."""
    finished = 0
    for seed in range(3):
        chat = client.chat.completions.create(model=M, messages=MSG, temperature=1, seed=seed, max_tokens=200,
                                              response_format={"type": "json_object"})
        text = chat.choices[0].message.content
        assert text.lstrip().startswith("{")
        if chat.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
            finished += 1
    assert finished >= 1


def test_regex_and_choice(client):
    pattern = r"[a-z]{3}-[0-9]{2,4}"
    for seed in range(3):
        chat = client.chat.completions.create(model=M, messages=MSG, temperature=1, seed=seed, max_tokens=20,
                                              extra_body={"structured_outputs": {"regex": pattern}})
        assert re.fullmatch(pattern, chat.choices[0].message.content), chat.choices[0].message.content
        done = client.completions.create(model=M, prompt="x", temperature=1, seed=seed, max_tokens=20,
                                         extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
        assert done.choices[0].text in ("red", "green", "blue") and done.choices[0].finish_reason == "stop"
    text_format = client.chat.completions.create(model=M, messages=MSG, max_tokens=5, response_format={"type": "text"})
    assert text_format.choices[0].finish_reason in ("stop", "length")


def test_structured_errors(client):
    e = bad_request(lambda: client.chat.completions.create(
        model=M, messages=MSG, response_format=json_schema_format({"type": "strin"})))
    assert e.body["param"] == "response_format" and "strin" in e.body["message"], e.body
    assert e.body["message"].startswith("response_format.json_schema.schema: the grammar does not compile")
    e = bad_request(lambda: client.chat.completions.create(
        model=M, messages=MSG, response_format=json_schema_format({"$ref": "#/$defs/missing"})))
    assert e.body["param"] == "response_format" and "missing" in e.body["message"], e.body
    e = bad_request(lambda: client.chat.completions.create(model=M, messages=MSG, response_format={"type": "yaml"}))
    assert e.body["param"] == "response_format", e.body
    e = bad_request(lambda: client.chat.completions.create(
        model=M, messages=MSG, response_format={"type": "json_schema"}))
    assert e.body["param"] == "response_format", e.body
    e = bad_request(lambda: client.completions.create(
        model=M, prompt="x", extra_body={"structured_outputs": {"regex": "(unclosed"}}))
    assert e.body["param"] == "structured_outputs" and "unclosed" in e.body["message"], e.body
    e = bad_request(lambda: client.completions.create(
        model=M, prompt="x", extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}))
    assert e.body["param"] == "structured_outputs" and "exactly one" in e.body["message"], e.body
    e = bad_request(lambda: client.completions.create(
        model=M, prompt="x", extra_body={"structured_outputs": {"jsonn": {}}}))
    assert e.body["param"] == "structured_outputs", e.body
    e = bad_request(lambda: client.chat.completions.create(
        model=M, messages=MSG, response_format={"type": "json_object"},
        extra_body={"structured_outputs": {"regex": "a"}}))
    assert e.body["param"] == "structured_outputs", e.body
    # completions have no tools
    e = bad_request(lambda: client.completions.create(model=M, prompt="x", extra_body={"tools": TOOLS}))
    assert e.body["param"] == "tools", e.body


def test_hostile_schemas_are_answered_quickly_and_others_are_served(server):
    """Schemas that are costly to compile (a nested ambiguous pattern, a 20,000-entry enum, deep
    nesting, a huge alternation) are answered, with a 400 or valid output, in bounded time, while a
    normal request at the same time completes."""
    huge_enum = {"enum": [f"v{i}" for i in range(20_000)]}
    nested = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^((a|aa)*)*(b|ab)*((a|aa)*)*c$"}},
              "required": ["s"]}
    deep: dict = {"type": "string", "maxLength": 3}
    for _ in range(12):
        deep = {"type": "array", "items": deep, "maxItems": 1}
    many_refs = {"$defs": {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}] * 2} for i in range(24)}
                 | {"d24": {"type": "string"}}, "$ref": "#/$defs/d0"}
    normal = {"model": M, "prompt": "the bystander", "max_tokens": 32, "temperature": 0, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(timeout=120) as http:
            async def post(schema):
                start = time.monotonic()
                r = await http.post(f"{server['base']}/v1/chat/completions", json={
                    "model": M, "messages": MSG, "max_tokens": 64, "temperature": 1, "seed": 0,
                    "response_format": json_schema_format(schema)})
                return r, time.monotonic() - start

            async def bystander():
                r = await http.post(f"{server['base']}/v1/completions", json=normal)
                return r

            return await asyncio.gather(*(post(s) for s in (huge_enum, nested, deep, many_refs)), bystander())

    *hostile, by = asyncio.run(main())
    assert by.status_code == 200 and by.json()["usage"]["completion_tokens"] == 32
    for (r, elapsed), schema in zip(hostile, ["huge_enum", "nested", "deep", "many_refs"]):
        assert elapsed < 60, (schema, elapsed)
        assert r.status_code in (200, 400), (schema, r.text)
        assert not INTERNALS.search(r.text), r.text
        if r.status_code == 400:
            assert r.json()["error"]["param"] == "response_format", r.text
        elif r.json()["choices"][0]["finish_reason"] == "stop":
            json.loads(r.json()["choices"][0]["message"]["content"])


# -- tools ----------------------------------------------------------------------------------------

NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_named_tool_call(client):
    chat = client.chat.completions.create(model=M, messages=MSG, tools=TOOLS, tool_choice=NAMED, temperature=0,
                                          max_tokens=200)
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert re.fullmatch(r"call_[0-9a-f]{24}", call.id) and call.type == "function"
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)

    chunks = list(client.chat.completions.create(model=M, messages=MSG, tools=TOOLS, tool_choice=NAMED,
                                                 temperature=0, max_tokens=200, stream=True,
                                                 stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    assert all(tc.index == 0 and tc.id is None for tc in calls[1:]) and len(calls) > 2  # arguments in pieces
    arguments = "".join(tc.function.arguments or "" for tc in calls)
    assert arguments == call.function.arguments
    assert not any(d.content for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens


def test_named_tool_call_seeded(client):
    for seed in range(3):
        chat = client.chat.completions.create(model=M, messages=MSG, tools=TOOLS, temperature=1, seed=seed,
                                              tool_choice={"type": "function", "function": {"name": "get_time"}})
        (call,) = chat.choices[0].message.tool_calls
        assert call.function.name == "get_time" and chat.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.function.arguments), TIME)


def test_required_tool_calls(client):
    """The random model may go on adding calls to the array without end: seeds that run out of tokens
    end with their text as content; those that finish have valid calls, and some do."""
    finished = 0
    for seed in range(10):
        if finished == 2:
            break
        kw = dict(model=M, messages=MSG, tools=TOOLS, tool_choice="required", temperature=1, seed=seed,
                  max_tokens=300)
        chat = client.chat.completions.create(**kw)
        choice = chat.choices[0]
        if choice.finish_reason == "length":
            assert choice.message.content.startswith("[") and not choice.message.tool_calls
            continue
        finished += 1
        assert choice.finish_reason == "tool_calls", choice.message.content
        assert choice.message.tool_calls and choice.message.content is None
        for call in choice.message.tool_calls:
            assert call.function.name in SCHEMAS and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        ids = [c.id for c in choice.message.tool_calls]
        assert len(set(ids)) == len(ids)
        # streamed: the same calls (the same seed), whole, then finish_reason tool_calls
        chunks = list(client.chat.completions.create(**kw, stream=True))
        streamed = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
        assert [(tc.index, tc.function.name, tc.function.arguments) for tc in streamed] == \
            [(i, c.function.name, c.function.arguments) for i, c in enumerate(choice.message.tool_calls)]
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
            ["tool_calls"]
    assert finished == 2


# a tool whose parameters refer to their own $defs: under 'required' they move to the schema's root
DEFS = {"type": "object", "$defs": {"unit": {"type": "string", "enum": ["c", "f"]}},
        "properties": {"unit": {"$ref": "#/$defs/unit"}}, "required": ["unit"], "additionalProperties": False}


def test_required_single_call(client):
    tools = [*TOOLS, {"type": "function", "function": {"name": "pick_unit", "parameters": DEFS}}]
    schemas = {**SCHEMAS, "pick_unit": DEFS}
    for seed in range(3):
        chat = client.chat.completions.create(model=M, messages=MSG, tools=tools, tool_choice="required",
                                              parallel_tool_calls=False, temperature=1, seed=seed, max_tokens=400)
        (call,) = chat.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    chat = client.chat.completions.create(model=M, messages=MSG, tools=tools, temperature=1, seed=0,
                                          tool_choice={"type": "function", "function": {"name": "pick_unit"}})
    assert json.loads(chat.choices[0].message.tool_calls[0].function.arguments)["unit"] in ("c", "f")
    other = {**DEFS, "$defs": {"unit": {"type": "integer"}}}
    e = bad_request(lambda: client.chat.completions.create(
        model=M, messages=MSG, tool_choice="required",
        tools=[*tools, {"type": "function", "function": {"name": "other", "parameters": other}}]))
    assert e.body["param"] == "tools" and "unit" in e.body["message"]


def test_tool_call_cut_short_is_content(client):
    chat = client.chat.completions.create(model=M, messages=MSG, tools=TOOLS, tool_choice="required",
                                          temperature=0, max_tokens=5)
    choice = chat.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content.startswith("[")
    content, finish, _ = streamed_chat(client, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=5)
    assert (content, finish) == (choice.message.content, "length")


def test_tool_choice_none_is_plain_text(client):
    chat = client.chat.completions.create(model=M, messages=MSG, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert chat.choices[0].message.tool_calls is None and chat.choices[0].finish_reason in ("stop", "length")


def test_tool_errors(client):
    e = bad_request(lambda: client.chat.completions.create(
        model=M, messages=MSG, tools=TOOLS, response_format={"type": "json_object"}))  # auto by default
    assert e.body["param"] == "response_format" and "auto" in e.body["message"]
    e = bad_request(lambda: client.chat.completions.create(
        model=M, messages=MSG, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}))
    assert e.body["param"] == "tool_choice" and "nope" in e.body["message"]
    e = bad_request(lambda: client.chat.completions.create(model=M, messages=MSG, tool_choice="required"))
    assert e.body["param"] == "tool_choice"
    e = bad_request(lambda: client.chat.completions.create(
        model=M, messages=MSG, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}))
    assert e.body["param"] == "response_format"

    def tools_error(tools, tool_choice="required"):
        e = bad_request(lambda: client.chat.completions.create(model=M, messages=MSG, tools=tools,
                                                               tool_choice=tool_choice))
        assert e.body["param"] == "tools", e.body
        return e.body["message"]

    fn = TOOLS[0]["function"]
    assert "unique" in tools_error([TOOLS[0], TOOLS[0]])
    assert "name" in tools_error([{"type": "function", "function": {**fn, "name": "has space"}}])
    assert "name" in tools_error([{"type": "function", "function": {**fn, "name": "x" * 65}}])
    assert "128" in tools_error([{"type": "function", "function": {**fn, "name": f"f{i}"}} for i in range(129)])
    assert "object" in tools_error([{"type": "function", "function": {**fn, "parameters": {"type": "string"}}}])
    tools_error([{"type": "retrieval"}])
    tools_error([{"type": "function", "function": {"description": "no name"}}])
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "strin"}}}}}]
    assert "strin" in tools_error(bad)
    assert tools_error(bad, {"type": "function", "function": {"name": "f"}}).startswith(
        "tools[0].function.parameters: the grammar does not compile")


# -- gRPC -----------------------------------------------------------------------------------------

def test_grpc_structured_outputs(server):
    stub = server["stub"]
    so = pb.StructuredOutputs(json_schema=json.dumps(PERSON), disable_any_whitespace=True)
    r = stub.Generate(pb.GenerateRequest(model=M, prompt="json:", max_tokens=200, temperature=1, seed=1,
                                         structured_outputs=so), timeout=120)
    assert r.finish_reason == "stop"
    jsonschema.validate(json.loads(r.text), PERSON)
    text = "".join(m.text for m in stub.GenerateStream(pb.GenerateRequest(
        model=M, messages=[pb.ChatMessage(role="user", content="hi")], max_tokens=20, temperature=1, seed=2,
        structured_outputs=pb.StructuredOutputs(choice=pb.ChoiceList(choices=["yes", "no"]))), timeout=120))
    assert text in ("yes", "no")
    r = stub.Generate(pb.GenerateRequest(model=M, prompt="x", max_tokens=20,
                                         structured_outputs=pb.StructuredOutputs(regex="[0-9]{4}")), timeout=120)
    assert re.fullmatch("[0-9]{4}", r.text)
    for bad in (pb.StructuredOutputs(json_schema='{"type": "strin"}'), pb.StructuredOutputs(regex="(unclosed"),
                pb.StructuredOutputs(json_schema="{not json"), pb.StructuredOutputs()):
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(pb.GenerateRequest(model=M, prompt="x", structured_outputs=bad), timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "structured_outputs" in info.value.details() and not INTERNALS.search(info.value.details())


# -- tool_choice 'auto' (pythonic calls: an answer that begins with '[' is a list of calls) ----------

@pytest.fixture(scope="module")
def bracket(server) -> dict:
    """A logit_bias that makes the random model begin its answer with '[': a call, then held to the tools."""
    [token] = httpx.post(f"{server['base']}/tokenize", json={"prompt": "[", "add_special_tokens": False}).json()["tokens"]
    return {str(token): 100}


def check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_auto_tool_choice_calls_tools_that_validate_or_answers_in_text(client, bracket):
    for seed in range(3):
        chat = client.chat.completions.create(model=M, messages=MSG, tools=TOOLS, max_tokens=200, temperature=1,
                                              seed=seed, logit_bias=bracket)
        choice = chat.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        check_calls(choice.message.tool_calls)
    texts = 0
    for seed in range(6):  # unforced: the random model mostly writes text; either way it's well formed
        chat = client.chat.completions.create(model=M, messages=MSG, tools=TOOLS, tool_choice="auto", max_tokens=30,
                                              temperature=1, seed=seed)
        choice = chat.choices[0]
        if choice.message.tool_calls:
            check_calls(choice.message.tool_calls)
        else:
            texts += 1
            assert choice.finish_reason in ("stop", "length") and not choice.message.content.startswith("[")
    assert texts


def test_auto_tool_calls_stream_as_openai_streams_them(client, bracket):
    kw = dict(model=M, messages=MSG, tools=TOOLS, max_tokens=200, temperature=1, seed=5, logit_bias=bracket)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    chunks = list(client.chat.completions.create(stream=True, **kw))
    calls: dict[int, dict] = {}
    for c in chunks:
        delta = c.choices[0].delta
        assert not delta.content  # the '[' and the calls' text never come as content
        for d in delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
            assert d.id is None or d.id == entry["id"]
            entry["arguments"] += d.function.arguments or ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == \
        [(t.function.name, json.loads(t.function.arguments)) for t in whole]
    assert len({entry["id"] for entry in calls.values()}) == len(calls)


def test_parallel_tool_calls_false_makes_at_most_one_call(client, bracket):
    for seed in range(3):
        chat = client.chat.completions.create(model=M, messages=MSG, tools=TOOLS, max_tokens=200, temperature=1,
                                              seed=seed, logit_bias=bracket, parallel_tool_calls=False)
        assert len(chat.choices[0].message.tool_calls) == 1
        check_calls(chat.choices[0].message.tool_calls)


def test_a_tool_loop_call_then_result_then_answer(client, bracket):
    tools = TOOLS[1:]  # one tool: the tools' listing and the loop fit this character model's 1024 tokens
    first = client.chat.completions.create(model=M, messages=MSG, tools=tools, max_tokens=60, temperature=1, seed=1,
                                           logit_bias=bracket).choices[0].message
    check_calls(first.tool_calls)
    messages = MSG + [first.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": call.id, "content": "UTC+1"} for call in first.tool_calls]
    answer = client.chat.completions.create(model=M, messages=messages, tools=tools, max_tokens=8, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the call and its result went into the prompt
    alone = client.chat.completions.create(model=M, messages=MSG, tools=tools, max_tokens=1).usage.prompt_tokens
    assert answer.usage.prompt_tokens >= alone + len("<tool_response>UTC+1</tool_response>get_time()")


def test_bad_tool_messages_get_400_naming_the_field(client):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    cases = [
        (MSG + [{"role": "tool", "tool_call_id": "call_1", "content": "x"}], "messages[1]"),
        (MSG + [{"role": "assistant", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "call_2", "content": "x"}],
         "messages[2].tool_call_id"),
        (MSG + [{"role": "assistant", "tool_calls": [{**call, "function": {"name": "get_time", "arguments": "{"}}]}],
         "messages[1].tool_calls[0].function.arguments"),
    ]
    for messages, param in cases:
        e = bad_request(lambda: client.chat.completions.create(model=M, messages=messages, tools=TOOLS, max_tokens=4))
        assert e.body["param"] == param, e.body


def test_grpc_returns_the_same_typed_tool_calls(server, bracket):
    stub = server["stub"]
    tools = [pb.Tool(name=t["function"]["name"], description=t["function"].get("description", ""),
                     parameters=json.dumps(t["function"]["parameters"])) for t in TOOLS]
    request = pb.GenerateRequest(model=M, messages=[pb.ChatMessage(role="user", content="hi")], tools=tools,
                                 max_tokens=200, temperature=1, seed=3,
                                 logit_bias={int(k): v for k, v in bracket.items()})
    whole = stub.Generate(request, timeout=120)
    assert whole.finish_reason == "tool_calls" and whole.text == "" and whole.tool_calls
    for call in whole.tool_calls:
        assert call.id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    pieces = list(stub.GenerateStream(request, timeout=120))
    calls: dict[int, list[str]] = {}
    for piece in pieces:
        assert piece.text == ""  # a call's text never comes as text
        for d in piece.tool_calls:
            entry = calls.setdefault(d.index, [d.name, ""])
            entry[1] += d.arguments
    assert [p.finish_reason for p in pieces if p.finish_reason] == ["tool_calls"]
    assert sum(len(p.token_ids) for p in pieces) == len(whole.token_ids)
    assert [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))] == \
        [(c.name, json.loads(c.arguments)) for c in whole.tool_calls]
    # the loop: the call and its result go back as messages
    answered = stub.Generate(pb.GenerateRequest(model=M, max_tokens=4, temperature=0, tools=tools[1:], messages=[
        pb.ChatMessage(role="user", content="hi"),
        pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="call_1", name="get_time", arguments='{"zone": "UTC"}')]),
        pb.ChatMessage(role="tool", tool_call_id="call_1", content="12:00")]), timeout=120)
    assert answered.finish_reason in ("stop", "length", "tool_calls")
    for bad in [pb.GenerateRequest(model=M, prompt="hi", tools=tools),
                pb.GenerateRequest(model=M, messages=[pb.ChatMessage(role="user", content="hi"),
                                                      pb.ChatMessage(role="tool", tool_call_id="x", content="1")]),
                pb.GenerateRequest(model=M, messages=[pb.ChatMessage(role="user", content="hi")],
                                   tools=[pb.Tool(name="f", parameters="{not json")])]:
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(bad, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and not INTERNALS.search(e.value.details())


def test_reasoning_comes_apart_from_the_answer(client, server):
    """The qwen3 reasoning parser: an answer that begins with <think> is thinking up to </think>. A
    regex makes the random model write one (this template doesn't open the thinking, so the grammar
    holds the whole output)."""
    regex = {"regex": "<think>[a-z]{3,12}</think>[a-z]{2,8}"}
    kw = dict(model=M, messages=MSG, max_tokens=40, temperature=1, seed=4, extra_body={"structured_outputs": regex})
    message = client.chat.completions.create(**kw).choices[0].message
    thinking, answer = message.model_extra["reasoning_content"], message.content
    assert re.fullmatch("[a-z]{3,12}", thinking) and re.fullmatch("[a-z]{2,8}", answer)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = ["".join(getattr(c.choices[0].delta, key, None) or "" for c in chunks if c.choices)
                for key in ("reasoning_content", "content")]
    assert streamed == [thinking, answer]
    request = pb.GenerateRequest(model=M, messages=[pb.ChatMessage(role="user", content="give me json")], max_tokens=40,
                                 temperature=1, seed=4, structured_outputs=pb.StructuredOutputs(regex=regex["regex"]))
    assert server["stub"].Generate(request, timeout=60).reasoning == thinking  # the same over gRPC
    pieces = list(server["stub"].GenerateStream(request, timeout=60))
    assert ["".join(p.reasoning for p in pieces), "".join(p.text for p in pieces)] == [thinking, answer]
    plain = client.chat.completions.create(model=M, messages=MSG, max_tokens=8, temperature=0).choices[0].message
    assert plain.model_extra["reasoning_content"] is None and plain.content  # no thinking: all answer
    e = bad_request(lambda: client.chat.completions.create(model=M, messages=MSG, max_tokens=4,
                                                           extra_body={"chat_template_kwargs": {"messages": []}}))
    assert "chat_template_kwargs" in e.body["message"]
    ok = client.chat.completions.create(model=M, messages=MSG, max_tokens=4,
                                        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert ok.choices[0].finish_reason in ("stop", "length")
