"""One request layer for both transports: HTTP and gRPC bodies become the same typed engine
requests, with the same validation, defaults and errors. Only the wire format differs.

`RequestLayer.prepare()` is synchronous and CPU-bound (JSON, validation, tokenization, chat
templates): transports run it in a worker thread, never on the event loop.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, TypeAdapter, ValidationError, field_validator

from deployments.tokenizer_info import tokenizer_info
from engine.chat import chat_prompt_ids, end_of_turn_ids
from engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestStream
from engine.output_processor import RequestDelta
from engine.config import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams
from engine.core import TokenizedPrompt
from engine.errors import INTERNAL_ERROR, ErrorKind, InvalidRequest
from engine.structured import StructuredOutputsParams

log = logging.getLogger(__name__)

MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 256
MAX_PROMPTS = 64  # prompts in one completion call (each times n is a request)
MAX_JSON_DEPTH = 32
MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# Tool calls' JSON may have at most one space between its tokens: `{"a": 1}` and `{"a":1}` both, but
# not the unbounded whitespace a JSON grammar otherwise allows, where a weak model can spend its whole
# budget (arguments are read by programs, not people).
TOOL_CALL_WHITESPACE = "[ ]?"


class RequestError(Exception):
    """A request's failure as a client sees it: an HTTP status, OpenAI's error fields, a message
    with no internals. gRPC maps the status to a code."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(status, message, type_, param, code)  # all in args: Ray pickles exceptions
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def __str__(self) -> str:
        return self.message

    def body(self, request_id: str | None) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code,
                          "request_id": request_id}}


def printable(text: str, limit: int = 200) -> str:
    """A client's string as we may echo it in a message: printable characters only, bounded."""
    text = text[:limit].encode("utf-8", "replace").decode("utf-8")
    return "".join(c if c.isprintable() else "?" for c in text)


def bad_request(message: str, param: str | None = None) -> RequestError:
    return RequestError(400, message, "invalid_request_error", param)


# Fields of OpenAI's (and vLLM's) API that Tandem does not implement. Each is accepted only at a
# value that changes nothing, so a client that sends defaults works and one that asks for the
# feature gets a 400 naming it instead of a silently different answer.
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "min_p": (None, 0, 0.0),
    "suffix": (None, ""),
    "tools": (None, []),  # chat implements tools, tool_choice and parallel_tool_calls
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None,),
    "use_beam_search": (None, False),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions (OpenAI's, plus vLLM's extensions)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_tokens: int = 0
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None  # the caller's end-user id: metadata, changes nothing
    presence_penalty: float | None = None  # None: 0
    frequency_penalty: float | None = None  # None: 0
    repetition_penalty: float | None = None  # vLLM's extension; None: 1
    logit_bias: dict[str, float] | None = None  # token id (as a string: a JSON key) -> bias
    # vLLM's: requests with different salts never share a prefix-cache block (tenants apart)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    # the output held to a grammar: OpenAI's response_format, or vLLM's structured_outputs (one of)
    response_format: Any = None
    structured_outputs: dict[str, Any] | None = None
    # not implemented: see NEUTRAL_VALUES
    best_of: Any = None
    min_p: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    use_beam_search: Any = None

    implemented: ClassVar[frozenset[str]] = frozenset()  # NEUTRAL_VALUES fields this kind implements

    def check_unsupported(self) -> None:
        for name, neutral in NEUTRAL_VALUES.items():
            if name in self.implemented:
                continue
            value = getattr(self, name, None)
            if not any(value == v and type(value) is type(v) for v in neutral):
                raise bad_request(f"'{name}' is not supported by this server; remove it (or send its default)",
                                  param=name)
        if self.stop is not None and not isinstance(self.stop, str) and len(self.stop) > MAX_STOP_STRINGS:
            raise bad_request(f"stop: at most {MAX_STOP_STRINGS} stop strings", param="stop")
        if self.stop_token_ids is not None and len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad_request(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids", param="stop_token_ids")

    def structured(self) -> Structured | None:
        """The grammar the request asks for (response_format or structured_outputs), or None."""
        fmt = response_format(self.response_format)
        if self.structured_outputs is not None:
            if fmt is not None:
                raise bad_request("give at most one of response_format (other than 'text') and structured_outputs",
                                  param="structured_outputs")
            return Structured(structured_params(self.structured_outputs, "structured_outputs"),
                              "structured_outputs", None)
        return fmt

    def sampling_params(self, max_tokens: int | None, extra_stop_ids: list[int], index: int,
                        logprobs: int | None = None, prompt_logprobs: int | None = None,
                        structured: Structured | None = None) -> SamplingParams:
        seed = None if self.seed is None else self.seed + index  # n > 1: distinct, reproducible samples
        try:
            return SamplingParams(
                temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, max_tokens=max_tokens,
                min_tokens=self.min_tokens, stop=self.stop, seed=seed, ignore_eos=self.ignore_eos,
                stop_token_ids=list(self.stop_token_ids or []) + list(extra_stop_ids),
                presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                logit_bias=self._logit_bias(),
                logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                structured_outputs=structured.params if structured is not None else None)
        except ValidationError as e:
            raise validation_error(e) from None

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise bad_request(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens", param="logit_bias")
        out = {}
        for key, bias in self.logit_bias.items():
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise bad_request("logit_bias: keys must be token ids (non-negative integers, as strings)",
                                  param="logit_bias")
            out[int(key)] = bias
        return out


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # top n per token (+ the prompt's with echo)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # vLLM's: the prompt's, top n
    suffix: Any = None
    max_tokens: int | None = 16  # OpenAI's default for completions


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]]
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        if isinstance(content, list):
            for i, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                    raise ValueError(f"content part {i}: only {{'type': 'text', 'text': <string>}} parts are supported")
        return content

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part["text"] for part in self.content)


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


