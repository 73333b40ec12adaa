"""Adaptive speculation: K per request per step, within num_speculative_tokens, 0 when drafts fail."""
import statistics

import pytest

from engine import LLM, SamplingParams
from engine.adaptive import MEASURED_DRAFTS, PROBE_EVERY, AcceptanceEstimate, BatchCosts, CostModel, PrefillCost, \
    SpeculationGate, adaptive_k, batch_k, choose_k, expected_tokens, prefill_pays

TARGET, DRAFT = "random:tiny-llama:1", "random:tiny-llama:2"


def measure(costs: CostModel, *observed) -> None:
    """A drafting round's costs, as often as a batch size's verdict takes."""
    for _ in range(MEASURED_DRAFTS):
        costs.observe(*observed)


def test_expected_tokens():
    assert expected_tokens(0.0, 3) == 1.0
    assert expected_tokens(1.0, 3) == 4.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12


def test_choose_k_follows_the_cost_model():
    cheap = [1.0 + 0.05 * k for k in range(6)]  # verify of K+1 tokens costs little more than 1
    assert choose_k(0.0, 0.05, cheap, 5) == 0  # nothing is ever accepted: plain decoding
    assert choose_k(0.95, 0.05, cheap, 5) == 5  # cheap draft, high acceptance: the maximum
    assert choose_k(0.95, 0.05, cheap, 3) == 3  # never above the maximum
    assert choose_k(0.9, 1.0, cheap, 5) == 0  # a draft as expensive as the target never pays
    mid = choose_k(0.6, 0.1, cheap, 5)
    assert 1 <= mid < 5  # moderate acceptance: a moderate K



def test_a_batch_drafts_only_where_its_rows_together_gain():
    """A drafting step costs every row of the batch: one row whose acceptance pays for K = 1 alone
    must not make its neighbour wait. Costs as measured at batch 2 on an AVX2 EPYC (Qwen pair): a
    draft step 0.36 of a plain step, a verify of 2 tokens a row 1.44x, 8% more outside the forwards."""
    c, v, overheads = 0.36, [1.0, 1.44, 2.06, 2.67], {"step_overhead": 0.05, "draft_overhead": 0.13}
    assert choose_k(0.9, c, v, 3, **overheads) == 1  # alone, the row with the predictable text drafts
    assert batch_k([0.9, 0.3], [1, 0], c, v, **overheads) == 0  # with a neighbour that doesn't: plain
    # both rows gain 3%: less than an acceptance estimate from ten rounds gets wrong, so plain
    assert batch_k([0.9, 0.9], [1, 1], c, v, **overheads) == 0
    assert batch_k([0.98, 0.98], [3, 3], c, v, **overheads) == 0  # at these costs not even that gains 10%
    flat = [1.0, 1.1, 1.2, 1.3]  # a verify of K+1 tokens a row at little more than one's cost (AVX-512)
    assert batch_k([0.9, 0.9], [3, 3], 0.3, flat, **overheads) == 3  # +40%: both draft
    cheap = [1.0 + 0.05 * k for k in range(4)]  # where verifying costs little (a GPU, AVX-512 at batch 1-2)
    assert batch_k([0.9, 0.3], [3, 0], 0.1, cheap) == 3  # the drafting row's gain pays for the step
    assert batch_k([0.9, 0.9], [3, 1], 0.1, cheap) == 3  # the cap never raises a row's own K
    assert batch_k([0.5, 0.5], [0, 0], 0.1, cheap) == 0
    # where no cap can gain the margin even at perfect acceptance, a batch of that size never drafts:
    # requests that join it don't prefill the draft (their first token comes as fast as plain's)
    costs = BatchCosts(k_max=3)
    measure(costs.for_batch(1), 3, 0.054, 0.075, 0.14)  # alone: drafts 0.36, a verify of 4 tokens 1.5x
    costs.for_batch(1).observe(0, 0.0, 0.050, 0.053)
    measure(costs.for_batch(2), 3, 0.058, 0.144, 0.215)  # two rows: a verify of 4 tokens each 2.67x
    costs.for_batch(2).observe(0, 0.0, 0.054, 0.057)
    assert costs.can_pay(1) and not costs.can_pay(2) and not costs.can_pay(3)


