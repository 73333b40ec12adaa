"""OpenAI-compatible HTTP API over an AsyncEngine: /v1/completions, /v1/chat/completions,
/v1/models, /health, /metrics. Errors use OpenAI's JSON shape and never carry a traceback."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deployments.app import ServeArgs
from deployments.chat import chat_prompt_ids, end_of_turn_ids
from deployments.metrics_export import metrics_text
from engine.async_engine import AsyncEngine, QueueFullError, RequestDelta
from engine.config import SamplingParams

log = logging.getLogger(__name__)

class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code)


def error_response(status: int, message: str, type_: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": type_, "param": param, "code": code}})


class APIKeyMiddleware:
    """Require `Authorization: Bearer <key>` under /v1 (health and metrics stay open for probes).

    Plain ASGI rather than @app.middleware("http"), which re-wraps every streamed chunk."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            path, root = scope["path"], scope.get("root_path", "")
            if path.startswith(root):  # under a Serve route_prefix, the path includes it
                path = path[len(root):]
            auth = dict(scope.get("headers") or []).get(b"authorization", b"")
            if path.startswith("/v1") and auth != self.expected:
                response = error_response(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                          "authentication_error", code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions (OpenAI's, plus vLLM's extensions)."""

    model_config = ConfigDict(extra="ignore")

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
    logprobs: Any = None
    user: str | None = None

    def sampling_params(self, default_max_tokens: int | None, extra_stop_ids: list[int] = (), index: int = 0):
        if self.logprobs not in (None, False, 0):
            raise APIError(400, "logprobs is not supported yet", param="logprobs")
        seed = None if self.seed is None else self.seed + index  # n > 1: distinct, reproducible samples
        try:
            return SamplingParams(
                temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
                min_tokens=self.min_tokens, stop=self.stop, seed=seed, ignore_eos=self.ignore_eos,
                stop_token_ids=list(self.stop_token_ids or []) + list(extra_stop_ids))
        except ValidationError as e:
            raise APIError(400, _first_error(e), param=_first_param(e)) from None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    max_tokens: int | None = 16  # OpenAI's default for completions


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    return f"{where}: {msg}" if where else msg


def _first_param(e: ValidationError) -> str | None:
    loc = [str(x) for x in e.errors()[0].get("loc", ()) if x != "body"]
    return loc[0] if loc else None


def create_app(engine: AsyncEngine, args: ServeArgs) -> FastAPI:
    app = FastAPI(title="Tandem", docs_url=None, redoc_url=None)
    tokenizer = engine.tokenizer
    model_name = args.model_name
    created = int(time.time())
    turn_end_ids = end_of_turn_ids(tokenizer)

    if args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=args.api_key)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        if errors and errors[0].get("type") == "json_invalid":
            return error_response(400, "request body is not valid JSON", "invalid_request_error")
        err = errors[0] if errors else {}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        message = f"{'.'.join(loc)}: {err.get('msg', 'invalid')}" if loc else err.get("msg", "invalid request")
        return error_response(400, message, "invalid_request_error", loc[0] if loc else None)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(500, "internal server error", "internal_error")

    @app.get("/health")
    async def health():
        if not engine.alive():
            return error_response(503, "engine is not running", "unavailable")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(metrics_text(engine, model_name), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "tandem", "root": args.model,
                                            "max_model_len": engine.max_model_len}]}

    def check_model(name: str) -> None:
        if name not in (model_name, args.model):
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{model_name}'",
                           param="model", code="model_not_found")

    async def start(prompt: Any, params: SamplingParams) -> tuple[AsyncIterator[RequestDelta], RequestDelta]:
        """Queue one request; return its stream and first delta (raises APIError on rejection)."""
        stream = engine.add_request(prompt, params, f"cmpl-{uuid.uuid4().hex}")
        try:
            first = await stream.__anext__()
        except QueueFullError as e:
            raise APIError(429, str(e), "rate_limit_error", code="queue_full") from None
        except ValueError as e:
            raise APIError(400, str(e), param="prompt" if "prompt" in str(e) else None) from None
        if first.finish_reason == "rejected":
            raise APIError(400, first.error, param="prompt" if "prompt" in first.error else None)
        if first.error:
            raise APIError(500, f"generation failed: {first.error}", "internal_error")
        return stream, first

    async def start_all(jobs: list[tuple[Any, SamplingParams]]) -> list[tuple[AsyncIterator[RequestDelta], RequestDelta]]:
        """Start every request of one API call, or none: a rejection aborts those already queued."""
        started = []
        try:
            for prompt, params in jobs:
                started.append(await start(prompt, params))
        except BaseException:
            for stream, _ in started:
                await stream.aclose()
            raise
        return started

    async def run_to_end(stream, first: RequestDelta) -> tuple[list[int], str, RequestDelta]:
        tokens, text, last = list(first.token_ids), first.text, first
        if first.finish_reason is None:
            async for delta in stream:
                tokens += delta.token_ids
                text += delta.text
                last = delta
        if last.error:
            raise APIError(500, f"generation failed: {last.error}", "internal_error")
        return tokens, text, last

    def prompts_of(req: CompletionRequest) -> list[Any]:
        p = req.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [{"prompt_token_ids": p}]
        if all(isinstance(x, str) for x in p):
            return list(p)
        return [{"prompt_token_ids": x} for x in p]

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        check_model(req.model)
        prompts = prompts_of(req)
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        jobs = []  # (choice index, prompt, params)
        for i, prompt in enumerate(prompts):
            for j in range(req.n):
                jobs.append((i * req.n + j, prompt, req.sampling_params(16, index=j)))
        started = await start_all([(prompt, params) for _, prompt, params in jobs])
        echo_text = [(prompt if isinstance(prompt, str) else tokenizer.decode(prompt["prompt_token_ids"]))
                     if req.echo else "" for _, prompt, _ in jobs]

        def chunk(index: int, text: str, finish: str | None) -> dict:
            return {"id": rid, "object": "text_completion", "created": now, "model": model_name,
                    "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish}]}

        if req.stream:
            return sse(merge_streams(started, [j[0] for j in jobs], echo_text, chunk,
                                     req.stream_options and req.stream_options.include_usage, rid, now,
                                     "text_completion"))
        results = await asyncio.gather(*(run_to_end(s, f) for s, f in started))
        choices, completion_tokens = [], 0
        for (index, _, _), echo, (tokens, text, last) in zip(jobs, echo_text, results):
            choices.append({"index": index, "text": echo + text, "logprobs": None,
                            "finish_reason": openai_finish(last.finish_reason)})
            completion_tokens += len(tokens)
        prompt_tokens = sum(len(f.prompt_token_ids) for _, f in started)
        return {"id": rid, "object": "text_completion", "created": now, "model": model_name, "choices": choices,
                "usage": usage(prompt_tokens, completion_tokens)}

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest):
        check_model(req.model)
        try:
            ids = chat_prompt_ids(tokenizer, [{"role": m.role, "content": m.text()} for m in req.messages])
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is not None:
            req = req.model_copy(update={"max_tokens": max_tokens})
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        jobs = [req.sampling_params(None, turn_end_ids, index=j) for j in range(req.n)]
        started = await start_all([({"prompt_token_ids": ids}, params) for params in jobs])

        def chunk(index: int, text: str, finish: str | None) -> dict:
            delta = {"content": text} if text or finish is None else {}
            return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_name,
                    "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        if req.stream:
            return sse(merge_streams(started, list(range(req.n)), [""] * req.n, chunk,
                                     req.stream_options and req.stream_options.include_usage, rid, now,
                                     "chat.completion.chunk", role_chunk=True))
        results = await asyncio.gather(*(run_to_end(s, f) for s, f in started))
        choices = [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                    "finish_reason": openai_finish(last.finish_reason)}
                   for i, (_, text, last) in enumerate(results)]
        completion_tokens = sum(len(tokens) for tokens, _, _ in results)
        return {"id": rid, "object": "chat.completion", "created": now, "model": model_name, "choices": choices,
                "usage": usage(len(ids) * req.n, completion_tokens)}

    async def merge_streams(started, indices, prefixes, chunk, include_usage, rid, now, obj, role_chunk=False):
        """Interleave the deltas of several requests as SSE chunks, in arrival order."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(k, stream, first):
            try:
                await queue.put((k, first))
                if first.finish_reason is None:
                    async for delta in stream:
                        await queue.put((k, delta))
            finally:
                await queue.put((k, None))

        tasks = [asyncio.create_task(pump(k, s, f)) for k, (s, f) in enumerate(started)]
        prompt_tokens = sum(len(f.prompt_token_ids) for _, f in started)
        completion_tokens, open_streams = 0, len(started)
        try:
            if role_chunk:
                for index in indices:
                    first = chunk(index, "", None)
                    first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                    yield first
            for k, prefix in enumerate(prefixes):
                if prefix:
                    yield chunk(indices[k], prefix, None)
            while open_streams:
                k, delta = await queue.get()
                if delta is None:
                    open_streams -= 1
                    continue
                completion_tokens += len(delta.token_ids)
                if delta.error:
                    yield {"error": {"message": f"generation failed: {delta.error}", "type": "internal_error",
                                     "param": None, "code": None}}
                    continue
                if delta.text or delta.finish_reason:
                    yield chunk(indices[k], delta.text, openai_finish(delta.finish_reason))
            if include_usage:
                yield {"id": rid, "object": obj, "created": now, "model": model_name, "choices": [],
                       "usage": usage(prompt_tokens, completion_tokens)}
        finally:
            for t in tasks:
                t.cancel()
            for s, _ in started:
                await s.aclose()  # a disconnected client aborts every request of this response

    return app


def openai_finish(reason: str | None) -> str | None:
    return {"abort": "stop", "error": "stop"}.get(reason, reason)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        async for c in chunks:
            yield f"data: {json.dumps(c)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")
