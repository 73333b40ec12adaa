"""Tools in chat requests: their schemas (OpenAI's), the grammar a tool_choice holds the answer
to, and how the answer's text becomes OpenAI's message.tool_calls."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from deployments.api_errors import bad_request, printable
from engine.structured import StructuredOutputsParams

MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# Tool calls' JSON may have at most one space between its tokens: `{"a": 1}` and `{"a":1}` both, but
# not the unbounded whitespace a JSON grammar otherwise allows, where a weak model can spend its whole
# budget (arguments are read by programs, not people).
TOOL_CALL_WHITESPACE = "[ ]?"


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of an object; None: no arguments
    strict: bool | None = None  # accepted; a called tool's arguments always follow its schema here


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    class Function(BaseModel):
        model_config = ConfigDict(extra="forbid")
        name: str

    type: Literal["function"]
    function: Function


AUTO_TOOL_CHOICE = ("tool_choice 'auto' (OpenAI's default when tools are given) needs a model-specific "
                    "tool-call parser, which this server does not have: send tool_choice 'required' (the "
                    "model calls one or more of the tools), a named function ({\"type\": \"function\", "
                    "\"function\": {\"name\": ...}}), or 'none'")


@dataclass(frozen=True)
class ToolCalls:
    """How a chat answer's text becomes tool calls: `named`, the arguments of the function `name`;
    `required`, a JSON array of {"name", "parameters"} objects (vLLM's form)."""

    kind: Literal["named", "required"]
    name: str | None = None


def check_tools(tools: list[Tool]) -> None:
    """The tools' names (OpenAI's rule, unique) and parameters (an object's schema)."""
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}", param="tools")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        f = tool.function
        if not TOOL_NAME.fullmatch(f.name):
            raise bad_request(f"tools[{i}].function.name must be 1 to 64 characters of a-z, A-Z, 0-9, _ "
                              f"and -, got '{printable(f.name, 64)}'", param="tools")
        if f.name in seen:
            raise bad_request(f"tools[{i}].function.name: '{f.name}' is given twice; tool names must be "
                              f"unique", param="tools")
        seen.add(f.name)
        if f.parameters is not None and f.parameters.get("type", "object") != "object":
            raise bad_request(f"tools[{i}].function.parameters must be the JSON schema of an object "
                              f"(type 'object')", param="tools")


def parameters_schema(tool: Tool) -> dict:
    return tool.function.parameters if tool.function.parameters is not None else {"type": "object", "properties": {}}


def required_tools_schema(tools: list[Tool], single: bool) -> dict:
    """vLLM's schema for tool_choice 'required': an array of one or more {"name", "parameters"}
    objects, each one tool's name and arguments. Each tool's $defs move to the root, where its
    `#/$defs/...` references point once the schema is nested."""
    defs: dict[str, Any] = {}
    options = []
    for i, tool in enumerate(tools):
        params = dict(parameters_schema(tool))
        for key in ("$defs", "definitions"):
            own = params.pop(key, None)
            if own is None:
                continue
            if not isinstance(own, dict):
                raise bad_request(f"tools[{i}].function.parameters.{key} must be an object", param="tools")
            for name, definition in own.items():
                if defs.setdefault(key, {}).setdefault(name, definition) != definition:
                    raise bad_request(f"tools[{i}].function.parameters.{key}: '{printable(name, 64)}' is defined "
                                      f"differently by another tool; with tool_choice 'required' the tools' "
                                      f"definitions share one namespace", param="tools")
        options.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                       "parameters": params},
                        "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}
    if single:
        schema["maxItems"] = 1
    schema.update(defs)
    return schema


def tool_params(schema: dict, label: str) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(json=schema, whitespace_pattern=TOOL_CALL_WHITESPACE)
    except ValidationError as e:
        raise bad_request(f"{label}: not a JSON schema ({e.errors()[0].get('msg', 'invalid')})", param="tools") from None


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(name: str, arguments: str) -> dict:
    return {"id": tool_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_tool_calls(mode: ToolCalls, text: str) -> list[dict] | None:
    """A finished answer's calls, as OpenAI's message.tool_calls; None if the text isn't calls (cut
    short: a stop string, an abort). Named: the text itself is the arguments."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if mode.kind == "named":
        return [tool_call(mode.name, text)] if isinstance(value, dict) else None
    if not isinstance(value, list) or not value:
        return None
    calls = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or "parameters" not in item:
            return None
        calls.append(tool_call(item["name"], json.dumps(item["parameters"], ensure_ascii=False)))
    return calls
