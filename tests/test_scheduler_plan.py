"""The scheduler on its own: schedule() plans a step, update() applies hand-made outputs. No executor,
no weights: the workers' answers are written here (acceptance patterns, a row that fails, a part of
a plan that raised), so each bookkeeping rule is checked where it is made. SmolLM2's tokenizer
makes the text; its vocabulary's token ids are the prompts."""
from dataclasses import dataclass

import pytest

from engine.config import EngineConfig, SamplingParams
from engine.errors import ErrorKind
from engine.models.loading import load_tokenizer, resolve_model
from engine.output_processor import OutputProcessor
from engine.plan import StepOutput, StepPlan
from engine.scheduler import Scheduler
from engine.ahead_policy import AheadPolicy
from engine.step import DraftOutput, VerifyOutput
from engine.structured import GrammarCompiler

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
BS = 16


@dataclass
class Groups:
    """The model groups' shape (engine/scheduler.py ModelGroups), with no model behind it."""

    num_blocks: int = 64
    overlaps_groups: bool = False
    ragged_rows: bool = False


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(MODEL))


@pytest.fixture(scope="module")
def word(tokenizer):
    """A token that is no EOS and decodes to text: every generated token here."""
    return tokenizer.encode(" cat", add_special_tokens=False)[0]


def scheduler(tokenizer, k: int | None = 3, groups: Groups | None = None, max_len: int = 512, draft_ahead: bool = False,
              **engine) -> Scheduler:
    spec = {"model": MODEL, "num_speculative_tokens": k, "draft_ahead": draft_ahead} if k else None
    config = EngineConfig(model=MODEL, block_size=BS, speculative_config=spec, **engine)
    eos = {tokenizer.eos_token_id}
    return Scheduler(groups or Groups(), eos, config, max_len, GrammarCompiler(tokenizer, eos),
                     OutputProcessor(tokenizer, eos, max_len))


def prompt(n: int, first: int = 1000) -> list[int]:
    return [first + i for i in range(n)]


def params(max_tokens: int = 20) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run(plan: StepPlan, token: int, accepted=lambda seq_id, k: k, errors: dict[int, str] | None = None,
        ahead_token: int | None = None) -> StepOutput:
    """What the workers would report for `plan`: each row accepts `accepted(seq_id, k)` of its k
    drafts and emits that many tokens plus one; the caches hold what each row was fed (its pending
    tokens, the accepted drafts; the draft's: its pending tokens and its proposals but the last)."""
    out = StepOutput()
    if plan.round is None:
        return out
    verify, ks = plan.round.verify, plan.round.ks
    acc = [min(k, accepted(seq_id, k)) for seq_id, k in zip(verify.seq_ids, ks)]
    draft = plan.round.draft
    draft_cached = {} if draft is None else {
        seq_id: s + len(p) + n - 1 for seq_id, s, p, n in zip(draft.seq_ids, draft.starts, draft.pending, draft.num_drafts)}
    out.round = VerifyOutput(
        tokens=[[] if b in (errors or {}) else [token] * (a + 1) for b, a in enumerate(acc)], num_accepted=acc,
        cached=[s + len(p) + a for s, p, a in zip(verify.starts, verify.pending, acc)],
        errors=errors or {}, draft_cached=draft_cached)
    ahead = plan.round.ahead
    if ahead is not None:  # the next blocks: `ahead_token` each, fed after the fresh drafts they go on from
        batch, ks_of = ahead.draft, dict(zip(draft.seq_ids, draft.num_drafts)) if draft else {}
        fed = [len(p) + (0 if j is None else ks_of[seq_id] - j)
               for seq_id, p, j in zip(batch.seq_ids, batch.pending, ahead.fresh_from)]
        out.round.ahead = DraftOutput(batch.seq_ids, [[ahead_token] * n for n in batch.num_drafts],
                                      cached=[s + f + n - 1 for s, f, n in zip(batch.starts, fed, batch.num_drafts)])
    return out


def step(sched: Scheduler, token: int, **kwargs) -> StepPlan:
    plan = sched.schedule()
    sched.update(plan, run(plan, token, **kwargs))
    return plan


def owned_blocks(sched: Scheduler) -> list[int]:
    return [b for seq in sched.running for b in seq.target.blocks]