def test_cost_model_interpolates_unmeasured_sizes():
    costs = CostModel(k_max=4)
    assert costs.ratios() is None
    costs.observe(0, 0.0, 0.100)
    costs.observe(4, 0.040, 0.140)
    c, v = costs.ratios()
    assert abs(c - 0.1) < 1e-9 and v[0] == 1.0 and abs(v[4] - 1.4) < 1e-9
    assert abs(v[2] - 1.2) < 1e-9  # halfway between the measured sizes


def test_one_noisy_verify_does_not_price_the_longer_drafts():
    """Rounds of one draft measured three times and a 3-token verify once, in a slow moment (behind Ray
    on 2 cores an HTTP client or a browser shares the cores): the longer verifies follow the slope of
    all the timings, not the one outlier scaled up to K = 3."""
    costs = CostModel(k_max=3)
    costs.observe(0, 0.0, 0.100)
    for _ in range(3):
        costs.observe(1, 0.030, 0.110)
    costs.observe(2, 0.060, 0.150)  # 1.5x a plain step: an outlier
    c, v = costs.ratios()
    assert abs(v[1] - 1.1) < 1e-9 and abs(v[2] - 1.2) < 1e-9 and abs(v[3] - 1.3) < 1e-9
    assert choose_k(0.63, c, v, 3) > 0  # code's acceptance still drafts (it did not at v[3] = 1.9)


def test_costs_are_kept_per_batch_size_and_k_follows_them():
    """Verify cost grows with the batch on a CPU: K that pays alone can lose at batch 8."""
    costs, estimate = BatchCosts(k_max=3), AcceptanceEstimate(accepted=7.0, trials=10.0)  # a = 0.7
    assert costs.for_batch(5) is costs.for_batch(4) is costs.for_batch(7)
    assert costs.for_batch(8) is not costs.for_batch(4) and costs.for_batch(0) is costs.for_batch(1)
    alone, batch = costs.for_batch(1), costs.for_batch(8)
    alone.observe(0, 0.0, 0.100)
    measure(alone, 3, 0.030, 0.110)  # K+1 tokens cost little more than one: speculate
    batch.observe(0, 0.0, 0.200)
    measure(batch, 3, 0.240, 0.600)  # 8 x 4 rows: verify 3x a plain step, drafts 1.2x
    assert adaptive_k(estimate, alone, 3) >= 2
    assert adaptive_k(estimate, batch, 3) == 0
    assert adaptive_k(estimate, costs.for_batch(2), 3) == 0  # not measured at 2-3 rows: a plain step first


def test_unmeasured_engine_measures_plain_then_drafts_of_one():
    costs, estimate = CostModel(k_max=3), AcceptanceEstimate()
    assert adaptive_k(estimate, costs, 3) == 0
    costs.observe(0, 0.0, 0.1)
    assert adaptive_k(estimate, costs, 3) == 1  # the cheapest drafting round measures
    # the first drafts at a batch size can be slow (an outlier): the verdict waits for a few rounds' median
    for _ in range(MEASURED_DRAFTS - 1):
        costs.observe(1, 0.1, 0.15)
        assert adaptive_k(estimate, costs, 3) == 1
    costs.observe(1, 0.1, 0.15)
    assert adaptive_k(estimate, costs, 3) == 0  # drafts as dear as the target: plain decoding


