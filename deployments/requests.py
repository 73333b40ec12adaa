"""One request layer for both transports: HTTP and gRPC bodies become the same typed engine
requests, with the same validation, defaults and errors. Only the wire format differs.

`RequestLayer.prepare()` is synchronous and CPU-bound (JSON, validation, tokenization, chat
templates): transports run it in a worker thread, never on the event loop.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from deployments.api_errors import RequestError, bad_request, printable, validation_error
from deployments.protocol import (MAX_PROMPTS, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                  Structured, TokenizeRequest, parse_json, valid_unicode)
from deployments.tokenizer_info import tokenizer_info
from deployments.tool_calls import ToolCalls, conversation
from engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestStream
from engine.chat import chat_prompt_ids, end_of_turn_ids
from engine.config import SamplingParams
from engine.core import TokenizedPrompt
from engine.errors import INTERNAL_ERROR, ErrorKind, InvalidRequest
from engine.output_processor import RequestDelta
from engine.reasoning import starts_in_reasoning
from engine.tool_parsers import ToolFormat, tool_format

log = logging.getLogger(__name__)


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
    tool_calls: ToolCalls | None = None  # chat with tools: how the text becomes calls
    reasoning: tuple[str, bool] | None = None  # chat with a reasoning parser: (its name, begins in thinking)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(c.prompt.ids) for c in self.choices)


class RequestLayer:
    def __init__(self, engine: AsyncEngine, model_name: str, model_root: str, prepare_threads: int = 2,
                 tool_format: ToolFormat | None = None, chat_template: str | None = None,
                 reasoning_parser: str | None = None):
        """`tool_format`: how the model writes calls when it may choose to (tool_choice 'auto'; None: off).
        `chat_template`: a template to use instead of the model's."""
        self.engine, self.model_name, self.model_root = engine, model_name, model_root
        self.tool_format, self.chat_template, self.reasoning_parser = tool_format, chat_template, reasoning_parser
        # its own small pool: a flood of big requests queues here instead of taking every thread
        # the process shares (and the GIL-bound parts can't use more than a couple anyway)
        self._pool = ThreadPoolExecutor(prepare_threads, thread_name_prefix="tandem-prepare")
        self.tokenizer = engine.tokenizer
        self.turn_end_ids = end_of_turn_ids(self.tokenizer)
        # Longest token in UTF-8 bytes: a text longer than max_model_len times this has more tokens
        # than fit, so it is refused without being tokenized.
        self.max_token_bytes = max(len(t.encode("utf-8", "replace")) for t in self.tokenizer.get_vocab())
        self._tokenizer_info: dict | None = None

    @classmethod
    def for_app(cls, engine: AsyncEngine, args) -> "RequestLayer":
        """The layer an application's args (deployments.app.ServeArgs) describe."""
        return cls(engine, args.model_name, args.model,
                   tool_format=tool_format(args.tool_call_parser, engine.tokenizer) if args.enable_auto_tool_choice else None,
                   chat_template=args.chat_template_text(), reasoning_parser=args.reasoning_parser)

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
        tool_calls = reasoning = None
        if kind == "completion":
            choices = self._completion_choices(req)
        else:
            choices, tool_calls, reasoning = self._chat_choices(req)
        return PreparedRequest(request_id, kind, choices, req.stream, include_usage, req.cache_salt, tool_calls,
                               reasoning)

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
            if not valid_unicode(req.prompt):
                raise bad_request("prompt must be valid Unicode (no lone surrogates)", param="prompt")
            self._check_text_bytes(len(req.prompt.encode("utf-8")))  # no tokenizing what can't fit
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            messages = self._conversation(req.messages)
            try:
                ids = chat_prompt_ids(self.tokenizer, messages, req.add_generation_prompt, tool_format=self.tool_format,
                                      chat_template=self.chat_template)
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

    def _chat_choices(self, req: ChatCompletionRequest) -> tuple[list[Choice], ToolCalls | None, tuple[str, bool] | None]:
        if len(req.messages) >= self.engine.max_model_len:  # each message costs at least one token
            raise bad_request(f"messages: {len(req.messages)} messages cannot fit in this model's maximum "
                              f"context length of {self.engine.max_model_len} tokens", param="messages")
        structured, tool_calls = req.tool_calls(self.tool_format)
        requested = req.structured()
        if structured is not None and requested is not None:
            choice = {"required": "'required'", "named": "naming a function", "auto": "'auto'"}[tool_calls.kind]
            raise bad_request(f"tool_choice {choice} holds the output to the tools' schemas; it cannot be combined "
                              f"with {requested.param}", param=requested.param)
        structured = structured or requested
        messages = self._conversation(req.messages)
        try:
            ids = chat_prompt_ids(self.tokenizer, messages, tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
                                  tool_format=self.tool_format, chat_template=self.chat_template,
                                  tool_instructions=tool_calls is not None and tool_calls.kind == "auto",
                                  template_kwargs=req.chat_template_kwargs)
        except ValueError as e:
            log.info("chat template failed: %s", e)
            raise bad_request("messages could not be formatted with the model's chat template",
                              param="messages") from None
        prompt = TokenizedPrompt(None, ids)
        reasoning = None
        if self.reasoning_parser is not None:
            opened = starts_in_reasoning(self.reasoning_parser, self.tokenizer.decode(ids[-8:]))
            reasoning = (self.reasoning_parser, opened)
            if structured is not None and opened:  # the grammar holds the answer, after the thinking
                structured = dataclasses.replace(structured, params=dataclasses.replace(structured.params,
                                                                                        after_reasoning=True))
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        choices = []
        for j in range(req.n):
            params = req.sampling_params(max_tokens, self.turn_end_ids, j, logprobs, structured=structured)
            self._check(prompt, params, structured)
            choices.append(Choice(j, prompt, params))
        return choices, tool_calls, reasoning

    def _conversation(self, messages: list) -> list[dict]:
        """The messages checked (tool turns, Unicode, size) into the chat template's input."""
        texts = [m.text() for m in messages] + [c.function.arguments for m in messages for c in m.tool_calls or []]
        if not all(valid_unicode(t) for t in texts):
            raise bad_request("messages must be valid Unicode (no lone surrogates)", param="messages")
        self._check_text_bytes(sum(len(t.encode("utf-8")) for t in texts))
        return conversation(messages)

    def _tokenize(self, prompt: str | list[int]) -> TokenizedPrompt:
        if isinstance(prompt, str):
            if not valid_unicode(prompt):
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
        if not all(valid_unicode(s) for s in params.stop):
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
    origins: list | None = None  # per token, as RequestDelta's (spec_trace)


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
            if delta.origins is not None:
                done.origins = (done.origins or []) + delta.origins
            done.last = delta
    finally:
        stream.abort()
    return done