def test_a_prompt_is_prefilled_then_its_first_round_verifies_k_drafts_in_the_same_step(tokenizer, word):
    sched = scheduler(tokenizer)
    ids = prompt(40)
    seq = sched.add("r", None, ids, params())
    plan = sched.schedule()
    assert [s.request_id for s in plan.start] == ["r"] and plan.start[0].draft
    (call,) = plan.prefills  # both models' chunks in one call: all of the prompt but its last token
    assert [(c.start, c.tokens) for c in call.target] == [(0, ids[:39])]
    assert [(c.start, c.tokens) for c in call.draft] == [(0, ids[:39])]
    rnd = plan.round
    assert rnd.ks == [3] and rnd.verify.starts == [39] and rnd.verify.pending == [[ids[39]]]
    assert rnd.draft.starts == [39] and rnd.draft.pending == [[ids[39]]] and rnd.draft.num_drafts == [3]
    changed = sched.update(plan, run(plan, word, accepted=lambda s, k: 2))
    assert changed == [seq] and seq.output_ids == [word] * 3
    # the target holds the prompt and the 2 accepted drafts; the draft the same (its 3rd proposal's
    # key was never written)
    assert (seq.target.computed, seq.draft.computed) == (42, 42)


@pytest.mark.parametrize("pattern", [[0, 0, 0], [3, 3, 3], [1, 3, 0, 2], [2, 0, 3, 1]])
def test_each_round_feeds_each_model_what_it_lacks_whatever_was_accepted(tokenizer, word, pattern):
    """Acceptance patterns: after any number accepted, the next round feeds each model exactly what
    its cache lacks (the target: the last committed token; the draft: that one too, and the last
    draft when all were accepted, since its key was never written), and the output grows by the
    accepted drafts plus one."""
    sched = scheduler(tokenizer)
    seq = sched.add("r", None, prompt(40), params(max_tokens=100))
    step(sched, word, accepted=lambda s, k: pattern[0])
    for prev, a in zip(pattern, pattern[1:]):
        before = seq.num_tokens
        plan = sched.schedule()
        verify, draft = plan.round.verify, plan.round.draft
        assert verify.starts == [before - 1] and verify.pending == [[seq.all_ids[-1]]]
        unfed = 2 if prev == 3 else 1
        assert draft.starts == [len(seq.draft_ids) - unfed] and draft.pending == [seq.draft_ids[-unfed:]]
        sched.update(plan, run(plan, word, accepted=lambda s, k: a))
        assert seq.num_tokens == before + a + 1 and seq.target.computed == seq.num_tokens - 1
        # the draft's cache claims no rejected proposal
        assert seq.draft.computed == len(seq.draft_ids) - (2 if a == 3 else 1)
    assert seq.stats.num_draft_tokens == 3 * len(pattern) and seq.stats.num_accepted_tokens == sum(pattern)


def test_a_request_at_its_max_tokens_finishes_and_its_state_is_dropped_at_the_next_step(tokenizer, word):
    sched = scheduler(tokenizer)
    free = sched.target_kv.pool.num_free
    seq = sched.add("r", None, prompt(40), params(max_tokens=10))
    plans = []
    while not seq.finished:
        plans.append(step(sched, word))
    assert seq.finish_reason == "length" and len(seq.output_ids) == 10
    # the last round drafts only what max_tokens leaves room for
    assert [p.round.ks[0] for p in plans] == [3, 3, 1]
    assert not sched.running and sched.target_kv.pool.num_free == free
    plan = sched.schedule()
    assert plan.remove == ["r"] and plan.round is None and not plan.prefills


def test_a_long_prompt_is_prefilled_in_chunks_within_the_budget_beside_a_decoding_row(tokenizer, word):
    sched = scheduler(tokenizer, k=None, max_num_batched_tokens=32, enable_prefix_caching=False)
    stream = sched.add("stream", None, prompt(5), params(max_tokens=50))
    step(sched, word)
    ids = prompt(100, first=3000)
    long = sched.add("long", None, ids, params(max_tokens=5))
    chunks = []
    while long.prefilling or not long.output_ids:
        plan = sched.schedule()
        mine = [c for call in plan.prefills for c in call.target] + plan.round.verify.prefill
        for chunk in [c for c in mine if c.seq_id == long.seq_id]:  # riding in the round but the last
            chunks.append((chunk.start, len(chunk.tokens)))
            assert chunk.tokens == ids[chunk.start:chunk.start + len(chunk.tokens)]
            assert len(chunk.tokens) + 1 <= 32  # the stream's row first
        sched.update(plan, run(plan, word))
    # contiguous, none past the prompt's last token (the round feeds that one)
    assert chunks[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(chunks, chunks[1:]))
    assert sum(n for _, n in chunks) == 99 and long.target.computed == 100
    assert len(stream.output_ids) == 1 + len(chunks)  # it got a token every step


