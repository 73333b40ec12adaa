"""A request's output: the one owner of its text.

Tokens a step accepted come in (`append`): each is decoded incrementally (engine/detokenizer.py),
and the stop conditions are checked in order — EOS, a stop token, a stop string, the length limit —
so that a request ends in the step that completes it and no token past the stop is kept. Deltas go
out (`delta`): the new token ids, the new text a client may see (a character split across tokens,
or text that may begin a stop string, waits), logprobs, and on the last one the finish reason and
the request's spec-decode stats. The offline API reads the same sequences whole
(engine/llm.py's RequestOutput).

Decoding runs on the step thread: a stop string must end its request before the next step
computes tokens past it. It costs one DecodeStream step per token (microseconds), not a decode of
the whole output.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from engine.detokenizer import IncrementalDetokenizer
from engine.errors import RequestFailure
from engine.metrics import SpecDecodeStats
from engine.step import TokenLogprob

if TYPE_CHECKING:
    from engine.scheduler import Sequence


@dataclass(frozen=True)
class TokenOrigin:
    """Where one output token came from (SamplingParams.spec_trace): a draft token the target
    accepted, or the target's own (a round's correction or bonus token; every token of plain
    decoding). `end`: where its text ends, in characters of the output text (so token i's text is
    text[end of i-1 : end of i]; a token that completes no character yet ends where the last did)."""

    round: int  # the request's round (one target forward) that produced it, from 0
    draft: bool
    end: int
    k: int = 0  # on a round's target token: the draft tokens that round proposed


def within(origins: list[TokenOrigin], length: int) -> list[TokenOrigin]:
    """The origins with no token ending past `length` characters (a stop string cut the text there)."""
    return [o if o.end <= length else replace(o, end=length) for o in origins]


@dataclass
class RequestDelta:
    """What one request's stream gets after a step: what is new since the previous delta."""

    request_id: str
    token_ids: list[int]  # new since the previous delta
    text: str  # new since the previous delta
    finish_reason: str | None = None  # as Sequence's, or "rejected": the request was invalid
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)  # filled on the first delta
    num_output_tokens: int = 0
    stats: SpecDecodeStats | None = None  # on the last delta
    failure: RequestFailure | None = None  # why it ended in an error: its kind, field and message
    logprobs: list[TokenLogprob] | None = None  # with SamplingParams.logprobs: one per token in token_ids
    # with prompt_logprobs, on the first delta: None, then one per token
    prompt_logprobs: list[TokenLogprob | None] | None = None
    origins: list[TokenOrigin] | None = None  # with SamplingParams.spec_trace: one per token in token_ids

    @property
    def error(self) -> str | None:
        """The failure's message, safe to show a client."""
        return self.failure.message if self.failure is not None else None


@dataclass
class StreamCursor:
    """How much of one request's output its stream has been sent."""

    arrived: float  # when the request arrived (time.monotonic)
    tokens: int = 0
    text: int = 0  # characters of its text
    last: float | None = None  # when the last delta with tokens was made


class OutputProcessor:
    def __init__(self, tokenizer, eos_ids: set[int], max_model_len: int):
        self.tokenizer, self.eos_ids, self.max_model_len = tokenizer, eos_ids, max_model_len

    def track(self, seq: Sequence) -> None:
        """A new request: its text starts empty, with its stop strings."""
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.params.stop)

    def append(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None = None,
               drafted: int = 0, k: int = 0) -> int:
        """A round's new tokens for `seq` (the first `drafted` of them accepted drafts, of `k`
        proposed), up to the first that finishes it (the rest are dropped); returns how many were kept."""
        p = seq.params
        kept = 0
        for i, token in enumerate(tokens):
            seq.output_ids.append(token)
            if logprobs is not None:
                seq.logprobs.append(logprobs[i])
            kept += 1
            stop = seq.detokenizer.add(token)  # new text only: the cost per token stays flat
            if p.spec_trace:
                seq.origins.append(TokenOrigin(seq.rounds, i < drafted, len(seq.detokenizer.text),
                                               k if i == drafted else 0))
            if not p.ignore_eos and token in self.eos_ids:
                seq.finish_reason = "stop"
            elif token in p.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
            elif stop is not None:  # tokens after the one that completes a stop string are dropped
                seq.finish_reason, seq.stop_reason = "stop", stop
            elif seq.remaining(self.max_model_len) <= 0:
                seq.finish_reason = "length"
            if seq.finished:
                break
        seq.rounds += 1
        return kept

    def delta(self, seq: Sequence, cursor: StreamCursor) -> RequestDelta:
        """What `seq`'s stream hasn't been sent; advances the cursor."""
        text, visible = seq.text, seq.visible_text()  # a split character or a stop string's start waits
        delta = RequestDelta(seq.request_id, seq.output_ids[cursor.tokens:], text[cursor.text:visible],
                             seq.finish_reason, seq.stop_reason, num_output_tokens=len(seq.output_ids),
                             failure=seq.error)
        if seq.params.logprobs is not None:
            delta.logprobs = seq.logprobs[cursor.tokens:]
        if seq.params.spec_trace:  # a stop string cut the text: no token ends past it
            delta.origins = within(seq.origins[cursor.tokens:], len(text))
        if cursor.tokens == 0:
            delta.prompt_token_ids = list(seq.prompt_ids)
            delta.prompt_logprobs = seq.prompt_logprobs
        if seq.finished:
            delta.stats = seq.stats
        cursor.tokens, cursor.text = len(seq.output_ids), max(cursor.text, visible)
        return delta

    @staticmethod
    def rejected(request_id: str, failure: RequestFailure) -> RequestDelta:
        """The only delta of a request the engine refused to queue."""
        return RequestDelta(request_id, [], "", "rejected", failure=failure)
