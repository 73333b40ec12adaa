"""Tool-call formats without a model: the parsers on text as each family's models write it (fixtures
written down from their chat templates' instructions and their published outputs), streamed in any
pieces the same as whole; malformed and hostile text; the lazy grammars accept exactly the calls
the tools allow (llguidance with SmolLM2's real tokenizer); the conversation's tool turns checked and
rendered; a streamed auto answer as OpenAI's deltas, equal to the non-streamed message."""
import json
import random
import time

import jsonschema
import pytest

from deployments.api_errors import RequestError
from deployments.protocol import ChatCompletionRequest
from deployments.tool_calls import ToolCalls, ToolCallStream, chat_message, conversation
from engine.chat import chat_prompt_ids, plain_conversation
from engine.tool_parsers import FORMATS, MAX_CALLS, CallArguments, CallStart, Content, ToolSpec, tool_format

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]},
                                            "days": {"type": "integer", "minimum": 1}, "metric": {"type": "boolean"}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [ToolSpec("get_weather", WEATHER), ToolSpec("get_time", {"type": "object", "properties": {}})]

# (format, text, content, [(name, arguments)]) as the families' models write calls
REAL = [
    ("hermes", 'I will look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
               '</tool_call>', "I will look that up.", [("get_weather", {"city": "Paris", "unit": "c"})]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
               '{"name": "get_time", "arguments": {}}\n</tool_call>', "",
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("hermes", "The capital of France is Paris.", "The capital of France is Paris.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "San Francisco", "metric": true}}', "",
     [("get_weather", {"city": "San Francisco", "metric": True})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}',
     "", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("llama3_json", "It is sunny, {as usual}.", "It is sunny, {as usual}.", []),
    ("pythonic", "[get_weather(city='San Francisco', metric=True), get_time()]", "",
     [("get_weather", {"city": "San Francisco", "metric": True}), ("get_time", {})]),
    ("pythonic", '[get_weather(city="Paris", days=3, unit=None)]', "",
     [("get_weather", {"city": "Paris", "days": 3, "unit": None})]),
    ("pythonic", "Sure! [1] is a citation.", "Sure! [1] is a citation.", []),
]


def parse(fmt: str, pieces: list[str]):
    parser = tool_format(fmt).parser()
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    return parser, events


def pieces_of(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("fmt,text,content,calls", REAL, ids=[f"{r[0]}-{i}" for i, r in enumerate(REAL)])
def test_each_family_s_calls_parse_whole_and_in_any_pieces(fmt, text, content, calls):
    rng = random.Random(0)
    for pieces in [[text], list(text)] + [pieces_of(text, rng) for _ in range(20)]:
        parser, events = parse(fmt, pieces)
        assert parser.content.strip() == content
        assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == calls
        assert all(c.complete for c in parser.calls)
        # the events say the same: content pieces, then each call's name and argument fragments
        said = "".join(e.text for e in events if isinstance(e, Content))
        assert said == parser.content
        names = [e.name for e in events if isinstance(e, CallStart)]
        args = ["".join(e.text for e in events if isinstance(e, CallArguments) and e.index == i)
                for i in range(len(names))]
        assert list(zip(names, [json.loads(a) for a in args])) == calls


def test_no_trigger_text_is_ever_said_as_content():
    text = 'Let me check <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    for n in range(1, len(text) + 1):
        parser = tool_format("hermes").parser()
        said = "".join(e.text for e in parser.feed(text[:n]) if isinstance(e, Content))
        assert "<" not in said and said in "Let me check"  # a trigger's beginning is held back


@pytest.mark.parametrize("fmt,text,content,calls", [
    # a trigger inside a string argument is the string's
    ("hermes", '<tool_call>{"name": "echo", "arguments": {"s": "<tool_call>}]"}}</tool_call>', "",
     [("echo", {"s": "<tool_call>}]"})]),
    ("pythonic", '[echo(s="]), f(")]', "", [("echo", {"s": "]), f("})]),
    # an unreadable opening: the text is content, trigger included
    ("hermes", "a <tool_call> not json at all </tool_call>", "a <tool_call> not json at all </tool_call>", []),
    ("hermes", 'a <tool_call>{"nam": 1}', 'a <tool_call>{"nam": 1}', []),
    ("pythonic", "[not a call]", "[not a call]", []),
    ("pythonic", "[f(x=1) g(y=2)]", "[f(x=1) g(y=2)]", []),
    ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
])
def test_malformed_and_hostile_text_becomes_content_or_calls_but_never_fails(fmt, text, content, calls):
    for pieces in ([text], list(text)):
        parser, _ = parse(fmt, pieces)
        assert parser.content == content
        assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == calls


def test_an_unclosed_call_is_a_call_begun_with_the_arguments_so_far():
    parser, _ = parse("hermes", ['ok <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'])
    assert parser.content == "ok" and len(parser.calls) == 1
    assert parser.calls[0].name == "get_weather" and parser.calls[0].arguments == '{"city": "Pa'
    assert not parser.calls[0].complete
    parser, _ = parse("pythonic", ['[get_time(), get_weather(city="Pa'])
    assert [c.name for c in parser.calls] == ["get_time"]  # a pythonic call is said whole or not at all
    assert parser.content.strip() == 'get_weather(city="Pa'


def test_hostile_sizes_are_bounded_work():
    one = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    for fmt, text in [("hermes", one * 10_000),
                      ("pythonic", "[" + ", ".join(["f()"] * 10_000) + "]"),
                      ("llama3_json", "; ".join(['{"name": "f", "parameters": {}}'] * 10_000)),
                      ("hermes", '<tool_call>{"name": "f", "arguments": ' + "{\"a\": " * 50_000 + "1" + "}" * 50_000 + "}</tool_call>"),
                      ("pythonic", "[f(a=" + "[" * 50_000 + "]" * 50_000 + ")]"),
                      ("hermes", "<" * 100_000)]:
        start = time.perf_counter()
        parser, _ = parse(fmt, [text[i:i + 7] for i in range(0, len(text), 7)])  # token-sized pieces
        assert time.perf_counter() - start < 20  # linear: ~1 s here; a quadratic parser takes minutes
        assert len(parser.calls) <= MAX_CALLS
        assert len(parser.content) + sum(len(c.arguments) for c in parser.calls) <= len(text)


# -- grammars ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def matcher():
    from llguidance import LLMatcher
    import llguidance

    from engine.models.loading import load_tokenizer, resolve_model
    from engine.structured import ll_tokenizer, parser_limits

    tokenizer = load_tokenizer(resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct"))
    ll = ll_tokenizer(tokenizer, {tokenizer.eos_token_id})

    def accepts(fmt: str, text: str, parallel: bool = True) -> bool:
        grammar = llguidance.grammar_from("lark", FORMATS[fmt].grammar(TOOLS, parallel))
        m = LLMatcher(ll, grammar, log_level=0, limits=parser_limits())
        return m.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and m.is_accepting()
    return accepts


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_the_lazy_grammar_allows_text_or_calls_to_known_tools_with_valid_arguments(matcher, fmt):
    write = FORMATS[fmt].write_calls
    good = [("get_weather", {"city": "Paris", "unit": "c", "days": 2}), ("get_time", {})]
    assert matcher(fmt, "Hello! How can I help?")
    assert matcher(fmt, write(good)) and matcher(fmt, write(good[:1]))
    if fmt == "hermes":
        assert matcher(fmt, "Let me see.\n" + write(good))
    for bad in ([("get_weather", {"city": 3})], [("get_weather", {"unit": "c"})],  # type, required
                [("get_weather", {"city": "P", "unit": "k"})], [("get_weather", {"city": "P", "x": 1})],
                [("launch_missiles", {})]):
        assert not matcher(fmt, write(bad)), bad
    assert matcher(fmt, write(good[:1]), parallel=False)
    assert not matcher(fmt, write(good), parallel=False)  # parallel_tool_calls false: at most one call
    for call in ([("get_weather", {"city": "Paris"})], good):  # what the grammar allows, the parser reads back
        parser, _ = parse(fmt, [write(call)])
        assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == call
        for c in parser.calls:
            jsonschema.validate(json.loads(c.arguments), {t.name: t.parameters for t in TOOLS}[c.name])


def test_a_call_s_json_has_bounded_whitespace(matcher):
    assert matcher("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert not matcher("hermes", '<tool_call>\n{"name": "get_time", "arguments": {' + " " * 40 + "}}\n</tool_call>")


# -- conversations -----------------------------------------------------------------------------------

def request(messages: list[dict], **kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=messages, **kw)


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
LOOP = [{"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]


def refused(messages: list[dict]) -> RequestError:
    with pytest.raises(RequestError) as e:
        conversation(request(messages).messages)
    assert e.value.status == 400
    return e.value


def test_tool_turns_are_checked_and_named():
    rendered = conversation(request(LOOP).messages)
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert rendered[2] == {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1"}
    assert refused(LOOP[:1] + LOOP[2:]).param == "messages[1]"  # no call before it
    assert refused(LOOP[:2] + [{**LOOP[2], "tool_call_id": "call_9"}]).param == "messages[2].tool_call_id"
    assert refused(LOOP + [LOOP[2]]).param == "messages[3].tool_call_id"  # answered twice
    assert refused(LOOP[:2] + [{"role": "tool", "content": "x"}]).param == "messages[2].tool_call_id"
    bad_args = {**CALL, "function": {"name": "get_weather", "arguments": "{not json"}}
    assert refused([LOOP[0], {"role": "assistant", "tool_calls": [bad_args]}]).param == \
        "messages[1].tool_calls[0].function.arguments"
    assert refused([LOOP[0], {"role": "assistant", "tool_calls": [{**CALL, "function": {
        "name": "get_weather", "arguments": "[1]"}}]}]).param == "messages[1].tool_calls[0].function.arguments"
    assert refused([{"role": "user", "content": "x", "tool_calls": [CALL]}]).param == "messages[0].tool_calls"
    assert refused([{"role": "user", "content": None}]).param == "messages[0].content"


def test_a_template_without_tools_gets_a_plain_conversation_that_alternates():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    loop = conversation(request(LOOP + [{"role": "user", "content": "And tomorrow?"}]).messages)
    plain = plain_conversation(loop, tools, FORMATS["pythonic"])
    assert [m["role"] for m in plain] == ["system", "user", "assistant", "user"]
    assert "get_weather" in plain[0]["content"] and "[func_name1(" in plain[0]["content"]
    assert plain[2]["content"] == '[get_weather(city="Paris")]'
    assert plain[3]["content"] == "<tool_response>\nsunny, 21 C\n</tool_response>\nAnd tomorrow?"


def test_a_template_with_tools_renders_them_itself():
    from engine.models.presets import char_tokenizer

    tokenizer = char_tokenizer(104)
    template = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
                "{% for m in messages %}{{ m.role }}:{{ m.content or '' }}{% if m.tool_calls %}"
                "{% for c in m.tool_calls %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}"
                "{% endif %}{% if m.tool_call_id %}(for {{ m.tool_call_id }}){% endif %}\n{% endfor %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    ids = chat_prompt_ids(tokenizer, conversation(request(LOOP).messages), tools=tools, chat_template=template,
                          tool_instructions=True)
    # (this character tokenizer has no line break)
    assert tokenizer.decode(ids) == ('TOOLS:get_weather;user:Weather in Paris?assistant:CALL get_weather '
                                     '{"city": "Paris"}tool:sunny, 21 C(for call_1)')


# -- the API's answers -------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,text,content,calls", [r for r in REAL if r[3]], ids=[r[0] for r in REAL if r[3]])
def test_a_streamed_auto_answer_is_the_non_streamed_message_in_openai_s_deltas(fmt, text, content, calls):
    mode = ToolCalls("auto", format=FORMATS[fmt])
    message, finish = chat_message(mode, text, "stop")
    assert finish == "tool_calls" and (message["content"] or "").strip() == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == calls
    stream = ToolCallStream(mode)
    chunks = [stream.feed(ch, None, None) for ch in text] + [stream.feed("", "stop", None)]
    deltas = [d for chunk in chunks for d in chunk]
    said, got = "", {}
    for delta, f, _ in deltas:
        said += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            entry = got.setdefault(call["index"], {"id": None, "name": "", "arguments": ""})
            if "id" in call:
                assert entry["id"] is None and call["id"].startswith("call_") and call["type"] == "function"
                entry["id"], entry["name"] = call["id"], call["function"]["name"]
            entry["arguments"] += call["function"]["arguments"]
    assert [f for _, f, _ in deltas if f] == ["tool_calls"]
    assert said.strip() == content and "<tool_call>" not in said and "[" not in said
    assert [(got[i]["name"], json.loads(got[i]["arguments"])) for i in sorted(got)] == calls


def test_auto_tool_choice_is_refused_unless_the_server_enables_it():
    body = dict(messages=[{"role": "user", "content": "hi"}],
                tools=[{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}])
    with pytest.raises(RequestError) as e:
        request(**body).tool_calls(None)
    assert e.value.param == "tool_choice" and "--enable-auto-tool-choice" in e.value.message
    structured, mode = request(**body).tool_calls(FORMATS["hermes"])
    assert mode.kind == "auto" and "<tool_call>" in structured.params.grammar
    structured, mode = request(**body, tool_choice="auto", parallel_tool_calls=False).tool_calls(FORMATS["pythonic"])
    assert "{0," not in structured.params.grammar  # one call at most


def test_hermes_grammar_allows_qwens_tool_call_token():
    """Qwen writes <tool_call> and </tool_call> as one added token each, and llguidance holds added tokens
    apart from text: a grammar that spelled the tags only as characters forbade the very token the model
    calls with (it then wrote its calls as text). Bound to Qwen's tokenizer, the hermes grammar allows the
    token where a call may begin, then holds what follows to the call's JSON and closes with the token."""
    from conftest import QWEN_CODER
    from engine.grammar_masks import GrammarMasks, unpack
    from engine.models.loading import load_tokenizer, resolve_model
    from engine.tool_parsers import ToolSpec, tool_format

    tokenizer = load_tokenizer(resolve_model(QWEN_CODER))
    fmt = tool_format("hermes", tokenizer)
    open_tag, close_tag = fmt.tag_tokens["<tool_call>"], fmt.tag_tokens["</tool_call>"]
    assert tokenizer.encode("<tool_call>", add_special_tokens=False) == [open_tag]
    vocab = len(tokenizer)
    masks = GrammarMasks(tokenizer, {tokenizer.eos_token_id}, vocab)
    grammar = fmt.grammar([ToolSpec("get_weather", {"type": "object", "properties": {"city": {"type": "string"}},
                                                    "required": ["city"]})], parallel=False)
    masks.add("r", grammar, [])
    allowed = unpack(masks.masks([("r", 0, [])])[0], vocab)[0]
    assert allowed[open_tag] and allowed[tokenizer.encode("Sure", add_special_tokens=False)[0]]  # a call or text
    call = tokenizer.encode('\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n', add_special_tokens=False)
    masks.advance("r", [open_tag, *call])
    bitmask, errors = masks.masks([("r", 1 + len(call), [])])
    allowed = unpack(bitmask, vocab)[0]
    assert not errors and allowed[close_tag]
    assert not allowed[tokenizer.encode("Sure", add_special_tokens=False)[0]]  # nothing but the call's end
    assert tool_format("hermes") is not fmt and not tool_format("hermes").tag_tokens  # unbound: characters only
