"""Continuous batching: sequences join and leave between steps.

Each step's plan (schedule()): admit waiting requests while both models' block pools hold their
prompts (after any prefix-cache hit) and prefill the rest in chunks, then one propose/verify round
for every decoding sequence; update() applies what the models gave back. The scheduler makes no
model call: EngineCore.step runs the plan. Each row has its own draft count k (0 = plain
decoding), stop conditions and new tokens. `max_num_seqs` bounds the batch; the rest wait in
arrival order. When a round's positions don't fit the blocks
left, the most recently admitted request is preempted: its blocks go back to the pool, and it
waits at the front of the queue to be recomputed (mostly from the prefix cache) with the output it
has; its client sees only a pause. The cache bookkeeping is engine/kv/'s.
"""
from __future__ import annotations

import itertools
import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Protocol

from engine.adaptive import AcceptanceEstimate
from engine.config import EngineConfig, SamplingParams
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import INTERNAL_ERROR, RequestFailure
from engine.kv.cache_manager import KVCacheManager, SeqCache
from engine.metrics import EngineCounters, SpecDecodeStats
from engine.output_processor import OutputProcessor, TokenOrigin
from engine.plan import PrefillCall, RequestStart, RoundPlan, StepOutput, StepPlan
from engine.prefill_pacing import PrefillPacer
from engine.rejection import ahead_block_continues
from engine.spec_policy import DraftPrefill, MeasuredRound, SpeculationPolicy
from engine.step import AheadBatch, DraftBatch, Prefill, RequestGrammar, RowSampling, TokenLogprob, VerifyBatch
from engine.structured import GrammarCompiler
from engine.vocab_mapping import VocabMapping

log = logging.getLogger(__name__)


@dataclass(eq=False)  # a request is itself: identity, never its fields, tells two apart
class Sequence:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    seq_id: int = 0  # unique among the engine's sequences: names its rows in a step's batches
    cache_salt: str | None = None  # requests with different salts never share a cached block
    grammar: str | None = None  # structured outputs: the compiled grammar its output is held to
    draft_grammar_at: int = 0  # output tokens the draft group's grammar state has been sent
    output_ids: list[int] = field(default_factory=list)
    target: SeqCache = field(default_factory=SeqCache)  # its blocks and computed tokens in the target's cache
    draft_ids: list[int] = field(default_factory=list)  # the draft's view of prompt+output
    draft: SeqCache = field(default_factory=SeqCache)  # ... in the draft's cache, in draft_ids
    drafts: bool = True  # False: this sequence never drafts (no draft state, no draft blocks)
    started: bool = False  # its per-request state is on the workers (it stays there while preempted)
    # admitted, its prompt (and a preempted request's output) is prefilled in chunks up to these
    # positions of each model's cache; it decodes once both are reached
    prefill_target: int = 0
    prefill_draft: int = 0
    # draft-ahead: the next step's drafts, proposed during the last verify (target vocabulary); with
    # them the draft cache holds draft_ids + ahead[:draft.computed - len(draft_ids)]
    ahead: list[int] | None = None
    detokenizer: IncrementalDetokenizer | None = None  # its output text, token by token
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: RequestFailure | None = None  # with finish_reason "error"
    stop_reason: int | str | None = None
    stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # with params.logprobs: per output token
    # with params.prompt_logprobs: per prompt token the same, None for the first
    prompt_logprobs: list[TokenLogprob | None] | None = None
    rounds: int = 0  # rounds that gave it tokens
    origins: list[TokenOrigin] = field(default_factory=list)  # with params.spec_trace: per output token

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilling(self) -> bool:
        return self.target.computed < self.prefill_target or self.draft.computed < self.prefill_draft

    @property
    def text(self) -> str:
        return self.detokenizer.text if self.detokenizer is not None else ""

    def visible_text(self) -> int:
        """How much of the text a client may see now (a possible stop string's start is held back)."""
        return self.detokenizer.visible(self.finished) if self.detokenizer is not None else 0

    def remaining(self, max_model_len: int) -> int:
        """New tokens it may still produce: within max_model_len and its max_tokens."""
        room = max_model_len - self.num_tokens
        if self.params.max_tokens is not None:
            room = min(room, self.params.max_tokens - len(self.output_ids))
        return room


