"""The gRPC service (proto/tandem.proto) over the same AsyncEngine and request layer as the HTTP API.

The coordinator serves it itself, from a grpc.aio server on its own thread and event loop, bound to
`grpc_host:grpc_port` (loopback by default, like HTTP). Ray Serve's gRPC proxy always binds every
interface and does not reliably abort a cancelled stream; here the call's done-callback aborts it.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import uuid
from collections.abc import AsyncIterator

import grpc
from pydantic import SecretStr

from deployments.app import ServeArgs
from deployments.api_errors import RequestError
from deployments.auth import key_matches
from deployments.requests import PreparedRequest, RequestLayer, collect, delta_error
from deployments.tool_calls import ToolCallStream, chat_message
from engine.async_engine import AsyncEngine
from engine.metrics import SpecDecodeStats
from engine.output_processor import TokenOrigin
from engine.reasoning import ReasoningSplitter
from tandem_proto import tandem_pb2 as pb
from tandem_proto import tandem_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

STATUS_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
                404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
                429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE}
OPTIONAL_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty",
                   "repetition_penalty")


def request_body(request: pb.GenerateRequest) -> tuple[str, dict]:
    """The message as the request layer's body: (kind, fields). Absent fields stay absent, so HTTP's
    defaults apply."""
    given = [bool(request.prompt), bool(request.prompt_token_ids), bool(request.messages)]
    if sum(given) != 1:
        raise RequestError(400, "give exactly one of prompt, prompt_token_ids, messages")
    body: dict = {"model": request.model}
    if request.messages:
        kind = "chat"
        body["messages"] = [chat_message_body(m) for m in request.messages]
        body.update(tools_body(request))
    else:
        if request.tools or request.tool_choice or request.tool_choice_function or request.HasField("parallel_tool_calls"):
            raise RequestError(400, "tools: only with messages, not prompts", param="tools")
        kind = "completion"
        body["prompt"] = request.prompt or list(request.prompt_token_ids)
    for name in OPTIONAL_FIELDS:
        if request.HasField(name):
            body[name] = getattr(request, name)
    if request.min_tokens:
        body["min_tokens"] = request.min_tokens
    if request.stop:
        body["stop"] = list(request.stop)
    if request.stop_token_ids:
        body["stop_token_ids"] = list(request.stop_token_ids)
    if request.ignore_eos:
        body["ignore_eos"] = True
    if request.logit_bias:
        body["logit_bias"] = {str(k): v for k, v in request.logit_bias.items()}
    if request.HasField("logprobs"):
        body.update({"logprobs": True, "top_logprobs": request.logprobs} if kind == "chat"
                    else {"logprobs": request.logprobs})
    if request.HasField("prompt_logprobs"):
        if kind == "chat":
            raise RequestError(400, "prompt_logprobs: only for prompts, not messages")
        body["prompt_logprobs"] = request.prompt_logprobs
    if request.HasField("cache_salt"):
        body["cache_salt"] = request.cache_salt
    if request.HasField("structured_outputs"):
        body["structured_outputs"] = structured_outputs(request.structured_outputs)
    if request.HasField("speculative"):
        body["speculative"] = request.speculative
    if request.spec_trace:
        body["spec_trace"] = True
    return kind, body


def chat_message_body(m: pb.ChatMessage) -> dict:
    message: dict = {"role": m.role, "content": m.content}
    if m.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in m.tool_calls]
        message["content"] = m.content or None
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    return message


def tools_body(request: pb.GenerateRequest) -> dict:
    """The request's tools as the chat API's fields."""
    body: dict = {}
    if request.tools:
        tools = []
        for i, tool in enumerate(request.tools):
            function: dict = {"name": tool.name}
            if tool.description:
                function["description"] = tool.description
            if tool.parameters:
                try:
                    function["parameters"] = json.loads(tool.parameters)
                except (ValueError, RecursionError):
                    raise RequestError(400, f"tools[{i}].parameters is not JSON", param="tools") from None
            tools.append({"type": "function", "function": function})
        body["tools"] = tools
    if request.tool_choice and request.tool_choice_function:
        raise RequestError(400, "give at most one of tool_choice, tool_choice_function", param="tool_choice")
    if request.tool_choice:
        body["tool_choice"] = request.tool_choice
    if request.tool_choice_function:
        body["tool_choice"] = {"type": "function", "function": {"name": request.tool_choice_function}}
    if request.HasField("parallel_tool_calls"):
        body["parallel_tool_calls"] = request.parallel_tool_calls
    return body


def structured_outputs(so: pb.StructuredOutputs) -> dict:
    """The message as the request layer's structured_outputs field (vLLM's StructuredOutputsParams)."""
    kind = so.WhichOneof("kind")
    if kind is None:
        raise RequestError(400, "structured_outputs: set one of json_schema, regex, choice, grammar, json_object",
                           param="structured_outputs")
    value = list(so.choice.choices) if kind == "choice" else getattr(so, kind)
    out: dict = {"json" if kind == "json_schema" else kind: value}
    if so.disable_any_whitespace:
        out["disable_any_whitespace"] = True
    return out


def token_logprobs(tokenizer, token_ids: list[int], entries: list | None) -> list[pb.TokenLogprob]:
    """The engine's TokenLogprob entries as messages; None (the prompt's first token) has no logprob."""
    out = []
    for token, entry in zip(token_ids, entries or []):
        msg = pb.TokenLogprob(token_id=token, token=tokenizer.decode([token]))
        if entry is not None:
            msg.logprob, msg.rank = entry.logprob, entry.rank
            msg.top_logprobs.extend(pb.TopLogprob(token_id=t, token=tokenizer.decode([t]), logprob=v) for t, v in entry.top)
        out.append(msg)
    return out


def token_origins(origins: list[TokenOrigin] | None) -> list[pb.TokenOrigin]:
    return [pb.TokenOrigin(end=o.end, round=o.round, draft=o.draft, k=o.k) for o in origins or []]


class TandemServicer(pb_grpc.TandemServiceServicer):
    def __init__(self, engine: AsyncEngine, args: ServeArgs, api_key: SecretStr | None):
        self.engine, self.args, self.api_key = engine, args, api_key
        self.layer = RequestLayer.for_app(engine, args)

    async def Generate(self, request: pb.GenerateRequest, context) -> pb.GenerateResponse:  # noqa: N802
        rid = f"grpc-{uuid.uuid4().hex}"
        try:
            prepared = await self._prepare(request, context, rid)
            (stream,) = self.layer.start(prepared)
            context.add_done_callback(lambda _: stream.abort())  # a cancelled call frees its blocks
            done = await collect(stream)
        except RequestError as e:
            await _abort(context, e, rid)
        except Exception as e:  # noqa: BLE001 - grpc.aio would put the exception's text in the status
            await _internal(context, e, rid)
        tok = self.engine.tokenizer
        text, finish, calls, reasoning = done.text, done.last.finish_reason, [], ""
        if prepared.reasoning is not None:
            splitter = ReasoningSplitter(*prepared.reasoning)
            splitter.feed(text, final=True)
            text, reasoning = splitter.content, splitter.reasoning
        if prepared.tool_calls is not None:
            message, finish = chat_message(prepared.tool_calls, done.text, finish)
            text = message["content"] or ""
            calls = [pb.ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
                     for c in message.get("tool_calls") or []]
        return pb.GenerateResponse(text=text, token_ids=done.token_ids, finish_reason=finish, tool_calls=calls,
                                   reasoning=reasoning,
                                   usage=_usage(prepared.prompt_tokens, len(done.token_ids)),
                                   spec_decode=_stats(done.last.stats),
                                   logprobs=token_logprobs(tok, done.token_ids, done.logprobs),
                                   prompt_logprobs=token_logprobs(tok, done.prompt_token_ids, done.prompt_logprobs),
                                   origins=token_origins(done.origins))

    async def GenerateStream(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateStreamResponse]:  # noqa: N802
        rid = f"grpc-{uuid.uuid4().hex}"
        try:
            prepared = await self._prepare(request, context, rid)
            (stream,) = self.layer.start(prepared)
        except RequestError as e:
            await _abort(context, e, rid)
        except Exception as e:  # noqa: BLE001
            await _internal(context, e, rid)
        # grpc.aio does not cancel a streaming handler when its client cancels (writes to the dead
        # call are dropped): the call's end frees its blocks
        context.add_done_callback(lambda _: stream.abort())
        completion = 0
        tools = ToolCallStream(prepared.tool_calls) if prepared.tool_calls is not None else None
        thinking = ReasoningSplitter(*prepared.reasoning) if prepared.reasoning is not None else None
        try:
            async for delta in stream:
                if delta.error:
                    await _abort(context, delta_error(delta), rid)
                completion += len(delta.token_ids)
                tok = self.engine.tokenizer
                text, reasoning = delta.text, ""
                if thinking is not None:
                    reasoning, text = thinking.feed(text, final=delta.finish_reason is not None)
                pieces = [({"content": text}, delta.finish_reason)] if tools is None else \
                    [(d, f) for d, f, _ in tools.feed(text, delta.finish_reason, None)] or [({}, None)]
                if reasoning:
                    pieces[0] = ({**pieces[0][0], "reasoning": reasoning}, pieces[0][1])
                for i, (piece, finish) in enumerate(pieces):
                    msg = pb.GenerateStreamResponse(text=piece.get("content") or "", finish_reason=finish or "",
                                                    reasoning=piece.get("reasoning", ""),
                                                    tool_calls=[tool_call_delta(c) for c in piece.get("tool_calls", [])])
                    if i == 0:  # the tokens (and their log-probabilities) ride on the first piece
                        msg.token_ids.extend(delta.token_ids)
                        msg.logprobs.extend(token_logprobs(tok, delta.token_ids, delta.logprobs))
                        msg.prompt_logprobs.extend(token_logprobs(tok, delta.prompt_token_ids, delta.prompt_logprobs))
                        msg.origins.extend(token_origins(delta.origins))
                    if finish:
                        msg.usage.CopyFrom(_usage(prepared.prompt_tokens, completion))
                        msg.spec_decode.CopyFrom(_stats(delta.stats))
                    yield msg
        except Exception as e:  # noqa: BLE001 - aborts (grpc's own) pass through untouched
            if isinstance(e, grpc.aio.AbortError):
                raise
            await _internal(context, e, rid)
        finally:
            stream.abort()  # a cancelled call (this task cancelled) frees its blocks

    async def ListModels(self, request: pb.ListModelsRequest, context) -> pb.ListModelsResponse:  # noqa: N802
        rid = f"grpc-{uuid.uuid4().hex}"
        try:
            self._authenticate(context)
        except RequestError as e:
            await _abort(context, e, rid)
        card = pb.ModelCard(id=self.args.model_name, root=self.args.model, max_model_len=self.engine.max_model_len)
        return pb.ListModelsResponse(models=[card])

    async def Health(self, request: pb.HealthRequest, context) -> pb.HealthResponse:  # noqa: N802
        problem = self.engine.health()
        if problem is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, problem)
        return pb.HealthResponse(status="ok")

    # -- shared parts -----------------------------------------------------------------------------

    def _authenticate(self, context) -> None:
        if self.api_key is None:
            return
        presented = dict(context.invocation_metadata() or ()).get("authorization")
        if not key_matches(presented, self.api_key):
            raise RequestError(401, "missing or invalid API key: send metadata ('authorization', 'Bearer <key>')",
                               "authentication_error")

    async def _prepare(self, request: pb.GenerateRequest, context, rid: str) -> PreparedRequest:
        self._authenticate(context)
        kind, body = request_body(request)
        return await self.layer.prepare_async(kind, body, rid)


async def _abort(context, error: RequestError, request_id: str) -> None:
    """End the call with the error's code and message (raises, as context.abort does)."""
    (log.info if error.status < 500 else log.warning)("request %s: %d %s", request_id, error.status, error.message)
    await context.abort(STATUS_CODES.get(error.status, grpc.StatusCode.INTERNAL),
                        f"{error.message} (request id {request_id})")