def test_with_ragged_rows_the_chunks_ride_in_the_round_and_the_last_is_the_rows_pending_tokens(tokenizer, word):
    sched = scheduler(tokenizer, k=None, groups=Groups(ragged_rows=True), max_num_batched_tokens=32,
                      enable_prefix_caching=False)
    sched.add("stream", None, prompt(5), params(max_tokens=50))
    step(sched, word)
    ids = prompt(70, first=3000)
    long = sched.add("long", None, ids, params(max_tokens=5))
    plans = []
    while not long.output_ids:
        plans.append(step(sched, word))
    riding = [c for p in plans for c in p.round.verify.prefill]
    assert all(not p.prefills for p in plans)  # no forward of their own: each rides in the round
    assert [(c.start, len(c.tokens)) for c in riding] == [(0, 31), (31, 31)]
    last = plans[-1].round.verify
    b = last.seq_ids.index(long.seq_id)
    assert (last.starts[b], last.pending[b]) == (62, ids[62:])  # the rest of the prompt: its row's pending


def test_with_ragged_rows_the_drafts_prompt_is_fed_with_its_first_drafts_not_in_a_call_before(tokenizer, word):
    """Alone, a prompt's first token comes from a step whose only draft call is the one that drafts:
    the draft is fed the prompt there (a catch-up: its time is not a draft step's cost). Beside a
    decoding stream, a short prompt's draft piece rides the same way; one longer than the pacer's
    minimum is prefilled before the round, as the pacer sized it."""
    sched = scheduler(tokenizer, groups=Groups(ragged_rows=True))
    ids = prompt(40)
    seq = sched.add("r", None, ids, params(max_tokens=100))
    plan = sched.schedule()
    rnd = plan.round
    assert not plan.prefills and rnd.verify.pending == [ids] and rnd.ks == [3]
    assert rnd.draft.starts == [0] and rnd.draft.pending == [ids] and rnd.catches_up
    sched.update(plan, run(plan, word, accepted=lambda s, k: 2))
    assert seq.output_ids == [word] * 3 and (seq.target.computed, seq.draft.computed) == (42, 42)
    short, long = prompt(10, first=2000), prompt(40, first=3000)
    sched.add("short", None, short, params())
    sched.add("long", None, long, params())
    plan = sched.schedule()
    (call,) = plan.prefills
    assert [(c.start, c.tokens) for c in call.draft] == [(0, long[:39])] and not call.target
    assert plan.round.draft.pending[1] == short and plan.round.ks == [3, 3, 3]


def test_with_ragged_rows_no_step_computes_more_than_the_budget_in_the_target(tokenizer, word):
    """A prompt's rest joins its first round as the row's pending tokens only if they and the row's
    drafts fit the step's budget; otherwise it is prefilled, and the row decodes next step (a
    32-token prompt under a 32-token budget once made a 35-token forward)."""
    sched = scheduler(tokenizer, groups=Groups(ragged_rows=True), max_num_batched_tokens=32,
                      enable_prefix_caching=False)
    for n in (32, 31, 29, 28, 27, 10):
        seq = sched.add(f"r{n}", None, prompt(n, first=1000 + 50 * n), params(max_tokens=6))
        while not seq.finished:
            plan = step(sched, word)
            rnd = plan.round
            target = sum(len(c.tokens) for call in plan.prefills for c in call.target)
            if rnd is not None:
                target += sum(len(p) for p in rnd.verify.pending) + sum(rnd.ks) + sum(len(c.tokens) for c in rnd.verify.prefill)
            assert target <= 32, (n, target)
        assert seq.output_ids == [word] * 6


