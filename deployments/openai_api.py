"""OpenAI-compatible HTTP API over an AsyncEngine: /v1/completions, /v1/chat/completions,
/v1/models, vLLM's /tokenize, /detokenize and /tokenizer_info, /health, /metrics.

The wire format only: parsing, validation and tokenization are deployments/requests.py's, run in a
worker thread. Every error, routing and parsing included, is OpenAI's JSON shape with a request id;
the detail goes to the log under that id.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import SecretStr
from ray.exceptions import TaskCancelledError
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.app import ServeArgs
from deployments.lingering import RequestBody, drain_limit
from deployments.metrics_export import metrics_text
from deployments.api_errors import RequestError
from deployments.auth import key_matches
from deployments.requests import PreparedRequest, RequestLayer, collect, delta_error
from deployments.tool_calls import ToolCallStream, chat_message
from deployments.logprobs import LogprobFormatter
from engine.async_engine import AsyncEngine, RequestStream
from engine.output_processor import RequestDelta
from engine.reasoning import ReasoningSplitter

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-tandem-request-id"  # x-request-id is Serve's own
# under the API key (a prefix match: /tokenize covers /tokenizer_info too); health and metrics stay open
PROTECTED = ("/v1", "/tokenize", "/detokenize", "/tokenizer_info")


class ErrorJSON(JSONResponse):
    def render(self, content) -> bytes:  # ASCII: a client's lone surrogate echoed back can't break it
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def error_response(error: RequestError, request_id: str | None = None) -> JSONResponse:
    headers = {REQUEST_ID_HEADER: request_id} if request_id else None
    return ErrorJSON(status_code=error.status, content=error.body(request_id), headers=headers)


async def until_disconnect(receive) -> None:
    """Returns when the client goes away. Serve's proxy cancels our handler on a disconnect, but a
    client can ask it not to (x-request-disconnect-disabled): this watches for itself."""
    while (await receive())["type"] != "http.disconnect":
        pass


class AbortingStream(StreamingResponse):
    """An SSE response that aborts its requests however it ends: finished, failed, never started,
    or the client gone."""

    def __init__(self, content, streams: list[RequestStream], **kwargs):
        super().__init__(content, **kwargs)
        self.streams = streams

    async def __call__(self, scope, receive, send):
        watcher = asyncio.create_task(until_disconnect(receive))
        watcher.add_done_callback(lambda t: t.cancelled() or abort_all(self.streams))
        try:
            await super().__call__(scope, receive, send)
        except TaskCancelledError:
            # the client left mid-stream and Serve cancelled the request: its receive() raises this
            # where Starlette listens for the disconnect; the streams are aborted below, and letting it
            # out only put Serve's own traceback in the log
            log.info("a streamed request ended: the client went away")
        finally:
            watcher.cancel()
            abort_all(self.streams)


def abort_all(streams: list[RequestStream]) -> None:
    for s in streams:
        s.abort()


async def send_error(scope, receive, send, error: RequestError) -> None:
    await error_response(error, f"req-{uuid.uuid4().hex}")(scope, receive, send)


class EdgeMiddleware:
    """Plain ASGI (not @app.middleware, which re-wraps every streamed chunk): a request-size limit
    answered with 413 before the body is read, and the API key on PROTECTED paths (health and
    metrics stay open for probes). A response that comes before the body is read ends the connection,
    after waiting (bounded) for the rest of the body, so that clients that read only after sending get
    it instead of a reset: deployments/lingering.py."""

    def __init__(self, app, max_request_bytes: int, api_key: SecretStr | None):
        self.app, self.max_bytes, self.api_key = app, max_request_bytes, api_key
        self.drain_bytes = drain_limit(max_request_bytes)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        body = RequestBody(headers, receive, send, self.drain_bytes)
        receive, send = body.receive, body.send
        path, root = scope["path"], scope.get("root_path", "")
        if path.startswith(root):  # under a Serve route_prefix, the path includes it
            path = path[len(root):]
        if self.api_key is not None and path.startswith(PROTECTED) and \
                not key_matches(headers.get(b"authorization"), self.api_key):
            return await send_error(scope, receive, send, RequestError(
                401, "missing or invalid API key: send 'Authorization: Bearer <key>'", "authentication_error",
                code="invalid_api_key"))
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await send_error(scope, receive, send, too_large(self.max_bytes))
        await self.app(scope, receive, send)


def too_large(limit: int) -> RequestError:
    return RequestError(413, f"request body is larger than this server's limit of {limit} bytes",
                        code="request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refusing it once it passes `limit` (a chunked upload has no Content-Length)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(engine: AsyncEngine, args: ServeArgs, api_key: SecretStr | None = None) -> FastAPI:
    app = FastAPI(title="Tandem", docs_url=None, redoc_url=None, openapi_url=None)
    layer = RequestLayer.for_app(engine, args)
    model_name = args.model_name
    created = int(time.time())
    app.add_middleware(EdgeMiddleware, max_request_bytes=args.max_request_bytes, api_key=api_key)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        message = {404: f"no route {request.method} {request.url.path[:200]}",
                   405: f"method {request.method} is not allowed on {request.url.path[:200]}"}.get(
            exc.status_code, "invalid request")
        return error_response(RequestError(exc.status_code, message, code="not_found" if exc.status_code == 404
                                           else None), f"req-{uuid.uuid4().hex}")

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        return error_response(RequestError(400, "invalid request"), f"req-{uuid.uuid4().hex}")

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception):
        rid = f"req-{uuid.uuid4().hex}"
        log.error("request %s: unhandled error on %s", rid, request.url.path, exc_info=exc)
        return error_response(RequestError(500, "internal server error", "internal_error"), rid)

    @app.get("/health")
    async def health():
        problem = engine.health()
        if problem is not None:
            return error_response(RequestError(503, problem, "unavailable_error"))
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(metrics_text(engine, model_name), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "tandem", "root": args.model,
                                            "max_model_len": engine.max_model_len}]}

    async def handle(request: Request, kind: str, prefix: str, respond: Callable) -> Response:
        rid = f"{prefix}-{uuid.uuid4().hex}"
        try:
            body = await read_body(request, args.max_request_bytes)
            prepared = await layer.prepare_async(kind, body, rid)
            streams = layer.start(prepared)
            if prepared.stream:
                return await respond(prepared, streams)
            # a non-streamed answer: stop generating if the client leaves before it
            answer = asyncio.ensure_future(respond(prepared, streams))
            gone = asyncio.ensure_future(until_disconnect(request.receive))
            try:
                await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
                if not answer.done():
                    answer.cancel()
                    abort_all(streams)
            if not answer.done() or answer.cancelled():
                log.info("request %s: the client went away", rid)
                return Response(status_code=499)
            return answer.result()
        except RequestError as e:
            (log.info if e.status < 500 else log.warning)("request %s: %d %s", rid, e.status, e.message)
            return error_response(e, rid)

    async def handle_plain(request: Request, prefix: str, run: Callable) -> Response:
        rid = f"{prefix}-{uuid.uuid4().hex}"
        try:
            return JSONResponse(await run(await read_body(request, args.max_request_bytes)),
                                headers={REQUEST_ID_HEADER: rid})
        except RequestError as e:
            log.info("request %s: %d %s", rid, e.status, e.message)
            return error_response(e, rid)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await handle_plain(request, "tok", layer.tokenize_async)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await handle_plain(request, "detok", layer.detokenize_async)

    @app.get("/tokenizer_info")
    async def get_tokenizer_info():
        return JSONResponse(await layer.tokenizer_info_async())

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "completion", "cmpl", respond_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, "chat", "chatcmpl", respond_chat)

    fmt = LogprobFormatter(engine.tokenizer)

    async def respond_completion(prepared: PreparedRequest, streams: list[RequestStream]) -> Response:
        rid, now = prepared.request_id, int(time.time())
        # streamed text offsets of each choice's tokens (after its echo)
        offsets = [len(c.echo) for c in prepared.choices]

        def chunk(index: int, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
            return {"id": rid, "object": "text_completion", "created": now, "model": model_name,
                    "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}

        def logprobs_of(k: int, delta: RequestDelta | None, echo: bool = False) -> dict | None:
            c = prepared.choices[k]
            if echo:  # the echo chunk: the prompt's log-probabilities (completions' echo + logprobs)
                if c.params.prompt_logprobs is None or delta is None:
                    return None
                obj = fmt.completion([], [], 0, c.prompt.ids, delta.prompt_logprobs)
            else:
                if c.params.logprobs is None or not delta.token_ids:
                    return None
                obj = fmt.completion(delta.token_ids, delta.logprobs or [], offsets[k])
            offsets[k] = (0 if echo else offsets[k]) + sum(len(t) for t in obj["tokens"])
            return obj

        if prepared.stream:
            return await sse(prepared, streams, chunk, "text_completion", now, logprobs_of)
        results = await gather_all(streams)
        choices = []
        for c, r in zip(prepared.choices, results):
            logprobs = None
            if c.params.logprobs is not None:
                echoed = c.params.prompt_logprobs is not None
                logprobs = fmt.completion(r.token_ids, r.logprobs or [], 0 if echoed else len(c.echo),
                                          c.prompt.ids if echoed else None, r.prompt_logprobs if echoed else None)
            choices.append({"index": c.index, "text": c.echo + r.text, "logprobs": logprobs,
                            "finish_reason": openai_finish(r.last.finish_reason)})
        return JSONResponse({"id": rid, "object": "text_completion", "created": now, "model": model_name,
                             "choices": choices, "usage": usage(prepared, results)},
                            headers={REQUEST_ID_HEADER: rid})

    async def respond_chat(prepared: PreparedRequest, streams: list[RequestStream]) -> Response:
        rid, now = prepared.request_id, int(time.time())
        tools = {c.index: ToolCallStream(prepared.tool_calls) for c in prepared.choices} if prepared.tool_calls else {}
        thinking = {c.index: ReasoningSplitter(*prepared.reasoning) for c in prepared.choices} if prepared.reasoning else {}

        def event(index: int, delta: dict, finish: str | None, logprobs: dict | None = None) -> dict:
            return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_name,
                    "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

        def chunk(index: int, text: str, finish: str | None, logprobs: dict | None = None) -> list[dict]:
            events = []
            if index in thinking:  # the thinking first, as reasoning_content; the rest is the answer
                reasoning, text = thinking[index].feed(text, final=finish is not None)
                if reasoning:
                    events.append(event(index, {"reasoning_content": reasoning}, None, logprobs))
                    logprobs = None
                    if not text and finish is None:
                        return events
            if index in tools:
                return events + [event(index, delta, f, lp) for delta, f, lp in tools[index].feed(text, finish, logprobs)]
            delta = {"content": text} if text or finish is None else {}
            return events + [event(index, delta, finish, logprobs)]

        def logprobs_of(k: int, delta: RequestDelta | None, echo: bool = False) -> dict | None:
            if echo or prepared.choices[k].params.logprobs is None or not delta.token_ids:
                return None
            return fmt.chat(delta.token_ids, delta.logprobs or [])

        if prepared.stream:
            return await sse(prepared, streams, chunk, "chat.completion.chunk", now, logprobs_of, role_chunk=True)
        results = await gather_all(streams)
        choices = []
        for c, r in zip(prepared.choices, results):
            text, reasoning = r.text, None
            if prepared.reasoning:
                splitter = ReasoningSplitter(*prepared.reasoning)
                splitter.feed(text, final=True)
                text, reasoning = splitter.content, splitter.reasoning or None
            message, finish = chat_message(prepared.tool_calls, text, openai_finish(r.last.finish_reason))
            if prepared.reasoning:
                message["reasoning_content"] = reasoning
            choices.append({"index": c.index, "message": message,
                            "logprobs": fmt.chat(r.token_ids, r.logprobs or []) if c.params.logprobs is not None
                            else None,
                            "finish_reason": finish})
        return JSONResponse({"id": rid, "object": "chat.completion", "created": now, "model": model_name,
                             "choices": choices, "usage": usage(prepared, results)},
                            headers={REQUEST_ID_HEADER: rid})

    async def sse(prepared: PreparedRequest, streams: list[RequestStream], chunk: Callable, obj: str, now: int,
                  logprobs_of: Callable, role_chunk: bool = False) -> Response:
        # Wait for each choice's first delta before answering 200, so a request that fails at once
        # still gets a status code; later failures become an error event.
        try:
            firsts = await asyncio.gather(*(anext(s) for s in streams))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        for first in firsts:
            if first.error:
                for s in streams:
                    s.abort()
                raise delta_error(first)
        events = merge_streams(prepared, streams, firsts, chunk, obj, now, logprobs_of, role_chunk)
        return AbortingStream(encode_sse(events), streams, media_type="text/event-stream",
                              headers={REQUEST_ID_HEADER: prepared.request_id})

    async def merge_streams(prepared, streams, firsts, chunk, obj, now, logprobs_of, role_chunk) -> AsyncIterator[dict]:
        """Interleave the deltas of the call's choices as SSE chunks, in arrival order."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(k: int, stream: RequestStream, first) -> None:
            try:
                await queue.put((k, first))
                if first.finish_reason is None:
                    async for delta in stream:
                        await queue.put((k, delta))
            finally:
                queue.put_nowait((k, None))

        tasks = [asyncio.create_task(pump(k, s, f)) for k, (s, f) in enumerate(zip(streams, firsts))]
        completion_tokens, open_streams = 0, len(streams)
        try:
            if role_chunk:
                for c in prepared.choices:
                    yield {"id": prepared.request_id, "object": obj, "created": now, "model": model_name,
                           "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]}
            for k, c in enumerate(prepared.choices):
                if c.echo:
                    yield chunk(c.index, c.echo, None, logprobs_of(k, firsts[k], echo=True))
            while open_streams:
                k, delta = await queue.get()
                if delta is None:
                    open_streams -= 1
                    continue
                completion_tokens += len(delta.token_ids)
                if delta.error:
                    log.warning("request %s: choice %d failed while streaming: %s", prepared.request_id,
                                prepared.choices[k].index, delta.error)
                    yield delta_error(delta).body(prepared.request_id)
                    continue
                if delta.text or delta.token_ids or delta.finish_reason:
                    out = chunk(prepared.choices[k].index, delta.text, openai_finish(delta.finish_reason),
                                logprobs_of(k, delta))
                    for event in out if isinstance(out, list) else (out,):
                        yield event
            if prepared.include_usage:
                yield {"id": prepared.request_id, "object": obj, "created": now, "model": model_name,
                       "choices": [], "usage": usage_counts(prepared.prompt_tokens, completion_tokens)}
        finally:
            # a disconnected client (this generator cancelled) aborts every choice of the call
            for s in streams:
                s.abort()
            for t in tasks:
                t.cancel()

    return app


async def gather_all(streams: list[RequestStream]):
    try:
        return await asyncio.gather(*(collect(s) for s in streams))
    finally:
        for s in streams:  # one choice failed or the client went away: stop the others too
            s.abort()


def openai_finish(reason: str | None) -> str | None:
    return {"abort": "stop", "error": "stop"}.get(reason, reason)


def usage(prepared: PreparedRequest, results) -> dict:
    return usage_counts(prepared.prompt_tokens, sum(len(r.token_ids) for r in results))


def usage_counts(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def encode_sse(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield f"data: {json.dumps(event)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        await events.aclose()  # same task that iterated it: runs merge_streams' finally (the aborts)
