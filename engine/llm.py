"""Offline API, shaped like vLLM's: LLM(model=..., speculative_config={...}).generate(prompts, params)."""
from __future__ import annotations

import itertools
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable

from engine.chat import chat_prompt_ids, end_of_turn_ids
from engine.config import EngineConfig, SamplingParams, check_cache_salt
from engine.core import EngineCore
from engine.metrics import SpecDecodeStats
from engine.output_processor import TokenOrigin, within
from engine.scheduler import Sequence
from engine.step import TokenLogprob

log = logging.getLogger(__name__)

@dataclass
class Logprob:
    """One token's log-probability at a position (vLLM's shape): rank 1 is the most likely."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# per position: {token id: Logprob} with the top `logprobs` tokens and the one chosen
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None  # with SamplingParams(logprobs=N)
    cumulative_logprob: float | None = None
    # LLM.chat with tools: the calls the answer made ({"name", "arguments": JSON text}) and its text
    # besides them; None without tools
    tool_calls: list[dict] | None = None
    content: str | None = None
    origins: list[TokenOrigin] | None = None  # with SamplingParams(spec_trace=True): one per token


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    spec_decode_stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # with SamplingParams(prompt_logprobs=N)

    @classmethod
    def from_sequences(cls, request_id: str, seqs: list[Sequence], tokenizer) -> "RequestOutput":
        """One request's output; n > 1 ran as n sequences."""
        outputs, stats = [], SpecDecodeStats()
        for i, seq in enumerate(seqs):
            logprobs = None
            if seq.params.logprobs is not None:
                logprobs = [position_logprobs(token, entry, tokenizer) for token, entry in zip(seq.output_ids, seq.logprobs)]
            cumulative = sum(e.logprob for e in seq.logprobs) if logprobs is not None else None
            origins = within(seq.origins, len(seq.text)) if seq.params.spec_trace else None
            outputs.append(CompletionOutput(i, seq.text, list(seq.output_ids), seq.finish_reason, seq.stop_reason,
                                            logprobs, cumulative, origins=origins))
            stats.merge(seq.stats)
        first = seqs[0]
        prompt_logprobs = None
        if first.prompt_logprobs is not None:
            prompt_logprobs = [None if entry is None else position_logprobs(token, entry, tokenizer)
                               for token, entry in zip(first.prompt_ids, first.prompt_logprobs)]
        return cls(request_id, first.prompt, list(first.prompt_ids), outputs, all(s.finished for s in seqs), stats,
                   prompt_logprobs)


def position_logprobs(token: int, entry: TokenLogprob, tokenizer) -> PositionLogprobs:
    """The engine's entry as {token: Logprob}, the top ones and the chosen one."""
    out = {t: Logprob(v, r + 1, tokenizer.decode([t])) for r, (t, v) in enumerate(entry.top)}
    if token not in out:
        out[token] = Logprob(entry.logprob, entry.rank, tokenizer.decode([token]))
    return out