async def _internal(context, error: Exception, request_id: str) -> None:
    if isinstance(error, grpc.aio.AbortError):
        raise error
    log.error("request %s: unexpected error", request_id, exc_info=error)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal server error (request id {request_id})")


def tool_call_delta(call: dict) -> pb.ToolCallDelta:
    function = call.get("function", {})
    return pb.ToolCallDelta(index=call["index"], id=call.get("id", ""), name=function.get("name", ""),
                            arguments=function.get("arguments", ""))


def _usage(prompt_tokens: int, completion_tokens: int) -> pb.Usage:
    return pb.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                    total_tokens=prompt_tokens + completion_tokens)


def _stats(stats: SpecDecodeStats | None) -> pb.SpecDecodeStats:
    if stats is None:
        return pb.SpecDecodeStats()
    return pb.SpecDecodeStats(num_drafts=stats.num_drafts, num_draft_tokens=stats.num_draft_tokens,
                              num_accepted_tokens=stats.num_accepted_tokens,
                              mean_acceptance_length=stats.mean_acceptance_length,
                              num_accepted_tokens_per_pos=stats.num_accepted_tokens_per_pos)


class GrpcServer:
    """A grpc.aio server on its own thread and event loop, so gRPC and HTTP never wait on each other."""

    def __init__(self, servicer: TandemServicer, host: str, port: int, max_message_bytes: int,
                 share_port: bool = False):
        self.address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
        self._servicer, self._max_bytes, self._share_port = servicer, max_message_bytes, share_port
        self._loop = asyncio.new_event_loop()
        self._server = None
        self.port = 0
        # the loop runs forever and the server is started and stopped on it: a server whose loop
        # also sat in wait_for_termination() took stop()'s whole grace period with no call in flight
        self._thread = threading.Thread(target=self._loop.run_forever, name="tandem-grpc", daemon=True)
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(60)
        except Exception as e:  # noqa: BLE001 - e.g. the port is taken
            self._loop.call_soon_threadsafe(self._loop.stop)
            raise RuntimeError(f"could not serve gRPC on {self.address}: {e}") from None

    async def _start(self) -> None:
        # so_reuseport off: a port already taken (another server) is an error, not a shared port;
        # on (share_port) for several replicas on one node: the kernel spreads connections
        # among them (Linux lets only the same user's processes share a port)
        server = grpc.aio.server(options=[("grpc.so_reuseport", int(self._share_port)),
                                          ("grpc.max_receive_message_length", self._max_bytes)])
        pb_grpc.add_TandemServiceServicer_to_server(self._servicer, server)
        self.port = server.add_insecure_port(self.address)
        await server.start()
        self._server = server

    def stop(self, grace_s: float = 5.0) -> None:
        """Refuse new calls; let those in flight finish for up to grace_s (a replica being drained)."""
        if self._server is not None and self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(self._server.stop(grace_s), self._loop).result(grace_s + 5)
            finally:
                self._server = None
                self._loop.call_soon_threadsafe(self._loop.stop)