def test_under_a_tiny_kv_cache_the_newest_request_is_preempted_and_resumes_with_its_output(tokenizer, word):
    """8 blocks of 16 (one is the null block): two 40-token prompts fit (3 blocks each) until they
    need a 4th; the newest then waits at the queue's front, keeps its output, and is recomputed
    when the first is done. No block is ever held by two requests."""
    sched = scheduler(tokenizer, groups=Groups(num_blocks=8), enable_prefix_caching=False)
    first = sched.add("first", None, prompt(40), params(max_tokens=20))
    second = sched.add("second", None, prompt(40, first=2000), params(max_tokens=20))
    preempted_with = None
    while not (first.finished and second.finished):
        plan = sched.schedule()
        blocks = owned_blocks(sched)
        assert len(blocks) == len(set(blocks)) and 0 not in blocks
        if second in sched.waiting and second.output_ids and preempted_with is None:
            preempted_with = list(second.output_ids)
            assert sched.target_kv.counters.preemptions == 1 and sched.waiting[0] is second
            assert plan.round.verify.seq_ids == [first.seq_id]
        if preempted_with is not None and second.output_ids == preempted_with and second in sched.running:
            # resumed: its prompt and output are prefilled again (nothing cached: prefix caching off)
            (call,) = plan.prefills
            assert call.target[0].start == 0 and call.target[0].tokens == second.all_ids[:-1]
        sched.update(plan, run(plan, word))
    assert preempted_with is not None
    assert first.output_ids == second.output_ids == [word] * 20
    assert sched.target_kv.pool.num_free == 7


def test_an_abort_mid_prefill_frees_its_blocks_and_drops_its_state_next_step(tokenizer, word):
    sched = scheduler(tokenizer, max_num_batched_tokens=32)
    free = sched.target_kv.pool.num_free
    seq = sched.add("r", None, prompt(100), params())
    step(sched, word)
    assert seq.prefilling and seq.target.computed == 32
    assert sched.abort("r") is seq and seq.finish_reason == "abort"
    assert not sched.running and sched.target_kv.pool.num_free == free
    plan = sched.schedule()
    assert plan.remove == ["r"] and not plan.prefills and plan.round is None


def test_a_row_the_workers_fail_fails_alone_with_its_own_message(tokenizer, word):
    sched = scheduler(tokenizer)
    good = sched.add("good", None, prompt(20), params())
    bad = sched.add("bad", None, prompt(20, first=2000), params())
    plan = sched.schedule()
    b = plan.round.verify.seq_ids.index(bad.seq_id)
    changed = sched.update(plan, run(plan, word, errors={b: "the logits of this row are not finite"}))
    assert sorted(s.request_id for s in changed) == ["bad", "good"]
    assert bad.finish_reason == "error" and bad.error.kind == ErrorKind.INVALID_REQUEST
    assert "not finite" in bad.error.message
    assert good.output_ids and not good.finished and sched.running == [good]
    assert sched.schedule().remove == ["bad"]


def test_a_plan_that_raised_is_cut_per_request_and_a_part_that_raises_again_fails_only_its_own(tokenizer, word):
    sched = scheduler(tokenizer, max_num_batched_tokens=64)
    done = sched.add("done", None, prompt(10), params(max_tokens=1))
    step(sched, word)
    assert done.finished
    a = sched.add("a", None, prompt(20), params())
    b = sched.add("b", None, prompt(20, first=2000), params())
    plan = sched.schedule()
    parts = plan.parts()
    assert [p.remove for p in parts] == [["done"], [], []]
    for part, seq in zip(parts[1:], (a, b)):
        assert list(part.requests) == [seq.seq_id] and [s.request_id for s in part.start] == [seq.request_id]
        assert {c.seq_id for call in part.prefills for c in call.target + call.draft} == {seq.seq_id}
        assert part.round.verify.seq_ids == [seq.seq_id] and part.round.draft.seq_ids == [seq.seq_id]
    # the part of `a` raises again; `b`'s runs: only `a` fails, `b` decodes on
    sched.update(parts[0], StepOutput())
    sched.update(parts[1], StepOutput(failed={a.seq_id: "boom"}))
    sched.update(parts[2], run(parts[2], word))
    assert a.finish_reason == "error" and a.error.kind == ErrorKind.INTERNAL and "boom" not in a.error.message
    assert b.output_ids == [word] * 4 and sched.running == [b]
    nxt = sched.schedule()
    assert nxt.remove == ["a"] and nxt.round.verify.seq_ids == [b.seq_id]
    assert nxt.round.verify.starts == [b.num_tokens - 1]