class LLM:
    """An engine in this process. Keyword arguments are EngineConfig's fields.

    What it holds (Ray actors and their placement group, with tensor parallelism or the Ray backend)
    is released by `shutdown()`, at the end of a `with LLM(...) as llm:` block, or when the object
    is garbage collected (`del llm`), so a script or notebook can build engines one after another."""

    def __init__(self, model: str, **kwargs: Any):
        self.config = EngineConfig(model=model, **kwargs)
        self.core = EngineCore(self.config)
        self.tokenizer = self.core.tokenizer
        self.max_model_len = self.core.max_model_len
        self._ids = itertools.count()
        # holds the core, not self: runs once, at shutdown(), collection or exit, whichever is first
        self._release = weakref.finalize(self, EngineCore.shutdown, self.core)

    def shutdown(self) -> None:
        """Release the model groups (Ray actors, placement group); the engine can't generate after."""
        self._release()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.tokenizer

    @property
    def spec_decode_stats(self) -> SpecDecodeStats:
        return self.core.stats().spec_decode

    def generate(self, prompts: str | dict | Iterable[str | dict],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        # validate everything before queueing anything
        parsed = [self.core.prompt_ids(p) for p in prompts]
        salts = [check_cache_salt(p.get("cache_salt")) if isinstance(p, dict) else None for p in prompts]
        for (_, ids), p in zip(parsed, params):
            error = self.core.check_request(ids, p)
            if error is not None:
                raise error
            self.core.compile_grammar(p)
        requests = []  # (request id, its n sequences)
        for (text, ids), p, salt in zip(parsed, params, salts):
            request_id = f"offline-{next(self._ids)}"
            requests.append((request_id, [self.core.add_request(f"{request_id}-{i}", text, ids, sample, salt)
                                          for i, sample in enumerate(samples(p))]))
        seqs = [s for _, group in requests for s in group]
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(seqs), desc="generate")
        done = 0
        while any(not s.finished for s in seqs):
            self.core.step()
            if bar is not None:
                now = sum(s.finished for s in seqs)
                bar.update(now - done)
                done = now
        if bar is not None:
            bar.close()
        errors = {s.error.message for s in seqs if s.error}
        if errors:
            raise RuntimeError(f"generation failed: {'; '.join(sorted(errors))}")
        return [RequestOutput.from_sequences(request_id, group, self.tokenizer) for request_id, group in requests]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False, *, tools: list[dict] | None = None, tool_parser: str = "hermes",
             parallel_tool_calls: bool = True, chat_template: str | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """One conversation ([{"role": ..., "content": ...}, ...]) or a list of them, through the
        model's chat template (generation prompt added); a reply ends at the model's end-of-turn
        token, as on the server.

        `tools` (OpenAI's function tools) lets the model call them as the server's tool_choice 'auto'
        does: in `tool_parser`'s format, held to the tools' schemas once a call begins; each output's
        `tool_calls` and `content` say what it called and wrote."""
        from engine.structured import StructuredOutputsParams
        from engine.tool_parsers import ToolSpec, tool_format

        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        fmt = tool_format(tool_parser, self.tokenizer) if tools else None
        prompts = [{"prompt_token_ids": chat_prompt_ids(
            self.tokenizer, [dict(m) for m in c], tools=tools, tool_format=fmt, tool_instructions=bool(tools),
            chat_template=chat_template, template_kwargs=chat_template_kwargs)} for c in conversations]
        if sampling_params is None:
            sampling_params = SamplingParams()
        turn_end = end_of_turn_ids(self.tokenizer)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        update: dict = {}
        if fmt is not None:
            specs = [ToolSpec(t["function"]["name"], t["function"].get("parameters") or
                              {"type": "object", "properties": {}}) for t in tools]
            update["structured_outputs"] = StructuredOutputsParams(grammar=fmt.grammar(specs, parallel_tool_calls))
            if any(p.structured_outputs is not None for p in params):
                raise ValueError("chat: tools hold the output to their grammar; give no structured_outputs with them")
        params = [p.model_copy(update={**update, "stop_token_ids": list(p.stop_token_ids) + turn_end}) for p in params]
        outputs = self.generate(prompts, params, use_tqdm)
        if fmt is not None:
            for request in outputs:
                for out in request.outputs:
                    parser = fmt.parser()
                    parser.feed(out.text)
                    parser.finish()
                    out.tool_calls = [{"name": c.name, "arguments": c.arguments} for c in parser.calls]
                    out.content = parser.content
        return outputs


def samples(params: SamplingParams) -> list[SamplingParams]:
    """n > 1 as n requests of one sample each; a seeded request's samples get seeds seed, seed + 1, ...
    (distinct and reproducible, as on the server)."""
    if params.n == 1:
        return [params]
    return [params.model_copy(update={"n": 1, "seed": None if params.seed is None else params.seed + i})
            for i in range(params.n)]