class ModelGroups(Protocol):
    """What the scheduler knows of the model groups: their shape, never their calls (the executor's)."""

    num_blocks: int  # KV cache blocks each model's cache holds
    overlaps_groups: bool  # the draft group's calls can run beside the target's (draft-ahead)
    ragged_rows: bool  # the target's forward takes rows of any lengths unpadded


class Scheduler:
    """schedule() makes a step's plan from the requests' state; update() applies what running it
    gave back. Neither calls a model: EngineCore.step runs the plan (engine/plan.py)."""

    def __init__(self, groups: ModelGroups, eos_ids: set[int], config: EngineConfig, max_model_len: int,
                 grammars: GrammarCompiler, outputs: OutputProcessor, vocab_mapping: VocabMapping | None = None,
                 draft_max_len: int | None = None):
        self.vocab_mapping = vocab_mapping
        self.eos_ids = eos_ids
        self.grammars = grammars
        self.outputs = outputs
        self.spec = config.speculative_config
        self.max_model_len = max_model_len
        # past its own context limit the draft stops drafting for a sequence; the target goes on alone
        self.draft_max_len = min(max_model_len, draft_max_len or max_model_len)
        self.max_num_seqs = config.resolved_max_num_seqs()
        self.max_num_batched_tokens = config.resolved_max_num_batched_tokens()
        decode_tokens = self.max_num_seqs * ((self.spec.num_speculative_tokens if self.spec else 0) + 1)
        if self.max_num_batched_tokens <= decode_tokens:
            log.warning("max_num_batched_tokens %d leaves no room for prefill when max_num_seqs %d rows verify "
                        "their drafts: new prompts wait for running requests to finish",
                        self.max_num_batched_tokens, self.max_num_seqs)
        self.pacer = PrefillPacer(config.resolved_prefill_stall_s())  # prompt chunks beside decoding streams
        self.ragged_rows = groups.ragged_rows
        # the executor sized the caches from the memory budget; each model keeps its own blocks
        self.target_kv = KVCacheManager(groups.num_blocks, config.block_size, config.enable_prefix_caching)
        self.draft_kv = KVCacheManager(groups.num_blocks, config.block_size, config.enable_prefix_caching) \
            if self.spec else None
        self._seq_ids = itertools.count()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SpecDecodeStats()
        self.counters = EngineCounters()
        self.policy = SpeculationPolicy(self.spec, groups.overlaps_groups)  # when and how far to speculate
        self._seeds = itertools.count(config.seed * 1_000_003)
        self._to_remove: list[str] = []
        self.ahead_drafted = self.ahead_used = 0  # draft-ahead blocks drafted / verified next step
        self._synthetic_rng = random.Random(config.seed)  # draft-ahead under synthetic acceptance
        self._synthetic_rates = (self.spec.synthetic_rates()
                                 if self.spec is not None and self.spec.rejection_sample_method == "synthetic" else None)
        self.executor_down = False  # the groups failed: the next step rebuilds them first
        self.rebuild_failed = False  # ... and the last try to rebuild them failed

    def add(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
            cache_salt: str | None = None) -> Sequence:
        """Queue a request EngineCore.check_request has passed (its grammar compiled: a cache hit here)."""
        seed = params.seed if params.seed is not None else next(self._seeds)
        grammar = self.grammars.compile(params.structured_outputs) if params.structured_outputs else None
        seq = Sequence(request_id, prompt, list(prompt_ids), params, seed, next(self._seq_ids), cache_salt, grammar,
                       acceptance=self.policy.prior())
        self.outputs.track(seq)
        self.waiting.append(seq)
        return seq

    def abort(self, request_id: str) -> Sequence | None:
        for seq in list(self.waiting):
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.finish_reason = "abort"
                if seq.started:  # preempted: its state on the workers goes too
                    self._to_remove.append(seq.request_id)
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                seq.finish_reason = "abort"
                self._release(seq)
                return seq
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the plan ------------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """The next step: finished requests' state dropped, waiting requests admitted, prompt chunks
        within the token budget (the decoding rows' verify tokens first), one round for every
        decoding row. Positions are advanced as if the plan runs; update() fails what didn't."""
        plan = StepPlan(remove=self._to_remove)
        self._to_remove = []
        self._admit(plan)
        decoding = [s for s in self.running if not s.prefilling]
        per_row = (self.spec.num_speculative_tokens if self.spec else 0) + 1
        budget = self.max_num_batched_tokens - per_row * len(decoding)
        riding = self._plan_prefills(plan, self.pacer.tokens(len(decoding), budget), bool(decoding))
        rows = [s for s in self.running if not s.prefilling]
        if rows:
            self._plan_round(plan, rows, riding)
        elif riding:
            plan.prefills.append(PrefillCall(riding, []))
        return plan

    def _admit(self, plan: StepPlan) -> None:
        """Admit waiting requests (new or preempted) while the batch has room and the target's pool
        holds their tokens (after their prefix-cache hits). Their prompts are prefilled in chunks by
        the steps that follow."""
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            resumed = seq.started
            tokens = seq.all_ids  # a preempted request recomputes its output too
            wants_scores = seq.params.prompt_logprobs is not None and \
                (seq.prompt_logprobs is None or len(seq.prompt_logprobs) < len(seq.prompt_ids))
            # prompt logprobs need every prompt position's logits: no cache hit for the first pass
            if not self.target_kv.admit(seq.target, tokens, len(tokens) - 1, seq.cache_salt, not wants_scores):
                if not self.running:  # nothing will free blocks: can't happen with check_request's bound
                    raise RuntimeError("KV cache holds no blocks for a request that should fit")
                break  # waits, in arrival order, for blocks to free up
            self.waiting.popleft()
            self.running.append(seq)
            plan.requests[seq.seq_id] = seq
            if not resumed:
                self.counters.num_prompt_tokens += len(seq.prompt_ids)
                self._start(seq, plan)
            seq.prefill_draft = self._admit_draft(seq)
            if wants_scores:
                seq.prompt_logprobs = [None]  # the first token has none
            seq.prefill_target = len(tokens) - 1  # the last token is fed by the first step

    def _start(self, seq: Sequence, plan: StepPlan) -> None:
        """A new request's state on the workers and the draft's view of its prompt (once: a
        preempted request keeps both)."""
        start = None if not seq.params.speculative else self.policy.start(  # (the request asked for none)
            seq.acceptance, len(self.running), min(seq.params.max_tokens or 0, self._budget(seq)), len(seq.prompt_ids))
        if start is None:  # no speculation, or gated: drafting can't pay at the acceptance measured
            seq.drafts = False  # never drafts: no draft state, prefill or probes
        else:
            seq.acceptance = start  # the engine's prior, or an explorer's optimistic start
        grammar = None if seq.grammar is None else \
            RequestGrammar(seq.grammar, tuple(seq.output_ids), tuple(seq.params.stop_token_ids))
        plan.start.append(RequestStart(seq.seq_id, seq.request_id, seq.seed, seq.drafts, grammar))
        seq.draft_grammar_at = len(seq.output_ids)
        seq.started = True
        if seq.drafts and self.vocab_mapping is not None:  # the draft reads the text in its tokens
            seq.draft_ids = self.vocab_mapping.draft_prompt(seq.prompt, seq.prompt_ids)
        elif seq.drafts:
            seq.draft_ids = list(seq.prompt_ids)
        if len(seq.draft_ids) >= self.draft_max_len:  # past the draft's context: the target goes alone
            seq.drafts = False

    def _admit_draft(self, seq: Sequence) -> int:
        """The draft's blocks (its own prefix-cache hit included) and the position its prefill must
        reach: where it is already when it prefills nothing (it doesn't draft, or drafting doesn't
        pay at the batch size it will join, the waiting requests counted: it catches up if it
        ever does). With adaptive K, a request whose output can't repay the draft's prefill at the
        measured costs (a long prompt, a short answer) never drafts."""
        if not seq.drafts or self.draft_kv is None:
            return 0
        ids = seq.draft_ids  # a preempted request's covers the output it had
        if not self.draft_kv.admit(seq.draft, ids, len(ids) - 1, seq.cache_salt):
            seq.drafts = False  # no room in the draft's pool now: this request decodes plainly
            return 0
        # the batch this request will decode in: the running ones and those waiting behind it
        batch = min(self.max_num_seqs, len(self.running) + len(self.waiting))
        decision = self.policy.draft_prefill(self._budget(seq), len(ids) - 1 - seq.draft.computed, batch,
                                             seq.acceptance.alpha)
        if decision is DraftPrefill.NEVER:
            self.draft_kv.free(seq.draft)
            seq.drafts = False
            return 0
        return seq.draft.computed if decision is DraftPrefill.LATER else len(ids) - 1

    def _plan_prefills(self, plan: StepPlan, budget: int, rounds: bool) -> list[Prefill]:
        """Prompt chunks of admitted sequences, oldest first, up to `budget` tokens in each model this
        step: one call per group for all of them (one forward or a few); a chunk writes the same keys
        and values wherever it ends. A chunk whose prompt logprobs are wanted is a call of its own (its
        logits span the vocabulary).

        Where the target takes ragged rows, a prompt's last chunk is no prefill: the sequence joins
        this step's round with the rest of its prompt as its pending tokens, and its first token
        comes from that forward. When the step has a round (decoding rows, or such a sequence:
        `rounds`), the target's other chunks are returned to ride in the round's forward: a long
        prompt then costs the running streams no forward of their own per chunk. The draft's chunks
        are prefilled before the round."""
        targets: list[Prefill] = []
        drafts: list[Prefill] = []
        riding: list[Prefill] = []
        for seq in [s for s in self.running if s.prefilling]:
            if budget <= 0:
                break
            plan.requests[seq.seq_id] = seq
            t0, d0 = seq.target.computed, seq.draft.computed
            n_target = min(seq.prefill_target - t0, budget)
            # a chunk that ends the prompt puts the sequence in this step's round: its last prompt
            # token and first drafts must fit the budget too, or the chunk stops short of the end
            # (where the budget can't hold a row and a token, as before: a prompt always moves on)
            row = 1 + (self.spec.num_speculative_tokens if seq.drafts and self.spec else 0)
            ends = n_target > 0 and t0 + n_target >= seq.prefill_target
            if ends and row < budget < n_target + row:
                n_target, ends = budget - row, False
            n_draft = min(seq.prefill_draft - d0, budget)
            tokens = seq.all_ids if n_target > 0 else []
            target = Prefill(seq.target.blocks, t0, tokens[t0:t0 + n_target], seq.seq_id) if n_target > 0 else None
            draft = Prefill(seq.draft.blocks, d0, seq.draft_ids[d0:d0 + n_draft], seq.seq_id) if n_draft > 0 else None
            budget -= max(n_target, n_draft, 0) + (row if ends else 0)
            if seq.prompt_logprobs is not None and len(seq.prompt_logprobs) < len(seq.prompt_ids) and target:
                scored = (tokens[t0 + n_target], seq.params.prompt_logprobs)  # the token after the chunk
                plan.prefills.append(PrefillCall([target], [draft] if draft else [], scored))
            elif target is not None and t0 + n_target < seq.prefill_target:
                riding.append(target)
                drafts += [draft] if draft else []
            elif target is not None and self.ragged_rows and d0 + n_draft >= seq.prefill_draft:
                seq.prefill_target = t0  # the rest of its prompt: its first round's pending tokens
                target = None
                if draft is not None and (not rounds or n_draft <= self.pacer.min_tokens):
                    # the draft's rest too: fed with its first drafts, in the call that makes them,
                    # so no draft call comes before the first token (alone, or a piece short enough
                    # not to stretch the round it rides in beyond what the pacer planned)
                    seq.prefill_draft, draft = d0, None
                rounds = True
                drafts += [draft] if draft else []
            else:
                targets += [target] if target else []
                drafts += [draft] if draft else []
            # the plan runs before update() sees it: positions move now (a chunk that fails, fails its request)
            seq.target.computed += len(target.tokens) if target else 0
            seq.draft.computed += len(draft.tokens) if draft else 0
        if not rounds:  # no forward to ride in
            targets, riding = targets + riding, []
        if targets or drafts:
            plan.prefills.append(PrefillCall(targets, drafts))
        return riding

    def _plan_round(self, plan: StepPlan, rows: list[Sequence], riding: list[Prefill]) -> None:
        """One propose / verify / sample round for the decoding rows; `riding`: prompt chunks of
        prefilling sequences the target writes in the same forward."""
        start = time.perf_counter()
        policy = self.policy.round(len(rows), any(seq.drafts for seq in rows))
        ahead_on = policy.ahead
        blocks = [self._ahead_block(seq) if ahead_on else None for seq in rows]
        for seq in rows:
            seq.ahead = None  # used now or never: the draft cache moves on either way
        ks = [len(blk) if blk else self._num_drafts(seq, len(rows), policy.pays) for seq, blk in zip(rows, blocks)]
        if not any(blocks):  # (draft-ahead blocks are drafted already: verifying them is the cheap part)
            ks = self.policy.batch_drafts([seq.acceptance for seq in rows], ks)
        rows, ks, blocks = self._make_room(plan, rows, ks, blocks, ahead_on)
        riding = [c for c in riding if plan.requests[c.seq_id] in self.running]  # not preempted for room
        if not rows:
            if riding:
                plan.prefills.append(PrefillCall(riding, []))
            return
        for seq in rows:
            plan.requests[seq.seq_id] = seq
        sampling = [self._row_sampling(seq) for seq in rows]
        verify = VerifyBatch(
            seq_ids=[s.seq_id for s in rows],
            starts=[s.target.computed for s in rows],
            pending=[s.all_ids[s.target.computed:] for s in rows],
            sampling=sampling,
            tables=[s.target.blocks for s in rows],
            ahead_counts=[len(blk) if blk else 0 for blk in blocks],
            prefill=riding,
        )
        # the draft proposes unpenalized (any q keeps verification exact): no histories; a grammar's
        # state there learns the output tokens it hasn't seen
        draft_sampling = [replace(x, prompt_ids=(), output_ids=(),
                                  grammar_tail=tuple(s.output_ids[s.draft_grammar_at:]) if s.grammar else ())
                          for x, s in zip(sampling, rows)]
        drafting = [b for b, k in enumerate(ks) if k > 0 and not blocks[b]]
        for b in drafting:  # a fresh draft feeds at least the last committed token
            rows[b].draft.computed = min(rows[b].draft.computed, len(rows[b].draft_ids) - 1)
        draft = None
        if drafting:
            draft = DraftBatch(
                seq_ids=[rows[b].seq_id for b in drafting],
                starts=[rows[b].draft.computed for b in drafting],
                pending=[rows[b].draft_ids[rows[b].draft.computed:] for b in drafting],
                num_drafts=[ks[b] for b in drafting],
                sampling=[draft_sampling[b] for b in drafting],
                tables=[rows[b].draft.blocks for b in drafting],
            )
        # a row drafting after plain steps (or with its prompt's rest) first feeds the draft the tokens
        # it missed: that call is a prefill of them besides the drafts. Counted as a draft step's
        # cost, eight probes filled the window with catch-ups (44.6 ms after 84 plain steps against
        # 4-5 ms a draft step) and held the default app at K = 0 for good on a text whose drafts it
        # accepted 99.7% of
        catches_up = any(rows[b].acceptance.steps_without_drafts > 0 or len(draft.pending[i]) > ks[b] + 1
                         for i, b in enumerate(drafting))
        ahead = self._ahead_batch(rows, ks, blocks, draft_sampling) if ahead_on else None
        self.ahead_drafted += len(ahead.draft.seq_ids) if ahead is not None else 0
        plan.round = RoundPlan(verify, ks, draft, ahead, catches_up, time.perf_counter() - start)

    def _make_room(self, plan: StepPlan, rows: list[Sequence], ks: list[int], blocks: list, ahead_on: bool):
        """Blocks for every position this round writes, in both models. While the target's pool is
        short, the most recently admitted request is preempted (it may be one of these rows); a row
        whose draft can't grow drafts nothing this round."""
        keep_rows, keep_ks, keep_blocks = [], [], []
        for seq, k, blk in zip(rows, ks, blocks):
            if seq not in self.running:  # preempted for an older row of this round
                continue
            while not self.target_kv.grow(seq.target, seq.num_tokens + k):
                victim = self.running[-1]
                self._preempt(victim, plan)
                if victim is seq:
                    break
            if seq not in self.running:
                continue
            if k > 0:
                # fresh drafts write up to k - 1 past draft_ids; a draft-ahead block k + 1 more
                reach = max(seq.draft.computed, len(seq.draft_ids)) + (2 * k + 2 if ahead_on else k)
                if not self.draft_kv.grow(seq.draft, reach):
                    k, blk = 0, None
                    seq.draft.computed = min(seq.draft.computed, len(seq.draft_ids))
            keep_rows.append(seq)
            keep_ks.append(k)
            keep_blocks.append(blk)
        self.ahead_used += sum(1 for blk in keep_blocks if blk)
        return keep_rows, keep_ks, keep_blocks

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Recompute later (vLLM v1's policy): its blocks go back, cached blocks of its prefix most
        likely stay for its return. Its output, random streams and text are kept; chunks this plan
        would have written for it are dropped (their blocks may be another row's now)."""
        self.running.remove(seq)
        self._free_blocks(seq)
        seq.ahead = None
        for call in plan.prefills:
            call.target = [c for c in call.target if c.seq_id != seq.seq_id]
            call.draft = [c for c in call.draft if c.seq_id != seq.seq_id]
        plan.prefills = [call for call in plan.prefills if call.target or call.draft]
        self.target_kv.counters.preemptions += 1
        self.waiting.appendleft(seq)
        log.info("request %s preempted (KV cache full: %d running); it resumes when blocks free up",
                 seq.request_id, len(self.running))

    def _ahead_block(self, seq: Sequence) -> list[int] | None:
        """The drafts this row verifies from its draft-ahead block (None: it drafts afresh). Fewer
        than the block when the row's budget is smaller; the draft cache then keeps only what
        precedes the last of them."""
        if not seq.ahead or not seq.drafts:
            return None
        k = min(len(seq.ahead), self._budget(seq) - 1)
        if k <= 0:
            seq.draft.computed = min(seq.draft.computed, len(seq.draft_ids))
            return None
        seq.draft.computed = min(seq.draft.computed, len(seq.draft_ids) + k - 1)
        return seq.ahead[:k]

    def _ahead_batch(self, rows: list[Sequence], ks: list[int], blocks: list, sampling: list[RowSampling]):
        """The next blocks to draft during this step's verify: k_b + 1 proposals after this step's k_b
        drafts, for each drafting row whose draft cache has room for them."""
        seq_ids, starts, pending, counts, fresh_from, rows_sampling, tables = [], [], [], [], [], [], []
        for b, seq in enumerate(rows):
            k = ks[b]
            if k <= 0 or len(seq.draft_ids) + 2 * k + 1 > self.draft_max_len:
                continue
            if blocks[b]:  # drafts known: feed what the cache lacks of draft_ids + block
                virtual = seq.draft_ids + (self.vocab_mapping.to_draft(blocks[b], retokenize=False)
                                           if self.vocab_mapping else blocks[b])
                starts.append(seq.draft.computed)
                pending.append(virtual[seq.draft.computed:])
                fresh_from.append(None)
            elif self.spec.parallel_drafting:  # the fresh call cached draft_ids only
                starts.append(len(seq.draft_ids))
                pending.append([])
                fresh_from.append(0)
            else:  # the fresh call cached draft_ids and drafts 1..k-1
                starts.append(len(seq.draft_ids) + k - 1)
                pending.append([])
                fresh_from.append(k - 1)
            seq_ids.append(seq.seq_id)
            tables.append(seq.draft.blocks)
            counts.append(k + 1)
            # held-back tokens (min_tokens) at the next block's positions, k + 1 further on
            rows_sampling.append(replace(sampling[b], hold_back_until=max(0, sampling[b].hold_back_until - k - 1)))
        if not seq_ids:
            return None
        return AheadBatch(DraftBatch(seq_ids, starts, pending, counts, rows_sampling, tables), fresh_from)

    # -- applying what ran ---------------------------------------------------------------------

    def update(self, plan: StepPlan, output: StepOutput) -> list[Sequence]:
        """Apply a plan's output: the sequences that got tokens or ended (finished ones included)."""
        changed: list[Sequence] = []
        for seq_id in output.failed:  # its part of a plan that raised, run alone, raised (EngineCore logged why)
            seq = plan.requests[seq_id]
            self._fail(seq, INTERNAL_ERROR)
            changed.append(seq)
        for seq_id, got in output.prompt_logprobs.items():
            seq = plan.requests[seq_id]
            if not seq.finished:
                seq.prompt_logprobs.extend(got)
        if not plan.isolated:
            for seconds, tokens in output.draft_prefill:  # the draft's prompt tokens alone: their cost
                self.policy.observe_draft_prefill(seconds, tokens)
        riding = plan.round.verify.prefill if plan.round is not None else []
        for chunk in [c for call in plan.prefills for c in call.target + call.draft] + riding:
            seq = plan.requests[chunk.seq_id]
            if not seq.finished and seq in self.running:
                self._commit(seq)
        if plan.round is not None and output.round is not None:
            changed += self._apply_round(plan, output)
        if not plan.isolated:
            self.pacer.observe(*self._step_shape(plan), output.execute_s)
        return changed

    @staticmethod
    def _step_shape(plan: StepPlan) -> tuple[int, int]:
        """(decoding rows, prompt tokens) of a plan, as the pacer counts them: a prompt's tokens in
        either model, the larger of the two (the token budget's unit)."""
        prompt: dict[int, list[int]] = {}
        riding = plan.round.verify.prefill if plan.round is not None else []
        target = [c for call in plan.prefills for c in call.target] + list(riding)
        draft = [c for call in plan.prefills for c in call.draft]
        for side, chunks in enumerate((target, draft)):
            for c in chunks:
                prompt.setdefault(c.seq_id, [0, 0])[side] += len(c.tokens)
        rows = len(plan.round.verify.seq_ids) if plan.round is not None else 0
        # a prompt's last chunk, as a row's pending tokens (the first of them is a decoding row's own)
        last_chunks = sum(len(p) - 1 for p in plan.round.verify.pending) if plan.round is not None else 0
        return rows, sum(max(t) for t in prompt.values()) + last_chunks

    def _apply_round(self, plan: StepPlan, output: StepOutput) -> list[Sequence]:
        start = time.perf_counter()
        rnd, result = plan.round, output.round
        rows = [plan.requests[seq_id] for seq_id in rnd.verify.seq_ids]
        ks = rnd.ks
        drafting = set(rnd.draft.seq_ids) if rnd.draft is not None else set()
        proposed, ahead_cached = {}, {}
        if result.ahead is not None:
            for i, seq_id in enumerate(result.ahead.seq_ids):
                if seq_id not in result.ahead.errors:
                    proposed[seq_id] = result.ahead.tokens[i]
                    ahead_cached[seq_id] = result.ahead.cached[i]
        for b, seq in enumerate(rows):
            if seq.finished:  # failed in this plan's prefill
                continue
            if b in result.errors:
                self._fail(seq, RequestFailure.invalid(result.errors[b]))  # the row's own numbers
                continue
            k = ks[b]
            if seq.seq_id in drafting and seq.grammar is not None:
                seq.draft_grammar_at = len(seq.output_ids)
            new, accepted = result.tokens[b], result.num_accepted[b]
            seq.stats.observe(k, accepted)
            self.policy.observe_acceptance(seq.acceptance, k, accepted)
            self.stats.observe(k, accepted)
            seq.target.computed = result.cached[b]
            # the draft cache holds what was last fed to it for this row, in order; of that, the
            # committed text's prefix: draft_ids (before this step's tokens) and the accepted drafts,
            # or, when the next block goes on from this step's last token, all it was fed
            known = len(seq.draft_ids)
            fed = ahead_cached.get(seq.seq_id, result.draft_cached.get(seq.seq_id, seq.draft.computed))
            nxt = proposed.get(seq.seq_id)
            if nxt is not None and len(nxt) == k + 1 and accepted == k and ahead_block_continues(
                    new[-1], nxt[0], k, self._synthetic_rates, self._synthetic_rng.random() if self._synthetic_rates else 0.0):
                seq.ahead = nxt[1:]
                seq.draft.computed = fed
            else:
                seq.draft.computed = min(fed, known + accepted)
            try:
                self._append(seq, new, result.logprobs.get(b), accepted, k)
            except Exception as e:  # noqa: BLE001 - e.g. detokenizing; fails this request only
                log.error("request %s failed after the step", seq.request_id, exc_info=e)
                seq.finish_reason, seq.error = "error", INTERNAL_ERROR
            if seq.finished:
                seq.ahead = None
                self._release(seq)
            else:
                self._commit(seq)
        if plan.isolated or rnd.verify.prefill or any(len(p) > 1 for p in rnd.verify.pending):
            return rows  # a prefill's time in the target's forward: not what a round of these rows costs
        # the whole round: its overhead beyond the forwards counts too
        wall = rnd.plan_s + output.round_s + time.perf_counter() - start
        self.policy.observe_round(MeasuredRound(len(rows), ks, result, wall, rnd.catches_up, ahead=rnd.ahead is not None,
                                                fresh=rnd.draft is not None))
        return rows

    # -- failures --------------------------------------------------------------------------------

    def _fail(self, seq: Sequence, failure: RequestFailure) -> None:
        seq.finish_reason, seq.error = "error", failure
        if seq in self.waiting:  # preempted in the plan that failed it
            self.waiting.remove(seq)
            self._to_remove.append(seq.request_id)
        self._release(seq)

    def fail_running(self, failure: RequestFailure) -> list[Sequence]:
        """A model group died: end every running sequence with the error; the next step rebuilds the
        groups (so these errors reach their clients now, not after a placement that may wait for a
        lost node). Waiting requests keep their place and run on the new groups; while the groups
        can't be rebuilt, each step tries again and fails the waiting requests (503, not a hang)."""
        failed = list(self.running)
        for seq in failed:
            seq.finish_reason, seq.error = "error", failure
            self._free_blocks(seq)
        self.running.clear()
        # the new groups' caches hold nothing: no cached block may be hit, and preempted requests
        # start over on them (their per-request state is gone with the old groups)
        for kv in (self.target_kv, self.draft_kv):
            if kv is not None:
                kv.reset()
        for seq in self.waiting:
            seq.started = False
        self._to_remove.clear()  # the old groups' per-request state goes with them
        self.executor_down = True
        return failed

    def fail_waiting(self, failure: RequestFailure) -> list[Sequence]:
        """The groups can't be rebuilt now: the waiting requests end with the error instead of hanging."""
        failed = list(self.waiting)
        self.waiting.clear()
        for seq in failed:
            seq.finish_reason, seq.error = "error", failure
        return failed

    # -- bookkeeping -----------------------------------------------------------------------------

    def _free_blocks(self, seq: Sequence) -> None:
        self.target_kv.free(seq.target)
        if self.draft_kv is not None:
            self.draft_kv.free(seq.draft)

    def _release(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self._free_blocks(seq)
            self._to_remove.append(seq.request_id)

    def _commit(self, seq: Sequence) -> None:
        """Hash the blocks this round filled with committed tokens, so later requests can share them."""
        kv, bs = self.target_kv, self.target_kv.block_size
        if kv.prefix_caching and seq.target.computed // bs > seq.target.hashed:
            kv.commit(seq.target, seq.all_ids, seq.cache_salt, seq.target.computed)
        if seq.drafts and self.draft_kv is not None:
            upto = min(seq.draft.computed, len(seq.draft_ids) - 1)  # never the position the next step rewrites
            if self.draft_kv.prefix_caching and upto // bs > seq.draft.hashed:
                self.draft_kv.commit(seq.draft, seq.draft_ids, seq.cache_salt, upto)

    def _budget(self, seq: Sequence) -> int:
        """New tokens this sequence may still produce."""
        return seq.remaining(self.max_model_len)

    def _num_drafts(self, seq: Sequence, batch: int, pays: bool) -> int:
        if self.spec is None or not seq.drafts:
            return 0
        k = self.policy.num_drafts(seq.acceptance, batch, pays, self._budget(seq),
                                   len(seq.draft_ids) - seq.draft.computed)
        # with another tokenizer the draft may need more tokens than the target for the same text
        # (Thai: ~6x): past its own context limit it stops drafting; the target goes on alone
        if len(seq.draft_ids) + k > self.draft_max_len:
            return 0
        return max(0, min(k, self._budget(seq) - 1))

    def _row_sampling(self, seq: Sequence) -> RowSampling:
        p = seq.params
        history = {}
        if seq.grammar is not None:
            history["num_output"] = len(seq.output_ids)
        if p.penalized:
            history["output_ids"] = tuple(seq.output_ids)
            if p.repetition_penalty != 1.0:
                history["prompt_ids"] = tuple(seq.prompt_ids)
        hold = p.min_tokens - len(seq.output_ids)
        if hold <= 0:
            return RowSampling(seq.request_id, p, **history)
        held = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids)
        return RowSampling(seq.request_id, p, tuple(sorted(held)), hold, **history)

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None, drafted: int,
                k: int) -> None:
        """The round's tokens to the request's output (text, stop checks: the output processor's),
        then to the draft's view of it."""
        start = len(seq.output_ids)
        self.counters.num_generation_tokens += self.outputs.append(seq, tokens, logprobs, drafted, k)
        if seq.drafts:  # the draft's view, for a request that may draft
            added = seq.output_ids[start:]
            seq.draft_ids.extend(self.vocab_mapping.to_draft(added) if self.vocab_mapping else added)
