"""EngineCore: the models, tokenizer, executor and scheduler of one engine, built from one EngineConfig.

Shared by the offline LLM (engine/llm.py) and the async engine the serving layer uses
(engine/async_engine.py).
"""
from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig, SamplingParams, check_model_pair, parallel_drafting_token
from engine.errors import INTERNAL_ERROR, WORKER_FAILED, ExecutorError, InvalidRequest, StepError
from engine.executor import LocalExecutor, RayExecutor
from engine.models.loading import eos_token_ids, load_config, load_tokenizer, resolve_model
from engine.metrics import CacheStats, EngineStats
from engine.output_processor import OutputProcessor
from engine.plan import StepOutput, StepPlan
from engine.scheduler import Scheduler, Sequence
from engine.structured import GrammarCompiler
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
        eos_ids = eos_token_ids(self.tokenizer, hf_config)
        self.grammars = GrammarCompiler(self.tokenizer, eos_ids)
        self._grammars_warmed = False
        self.outputs = OutputProcessor(self.tokenizer, eos_ids, max_len)
        self.scheduler = Scheduler(self.executor, eos_ids, config, max_len, self.grammars,
                                   self.outputs, vocab_mapping, draft_limit)

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

    # -- requests: checked, added, aborted -----------------------------------------------------------

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> InvalidRequest | None:
        """What is wrong with a request against this engine's limits (vLLM's messages), or None.
        No side effects: any thread may call it, as often as it likes."""
        n, limit = len(prompt_ids), self.max_model_len
        if not prompt_ids:
            return InvalidRequest("prompt", "prompt is empty: give at least one token")
        if n >= limit:
            return InvalidRequest("prompt", f"This model's maximum context length is {limit} tokens. However, your "
                                  f"request has {n} input tokens. Please reduce the length of the input so at "
                                  f"least one token can be generated.")
        if params.max_tokens is not None and n + params.max_tokens > limit:
            return InvalidRequest("max_tokens", f"'max_tokens' or 'max_completion_tokens' is too large: "
                                  f"{params.max_tokens}. This model's maximum context length is {limit} tokens "
                                  f"and your request has {n} input tokens ({params.max_tokens} > {limit} - {n}).")
        # it could never run, even alone (the engine starts only when one max_model_len sequence fits)
        spec = self.config.speculative_config
        k = spec.num_speculative_tokens if spec else 0
        longest = min(limit, n + params.max_tokens) if params.max_tokens is not None else limit
        capacity = self.scheduler.target_kv.capacity_tokens
        if longest + k + 1 > capacity:
            return InvalidRequest("max_tokens", f"this request needs up to {longest + k + 1} tokens of KV cache "
                                  f"({n} prompt tokens, max_tokens {params.max_tokens}, {k + 1} for a verify step); "
                                  f"the whole cache holds {capacity} tokens. Lower max_tokens or raise the "
                                  f"server's KV cache budget.")
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            return InvalidRequest.of_field("stop_token_ids", f"must be token ids in [0, {self.vocab_size}), "
                                           f"got {bad[:5]}")
        bad = [t for t in (params.logit_bias or {}) if not 0 <= t < self.vocab_size]
        if bad:
            return InvalidRequest.of_field("logit_bias", f"token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        return None

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compile (and cache) a structured request's grammar: InvalidRequest if it can't be held to
        one. Call it where compiling may take its time: the request layer's pool, the offline caller;
        never the step thread. The first grammar also starts the workers' tokenizer view."""
        if params.structured_outputs is None:
            return
        if not self._grammars_warmed:
            self._grammars_warmed = True
            self.executor.warm_grammars()
        self.grammars.compile(params.structured_outputs)

    def add_request(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None) -> Sequence:
        """Queue a checked request (its grammar compiled); called on the thread that steps."""
        return self.scheduler.add(request_id, prompt, prompt_ids, params, cache_salt)

    def abort(self, request_id: str) -> Sequence | None:
        return self.scheduler.abort(request_id)

    # -- the step ----------------------------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """One engine step (vLLM v1's EngineCore.step): the scheduler plans it, the executor runs the
        plan, the scheduler applies what came back. The sequences that got tokens or ended. Never
        raises: a bug fails the running requests (each with an internal error), not the caller's loop."""
        start = time.perf_counter()
        try:
            seqs = self._step()
        except Exception:  # noqa: BLE001
            log.exception("engine step failed; failing the running requests")
            try:
                seqs = self.scheduler.fail_running(INTERNAL_ERROR)
            except Exception:  # noqa: BLE001
                log.exception("failing the running requests failed")
                return []
        counters = self.scheduler.counters
        counters.step_time.observe(time.perf_counter() - start)
        for seq in seqs:
            if seq.finished:
                counters.finished(seq.finish_reason)
        return seqs

    def _step(self) -> list[Sequence]:
        sched = self.scheduler
        if sched.executor_down and not self._rebuild():
            time.sleep(1.0)  # still down: waiting requests get a 503 now instead of hanging
            return sched.fail_waiting(WORKER_FAILED)
        plan = sched.schedule()
        if plan.empty():
            return []
        try:
            try:
                output = self.executor.execute(plan)
            except (StepError, ValueError) as e:
                return self._run_parts(plan, e)
        except ExecutorError as e:
            log.error("a model group failed; failing %d running requests and restarting the groups: %s",
                      len(sched.running), e)
            return sched.fail_running(WORKER_FAILED)
        return sched.update(plan, output)

    def _run_parts(self, plan: StepPlan, error: Exception) -> list[Sequence]:
        """A call raised in a live worker: each sequence's part of the plan again alone, so that only
        the one that raises fails (the others rewrite the same keys and values at the same positions)."""
        chunks = plan.prompt_chunks()
        if chunks:
            log.warning("a step carrying %d prompt chunks raised (%s); running each request alone", chunks, error)
        else:
            log.warning("a step raised (%s); running each request alone", error)
        outputs = [(part, self._run_alone(part)) for part in plan.parts()]
        return [seq for part, output in outputs for seq in self.scheduler.update(part, output)]

    def _run_alone(self, part: StepPlan) -> StepOutput:
        """One part of a plan that raised; what raises again fails the part's sequences."""
        try:
            return self.executor.execute(part)
        except (StepError, ValueError) as e:
            ids = ", ".join(seq.request_id for seq in part.requests.values()) or "(removals)"
            log.error("request %s failed: %s", ids, e, exc_info=e.__cause__ or e)
            return StepOutput(failed={seq_id: str(e) for seq_id in part.requests})

    def _rebuild(self) -> bool:
        """Rebuild failed model groups: whether they are up again."""
        sched = self.scheduler
        try:
            self.executor.restart()
            sched.executor_down = sched.rebuild_failed = False
        except Exception:  # noqa: BLE001 - e.g. no resources for the new groups yet
            log.exception("could not rebuild the model groups; retrying at the next step")
            sched.executor_down = sched.rebuild_failed = True
        return not sched.executor_down

    def has_work(self) -> bool:
        """Whether a step has anything to do: requests to run, or failed groups to rebuild."""
        return self.scheduler.has_unfinished() or self.scheduler.executor_down

    def stats(self) -> EngineStats:
        """A snapshot of the engine's counters, for metrics and logs (copies: safe to read anywhere)."""
        sched = self.scheduler
        caches = {name: CacheStats(kv.pool.usage(), kv.counters.queries, kv.counters.hits, kv.counters.preemptions)
                  for name, kv in (("target", sched.target_kv), ("draft", sched.draft_kv)) if kv is not None}
        running, waiting = self.load()
        return EngineStats(copy.deepcopy(sched.stats), copy.deepcopy(sched.counters), running, waiting, caches,
                           self.rebuild_failed)

    def load(self) -> tuple[int, int]:
        """(running, waiting) requests now, without copying any counter: for admission and gauges."""
        return len(self.scheduler.running), len(self.scheduler.waiting)

    @property
    def rebuild_failed(self) -> bool:
        """The model groups failed and could not be rebuilt: this engine can't serve."""
        return self.scheduler.rebuild_failed

    def observe_latency(self, first_token: bool, seconds: float) -> None:
        """A frontend's view of a request's tokens: time to its first, or between two deltas."""
        counters = self.scheduler.counters
        (counters.time_to_first_token if first_token else counters.inter_token_latency).observe(seconds)

    def shutdown(self) -> None:
        self.executor.shutdown()


def uses_ray(config: EngineConfig, use_ray: bool | None = None) -> bool:
    """Whether an engine built with `use_ray` (None: as the config says) runs its groups as Ray actors."""
    if use_ray is not None:
        return use_ray
    return config.distributed_executor_backend == "ray" or config.tensor_parallel_size > 1 \
        or config.draft_tensor_parallel_size > 1
