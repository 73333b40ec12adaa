"""The engine as the serving layer sees it: add_request() returns a RequestStream of deltas.

One thread runs the step loop (model calls block); each request has an asyncio.Queue that the
loop feeds through the event loop's thread-safe door, with the deltas engine/output_processor.py
makes. Streaming convention: every delta carries
the tokens and text new since the previous one; the last has finish_reason set (and `error`, a
message safe to show a client, when the request failed). A stream that is dropped before its end
must be aborted: `stream.abort()` is idempotent, synchronous, and safe from any task.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
from typing import Any, NamedTuple

from engine.config import EngineConfig, SamplingParams, check_cache_salt
from engine.core import EngineCore, uses_ray
from engine.errors import QUEUE_FAILED, InvalidRequest, RequestFailure
from engine.executor import ensure_ray
from engine.metrics import CacheLogger, EngineStats, SpecDecodeLogger
from engine.output_processor import OutputProcessor, RequestDelta, StreamCursor
from engine.scheduler import Sequence

log = logging.getLogger(__name__)


class AddRequest(NamedTuple):
    """The loop thread's command: queue this request in the scheduler."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str | None


class AbortRequest(NamedTuple):
    """The loop thread's command: end this request (its stream gets what it has, finish "abort")."""

    request_id: str


class QueueFullError(RuntimeError):
    """More requests are waiting than max_queued_requests allows."""


class EngineDeadError(RuntimeError):
    """The step loop has stopped: nothing can be served (503)."""


class RequestStream:
    """The deltas of one request, in order; the last has finish_reason set."""

    def __init__(self, engine: "AsyncEngine", request_id: str, queue: asyncio.Queue):
        self.request_id = request_id
        self._engine, self._queue, self._done = engine, queue, False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestDelta:
        if self._done:
            raise StopAsyncIteration
        delta = await self._queue.get()
        if delta.finish_reason is not None:
            self._done = True
        return delta

    def abort(self) -> None:
        """Stop generating for this request and free its blocks (nothing happens once it has ended)."""
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)


