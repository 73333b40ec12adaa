"""What the completions and chat routes share: one call's streams into OpenAI's answer, whole
(JSON) or streamed (SSE), in the shape a `CallFormat` gives it.

A route's serving class (deployments/serving_completion.py, serving_chat.py) names its format; the
plumbing here waits for the streams, merges the deltas of a call's choices in arrival order, counts
usage and aborts every choice when the client leaves. Formats are plain objects: deltas in, dicts
out, testable without a server or an engine.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray.exceptions import TaskCancelledError

from deployments.logprobs import LogprobFormatter
from deployments.requests import Completion, PreparedRequest, collect, delta_error
from engine.async_engine import RequestStream
from engine.metrics import SpecDecodeStats
from engine.output_processor import RequestDelta, TokenOrigin

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-tandem-request-id"  # x-request-id is Serve's own


class CallFormat:
    """One call's answer in OpenAI's shape. Subclasses: the chunks a stream sends, and the whole answer."""

    object_name = ""  # a streamed chunk's "object"

    def __init__(self, prepared: PreparedRequest, model_name: str, fmt: LogprobFormatter, now: int):
        self.prepared, self.model_name, self.fmt, self.now = prepared, model_name, fmt, now

    def chunk(self, choices: list[dict], **extra) -> dict:
        return {"id": self.prepared.request_id, "object": self.object_name, "created": self.now,
                "model": self.model_name, "choices": choices, **extra}

    def opening(self, firsts: list[RequestDelta]) -> list[dict]:
        """The chunks before any delta (`firsts`: each choice's first delta, not yet sent)."""
        return []

    def events(self, k: int, delta: RequestDelta) -> list[dict]:
        """The chunks of choice k's delta."""
        raise NotImplementedError

    def answer(self, results: list[Completion]) -> dict:
        """The whole answer, once every choice has ended."""
        raise NotImplementedError

    def blank(self, index: int) -> dict:
        """A chunk for choice `index` that adds nothing (it carries a spec_trace the text didn't)."""
        raise NotImplementedError

    def traced(self, k: int, delta: RequestDelta, events: list[dict]) -> list[dict]:
        """Choice k's chunks with the delta's token origins on the last (spec_trace requests)."""
        if delta.origins is None or not (events or delta.origins):
            return events
        events = events or [self.blank(self.prepared.choices[k].index)]
        events[-1]["choices"][0]["spec_trace"] = spec_trace(delta.origins, delta.stats)
        return events

    def traced_answer(self, answer: dict, results: list[Completion]) -> dict:
        for choice, r in zip(answer["choices"], results):
            if r.origins is not None:
                choice["spec_trace"] = spec_trace(r.origins, r.last.stats)
        return answer

    def usage_chunk(self, completion_tokens: int) -> dict:
        return self.chunk([], usage=usage_counts(self.prepared.prompt_tokens, completion_tokens))


class Serving:
    """A route's serving: its call format over the shared stream plumbing."""

    format: type[CallFormat] = CallFormat

    def __init__(self, model_name: str, tokenizer):
        self.model_name, self.fmt = model_name, LogprobFormatter(tokenizer)

    async def respond(self, prepared: PreparedRequest, streams: list[RequestStream]) -> Response:
        call = self.format(prepared, self.model_name, self.fmt, int(time.time()))
        if prepared.stream:
            return await sse(call, streams)
        results = await gather_all(streams)
        return JSONResponse(call.traced_answer(call.answer(results), results), headers={REQUEST_ID_HEADER: prepared.request_id})


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


async def sse(call: CallFormat, streams: list[RequestStream]) -> Response:
    # Wait for each choice's first delta before answering 200, so a request that fails at once
    # still gets a status code; later failures become an error event.
    try:
        firsts = await asyncio.gather(*(anext(s) for s in streams))
    except BaseException:
        abort_all(streams)
        raise
    for first in firsts:
        if first.error:
            abort_all(streams)
            raise delta_error(first)
    return AbortingStream(encode_sse(merge_streams(call, streams, firsts)), streams, media_type="text/event-stream",
                          headers={REQUEST_ID_HEADER: call.prepared.request_id})


async def merge_streams(call: CallFormat, streams: list[RequestStream], firsts: list[RequestDelta]) \
        -> AsyncIterator[dict]:
    """Interleave the deltas of the call's choices as SSE chunks, in arrival order."""
    prepared = call.prepared
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
        for event in call.opening(firsts):
            yield event
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
            events = call.events(k, delta) if delta.text or delta.token_ids or delta.finish_reason else []
            for event in call.traced(k, delta, events):
                yield event
        if prepared.include_usage:
            yield call.usage_chunk(completion_tokens)
    finally:
        # a disconnected client (this generator cancelled) aborts every choice of the call
        abort_all(streams)
        for t in tasks:
            t.cancel()


async def gather_all(streams: list[RequestStream]) -> list[Completion]:
    try:
        return await asyncio.gather(*(collect(s) for s in streams))
    finally:
        abort_all(streams)  # one choice failed or the client went away: stop the others too


async def encode_sse(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield f"data: {json.dumps(event)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        await events.aclose()  # same task that iterated it: runs merge_streams' finally (the aborts)


def spec_trace(origins: list[TokenOrigin], stats: SpecDecodeStats | None) -> dict:
    """The `spec_trace` extension: one entry per token (where its text ends, in characters of the
    generated text; its round; whether it was an accepted draft; on a round's own target token, the
    drafts proposed), and the request's counters once it has finished."""
    trace: dict = {"tokens": [{"end": o.end, "round": o.round, "draft": o.draft, "k": o.k} for o in origins]}
    if stats is not None:
        trace["stats"] = {"num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
                          "num_accepted_tokens": stats.num_accepted_tokens,
                          "mean_acceptance_length": stats.mean_acceptance_length}
    return trace


def openai_finish(reason: str | None) -> str | None:
    return {"abort": "stop", "error": "stop"}.get(reason, reason)


def usage(prepared: PreparedRequest, results: list[Completion]) -> dict:
    return usage_counts(prepared.prompt_tokens, sum(len(r.token_ids) for r in results))


def usage_counts(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