class ChatCompletionRequest(SamplingFields):
    implemented: ClassVar[frozenset[str]] = frozenset({"tools", "tool_choice", "parallel_tool_calls"})

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool | None = None  # false: at most one call under "required"

    def check_tools(self) -> None:
        tools = self.tools or []
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

    def tool_calls(self) -> tuple[Structured | None, ToolCalls | None]:
        """The grammar tool_choice holds the output to, and how its text becomes calls; (None, None)
        for plain text."""
        self.check_tools()
        tools, choice = self.tools or [], self.tool_choice
        if choice is None and not tools or choice == "none":
            return None, None
        if not tools:
            raise bad_request("tool_choice needs tools", param="tool_choice")
        if choice is None or choice == "auto":
            raise bad_request(AUTO_TOOL_CHOICE, param="tool_choice")
        if choice == "required":
            schema = required_tools_schema(tools, self.parallel_tool_calls is False)
            return Structured(tool_params(schema, "tools"), "tools", "tools"), ToolCalls("required")
        if not isinstance(choice, dict):
            raise bad_request("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                              "\"function\": {\"name\": ...}}", param="tool_choice")
        try:
            named = NamedToolChoice.model_validate(choice)
        except ValidationError as e:
            raise validation_error(e, "tool_choice") from None
        index = next((i for i, t in enumerate(tools) if t.function.name == named.function.name), None)
        if index is None:
            raise bad_request(f"tool_choice names the function '{printable(named.function.name, 64)}', which is "
                              f"not one of the tools", param="tool_choice")
        label = f"tools[{index}].function.parameters"
        schema = parameters_schema(tools[index])
        return Structured(tool_params(schema, label), "tools", label), ToolCalls("named", named.function.name)


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages through the chat template."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


