"""The gRPC operations (proto/tandem.proto) over the same AsyncEngine as the HTTP API.

Ray Serve's gRPC proxy calls the coordinator's method named like the RPC with the request message
and a grpc_context; errors become status codes with a message.
"""
from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from pydantic import ValidationError

from deployments.app import ServeArgs
from deployments.chat import chat_prompt_ids, end_of_turn_ids
from engine.async_engine import AsyncEngine, QueueFullError, RequestDelta
from engine.config import SamplingParams
from engine.metrics import SpecDecodeStats
from tandem_proto import tandem_pb2 as pb


class RequestError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(code, message)  # both in args: Ray pickles exceptions across processes
        self.code, self.message = code, message

    def __str__(self) -> str:
        return self.message


class GrpcService:
    def __init__(self, engine: AsyncEngine, args: ServeArgs):
        self.engine, self.args = engine, args
        self.turn_end_ids = end_of_turn_ids(engine.tokenizer)

    # -- the four RPCs ----------------------------------------------------------------------------

    async def generate(self, request: pb.GenerateRequest, context) -> pb.GenerateResponse:
        try:
            prompt, params = self._parse(request, context)
            tokens, text, last, prompt_len = [], "", None, 0
            async for delta in self._run(prompt, params):
                tokens += delta.token_ids
                text += delta.text
                prompt_len = prompt_len or len(delta.prompt_token_ids)
                last = delta
            return pb.GenerateResponse(text=text, token_ids=tokens, finish_reason=last.finish_reason,
                                       usage=_usage(prompt_len, len(tokens)), spec_decode=_stats(last.stats))
        except RequestError as e:
            _abort(context, e)
            return pb.GenerateResponse()

    async def generate_stream(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateStreamResponse]:
        try:
            prompt, params = self._parse(request, context)
            prompt_len = completion = 0
            async for delta in self._run(prompt, params):
                prompt_len = prompt_len or len(delta.prompt_token_ids)
                completion += len(delta.token_ids)
                msg = pb.GenerateStreamResponse(text=delta.text, token_ids=delta.token_ids,
                                                finish_reason=delta.finish_reason or "")
                if delta.finish_reason:
                    msg.usage.CopyFrom(_usage(prompt_len, completion))
                    msg.spec_decode.CopyFrom(_stats(delta.stats))
                yield msg
        except RequestError as e:
            # Serve's proxy applies a stream's status only when the generator raises: set the code,
            # then raise, and the proxy keeps the code and message
            _abort(context, e)
            raise

    def list_models(self, request: pb.ListModelsRequest, context) -> pb.ListModelsResponse:
        try:
            self._authenticate(context)
        except RequestError as e:
            _abort(context, e)
            return pb.ListModelsResponse()
        card = pb.ModelCard(id=self.args.model_name, root=self.args.model, max_model_len=self.engine.max_model_len)
        return pb.ListModelsResponse(models=[card])

    def health(self, request: pb.HealthRequest, context) -> pb.HealthResponse:
        if not self.engine.alive():
            _abort(context, RequestError(grpc.StatusCode.UNAVAILABLE, "engine is not running"))
            return pb.HealthResponse(status="unavailable")
        return pb.HealthResponse(status="ok")

    # -- shared parts -----------------------------------------------------------------------------

    def _authenticate(self, context) -> None:
        if not self.args.api_key:
            return
        metadata = dict(context.invocation_metadata()) if context is not None else {}
        if metadata.get("authorization") != f"Bearer {self.args.api_key}":
            raise RequestError(grpc.StatusCode.UNAUTHENTICATED,
                               "missing or invalid API key: send metadata ('authorization', 'Bearer <key>')")

    def _parse(self, request: pb.GenerateRequest, context) -> tuple[object, SamplingParams]:
        self._authenticate(context)
        if request.model not in (self.args.model_name, self.args.model):
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"The model '{request.model}' does not exist; "
                                                          f"this server serves '{self.args.model_name}'")
        given = [bool(request.prompt), bool(request.prompt_token_ids), bool(request.messages)]
        if sum(given) != 1:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               "give exactly one of prompt, prompt_token_ids, messages")
        extra_stop: list[int] = []
        try:
            if request.messages:
                ids = chat_prompt_ids(self.engine.tokenizer,
                                      [{"role": m.role, "content": m.content} for m in request.messages])
                prompt, extra_stop = {"prompt_token_ids": ids}, self.turn_end_ids
            elif request.prompt_token_ids:
                prompt = {"prompt_token_ids": list(request.prompt_token_ids)}
            else:
                prompt = request.prompt
            default_max = None if request.messages else 16
            params = SamplingParams(
                max_tokens=request.max_tokens if request.HasField("max_tokens") else default_max,
                temperature=request.temperature if request.HasField("temperature") else 1.0,
                top_p=request.top_p if request.HasField("top_p") else 1.0,
                top_k=request.top_k if request.HasField("top_k") else -1,
                min_tokens=request.min_tokens, stop=list(request.stop),
                stop_token_ids=list(request.stop_token_ids) + extra_stop,
                seed=request.seed if request.HasField("seed") else None, ignore_eos=request.ignore_eos)
        except (ValueError, ValidationError) as e:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(e).removeprefix("Value error, ")) from None
        return prompt, params

    async def _run(self, prompt, params: SamplingParams) -> AsyncIterator[RequestDelta]:
        stream = self.engine.add_request(prompt, params)
        try:
            async for delta in stream:
                if delta.finish_reason == "rejected":
                    raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, delta.error)
                if delta.error:
                    raise RequestError(grpc.StatusCode.UNAVAILABLE, f"generation failed: {delta.error}")
                yield delta
        except QueueFullError as e:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        except ValueError as e:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        finally:
            await stream.aclose()  # a cancelled call aborts its request


def _abort(context, error: RequestError) -> None:
    if context is not None:
        context.set_code(error.code)
        context.set_details(error.message)


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
