"""The OpenAI-compatible API's request bodies (pydantic models), their limits, the grammars
response_format and structured_outputs ask for, and the JSON a body comes in."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from deployments.api_errors import bad_request, printable, validation_error
from deployments.tool_calls import (AUTO_TOOL_CHOICE, NamedToolChoice, Tool, ToolCalls, check_tools,
                                    parameters_schema, required_tools_schema, tool_params, tool_specs)
from engine.config import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams
from engine.structured import StructuredOutputsParams
from engine.tool_parsers import ToolFormat

MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 256
MAX_PROMPTS = 64  # prompts in one completion call (each times n is a request)
MAX_JSON_DEPTH = 32


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
    # Tandem's own: false decodes with the target alone (no draft; e.g. to measure the speedup);
    # spec_trace: each token's origin (draft or target, round) comes back in choices[].spec_trace
    speculative: bool = True
    spec_trace: bool = False
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
                speculative=self.speculative, spec_trace=self.spec_trace,
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


class MessageToolCall(BaseModel):
    """A call in an earlier assistant turn, as OpenAI's message.tool_calls gives it back."""

    model_config = ConfigDict(extra="forbid")

    class Function(BaseModel):
        model_config = ConfigDict(extra="forbid")
        name: str
        arguments: str  # JSON text of an object, as the API returned it

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: Function


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None  # None: an assistant turn that only calls tools
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = Field(default=None, max_length=256)  # a tool turn: the call it answers

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        if isinstance(content, list):
            for i, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                    raise ValueError(f"content part {i}: only {{'type': 'text', 'text': <string>}} parts are supported")
        return content

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part["text"] for part in self.content)


class ChatCompletionRequest(SamplingFields):
    implemented: ClassVar[frozenset[str]] = frozenset({"tools", "tool_choice", "parallel_tool_calls"})

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool | None = None  # false: at most one call under "required"
    # keyword arguments for the chat template, e.g. {"enable_thinking": false} (vLLM's)
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _own_names_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = {"messages", "tools", "add_generation_prompt", "chat_template", "tokenize", "documents",
                 "continue_final_message", "return_dict"} & set(value or {})
        if taken:
            raise ValueError(f"chat_template_kwargs: {', '.join(sorted(taken))} is set by the server")
        if len(value or {}) > 32:
            raise ValueError("chat_template_kwargs: at most 32 keys")
        return value

    def check_tools(self) -> None:
        check_tools(self.tools or [])

    def tool_calls(self, auto: ToolFormat | None = None) -> tuple[Structured | None, ToolCalls | None]:
        """The grammar tool_choice holds the output to, and how its text becomes calls; (None, None)
        for plain text. `auto`: the server's tool-call format when it lets the model choose."""
        self.check_tools()
        tools, choice = self.tools or [], self.tool_choice
        if choice is None and not tools or choice == "none":
            return None, None
        if not tools:
            raise bad_request("tool_choice needs tools", param="tool_choice")
        if choice is None or choice == "auto":
            if auto is None:
                raise bad_request(AUTO_TOOL_CHOICE, param="tool_choice")
            grammar = auto.grammar(tool_specs(tools), self.parallel_tool_calls is not False)
            return (Structured(StructuredOutputsParams(grammar=grammar), "tools", "tools"),
                    ToolCalls("auto", format=auto))
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


def valid_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
