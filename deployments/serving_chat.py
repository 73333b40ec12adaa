"""/v1/chat/completions: a call's choices as `chat.completion` answers and chunks: the assistant's
role first, reasoning apart from the answer (a reasoning parser), tool calls apart from the text."""
from __future__ import annotations

from deployments.logprobs import LogprobFormatter
from deployments.requests import Completion, PreparedRequest
from deployments.serving import CallFormat, Serving, openai_finish, usage
from deployments.tool_calls import ToolCallStream, chat_message
from engine.output_processor import RequestDelta
from engine.reasoning import ReasoningSplitter


class ChatFormat(CallFormat):
    object_name = "chat.completion.chunk"

    def __init__(self, prepared: PreparedRequest, model_name: str, fmt: LogprobFormatter, now: int):
        super().__init__(prepared, model_name, fmt, now)
        indices = [c.index for c in prepared.choices]
        self.tools = {i: ToolCallStream(prepared.tool_calls) for i in indices} if prepared.tool_calls else {}
        self.thinking = {i: ReasoningSplitter(*prepared.reasoning) for i in indices} if prepared.reasoning else {}

    def _delta(self, index: int, delta: dict, finish: str | None, logprobs: dict | None = None) -> dict:
        return self.chunk([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}])

    def blank(self, index: int) -> dict:
        return self._delta(index, {}, None)

    def opening(self, firsts: list[RequestDelta]) -> list[dict]:
        return [self._delta(c.index, {"role": "assistant", "content": ""}, None) for c in self.prepared.choices]

    def events(self, k: int, delta: RequestDelta) -> list[dict]:
        c = self.prepared.choices[k]
        index, text, finish = c.index, delta.text, openai_finish(delta.finish_reason)
        logprobs = self.fmt.chat(delta.token_ids, delta.logprobs or []) \
            if c.params.logprobs is not None and delta.token_ids else None
        events = []
        if index in self.thinking:  # the thinking first, as reasoning_content; the rest is the answer
            reasoning, text = self.thinking[index].feed(text, final=finish is not None)
            if reasoning:
                events.append(self._delta(index, {"reasoning_content": reasoning}, None, logprobs))
                logprobs = None
                if not text and finish is None:
                    return events
        if index in self.tools:
            return events + [self._delta(index, d, f, lp) for d, f, lp in self.tools[index].feed(text, finish, logprobs)]
        return events + [self._delta(index, {"content": text} if text or finish is None else {}, finish, logprobs)]

    def answer(self, results: list[Completion]) -> dict:
        prepared, choices = self.prepared, []
        for c, r in zip(prepared.choices, results):
            text, reasoning = r.text, None
            if prepared.reasoning:
                splitter = ReasoningSplitter(*prepared.reasoning)
                splitter.feed(text, final=True)
                text, reasoning = splitter.content, splitter.reasoning or None
            message, finish = chat_message(prepared.tool_calls, text, openai_finish(r.last.finish_reason))
            if prepared.reasoning:
                message["reasoning_content"] = reasoning
            logprobs = self.fmt.chat(r.token_ids, r.logprobs or []) if c.params.logprobs is not None else None
            choices.append({"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": finish})
        return {**self.chunk(choices, usage=usage(prepared, results)), "object": "chat.completion"}


class ChatServing(Serving):
    format = ChatFormat
