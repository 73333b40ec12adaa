"""OpenAI-compatible HTTP API over an AsyncEngine: /v1/completions, /v1/chat/completions,
/v1/models, vLLM's /tokenize, /detokenize and /tokenizer_info, /health, /metrics, and the
playground page (/playground; deployments/playground.py).

The routes and the edge only: parsing, validation and tokenization are deployments/requests.py's,
run in a worker thread; answers are the serving classes' (deployments/serving_completion.py,
serving_chat.py). Every error, routing and parsing included, is OpenAI's JSON shape with a request id;
the detail goes to the log under that id.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import SecretStr
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.app import ServeArgs
from deployments.lingering import RequestBody, drain_limit
from deployments.metrics_export import metrics_text
from deployments.playground import add_playground
from deployments.api_errors import RequestError
from deployments.auth import key_matches
from deployments.requests import RequestLayer
from deployments.serving import REQUEST_ID_HEADER, abort_all, until_disconnect
from deployments.serving_chat import ChatServing
from deployments.serving_completion import CompletionServing
from engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)

# under the API key (a prefix match: /tokenize covers /tokenizer_info too); health and metrics stay open
PROTECTED = ("/v1", "/tokenize", "/detokenize", "/tokenizer_info")


class ErrorJSON(JSONResponse):
    def render(self, content) -> bytes:  # ASCII: a client's lone surrogate echoed back can't break it
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def error_response(error: RequestError, request_id: str | None = None) -> JSONResponse:
    headers = {REQUEST_ID_HEADER: request_id} if request_id else None
    return ErrorJSON(status_code=error.status, content=error.body(request_id), headers=headers)


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
    completion = CompletionServing(args.model_name, engine.tokenizer)
    chat = ChatServing(args.model_name, engine.tokenizer)
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

    if not args.disable_playground:
        add_playground(app)

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
        return await handle(request, "completion", "cmpl", completion.respond)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, "chat", "chatcmpl", chat.respond)

    return app
