"""Offline API, shaped like vLLM's: LLM(model=..., speculative_config={...}).generate(prompts, params)."""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Iterable

from engine.config import EngineConfig, SamplingParams, check_model_pair
from engine.executor import LocalExecutor
from engine.metrics import SpecDecodeStats
from engine.models.loading import load_config, load_tokenizer, resolve_model
from engine.scheduler import Scheduler, Sequence
from engine.vocab_mapping import VocabMapping

log = logging.getLogger(__name__)

# Without an explicit max_model_len the KV cache is sized for this many tokens per sequence
# (a model's own limit, 8k-32k here, would reserve gigabytes per slot on a CPU).
DEFAULT_MAX_MODEL_LEN = 2048


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


def eos_token_ids(tokenizer, hf_config) -> set[int]:
    ids = set()
    for value in (getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(value)
    return ids


class LLM:
    """An engine in this process. Keyword arguments are EngineConfig's fields."""

    def __init__(self, model: str, **kwargs: Any):
        kwargs.pop("gpu_memory_utilization", None)  # accepted for vLLM compatibility; CPU caches are sized by slots
        self.config = EngineConfig(model=model, **kwargs)
        spec = self.config.speculative_config
        target_source = resolve_model(self.config.model)
        self.tokenizer = load_tokenizer(target_source, self.config.tokenizer)
        hf_config = load_config(target_source)
        limit = hf_config.max_position_embeddings
        vocab_mapping = None
        if spec is not None:
            draft_source = resolve_model(spec.model)
            draft_config = load_config(draft_source)
            # checked before any weights load, so a bad pair fails fast
            check_model_pair(spec, hf_config.vocab_size, draft_config.vocab_size,
                             limit, draft_config.max_position_embeddings)
            limit = min(limit, draft_config.max_position_embeddings)
            if spec.use_heterogeneous_vocab:
                vocab_mapping = VocabMapping(self.tokenizer, load_tokenizer(draft_source),
                                             hf_config.vocab_size, draft_config.vocab_size)
        max_len = self.config.max_model_len or min(limit, DEFAULT_MAX_MODEL_LEN)
        if spec is not None and spec.max_model_len is not None:
            max_len = min(max_len, spec.max_model_len)
        if max_len > limit:
            raise ValueError(f"max_model_len ({max_len}) is above the models' limit ({limit})")
        self.max_model_len = max_len
        k = spec.num_speculative_tokens if spec else 0
        self.executor = LocalExecutor(self.config, cache_len=max_len + k + 1, vocab_mapping=vocab_mapping)
        self.scheduler = Scheduler(self.executor, self.tokenizer, eos_token_ids(self.tokenizer, hf_config),
                                   self.config, max_len, vocab_mapping)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    @property
    def spec_decode_stats(self) -> SpecDecodeStats:
        return self.scheduler.stats

    def _prompt_ids(self, prompt: Any) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = list(prompt["prompt_token_ids"])
        elif isinstance(prompt, dict) and "prompt" in prompt:
            return self._prompt_ids(prompt["prompt"])
        else:
            raise ValueError("a prompt is a string or {'prompt_token_ids': [...]}")
        vocab = self.executor.target.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {bad[:5]}")
        return None, ids

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
        parsed = [self._prompt_ids(p) for p in prompts]
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
        return [RequestOutput.from_sequence(s) for s in seqs]