def validation_error(e: ValidationError, field: str | None = None) -> RequestError:
    """pydantic's first error as one line: where, and what; never the input value. `field`: the
    request field the validated value came from (what `loc` is relative to)."""
    err = e.errors(include_input=False, include_url=False)[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    loc = [printable(x, 64) for x in loc]
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    if field is not None and not (not loc and msg.startswith(field)):  # its own messages name it already
        loc = [field, *loc]
    if err.get("type") == "extra_forbidden":
        return bad_request(f"unknown field '{'.'.join(loc)}'", param=loc[0] if loc else None)
    param = loc[0] if loc else field
    return bad_request(f"{'.'.join(loc)}: {msg}" if loc else msg, param=param)


# -- structured outputs and tools ------------------------------------------------------------------

@dataclass(frozen=True)
class Structured:
    """A request's grammar, and where it came from: errors name `param` (the request field) and call
    the grammar `label` (None: the engine's own name for it, structured_outputs.<kind>)."""

    params: StructuredOutputsParams
    param: str
    label: str | None


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str | None = None  # OpenAI requires it; it changes nothing here
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # accepted; the output always follows the schema here


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


_STRUCTURED = TypeAdapter(StructuredOutputsParams)


def structured_params(value: Any, field: str) -> StructuredOutputsParams:
    try:
        return _STRUCTURED.validate_python(value)
    except ValidationError as e:
        raise validation_error(e, field) from None


def response_format(value: Any) -> Structured | None:
    """OpenAI's response_format as a grammar; None for text."""
    if value is None:
        return None
    try:
        fmt = ResponseFormat.model_validate(value)
    except ValidationError as e:
        raise validation_error(e, "response_format") from None
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Structured(structured_params({"json_object": True}, "response_format"), "response_format",
                          "response_format")
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise bad_request("response_format: type 'json_schema' needs json_schema: {\"name\": ..., \"schema\": "
                          "{...}}", param="response_format")
    return Structured(structured_params({"json": fmt.json_schema.schema_}, "response_format"), "response_format",
                      "response_format.json_schema.schema")


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


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError):
        raise bad_request("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    if _depth(body) > MAX_JSON_DEPTH:
        raise bad_request("request body is nested too deeply")
    return body


def _depth(value: Any, limit: int = MAX_JSON_DEPTH + 1) -> int:
    stack, deepest = [(value, 1)], 0
    while stack:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v)
    return deepest


def _valid_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass
class Choice:
    index: int
    prompt: TokenizedPrompt
    params: SamplingParams
    echo: str = ""  # text that precedes the completion in the response (completions' echo)


@dataclass
class PreparedRequest:
    """One API call, validated and tokenized: what either transport hands the engine."""

    request_id: str
    kind: Literal["completion", "chat"]
    choices: list[Choice]
    stream: bool
    include_usage: bool
    cache_salt: str | None = None
    tool_calls: ToolCalls | None = None  # chat with tool_choice 'required' or named: the text is calls

    @property
    def prompt_tokens(self) -> int:
        return sum(len(c.prompt.ids) for c in self.choices)


