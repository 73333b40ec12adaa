"""The serving layer's parts on their own, without a server or an engine: request bodies
(deployments/protocol.py), tools (deployments/tool_calls.py), the API key (deployments/auth.py)."""
import json

import jsonschema
import pytest
from pydantic import SecretStr

from deployments.api_errors import RequestError
from deployments.auth import key_matches, resolve_api_key
from deployments.protocol import MAX_JSON_DEPTH, ChatCompletionRequest, CompletionRequest, parse_json, response_format
from deployments.tool_calls import Tool, ToolCalls, parse_tool_calls, required_tools_schema

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "time", "parameters": {
    "type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}}, "$defs": {"zone": {"type": "string"}}}}}


def refused(call) -> RequestError:
    with pytest.raises(RequestError) as e:
        call()
    assert e.value.status == 400
    return e.value


def test_bodies_are_json_objects_of_bounded_depth():
    assert parse_json(b'{"a": [1, {"b": 2}]}') == {"a": [1, {"b": 2}]}
    assert "not valid JSON" in refused(lambda: parse_json(b"{nope")).message
    assert "JSON object" in refused(lambda: parse_json(b"[1, 2]")).message
    deep = b'{"a": ' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}"
    assert "nested too deeply" in refused(lambda: parse_json(deep)).message


def test_unimplemented_fields_pass_only_at_their_neutral_value():
    CompletionRequest(model="m", prompt="hi", best_of=1).check_unsupported()
    error = refused(lambda: CompletionRequest(model="m", prompt="hi", best_of=3).check_unsupported())
    assert error.param == "best_of"


def test_response_format_becomes_a_grammar_named_as_the_client_wrote_it():
    assert response_format({"type": "text"}) is None
    structured = response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}})
    assert (structured.param, structured.label) == ("response_format", "response_format.json_schema.schema")
    assert refused(lambda: response_format({"type": "json_schema"})).param == "response_format"


def test_required_tools_schema_accepts_exactly_calls_of_the_given_tools():
    tools = [Tool.model_validate(t) for t in (WEATHER, TIME)]
    schema = required_tools_schema(tools, single=False)
    jsonschema.validate([{"name": "weather", "parameters": {"city": "Oslo"}},
                         {"name": "time", "parameters": {"zone": "CET"}}], schema)
    for bad in ([], [{"name": "other", "parameters": {}}], [{"name": "weather", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert schema["$defs"] == {"zone": {"type": "string"}}  # moved to the root, where the $ref points
    single = required_tools_schema(tools, single=True)  # parallel_tool_calls: false
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "time", "parameters": {}}] * 2, single)


def test_tool_names_and_choice_are_checked():
    clash = {**WEATHER, "function": {**WEATHER["function"]}}
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER, clash],
                                    tool_choice="required")
    assert "given twice" in refused(request.tool_calls).message
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER],
                                    tool_choice={"type": "function", "function": {"name": "nope"}})
    assert refused(request.tool_calls).param == "tool_choice"
    named = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER],
                                  tool_choice={"type": "function", "function": {"name": "weather"}})
    structured, mode = named.tool_calls()
    assert mode == ToolCalls("named", "weather") and structured.label == "tools[0].function.parameters"


def test_an_answer_becomes_tool_calls_or_none():
    calls = parse_tool_calls(ToolCalls("required"), '[{"name": "weather", "parameters": {"city": "Oslo"}}]')
    assert [c["function"]["name"] for c in calls] == ["weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"} and calls[0]["id"].startswith("call_")
    assert parse_tool_calls(ToolCalls("named", "weather"), '{"city": "Oslo"}')[0]["function"]["name"] == "weather"
    assert parse_tool_calls(ToolCalls("required"), '[{"name": "weather"') is None  # cut short
    assert parse_tool_calls(ToolCalls("named", "weather"), "[1]") is None


def test_the_api_key_comes_from_one_place_and_is_compared_whole(tmp_path, monkeypatch):
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    assert resolve_api_key(None, None, None) is None
    monkeypatch.setenv("TANDEM_API_KEY", "sk-env")
    assert resolve_api_key(None, None, None).get_secret_value() == "sk-env"
    (tmp_path / "key").write_text("sk-file\n")
    assert resolve_api_key(None, None, str(tmp_path / "key")).get_secret_value() == "sk-file"
    with pytest.raises(ValueError, match="NOPE"):
        resolve_api_key(None, "NOPE", None)
    key = SecretStr("sk-1")
    assert key_matches("Bearer sk-1", key) and key_matches(b"Bearer sk-1", key)
    assert not key_matches("Bearer sk-12", key) and not key_matches("sk-1", key) and not key_matches(None, key)