class AsyncEngine:
    def __init__(self, config: EngineConfig, use_ray: bool | None = None, max_queued_requests: int | None = None,
                 log_interval_s: float = 10.0):
        self.max_queued_requests = max_queued_requests
        self._lock = threading.Condition()
        self._pending: list[AddRequest | AbortRequest] = []  # for the loop thread
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, dict]] = {}
        self._ids = itertools.count()
        self._stopped = False
        self._spec_log = SpecDecodeLogger(log_interval_s)
        self._cache_log = CacheLogger(log_interval_s)
        self._thread_built = threading.Event()
        self._build_error: BaseException | None = None
        # The loop thread builds the engine as well as stepping it: libgomp gives each thread that
        # starts parallel regions its own team, and with two teams on the cores (built here, run
        # there) it stops spin-waiting between regions; every region then sleeps and wakes its
        # threads, and an in-process decode step took 1.4x as long (20 ms a token against 14 on
        # a 2-core Xeon).
        if uses_ray(config, use_ray):
            ensure_ray(config)  # from the caller's thread: Ray sets its signal handlers on the main one
        self._thread = threading.Thread(target=self._build_and_run, args=(config, use_ray),
                                        name="tandem-step-loop", daemon=True)
        self._thread.start()
        self._thread_built.wait()
        if self._build_error is not None:  # raised again here, in the caller's thread
            self._thread.join()
            raise self._build_error
        self.tokenizer = self.core.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def alive(self) -> bool:
        return self._thread.is_alive()

    def health(self) -> str | None:
        """None when this engine can serve, else why not (for health checks: a replica that can't
        serve should be replaced)."""
        if not self.alive():
            return "the engine's step loop is not running"
        if self.core.rebuild_failed:
            return "the model groups failed and could not be rebuilt"
        return None

    def stats(self) -> EngineStats:
        """The engine's counters now; num_waiting counts requests not yet handed to the step loop too."""
        stats = self.core.stats()
        return dataclasses.replace(stats, num_waiting=stats.num_waiting + self._queued())

    def num_running(self) -> int:
        return self.core.load()[0]

    def num_waiting(self) -> int:
        return self.core.load()[1] + self._queued()

    def _queued(self) -> int:
        """Requests added but not yet handed to the step loop."""
        return sum(isinstance(p, AddRequest) for p in self._pending)

    def add_request(self, prompt: Any, params: SamplingParams, request_id: str | None = None,
                    cache_salt: str | None = None) -> RequestStream:
        """Validate (ValueError on bad input; QueueFullError), queue, and return the request's stream.

        `prompt` as EngineCore.prompt_ids takes it; a string is tokenized here, so callers on an event
        loop pass {'prompt_token_ids': ..., 'prompt': text} tokenized off it."""
        request_id = request_id or f"req-{next(self._ids)}"
        if not self.alive():
            raise EngineDeadError("the engine is not running")
        text, ids = self.core.prompt_ids(prompt)
        error = self.core.check_request(ids, params)  # raised here, in the caller's task, not in the loop
        if error is not None:
            raise error
        cache_salt = check_cache_salt(cache_salt)
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if self.max_queued_requests is not None and self.num_waiting() >= self.max_queued_requests:
                raise QueueFullError(f"queue is full ({self.max_queued_requests} requests waiting); retry later")
            self._streams[request_id] = (asyncio.get_running_loop(), queue, StreamCursor(time.monotonic()))
            self._pending.append(AddRequest(request_id, text, ids, params, cache_salt))
            self._lock.notify()
        return RequestStream(self, request_id, queue)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._pending.append(AbortRequest(request_id))
            self._lock.notify()

    def shutdown(self) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify()
        self._thread.join(timeout=30)
        self.core.shutdown()

    # -- the loop thread ------------------------------------------------------------------------

    def _build_and_run(self, config: EngineConfig, use_ray: bool | None) -> None:
        try:
            self.core = EngineCore(config, use_ray=use_ray)
        except BaseException as e:  # noqa: BLE001 - raised again by __init__, in its caller's thread
            self._build_error = e
            return
        finally:
            self._thread_built.set()
        self._run()

    def _run(self) -> None:
        core = self.core
        while True:
            with self._lock:
                # failed groups are rebuilt at once, not when the next request comes
                while not self._stopped and not self._pending and not core.has_work():
                    self._lock.wait()
                if self._stopped:
                    return
                pending, self._pending = self._pending, []
            for command in pending:
                if isinstance(command, AddRequest):
                    rid = command.request_id
                    try:
                        core.add_request(rid, command.prompt, command.prompt_ids, command.params, command.cache_salt)
                    except InvalidRequest as e:
                        self._emit_error(rid, RequestFailure.invalid(str(e), e.param))
                    except Exception:  # noqa: BLE001 - one request's problem, never the loop's
                        log.exception("request %s could not be queued", rid)
                        self._emit_error(rid, QUEUE_FAILED)
                else:
                    try:
                        seq = core.abort(command.request_id)
                        if seq is not None:
                            self._emit(seq)
                    except Exception:  # noqa: BLE001 - an abort must never stop the loop
                        log.exception("aborting request %s failed", command.request_id)
                    self._streams.pop(command.request_id, None)
            for seq in core.step():
                self._emit(seq)
            now = time.monotonic()
            if self._spec_log.due(now) or self._cache_log.due(now):  # a snapshot only when a line may be due
                stats = core.stats()
                self._spec_log.maybe_log(stats.spec_decode, now, log)
                self._cache_log.maybe_log(stats.caches, now, log)

    def _emit_error(self, request_id: str, failure: RequestFailure) -> None:
        stream = self._streams.pop(request_id, None)
        if stream:
            loop, queue, _ = stream
            loop.call_soon_threadsafe(queue.put_nowait, OutputProcessor.rejected(request_id, failure))

    def _emit(self, seq: Sequence) -> None:
        stream = self._streams.get(seq.request_id)
        if stream is None:
            return
        loop, queue, cursor = stream
        if len(seq.output_ids) > cursor.tokens:  # the latency histograms, as a streaming client sees them
            now = time.monotonic()
            first = cursor.last is None
            self.core.observe_latency(first_token=first, seconds=now - (cursor.arrived if first else cursor.last))
            cursor.last = now
        delta = self.core.outputs.delta(seq, cursor)
        if seq.finished:
            self._streams.pop(seq.request_id, None)
        loop.call_soon_threadsafe(queue.put_nowait, delta)