class RequestLayer:
    def __init__(self, engine: AsyncEngine, model_name: str, model_root: str, prepare_threads: int = 2):
        self.engine, self.model_name, self.model_root = engine, model_name, model_root
        # its own small pool: a flood of big requests queues here instead of taking every thread
        # the process shares (and the GIL-bound parts can't use more than a couple anyway)
        self._pool = ThreadPoolExecutor(prepare_threads, thread_name_prefix="tandem-prepare")
        self.tokenizer = engine.tokenizer
        self.turn_end_ids = end_of_turn_ids(self.tokenizer)
        # Longest token in UTF-8 bytes: a text longer than max_model_len times this has more tokens
        # than fit, so it is refused without being tokenized.
        self.max_token_bytes = max(len(t.encode("utf-8", "replace")) for t in self.tokenizer.get_vocab())
        self._tokenizer_info: dict | None = None

    # -- parsing (worker thread) ---------------------------------------------------------------

    async def prepare_async(self, kind: Literal["completion", "chat"], body: bytes | dict,
                            request_id: str) -> PreparedRequest:
        """prepare() on the layer's own threads, off the caller's event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.prepare, kind, body, request_id)

    def prepare(self, kind: Literal["completion", "chat"], body: bytes | dict, request_id: str) -> PreparedRequest:
        data = parse_json(body) if isinstance(body, (bytes, bytearray)) else body
        try:
            req = (CompletionRequest if kind == "completion" else ChatCompletionRequest).model_validate(data)
        except ValidationError as e:
            raise validation_error(e) from None
        req.check_unsupported()
        self.check_model(req.model)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        tool_calls = None
        if kind == "completion":
            choices = self._completion_choices(req)
        else:
            choices, tool_calls = self._chat_choices(req)
        return PreparedRequest(request_id, kind, choices, req.stream, include_usage, req.cache_salt, tool_calls)

    async def tokenize_async(self, body: bytes) -> dict:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.tokenize, body)

    async def detokenize_async(self, body: bytes) -> dict:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.detokenize, body)

    async def tokenizer_info_async(self) -> dict:
        if self._tokenizer_info is None:  # built once (thousands of added tokens on some models)
            self._tokenizer_info = await asyncio.get_running_loop().run_in_executor(
                self._pool, tokenizer_info, self.tokenizer, self.engine.max_model_len)
        return self._tokenizer_info

    def tokenize(self, body: bytes | dict) -> dict:
        req = self._parse(TokenizeRequest, body)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt, messages")
        if req.prompt is not None:
            if not _valid_unicode(req.prompt):
                raise bad_request("prompt must be valid Unicode (no lone surrogates)", param="prompt")
            self._check_text_bytes(len(req.prompt.encode("utf-8")))  # no tokenizing what can't fit
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            if not all(_valid_unicode(m["content"]) for m in messages):
                raise bad_request("messages must be valid Unicode (no lone surrogates)", param="messages")
            self._check_text_bytes(sum(len(m["content"].encode("utf-8")) for m in messages))
            try:
                ids = chat_prompt_ids(self.tokenizer, messages, req.add_generation_prompt)
            except ValueError as e:
                log.info("chat template failed: %s", e)
                raise bad_request("messages could not be formatted with the model's chat template",
                                  param="messages") from None
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids, "token_strs": None}

    def detokenize(self, body: bytes | dict) -> dict:
        req = self._parse(DetokenizeRequest, body)
        if len(req.tokens) > self.engine.max_model_len:
            raise bad_request(f"tokens: at most this model's context length ({self.engine.max_model_len})",
                              param="tokens")
        vocab = self.engine.core.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"tokens must be token ids in [0, {vocab}), got {bad[:5]}", param="tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}

    def _parse(self, model: type[BaseModel], body: bytes | dict):
        data = parse_json(body) if isinstance(body, (bytes, bytearray)) else body
        try:
            req = model.model_validate(data)
        except ValidationError as e:
            raise validation_error(e) from None
        if req.model is not None:
            self.check_model(req.model)
        return req

    def check_model(self, name: str) -> None:
        if name not in (self.model_name, self.model_root):
            raise RequestError(404, f"The model '{printable(name)}' does not exist; this server serves "
                                    f"'{self.model_name}'", param="model", code="model_not_found")

    def _completion_choices(self, req: CompletionRequest) -> list[Choice]:
        p = req.prompt
        if isinstance(p, str):
            prompts: list[Any] = [p]
        elif not p:
            raise bad_request("prompt is empty", param="prompt")
        elif all(isinstance(x, int) for x in p):
            prompts = [p]
        else:
            prompts = list(p)
        if len(prompts) > MAX_PROMPTS:
            raise bad_request(f"prompt: at most {MAX_PROMPTS} prompts per request", param="prompt")
        structured = req.structured()
        choices = []
        for i, prompt in enumerate(prompts):
            tokenized = self._tokenize(prompt)
            prompt_logprobs = req.prompt_logprobs
            if prompt_logprobs is None and req.echo and req.logprobs is not None:
                prompt_logprobs = req.logprobs
            params = [req.sampling_params(req.max_tokens, [], j, req.logprobs, prompt_logprobs, structured)
                      for j in range(req.n)]
            for p in params:
                self._check(tokenized, p, structured)
            echo = (prompt if isinstance(prompt, str) else self.tokenizer.decode(tokenized.ids)) if req.echo else ""
            choices.extend(Choice(i * req.n + j, tokenized, p, echo) for j, p in enumerate(params))
        return choices

    def _chat_choices(self, req: ChatCompletionRequest) -> tuple[list[Choice], ToolCalls | None]:
        if len(req.messages) >= self.engine.max_model_len:  # each message costs at least one token
            raise bad_request(f"messages: {len(req.messages)} messages cannot fit in this model's maximum "
                              f"context length of {self.engine.max_model_len} tokens", param="messages")
        structured, tool_calls = req.tool_calls()
        requested = req.structured()
        if structured is not None and requested is not None:
            raise bad_request(f"tool_choice '{'required' if tool_calls.kind == 'required' else 'function'}' holds "
                              f"the output to the tools' schemas; it cannot be combined with {requested.param}",
                              param=requested.param)
        structured = structured or requested
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        if not all(_valid_unicode(m["content"]) for m in messages):
            raise bad_request("messages must be valid Unicode (no lone surrogates)", param="messages")
        self._check_text_bytes(sum(len(m["content"].encode("utf-8")) for m in messages))
        try:
            ids = chat_prompt_ids(self.tokenizer, messages, tools=[t.model_dump(exclude_none=True) for t in req.tools or []])
        except ValueError as e:
            log.info("chat template failed: %s", e)
            raise bad_request("messages could not be formatted with the model's chat template",
                              param="messages") from None
        prompt = TokenizedPrompt(None, ids)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        choices = []
        for j in range(req.n):
            params = req.sampling_params(max_tokens, self.turn_end_ids, j, logprobs, structured=structured)
            self._check(prompt, params, structured)
            choices.append(Choice(j, prompt, params))
        return choices, tool_calls

    def _tokenize(self, prompt: str | list[int]) -> TokenizedPrompt:
        if isinstance(prompt, str):
            if not _valid_unicode(prompt):
                raise bad_request("prompt must be valid Unicode (no lone surrogates)", param="prompt")
            self._check_text_bytes(len(prompt.encode("utf-8")))
        try:
            text, ids = self.engine.core.prompt_ids(prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt})
        except ValueError as e:
            raise bad_request(str(e), param="prompt") from None
        return TokenizedPrompt(text, ids)

    def _check_text_bytes(self, n_bytes: int) -> None:
        limit = self.engine.max_model_len
        if n_bytes > limit * self.max_token_bytes:
            raise bad_request(f"This model's maximum context length is {limit} tokens; the input is "
                              f"{n_bytes} bytes, more than any {limit} tokens can hold. Please reduce the "
                              f"length of the input.", param="prompt")

    def _check(self, prompt: TokenizedPrompt, params: SamplingParams, structured: Structured | None = None) -> None:
        """The engine's one validation, then its grammar compiled (here, on the pool: never on the
        loop or the step thread)."""
        if not all(_valid_unicode(s) for s in params.stop):
            raise bad_request("stop strings must be valid Unicode (no lone surrogates)", param="stop")
        try:
            error = self.engine.core.check_request(prompt.ids, params)
            if error is not None:
                raise error
            self.engine.core.compile_grammar(params)
        except InvalidRequest as e:
            raise client_error(e, structured) from None

    # -- running (event loop) ------------------------------------------------------------------

    def start(self, prepared: PreparedRequest) -> list[RequestStream]:
        """Queue every choice of the call, or none: a rejection aborts those already queued."""
        streams: list[RequestStream] = []
        try:
            for c in prepared.choices:
                streams.append(self.engine.add_request(c.prompt, c.params, f"{prepared.request_id}-{c.index}",
                                                       prepared.cache_salt))
        except BaseException as e:
            for s in streams:
                s.abort()
            if isinstance(e, QueueFullError):
                raise RequestError(429, str(e), "rate_limit_error", code="queue_full") from None
            if isinstance(e, EngineDeadError):
                raise RequestError(503, "the engine is not running", "unavailable_error", code="unavailable") from None
            if isinstance(e, InvalidRequest):
                raise client_error(e) from None
            if isinstance(e, ValueError):
                raise bad_request(str(e)) from None
            raise
        return streams


def client_error(e: InvalidRequest, structured: Structured | None = None) -> RequestError:
    """The engine's typed refusal as the API's 400: its field as the client named it (a grammar's
    error under response_format, tools, or structured_outputs, as the request gave it)."""
    if structured is not None and e.param is not None and e.param.startswith("structured_outputs"):
        message = f"{structured.label}: {e.reason}" if structured.label is not None else str(e)
        return bad_request(printable(message, 600), param=structured.param)
    return bad_request(str(e), param=e.param)


def delta_error(delta: RequestDelta) -> RequestError:
    """A request that ended with an error, as the client sees it."""
    failure = delta.failure
    kind = failure.kind if failure is not None else \
        (ErrorKind.INVALID_REQUEST if delta.finish_reason == "rejected" else ErrorKind.INTERNAL)
    if kind is ErrorKind.INVALID_REQUEST:
        return bad_request(delta.error or "invalid request", param=failure.param if failure is not None else None)
    if kind is ErrorKind.UNAVAILABLE:
        return RequestError(503, delta.error or "service unavailable", "unavailable_error", code="unavailable")
    return RequestError(500, delta.error or INTERNAL_ERROR.message, "internal_error")


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    last: RequestDelta
    prompt_token_ids: list[int]
    logprobs: list | None = None  # per token, as RequestDelta's
    prompt_logprobs: list | None = None


async def collect(stream: RequestStream) -> Completion:
    """Read a stream to its end (RequestError if it failed); aborts it if this task is cancelled."""
    done = Completion([], "", None, [])
    try:
        async for delta in stream:
            if delta.error:
                raise delta_error(delta)
            done.token_ids += delta.token_ids
            done.text += delta.text
            done.prompt_token_ids = done.prompt_token_ids or delta.prompt_token_ids
            if delta.logprobs is not None:
                done.logprobs = (done.logprobs or []) + delta.logprobs
            done.prompt_logprobs = done.prompt_logprobs or delta.prompt_logprobs
            done.last = delta
    finally:
        stream.abort()
    return done


DEFAULT_API_KEY_ENV = "TANDEM_API_KEY"


def resolve_api_key(api_key: SecretStr | None, api_key_env: str | None, api_key_file: str | None) -> SecretStr | None:
    """The key from the args (CLI), a named environment variable, or a file; never logged."""
    import os

    if api_key is not None:
        return api_key
    if not api_key_file and not api_key_env and os.environ.get(DEFAULT_API_KEY_ENV):
        api_key_env = DEFAULT_API_KEY_ENV
    if api_key_file:
        with open(api_key_file, encoding="utf-8") as f:
            value = f.read().strip()
        if not value:
            raise ValueError("api_key_file is empty")
        return SecretStr(value)
    if api_key_env:
        value = os.environ.get(api_key_env, "")
        if not value:
            raise ValueError(f"api_key_env names {api_key_env!r}, but that environment variable is not set")
        return SecretStr(value)
    return None


def key_matches(presented: str | bytes | None, expected: SecretStr) -> bool:
    """`presented` is an Authorization value; constant-time comparison against 'Bearer <key>'."""
    if presented is None:
        return False
    if isinstance(presented, str):
        presented = presented.encode("utf-8", "replace")
    return hmac.compare_digest(presented, f"Bearer {expected.get_secret_value()}".encode())
