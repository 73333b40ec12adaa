"""/v1/completions: a call's choices as `text_completion` answers and chunks (echo, logprobs)."""
from __future__ import annotations

from deployments.requests import Completion, PreparedRequest
from deployments.serving import CallFormat, Serving, openai_finish, usage
from deployments.logprobs import LogprobFormatter
from engine.output_processor import RequestDelta


class CompletionFormat(CallFormat):
    object_name = "text_completion"

    def __init__(self, prepared: PreparedRequest, model_name: str, fmt: LogprobFormatter, now: int):
        super().__init__(prepared, model_name, fmt, now)
        # streamed text offsets of each choice's tokens (after its echo)
        self.offsets = [len(c.echo) for c in prepared.choices]

    def _choice(self, index: int, text: str, finish: str | None, logprobs: dict | None) -> dict:
        return self.chunk([{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}])

    def blank(self, index: int) -> dict:
        return self._choice(index, "", None, None)

    def opening(self, firsts: list[RequestDelta]) -> list[dict]:
        """Each echoing choice's prompt first, with its log-probabilities when asked (echo + logprobs)."""
        events = []
        for k, c in enumerate(self.prepared.choices):
            if not c.echo:
                continue
            logprobs = None
            if c.params.prompt_logprobs is not None and firsts[k] is not None:
                logprobs = self.fmt.completion([], [], 0, c.prompt.ids, firsts[k].prompt_logprobs)
                self.offsets[k] = sum(len(t) for t in logprobs["tokens"])
            events.append(self._choice(c.index, c.echo, None, logprobs))
        return events

    def events(self, k: int, delta: RequestDelta) -> list[dict]:
        c, logprobs = self.prepared.choices[k], None
        if c.params.logprobs is not None and delta.token_ids:
            logprobs = self.fmt.completion(delta.token_ids, delta.logprobs or [], self.offsets[k])
            self.offsets[k] += sum(len(t) for t in logprobs["tokens"])
        return [self._choice(c.index, delta.text, openai_finish(delta.finish_reason), logprobs)]

    def answer(self, results: list[Completion]) -> dict:
        choices = []
        for c, r in zip(self.prepared.choices, results):
            logprobs = None
            if c.params.logprobs is not None:
                echoed = c.params.prompt_logprobs is not None
                logprobs = self.fmt.completion(r.token_ids, r.logprobs or [], 0 if echoed else len(c.echo),
                                               c.prompt.ids if echoed else None, r.prompt_logprobs if echoed else None)
            choices.append({"index": c.index, "text": c.echo + r.text, "logprobs": logprobs,
                            "finish_reason": openai_finish(r.last.finish_reason)})
        return self.chunk(choices, usage=usage(self.prepared, results))


class CompletionServing(Serving):
    format = CompletionFormat