def synthetic_llm(rate: float, k: int = 3) -> LLM:
    return LLM(model=TARGET, speculative_config={
        "model": DRAFT, "num_speculative_tokens": k, "adaptive": True,
        "rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [rate] * k})


def drafted_steps_at_zero_acceptance(steps: int, draft_cost: float, verify_cost: list[float], overhead: float,
                                     k_max: int = 3) -> list[int]:
    """The steps at which adaptive_k drafts for a request whose every draft is rejected, with the
    engine's cost model fed fixed costs (in target steps) as the scheduler feeds it measured ones. The
    request starts from the estimate the engine's first request gets (the gate's prior: 4 trials)."""
    costs, estimate, drafted = CostModel(k_max), AcceptanceEstimate().prior(), []
    for step in range(steps):
        k = adaptive_k(estimate, costs, k_max)
        costs.observe(k, draft_cost * k, verify_cost[k], draft_cost * k + verify_cost[k] + overhead)
        estimate.observe(k, 0)
        if k:
            drafted.append(step)
    return drafted


# the costs under which the policy drafts longest: free drafts, free verification of more tokens, and a
# step overhead that dwarfs the forwards (tiny random models on a busy machine come close): then any
# estimated acceptance above ~2% pays, and the estimate needs ~23 rejected steps to fall below it
FREE_DRAFTS = (1e-9, [1.0] * 4, 100.0)


def test_policy_stops_drafting_at_zero_acceptance_whatever_the_costs():
    realistic = drafted_steps_at_zero_acceptance(150, 0.3, [1.0, 1.1, 1.2, 1.3], 0.1)
    assert len(realistic) <= 2 + 150 // 16  # one measurement, then only the periodic one-token probes
    worst = drafted_steps_at_zero_acceptance(300, *FREE_DRAFTS)
    assert len([s for s in worst if s < 30]) >= 15  # free drafts: trying for a while is right
    assert len([s for s in worst if s >= 30]) <= 4  # then probes only, at doubling intervals
    assert all(b - a >= 16 for a, b in zip(worst[-4:], worst[-3:]))


def test_adaptive_reaches_zero_when_acceptance_is_zero():
    """Through the engine, with the costs it measures (timing-dependent): never more drafted steps
    than the policy takes under the costs most favourable to drafting."""
    llm = synthetic_llm(0.0)
    out = llm.generate("hello", SamplingParams(temperature=1.0, max_tokens=300, ignore_eos=True, seed=0))[0]
    stats = out.spec_decode_stats
    assert stats.num_accepted_tokens == 0
    assert stats.num_drafts <= len(drafted_steps_at_zero_acceptance(300, *FREE_DRAFTS)), stats
    assert len(stats.num_accepted_tokens_per_pos) <= 3


def test_adaptive_respects_the_maximum():
    llm = synthetic_llm(1.0, k=2)
    # make drafting look free, so the policy wants as many drafts as it may take
    llm.core.scheduler.policy.costs.for_batch(1).observe(0, 0.0, 1.0)
    measure(llm.core.scheduler.policy.costs.for_batch(1), 2, 1e-6, 1.0)
    out = llm.generate("hello", SamplingParams(temperature=1.0, max_tokens=60, ignore_eos=True, seed=0))[0]
    stats = out.spec_decode_stats
    assert len(stats.num_accepted_tokens_per_pos) == 2  # the maximum was used, never a third draft
    assert stats.num_draft_tokens > stats.num_drafts  # steps with two drafts happened


def test_acceptance_estimate_recovers_the_per_position_rate():
    """With conditional acceptance a per position, the estimate must find a, not accepted/drafted
    (which at a = 0.9, K = 5 is ~0.74 and would make the policy pick too small a K)."""
    import random

    rng = random.Random(0)
    estimate = AcceptanceEstimate(decay=1.0)
    drafted = accepted_total = 0
    for _ in range(2000):
        accepted = 0
        while accepted < 5 and rng.random() < 0.9:
            accepted += 1
        estimate.observe(5, accepted)
        drafted, accepted_total = drafted + 5, accepted_total + accepted
    assert abs(estimate.alpha - 0.9) < 0.02, estimate.alpha
    assert accepted_total / drafted < 0.8  # the naive ratio, for contrast


def test_per_step_overhead_favours_longer_drafts():
    cheap = [1.0 + 0.05 * k for k in range(6)]
    assert choose_k(0.0, 0.05, cheap, 5, step_overhead=1.0) == 0  # still nothing to gain
    without = choose_k(0.5, 0.15, cheap, 5)
    with_overhead = choose_k(0.5, 0.15, cheap, 5, step_overhead=1.0)
    assert with_overhead > without


def test_cost_model_measures_step_overhead():
    costs = CostModel(k_max=2)
    assert costs.overheads() == {"step_overhead": 0.0, "draft_overhead": 0.0}
    costs.observe(0, 0.0, 0.100, step_s=0.120)
    # one kind measured: it stands for both (20 ms over a 100 ms plain step)
    assert costs.overheads() == pytest.approx({"step_overhead": 0.2, "draft_overhead": 0.2})
    costs.observe(2, 0.020, 0.110, step_s=0.180)
    # a drafting step's own: 50 ms beyond its forwards (the draft group's call), a plain step's stays 20
    assert costs.overheads() == pytest.approx({"step_overhead": 0.2, "draft_overhead": 0.5})


def test_a_drafting_steps_own_overhead_is_what_decides():
    """Behind Ray actors a drafting step calls the draft group too and hands its proposals to the
    target. Charged to plain steps as well (one median over both kinds), that cost made drafting look
    as if it paid at 4 streams where it lost (0.86x plain over HTTP, the Qwen pair on an AVX2 EPYC)."""
    costs = CostModel(k_max=3)
    for _ in range(4):  # plain steps: 100 ms forward, 5 ms beyond it
        costs.observe(0, 0.0, 0.100, step_s=0.105)
    for _ in range(4):  # K=1: a 30 ms draft step, a 110 ms verify, 40 ms beyond them
        costs.observe(1, 0.030, 0.110, step_s=0.180)
    ratios = costs.ratios()
    alpha = 0.66  # 1.66 tokens a round at K=1: 1.66 / (0.3 + 1.1 + 0.4) = 0.92 of plain's 1 / 1.05
    assert choose_k(alpha, *ratios, 1, **costs.overheads()) == 0
    pooled = statistics.median([0.005] * 4 + [0.040] * 4) / 0.100  # the old single median
    assert choose_k(alpha, *ratios, 1, step_overhead=pooled) == 1  # what it chose: drafting
    assert costs.saving_per_token(alpha) == 0.0
    assert choose_k(0.95, *ratios, 3, **costs.overheads()) > 0  # where drafts are accepted, it pays


def test_gate_turns_drafting_off_for_new_requests_where_it_cannot_pay_and_keeps_exploring():
    costs, gate = BatchCosts(3), SpeculationGate(3)
    low = AcceptanceEstimate(accepted=0.2, trials=2.0)  # a = 0.1
    assert gate.admit(low, costs, 1)  # nothing measured: draft, and measure
    costs.for_batch(1).observe(0, 0.0, 0.100)
    measure(costs.for_batch(1), 3, 0.150, 0.110)  # a draft step costs half a target step
    admitted = [gate.admit(low, costs, 1) for _ in range(4 + 8 + 16 + 32 + 64 + 64)]
    # explorers after 3, 7, 15, 31, 63 and then every 64th skipped request
    assert [i for i, a in enumerate(admitted) if a] == [3, 11, 27, 59, 123, 187]
    assert not any(gate.admit(low, costs, 4) for _ in range(200))  # explorers run alone only
    assert gate.admit(low, costs, 1)
    high = AcceptanceEstimate(accepted=1.8, trials=2.0)  # a = 0.9: K > 0 pays
    assert gate.admit(high, costs, 1) and gate.every == SpeculationGate.MIN_EVERY
    assert all(gate.admit(high, costs, 1) for _ in range(10))


def test_gate_lets_a_long_request_with_a_short_prompt_explore_from_its_own_drafts():
    """Acceptance is the text's: where earlier requests' drafts failed, a request asking for many
    tokens still drafts (its probes and the draft's prefill of a short prompt cost ~1% of its output's
    time), starting from an optimistic estimate so that its own first drafts decide."""
    costs, gate = BatchCosts(3), SpeculationGate(3)
    costs.for_batch(1).observe(0, 0.0, 0.100)
    measure(costs.for_batch(1), 3, 0.150, 0.110)  # a draft step costs half a target step
    low = AcceptanceEstimate(accepted=0.2, trials=2.0)  # a = 0.1: no K pays
    assert gate.admit(low, costs, 1, max_tokens=40, prompt_tokens=10) is None
    explorer = gate.admit(low, costs, 1, max_tokens=1000, prompt_tokens=11)
    assert explorer is not None and explorer.alpha == 1.0
    assert adaptive_k(explorer, costs.for_batch(1), 3) == 3  # its first step drafts K_max
    assert gate.admit(low, costs, 1, max_tokens=1000, prompt_tokens=300) is None  # the draft's prefill would cost too much
    assert gate.admit(low, costs, 1, max_tokens=0, prompt_tokens=11) is None  # no max_tokens: unknown length
    assert gate.admit(low, costs, 2, max_tokens=1000, prompt_tokens=11) is None  # a probe would cost the batch
    assert gate.admit(low, costs, 1, max_tokens=40, prompt_tokens=10).alpha == low.alpha  # one in 4 skipped: the usual explorer
    hopeless = BatchCosts(3)
    hopeless.for_batch(1).observe(0, 0.0, 0.100)
    measure(hopeless.for_batch(1), 3, 0.600, 0.200)  # not even accepted drafts pay
    assert gate.admit(low, hopeless, 1, max_tokens=1000, prompt_tokens=11) is None


def test_gate_judges_by_batch_one_costs_when_measured():
    costs, gate = BatchCosts(3), SpeculationGate(3)
    costs.for_batch(1).observe(0, 0.0, 0.100)
    measure(costs.for_batch(1), 3, 0.030, 0.105)  # cheap drafts at batch 1
    costs.for_batch(8).observe(0, 0.0, 0.200)
    measure(costs.for_batch(8), 3, 0.300, 0.700)  # hopeless at batch 8
    fair = AcceptanceEstimate(accepted=1.2, trials=2.0)  # a = 0.6
    assert all(gate.admit(fair, costs, 8) for _ in range(8))  # it pays somewhere: keep drafting


def test_requests_after_a_losing_draft_run_as_plain_decoding():
    """Gemma 3 <- SmolLM2 at a synthetic acceptance of 0.1: after the first request has measured,
    requests run without drafting (no draft prefill, no probes) but for an explorer now and then:
    in one process because not even accepted drafts pay here (BatchCosts.can_pay), behind Ray actors
    (where they may) because the acceptance measured can't pay (SpeculationGate, tested above)."""
    llm = LLM(model="google/gemma-3-270m", max_model_len=256, speculative_config={
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct", "num_speculative_tokens": 3, "adaptive": True,
        "use_heterogeneous_vocab": True,
        "rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [0.1] * 3})
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    drafted = [llm.generate("The history of", params)[0].spec_decode_stats.num_drafts > 0 for _ in range(10)]
    assert drafted[0]  # the first request measures
    assert sum(drafted[1:]) <= 2, drafted


def measured_costs(model: CostModel) -> None:
    """A plain step 10 ms (+1 ms around it), a draft forward 1 ms, verifying 3 drafts 11 ms."""
    for _ in range(8):
        model.observe(0, 0.0, 0.010, 0.011)
        measure(model, 3, 0.003, 0.011, 0.015)


def test_saving_per_token_is_plain_time_less_the_best_ks_time_per_token():
    model = CostModel(3)
    assert model.saving_per_token(0.9) is None  # nothing measured
    measured_costs(model)
    # plain: 11 ms a token; K=3 at alpha 1: (3 + 11 + 1) ms for 4 tokens
    assert abs(model.saving_per_token(1.0) - (0.011 - 0.015 / 4)) < 1e-9
    assert model.saving_per_token(0.0) == 0.0  # drafting loses: K = 0


def test_an_unmeasured_batch_size_is_credited_with_a_smaller_ones_saving_at_most():
    """A long prompt arriving beside three streams joins a batch of 4 that nothing has measured yet;
    'unknown, so it may pay' let its draft prefill ~1900 tokens for an 8-token answer (TTFT 3.9 s
    against 1.6 s). A larger batch only saves less per token, so the smaller size's saving bounds it."""
    costs = BatchCosts(3)
    assert costs.saving_per_token(4, 0.9) is None  # nothing measured: it may pay (and gets measured)
    measured_costs(costs.for_batch(2))
    assert costs.saving_per_token(4, 0.9) == costs.for_batch(2).saving_per_token(0.9) > 0
    assert costs.saving_per_token(1, 0.9) is None  # a smaller batch saves more: no bound from batch 2
    assert not prefill_pays(8, 1900, costs.saving_per_token(4, 1.0), 0.0007)


def test_the_drafts_prefill_must_be_repaid_by_the_output():
    cost = PrefillCost()
    assert cost.per_token() is None
    cost.observe(0.1, 200)
    cost.observe(0.02, 0)  # a call that prefilled nothing doesn't count
    cost.observe(0.3, 400)
    assert abs(cost.per_token() - 0.4 / 600) < 1e-12  # long chunks weigh more than short ones
    assert prefill_pays(100, 300, 0.005, 0.001)  # saves up to 0.5 s, costs 0.3 s
    assert not prefill_pays(8, 300, 0.005, 0.001)  # a short answer to a long prompt: 0.04 s against 0.3
    assert not prefill_pays(10**6, 10, 0.0, 0.001)  # drafting doesn't save anything here
    assert prefill_pays(8, 300, None, 0.001) and prefill_pays(8, 300, 0.005, None) and prefill_pays(None, 300, 0.005, 0.001)


def test_a_request_whose_output_cant_repay_the_drafts_prefill_never_drafts():
    """At measured costs (above; the draft's prompt tokens 0.5 ms each) and high acceptance, a
    300-token prompt with max_tokens 8 (saves < 60 ms, its draft prefill costs 150 ms) decodes
    plainly with no draft blocks; with max_tokens 100 it prefills the draft and drafts."""
    llm = LLM(model=TARGET, speculative_config={"model": DRAFT, "num_speculative_tokens": 3, "adaptive": True},
              max_model_len=1024, max_num_batched_tokens=1024)
    sched = llm.core.scheduler
    measured_costs(sched.policy.costs.for_batch(1))
    for _ in range(20):
        sched.policy.acceptance.observe(3, 3)
    sched.policy.observe_draft_prefill(0.1, 200)
    prompt = llm.get_tokenizer().encode("one two three four five six seven eight nine ten " * 40)[:300]
    assert len(prompt) == 300
    few = llm.core.add_request("few", None, prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    llm.core.step()
    assert not few.drafts and not few.draft.blocks and few.draft.computed == 0
    while not few.finished:
        llm.core.step()
    assert few.stats.num_drafts == 0 and len(few.output_ids) == 8
    measured_costs(sched.policy.costs.for_batch(1))  # again: few's plain steps measured this machine's
    many = llm.core.add_request("many", None, prompt, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    llm.core.step()
    assert many.drafts and many.draft.computed >= len(prompt) - 1


def test_a_long_request_drafts_where_the_requests_before_it_did_not_pay():
    """Behind the gate (its engine-wide acceptance low: no K pays at the measured costs), a request for
    40 tokens decodes plainly with no draft state, while one for 300 tokens with a short prompt
    prefills the draft and drafts K_max in its first decode step."""
    llm = LLM(model=TARGET, speculative_config={"model": DRAFT, "num_speculative_tokens": 3, "adaptive": True},
              max_model_len=1024)
    sched = llm.core.scheduler
    measured_costs(sched.policy.costs.for_batch(1))
    for _ in range(40):
        sched.policy.acceptance.observe(3, 0)  # every draft of the requests before was rejected
    prompt = llm.get_tokenizer().encode("Write a very long story about a lighthouse keeper.")
    short = llm.core.add_request("short", None, prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    llm.core.step()
    assert not short.drafts and not short.draft.blocks
    while not short.finished:
        llm.core.step()
    measured_costs(sched.policy.costs.for_batch(1))  # again: short's plain steps measured this machine's
    long = llm.core.add_request("long", None, prompt, SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True))
    llm.core.step()
    assert long.drafts and long.draft.computed >= len(prompt) - 1
    while len(long.output_ids) < 2:
        llm.core.step()
    assert long.stats.num_draft_tokens >= 3


def test_a_probes_catch_up_is_not_measured_as_the_cost_of_a_draft_step():
    """A probe after plain steps first feeds the draft the tokens it missed: that call's time is a
    prefill of them, not what a draft step costs. Counted as one (as it once was), eight probes filled
    the window with catch-up times (44.6 ms against 4-5 ms per draft step on the default app) and the
    engine stopped drafting for good, though its drafts were accepted 99.7% of the time."""
    llm = LLM(model=TARGET, speculative_config={"model": DRAFT, "num_speculative_tokens": 3, "adaptive": True},
              max_model_len=1024)
    sched = llm.core.scheduler
    costs = sched.policy.costs.for_batch(1)
    measured_costs(costs)
    for _ in range(20):
        sched.policy.acceptance.observe(3, 3)  # the gate lets the request draft
    seq = llm.core.add_request("r", None, [1, 2, 3, 4, 5], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    llm.core.step()
    assert seq.drafts
    seq.acceptance = AcceptanceEstimate(accepted=0.01, trials=10.0)  # drafts stop paying: plain steps
    drafted = seq.stats.num_drafts
    while seq.stats.num_drafts == drafted:  # plain steps, then a probe of one draft
        measured_costs(costs)  # this machine's plain steps keep the costs where drafting may pay
        window = list(costs.draft_s)
        llm.core.step()
        assert len(seq.output_ids) < 100, "no probe came"
    assert seq.acceptance.probe_every > PROBE_EVERY  # that was the probe, after PROBE_EVERY plain steps
    assert list(costs.draft_s) == window  # its catch-up call is not a draft step's cost
    assert costs.verify_s[1]  # its verify is measured as usual


def test_a_row_whose_draft_is_behind_drafts_only_if_its_remaining_output_can_repay_the_catch_up():
    """The tokens a draft missed while its row decoded plainly are a prefill it must be fed before
    it drafts: a probe of a row far behind, with little output left, costs the whole batch that
    prefill and can never earn it back (95 ms against a 26 ms plain step at batch 8 on the default
    app). The same row with a long output still probes; a row that drafted last step is never held."""
    from engine.config import SpeculativeConfig
    from engine.spec_policy import SpeculationPolicy

    policy = SpeculationPolicy(SpeculativeConfig(model=DRAFT, num_speculative_tokens=3, adaptive=True),
                               overlaps_groups=True)
    batch = policy.costs.for_batch(8)
    batch.observe(0, 0.0, 0.030)
    measure(batch, 3, 0.012, 0.075)  # verifying 4 tokens a row costs 2.5 plain steps at batch 8
    saving = policy.costs.saving_per_token(8, 1.0)
    assert 0 < saving < 0.010  # perfect drafts would save < 10 ms a token
    policy.observe_draft_prefill(0.012, 10)  # the draft's prefill: 1.2 ms a token
    plain = AcceptanceEstimate(accepted=0.2, trials=2.0, steps_without_drafts=PROBE_EVERY)  # due a probe
    behind = PROBE_EVERY + 24  # the steps it missed and its prompt (it never prefilled)
    assert policy.num_drafts(plain, 8, True, remaining=4, behind=behind) == 0
    assert policy.num_drafts(plain, 8, True, remaining=behind * 0.0012 / saving + 1, behind=behind) == 1  # a probe
    assert policy.num_drafts(plain, 8, False, remaining=10**4, behind=behind) == 0  # can't pay at this batch
    drafting = AcceptanceEstimate(accepted=9.0, trials=10.0)  # a = 0.9, drafted last step
    assert policy.num_drafts(drafting, 8, True, remaining=4, behind=2) > 0


def test_a_batch_prefills_the_draft_only_where_it_would_draft_at_its_acceptance():
    """A request joining a batch of 4 prefills its draft now only where the batch would draft at the
    acceptance it starts from: that drafts that are always accepted could pay is not enough (each
    request of 4 streams then prefilled a draft that never drafted, 0.98x plain over HTTP). It
    catches up later if the batch shrinks or its acceptance rises; alone, it prefills now."""
    from engine.config import SpeculativeConfig
    from engine.spec_policy import DraftPrefill, SpeculationPolicy

    policy = SpeculationPolicy(SpeculativeConfig(model=DRAFT, num_speculative_tokens=3, adaptive=True),
                               overlaps_groups=True)
    for rows in (1, 4):
        costs = policy.costs.for_batch(rows)
        costs.observe(0, 0.0, 0.030 * rows ** 0.5, 0.031 * rows ** 0.5)
    measure(policy.costs.for_batch(1), 3, 0.010, 0.033, 0.044)
    measure(policy.costs.for_batch(4), 1, 0.020, 0.078, 0.100)  # 4 rows x 2 tokens: 1.3 plain steps
    assert policy.costs.can_pay(4)  # perfect drafts would pay ...
    assert policy.draft_prefill(256, 20, 4, 0.6) is DraftPrefill.LATER  # ... but not at 0.6
    assert policy.draft_prefill(256, 20, 4, 1.0) is DraftPrefill.NOW
    assert policy.draft_prefill(256, 20, 1, 0.6) is DraftPrefill.NOW