def test_waiting_requests_wait_for_a_batch_slot_in_arrival_order(tokenizer, word):
    sched = scheduler(tokenizer, max_num_seqs=2)
    seqs = [sched.add(f"r{i}", None, prompt(10, first=1000 + 100 * i), params(max_tokens=4 + 4 * i)) for i in range(4)]
    admitted = []
    while not all(s.finished for s in seqs):
        plan = sched.schedule()
        admitted += [s.request_id for s in plan.start]
        assert len(sched.running) <= 2
        sched.update(plan, run(plan, word, accepted=lambda s, k: 0))
    assert admitted == ["r0", "r1", "r2", "r3"]
    assert [len(s.output_ids) for s in seqs] == [4, 8, 12, 16]


@pytest.mark.parametrize("goes_on", [True, False])
def test_a_draft_ahead_block_is_verified_next_round_when_it_goes_on_from_the_bonus_token(tokenizer, word, goes_on):
    """Draft-ahead: while the target verifies, the draft proposes the next k + 1 tokens after this
    round's drafts. When every draft is accepted and the bonus token is the block's first proposal,
    the next round verifies the rest of the block with no fresh draft call; otherwise the block
    is dropped and the draft's cache claims none of it."""
    sched = scheduler(tokenizer, groups=Groups(overlaps_groups=True), draft_ahead=True)
    sched.policy.ahead = AheadPolicy(fixed=True)
    seq = sched.add("r", None, prompt(40), params(max_tokens=50))
    plan = sched.schedule()
    ahead = plan.round.ahead
    assert ahead.draft.seq_ids == [seq.seq_id] and ahead.draft.num_drafts == [4] and ahead.fresh_from == [2]
    other = tokenizer.encode(" dog", add_special_tokens=False)[0]
    sched.update(plan, run(plan, word, ahead_token=word if goes_on else other))
    assert seq.output_ids == [word] * 4 and len(seq.draft_ids) == 44
    plan = sched.schedule()
    if goes_on:
        assert seq.draft.computed == 46  # draft_ids and the block's first two proposals
        assert plan.round.draft is None and plan.round.verify.ahead_counts == [3] and plan.round.ks == [3]
        assert plan.round.ahead.draft.starts == [46] and plan.round.ahead.draft.pending == [[word]]
    else:
        assert seq.ahead is None and seq.draft.computed == 43
        assert plan.round.draft.starts == [43] and plan.round.draft.pending == [[word]]


def test_the_scheduler_shrinks_a_long_prompts_chunks_while_streams_decode_and_not_before(tokenizer, word):
    sched = scheduler(tokenizer, k=None, max_len=2048, max_num_batched_tokens=256, prefill_stall_ms=300, max_num_seqs=4,
                      groups=Groups(num_blocks=256))
    streams = [sched.add(f"s{i}", None, prompt(8, 1000 + 10 * i), params(200)) for i in range(2)]
    plan = sched.schedule()  # the streams' prompts, no decoding row yet: the whole budget
    out = run(plan, word)
    out.execute_s = 0.05
    sched.update(plan, out)
    for _ in range(3):  # decode rounds of 2 rows: 40 ms
        plan = sched.schedule()
        out = run(plan, word)
        out.execute_s = 0.04
        sched.update(plan, out)
    long = sched.add("long", None, prompt(1000, 5000), params(4))
    plan = sched.schedule()
    (chunk,) = plan.round.verify.prefill  # rides in the round's forward
    # the only prompt cost measured: the streams' own prompts, 14 tokens in 50 ms (fixed costs in it):
    # a cautious first chunk
    assert len(chunk.tokens) == int((0.3 - 0.04) / (0.05 / 14)) == 72
    out = run(plan, word)
    out.execute_s = 0.04 + 72 * 0.002  # 2 ms a prompt token
    sched.update(plan, out)
    plan = sched.schedule()
    (chunk,) = plan.round.verify.prefill
    # a chunk measured: the short prompts' guess is set aside
    assert len(chunk.tokens) == int((0.3 - 0.04) / 0.002) == 130
    assert all(not s.finished for s in streams) and long.prefilling
    # with no stream decoding, nobody waits: the whole budget
    for s in streams:
        sched.abort(s.request_id)
    out = run(plan, word)
    sched.update(plan, out)
    plan = sched.schedule()
    assert [len(c.tokens) for call in plan.prefills for c in call.target] == [256]
