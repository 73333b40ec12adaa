"""EngineCore: the models, tokenizer, executor and scheduler of one engine, built from one EngineConfig.

Shared by the offline LLM (engine/llm.py) and the async engine the serving layer uses
(engine/async_engine.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig, check_model_pair, parallel_drafting_token
from engine.executor import LocalExecutor, RayExecutor
from engine.models.loading import eos_token_ids, load_config, load_tokenizer, resolve_model
from engine.scheduler import Scheduler
from engine.vocab_mapping import VocabMapping

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenizedPrompt:
    """A prompt that EngineCore.prompt_ids has already checked (the serving layer does it off the loop)."""

    text: str | None
    ids: list[int]


class EngineCore:
    def __init__(self, config: EngineConfig, use_ray: bool | None = None):
        self.config = config
        spec = config.speculative_config
        target_source = resolve_model(config.model)
        self.tokenizer = load_tokenizer(target_source, config.tokenizer)
        hf_config = load_config(target_source)
        self.vocab_size = hf_config.vocab_size
        limit = hf_config.max_position_embeddings
        draft_limit = None
        vocab_mapping = None
        if spec is not None:
            draft_source = resolve_model(spec.model)
            draft_config = load_config(draft_source)
            # checked before any weights load, so a bad pair fails fast
            check_model_pair(spec, hf_config.vocab_size, draft_config.vocab_size,
                             limit, draft_config.max_position_embeddings)
            # the target's limit is the engine's; past the draft's own, a sequence stops drafting
            draft_limit = draft_config.max_position_embeddings
            if spec.parallel_drafting:
                parallel_drafting_token(draft_config)
            if spec.use_heterogeneous_vocab:
                vocab_mapping = VocabMapping(self.tokenizer, load_tokenizer(draft_source),
                                             hf_config.vocab_size, draft_config.vocab_size)
        max_len = config.max_model_len or limit  # the target's own limit, as in vLLM
        if spec is not None and spec.max_model_len is not None:
            max_len = min(max_len, spec.max_model_len)
        if max_len > limit:
            raise ValueError(f"max_model_len ({max_len}) is above the target model's limit ({limit})")
        k = spec.num_speculative_tokens if spec else 0
        executor_cls = RayExecutor if uses_ray(config, use_ray) else LocalExecutor
        self.executor = executor_cls(config, max_len + k + 1, target_vocab=self.vocab_size,
                                     vocab_mapping=vocab_mapping)
        max_len = self._fit_cache(max_len, k, explicit=config.max_model_len is not None or
                                  (spec is not None and spec.max_model_len is not None))
        self.max_model_len = max_len
        self.scheduler = Scheduler(self.executor, self.tokenizer, eos_token_ids(self.tokenizer, hf_config),
                                   config, max_len, vocab_mapping, self.vocab_size, draft_limit)

    def _fit_cache(self, max_len: int, k: int, explicit: bool) -> int:
        """max_model_len that one sequence can reach in the cache that fit (a verify step's k + 1 on top)."""
        capacity = (self.executor.num_blocks - 1) * self.config.block_size
        if max_len + k + 1 <= capacity:
            return max_len
        message = (f"the KV cache holds {capacity} tokens, fewer than one sequence of max_model_len {max_len} "
                   f"needs ({max_len + k + 1} with a verify step)")
        if explicit:
            self.executor.shutdown()
            raise ValueError(f"{message}; lower max_model_len, or raise gpu_memory_utilization or kv_cache_memory_bytes")
        log.warning("%s: max_model_len lowered to %d", message, capacity - k - 1)
        return capacity - k - 1

    def prompt_ids(self, prompt: Any) -> tuple[str | None, list[int]]:
        """(text or None, token ids) from a string or {'prompt_token_ids': [...]} / {'prompt': str},
        or a TokenizedPrompt (already checked: passed through)."""
        if isinstance(prompt, TokenizedPrompt):
            return prompt.text, prompt.ids
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = list(prompt["prompt_token_ids"])
            text = prompt.get("prompt")  # the text the ids came from, when known (TLI re-tokenizes it)
        elif isinstance(prompt, dict) and "prompt" in prompt:
            return self.prompt_ids(prompt["prompt"])
        else:
            raise ValueError("a prompt is a string or {'prompt_token_ids': [...]}")
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size}), got {bad[:5]}")
        return text if isinstance(text, str) else None, ids

    def shutdown(self) -> None:
        self.executor.shutdown()


def uses_ray(config: EngineConfig, use_ray: bool | None = None) -> bool:
    """Whether an engine built with `use_ray` (None: as the config says) runs its groups as Ray actors."""
    if use_ray is not None:
        return use_ray
    return config.distributed_executor_backend == "ray" or config.tensor_parallel_size > 1 \
        or config.draft_tensor_parallel_size > 1
