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
from engine.tool_parsers import CallStart, Content, ToolFormat, ToolSpec

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


AUTO_TOOL_CHOICE = ("tool_choice 'auto' (OpenAI's default when tools are given) is off on this server: start it "
                    "with --enable-auto-tool-choice --tool-call-parser NAME (serve args enable_auto_tool_choice, "
                    "tool_call_parser), or send tool_choice 'required' (the model calls one or more of the "
                    "tools), a named function ({\"type\": \"function\", \"function\": {\"name\": ...}}), or 'none'")


@dataclass(frozen=True)
class ToolCalls:
    """How a chat answer's text becomes tool calls: `named`, the arguments of the function `name`;
    `required`, a JSON array of {"name", "parameters"} objects (vLLM's form); `auto`, text and calls
    in the model family's format (`format`)."""

    kind: Literal["named", "required", "auto"]
    name: str | None = None
    format: ToolFormat | None = None


def tool_specs(tools: list[Tool]) -> list[ToolSpec]:
    return [ToolSpec(t.function.name, parameters_schema(t), t.function.description) for t in tools]


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


def conversation(messages: list) -> list[dict]:
    """Chat messages (protocol.ChatMessage) as the chat template takes them, their tool turns checked:
    calls only in assistant turns, each with JSON-object arguments; a tool turn answers a call of the
    assistant turn before it, by that call's id."""
    out: list[dict] = []
    open_calls: set[str] | None = None  # ids of the last assistant turn's calls not yet answered
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        item: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls is not None and m.role != "assistant":
            raise bad_request(f"{where}.tool_calls: only an assistant message carries tool calls",
                              param=f"{where}.tool_calls")
        if m.tool_call_id is not None and m.role != "tool":
            raise bad_request(f"{where}.tool_call_id: only a tool message answers a tool call",
                              param=f"{where}.tool_call_id")
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise bad_request(f"{where}.content is required (only an assistant message with tool_calls may "
                              f"leave it null)", param=f"{where}.content")
        if m.role == "assistant" and m.tool_calls:
            calls = []
            for j, call in enumerate(m.tool_calls):
                field = f"{where}.tool_calls[{j}].function"
                if not TOOL_NAME.fullmatch(call.function.name):
                    raise bad_request(f"{field}.name must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -",
                                      param=f"{field}.name")
                try:
                    arguments = json.loads(call.function.arguments)
                except (ValueError, RecursionError):
                    arguments = None
                if not isinstance(arguments, dict):
                    raise bad_request(f"{field}.arguments must be a JSON object (as text)", param=f"{field}.arguments")
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": arguments}})
            item["tool_calls"] = calls
            open_calls = {c.id for c in m.tool_calls}
        elif m.role == "tool":
            if open_calls is None:
                raise bad_request(f"{where}: a tool message must come after an assistant message with tool_calls",
                                  param=where)
            if m.tool_call_id is None:
                raise bad_request(f"{where}.tool_call_id is required: the id of the call this message answers",
                                  param=f"{where}.tool_call_id")
            if m.tool_call_id not in open_calls:
                raise bad_request(f"{where}.tool_call_id: '{printable(m.tool_call_id, 64)}' is not the id of an "
                                  f"unanswered call in the assistant message before it", param=f"{where}.tool_call_id")
            open_calls.discard(m.tool_call_id)
            item["tool_call_id"] = m.tool_call_id
        elif m.role in ("user", "assistant"):
            open_calls = None
        out.append(item)
    return out


# -- answers: text into OpenAI's message.tool_calls ------------------------------------------------

def tool_calls_of(mode: ToolCalls | None, text: str, finish: str | None) -> list[dict] | None:
    """A finished 'required' or 'named' choice's tool calls; None when it has none (no tools asked
    for, or cut short: then its text is the answer's content)."""
    if mode is None or mode.kind == "auto" or finish != "stop":
        return None
    return parse_tool_calls(mode, text)


def chat_message(mode: ToolCalls | None, text: str, finish: str | None) -> tuple[dict, str | None]:
    """A finished choice's message and finish_reason (OpenAI's: "tool_calls" when it calls tools)."""
    if mode is not None and mode.kind == "auto":
        parser = mode.format.parser()
        parser.feed(text)
        parser.finish()
        calls = [tool_call(c.name, c.arguments) for c in parser.calls]
        if not calls:
            return {"role": "assistant", "content": text}, finish
        return ({"role": "assistant", "content": parser.content if parser.content.strip() else None,
                 "tool_calls": calls}, "tool_calls" if finish == "stop" else finish)
    calls = tool_calls_of(mode, text, finish)
    if calls is not None:
        return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
    return {"role": "assistant", "content": text}, finish


class ToolCallStream:
    """One streamed choice's text as OpenAI streams tool calls.
    - auto: content until a call begins, then each call's id and name, then its arguments as they
      come (pythonic: whole, once the call is); the trigger and the calls' wrapping never reach the
      client; "tool_calls" as the finish_reason when the answer called tools.
    - named: the arguments stream as they come (the call's id and name first).
    - required: the calls come whole once the array is complete.
    A choice cut short (length) ends with what it had: calls begun stay calls (auto, named); a
    'required' array's text is content."""

    def __init__(self, mode: ToolCalls):
        self.mode, self.text, self.started = mode, "", False
        self.parser = mode.format.parser() if mode.kind == "auto" else None
        self.ids: list[str] = []

    def feed(self, text: str, finish: str | None, logprobs: dict | None) -> list[tuple[dict, str | None, dict | None]]:
        """(delta, finish_reason, logprobs) for each chunk to send."""
        self.text += text
        if self.parser is not None:
            return self._auto(text, finish, logprobs)
        out: list[tuple[dict, str | None, dict | None]] = []
        if self.mode.kind == "named":
            if not self.started:
                self.started = True
                out.append(({"tool_calls": [{"index": 0, "id": tool_call_id(), "type": "function",
                                             "function": {"name": self.mode.name, "arguments": ""}}]}, None, None))
            if text or logprobs is not None:
                out.append(({"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {},
                            None, logprobs))
            if finish is not None:
                calls = tool_calls_of(self.mode, self.text, finish)
                out.append(({}, "tool_calls" if calls is not None else finish, None))
            return out
        if logprobs is not None:  # 'required': the text is held back until the array is whole
            out.append(({}, None, logprobs))
        if finish is not None:
            calls = tool_calls_of(self.mode, self.text, finish)
            if calls is None:
                out.append(({"content": self.text} if self.text else {}, finish, None))
            else:
                out.append(({"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}, None, None))
                out.append(({}, "tool_calls", None))
        return out

    def _auto(self, text: str, finish: str | None, logprobs: dict | None) -> list[tuple[dict, str | None, dict | None]]:
        events = self.parser.feed(text) + (self.parser.finish() if finish is not None else [])
        deltas = [self._delta(e) for e in events]
        out: list[tuple[dict, str | None, dict | None]] = [(d, None, None) for d in deltas]
        if logprobs is not None:  # the tokens' log-probabilities ride on this step's first chunk
            out = [(out[0][0], None, logprobs)] + out[1:] if out else [({}, None, logprobs)]
        if finish is not None:
            out.append(({}, "tool_calls" if self.parser.calls and finish == "stop" else finish, None))
        return out

    def _delta(self, event) -> dict:
        if isinstance(event, Content):
            return {"content": event.text}
        if isinstance(event, CallStart):
            self.ids.append(tool_call_id())
            return {"tool_calls": [{"index": event.index, "id": self.ids[event.index], "type": "function",
                                    "function": {"name": event.name, "arguments": ""}}]}
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
