"""Offline API, shaped like vLLM's: LLM(model=..., speculative_config={...}).generate(prompts, params)."""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Iterable

from engine.config import EngineConfig, SamplingParams
from engine.core import EngineCore
from engine.metrics import SpecDecodeStats
from engine.scheduler import Sequence

log = logging.getLogger(__name__)

@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    spec_decode_stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)

    @classmethod
    def from_sequence(cls, seq: Sequence) -> "RequestOutput":
        out = CompletionOutput(0, seq.text, list(seq.output_ids), seq.finish_reason, seq.stop_reason)
        return cls(seq.request_id, seq.prompt, list(seq.prompt_ids), [out], seq.finished, seq.stats)


class LLM:
    """An engine in this process. Keyword arguments are EngineConfig's fields."""

    def __init__(self, model: str, **kwargs: Any):
        kwargs.pop("gpu_memory_utilization", None)  # accepted for vLLM compatibility; CPU caches are sized by slots
        self.config = EngineConfig(model=model, **kwargs)
        self.core = EngineCore(self.config)
        self.tokenizer = self.core.tokenizer
        self.scheduler = self.core.scheduler
        self.executor = self.core.executor
        self.max_model_len = self.core.max_model_len
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    @property
    def spec_decode_stats(self) -> SpecDecodeStats:
        return self.scheduler.stats

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
        for p in params:
            if p.n != 1:
                raise ValueError("n > 1 is not supported by LLM.generate; repeat the prompt instead")
        seqs = [self.scheduler.add(f"offline-{next(self._ids)}", text, ids, p)
                for (text, ids), p in zip(parsed, params)]
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(seqs), desc="generate")
        done = 0
        while any(not s.finished for s in seqs):
            self.scheduler.step()
            if bar is not None:
                now = sum(s.finished for s in seqs)
                bar.update(now - done)
                done = now
        if bar is not None:
            bar.close()
        errors = {s.error for s in seqs if s.error}
        if errors:
            raise RuntimeError(f"generation failed: {'; '.join(sorted(errors))}")
        return [RequestOutput.from_sequence(s) for s in seqs]
