"""Adaptive speculation: pick each request's K every step from what speculation costs and earns.

With per-draft acceptance a, K drafts yield E(K) = (1 - a^(K+1)) / (1 - a) tokens per step
(Leviathan et al.), at a cost of K draft steps plus one verify of K+1 tokens. In units of one plain
target step: cost(K) = K*c + v(K), c = draft step / target step, v(K) = verify(K+1 tokens) / verify(1).
With parallel drafting one draft forward proposes all K: cost(K) = c + v(K), c = that forward.
K = 0 is plain decoding (E = 1, cost = 1). The policy takes the K in [0, K_max] with the best
E(K)/cost(K); costs are measured by the engine as it runs, acceptance per request.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median


def expected_tokens(alpha: float, k: int) -> float:
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def choose_k(alpha: float, draft_cost: float, verify_cost: list[float], k_max: int,
             step_overhead: float = 0.0, parallel: bool = False, draft_overhead: float | None = None) -> int:
    """Best K in [0, k_max]; draft_cost = c, verify_cost[k] = v(k) (v(0) = 1), step_overhead = what
    a plain step costs beyond its forward (sampling, bookkeeping, transfers), draft_overhead = what a
    drafting step costs beyond its forwards (also the draft group's call and its proposals' way to
    the target; unset: step_overhead), all in target steps; parallel: c is the one draft forward that
    proposes all K."""
    extra = step_overhead if draft_overhead is None else draft_overhead
    best_k, best_rate = 0, 1.0 / (1.0 + step_overhead)
    for k in range(1, k_max + 1):
        drafting = draft_cost if parallel else k * draft_cost
        rate = expected_tokens(alpha, k) / (drafting + verify_cost[k] + extra)
        if rate > best_rate * 1.02:  # a 2% margin keeps noise from flipping to speculation
            best_k, best_rate = k, rate
    return best_k


# What a batch's drafting step must gain over a plain step. Where a batch of two or more gains at all
# on a CPU it gains a few percent, while each row's acceptance is estimated from its last ~10 rounds:
# over a 2% margin the rows drafted whenever their estimates ran high by chance, and lost more than
# they won (two streams of the Qwen pair on an AVX2 EPYC over HTTP: 0.91x plain).
BATCH_MARGIN = 1.10


def batch_k(alphas: list[float], ks: list[int], draft_cost: float, verify_cost: list[float],
            step_overhead: float = 0.0, parallel: bool = False, draft_overhead: float | None = None) -> int:
    """The cap on a batch's Ks (its rows' own choices, `ks`) with the most tokens per unit of the step's
    cost, 0: a plain step. A row picks its K as if the step were its alone, but a drafting step costs
    every row of the batch its drafts and its verify: a row whose acceptance pays for K = 1 at batch 2
    made its plain neighbour wait for it (Qwen pair, AVX2 EPYC, two streams: 103 ms a step against 55
    plain, 0.84x plain's tokens/s). Row b yields E(alphas[b], min(cap, ks[b])) tokens; costs in plain
    target steps as in choose_k; drafting must beat plain by BATCH_MARGIN."""
    extra = step_overhead if draft_overhead is None else draft_overhead
    plain = len(alphas) / (1.0 + step_overhead)
    best_k, best_rate = 0, plain * BATCH_MARGIN
    for cap in range(1, max(ks, default=0) + 1):
        tokens = sum(expected_tokens(a, min(cap, k)) for a, k in zip(alphas, ks))
        drafting = draft_cost if parallel else cap * draft_cost
        rate = tokens / (drafting + verify_cost[cap] + extra)
        if rate > best_rate:
            best_k, best_rate = cap, rate
    return best_k


# Drafting rounds a batch size's costs rest on before its verdict: the first draft at a new batch size
# can be an outlier (Qwen pair, AVX2 EPYC: 45 ms a draft step at batch 2, 19 ms after), and a verdict
# that drafting can't pay is never measured again. They draft one token a row, the cheapest drafting
# round (a K = 3 round at batch 8 cost 5.3 plain steps there, K = 1 about 2.3); verifies of more
# tokens are priced on the line through its timings until rounds of that K measure them (ratios).
MEASURED_DRAFTS = 3


@dataclass
class CostModel:
    """Running estimates of step costs, in seconds, from the engine's own timings: the median of
    the last few measurements per size, so a slow first call (allocation, caches) doesn't linger."""

    k_max: int
    window: int = 8
    parallel: bool = False  # parallel drafting: a step's drafts cost one forward, whatever K
    draft_s: deque = field(default_factory=deque)  # one draft forward (batched)
    verify_s: list[deque] = field(default_factory=list)  # index k: a verify of k+1 tokens per row
    # a step's wall time beyond its forwards, plain steps and drafting steps apart: a drafting step
    # also calls the draft group and hands its proposals to the target (behind Ray actors on a CPU,
    # milliseconds a step that one median over both kinds charged to plain decoding too)
    plain_overhead_s: deque = field(default_factory=deque)
    draft_overhead_s: deque = field(default_factory=deque)

    def __post_init__(self):
        self.draft_s = deque(maxlen=self.window)
        self.verify_s = [deque(maxlen=self.window) for _ in range(self.k_max + 1)]
        self.plain_overhead_s = deque(maxlen=self.window)
        self.draft_overhead_s = deque(maxlen=self.window)

    def observe(self, num_drafts: int, propose_s: float, verify_s: float, step_s: float | None = None) -> None:
        if num_drafts > 0 and propose_s > 0:
            self.draft_s.append(propose_s if self.parallel else propose_s / num_drafts)
        self.verify_s[num_drafts].append(verify_s)
        if step_s is not None:
            (self.draft_overhead_s if num_drafts > 0 else self.plain_overhead_s).append(
                max(0.0, step_s - propose_s - verify_s))

    @property
    def measuring(self) -> bool:
        """Still measuring: a plain step, then MEASURED_DRAFTS drafting rounds (their median decides)."""
        return not self.verify_s[0] or len(self.draft_s) < MEASURED_DRAFTS

    def overheads(self) -> dict[str, float]:
        """The per-step cost outside the forwards, of a plain step and of a drafting step, in plain
        target steps (0 until measured; where one kind is measured it stands for both): choose_k's
        step_overhead and draft_overhead. Each is paid once per step whatever K is, so ignoring it
        undervalues longer drafts."""
        plain = median(self.plain_overhead_s) if self.plain_overhead_s else None
        drafting = median(self.draft_overhead_s) if self.draft_overhead_s else None
        if not self.verify_s[0] or (plain is None and drafting is None):
            return {"step_overhead": 0.0, "draft_overhead": 0.0}
        base = median(self.verify_s[0])
        plain = drafting if plain is None else plain
        drafting = plain if drafting is None else drafting
        return {"step_overhead": plain / base, "draft_overhead": drafting / base}

    def batch_cap(self, alphas: list[float], ks: list[int]) -> int:
        """batch_k at these measured costs (measured: not `measuring`)."""
        return batch_k(alphas, ks, *self.ratios(), parallel=self.parallel, **self.overheads())

    def saving_per_token(self, alpha: float) -> float | None:
        """Seconds a decoded token saves, at acceptance alpha and the best K, against plain decoding
        (0 where drafting loses); None until measured."""
        ratios = self.ratios()
        if ratios is None:
            return None
        c, v = ratios
        base, overheads = median(self.verify_s[0]), self.overheads()
        k = choose_k(alpha, c, v, self.k_max, parallel=self.parallel, **overheads)
        if k == 0:
            return 0.0
        drafting = c if self.parallel else k * c
        return max(0.0, base * ((1.0 + overheads["step_overhead"])
                                - (drafting + v[k] + overheads["draft_overhead"]) / expected_tokens(alpha, k)))

    def ratios(self) -> tuple[float, list[float]] | None:
        """(c, [v(0)..v(k_max)]) once a plain step and a draft step have been measured. A verify size
        with MEASURED_DRAFTS or more timings is their median; the others lie on the line 1 + s * k, s
        the median of every verify timing's own slope. (Extrapolating from the two largest measured
        sizes tripled one noisy timing of a 2-token verify into K = 3's: behind Ray actors on 2 cores,
        with HTTP clients beside them, the default app then closed its gate to code at 0.63 acceptance.)"""
        if not self.verify_s[0] or not self.draft_s:
            return None
        base = median(self.verify_s[0])
        slopes = [(t / base - 1.0) / k for k in range(1, self.k_max + 1) for t in self.verify_s[k]]
        slope = max(0.0, median(slopes)) if slopes else 0.1
        v = [median(s) / base if k == 0 or len(s) >= MEASURED_DRAFTS else 1.0 + slope * k
             for k, s in enumerate(self.verify_s)]
        # verifying more tokens never costs less than fewer (timing noise can say otherwise)
        for k in range(len(v)):
            v[k] = max(v[k], v[k - 1] if k else 1.0, 1.0)
        return median(self.draft_s) / base, v


class BatchCosts:
    """A CostModel per batch size (powers of two: 1, 2-3, 4-7, ...): on CPU a verify of B rows x K+1
    tokens costs far more, against a plain step of B rows, than at B = 1 (the weights are read
    once, the arithmetic grows with the rows), so the K that pays at batch 1 can lose at batch 8.
    A batch size not yet seen measures its own costs first: a plain step, then MEASURED_DRAFTS drafting
    rounds of one token a row."""

    def __init__(self, k_max: int, parallel: bool = False):
        self.k_max, self.parallel = k_max, parallel
        self.by_bucket: dict[int, CostModel] = {}

    @staticmethod
    def bucket(rows: int) -> int:
        return 1 << (max(1, rows).bit_length() - 1)

    def for_batch(self, rows: int) -> CostModel:
        bucket = self.bucket(rows)
        if bucket not in self.by_bucket:
            self.by_bucket[bucket] = CostModel(self.k_max, parallel=self.parallel)
        return self.by_bucket[bucket]

    def saving_per_token(self, rows: int, alpha: float) -> float | None:
        """CostModel.saving_per_token at this batch size; where it isn't measured yet, at the largest
        smaller one that is (at most what this size saves: a larger batch only makes verifying
        dearer); None where none is."""
        bucket = self.bucket(rows)
        measured = [b for b, m in self.by_bucket.items() if b <= bucket and m.ratios() is not None]
        return self.by_bucket[max(measured)].saving_per_token(alpha) if measured else None

    def can_pay(self, rows: int) -> bool:
        """False when drafting can't pay at this batch size even if every draft were accepted, as
        measured here or at a smaller batch (a larger one only makes verifying dearer against a
        plain step): then the engine neither drafts nor prefills the draft, nor spends a step of
        every draft to measure this size."""
        bucket = self.bucket(rows)
        return all(drafting_can_pay(m, self.k_max, b) for b, m in self.by_bucket.items() if b <= bucket)


class PrefillCost:
    """Seconds per token of the draft's prompt prefill, from its recent prefill calls (the call's
    wall time: a chunk pays its call's overhead too)."""

    def __init__(self, window: int = 16):
        self.calls: deque = deque(maxlen=window)  # (seconds, tokens)

    def observe(self, seconds: float, tokens: int) -> None:
        if tokens > 0:
            self.calls.append((seconds, tokens))

    def per_token(self) -> float | None:
        tokens = sum(n for _, n in self.calls)
        return sum(s for s, _ in self.calls) / tokens if tokens else None


def prefill_pays(max_tokens: int | None, prompt_tokens: int, saving_per_token: float | None,
                 prefill_per_token: float | None) -> bool:
    """Whether prefilling the draft on a prompt can pay for itself: the most the request's output can
    save (max_tokens at the measured saving per token) against the prefill's cost. Unknown costs or
    no output bound: it may."""
    if max_tokens is None or saving_per_token is None or prefill_per_token is None:
        return True
    return max_tokens * saving_per_token >= prompt_tokens * prefill_per_token


# After this many plain steps a request drafts one token again, so a wrong estimate can recover;
# each probe that changes nothing doubles the wait, up to MAX_PROBE_EVERY.
PROBE_EVERY = 16
MAX_PROBE_EVERY = 256


@dataclass
class AcceptanceEstimate:
    """Per request: the probability a draft token is accepted given the ones before it were (the a
    of E(K)), a decayed Beta(1, 1) posterior mean.

    Each accepted draft is a success and the first rejected one a failure; drafts after a
    rejection were never tested. (Accepted / drafted would understate a: at a = 0.9 and K = 5 it
    is 0.74, and the policy would pick too small a K.)
    """

    decay: float = 0.9
    accepted: float = 1.0
    trials: float = 2.0
    steps_without_drafts: int = 0
    probe_every: int = PROBE_EVERY

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts == 0:
            self.steps_without_drafts += 1
            return
        self.steps_without_drafts = 0
        rejected = 1 if num_accepted < num_drafts else 0
        self.accepted = self.decay * self.accepted + num_accepted
        self.trials = self.decay * self.trials + num_accepted + rejected

    @property
    def alpha(self) -> float:
        return self.accepted / self.trials

    def prior(self, weight: float = 4.0) -> "AcceptanceEstimate":
        """A new request's starting estimate: this one's acceptance, worth `weight` trials."""
        return AcceptanceEstimate(accepted=weight * self.alpha, trials=weight)


def drafting_can_pay(costs: CostModel, k_max: int, rows: int = 1) -> bool:
    """False once measured that not even drafts that are always accepted would pay at this batch
    size (a large batch on a CPU): then acceptance can't change the verdict, only the costs can.
    A batch of `rows` > 1 drafts only past BATCH_MARGIN (batch_k), so the verdict takes that margin."""
    if costs.measuring:
        return True
    if rows > 1:
        return costs.batch_cap([1.0] * rows, [k_max] * rows) > 0
    return choose_k(1.0, *costs.ratios(), k_max, parallel=costs.parallel, **costs.overheads()) > 0


class SpeculationGate:
    """Which new requests get a draft at all (adaptive K). Where the engine's measured acceptance over
    recent requests, plus MARGIN for a request unlike them, would make no K pay at the costs measured
    at batch 1 (the batch where drafting pays most on a CPU), a request runs as in plain decoding: no
    draft prefill, no drafts, no probes. Per-request probing alone cost 3-6% of plain throughput with
    a draft that never pays (the default app on a CPU). Some requests still draft (adaptively) so that
    the verdict can change, if they run alone (a probe in a larger batch costs the whole batch a
    step): one in `every` (`every` doubles while the verdict holds, MIN_EVERY ... MAX_EVERY), and every
    request that asks for EXPLORE_TOKENS or more with a prompt of at most a quarter of that: its speed
    rests on its own text's acceptance (a story the draft knows: 0.99 where the requests before had
    little), and its few probes and the draft's prefill of its prompt (a token of it ~1/20 of a
    decode step on a CPU) cost ~1% of its output's time. Those start from an optimistic estimate, so
    that their own first drafts, not other requests' acceptance, decide (the one-in-`every` explorers
    start from the engine's: optimistic, they taught it the stall case's stories pay, and the streams'
    drafts then rode in each chunk step of a long prompt, +25% on its TTFT). A verdict that drafting
    may pay lets every request draft again."""

    MARGIN = 0.1
    MIN_EVERY, MAX_EVERY = 4, 64
    EXPLORE_TOKENS = 256

    def __init__(self, k_max: int):
        self.k_max = k_max
        self.every, self.skipped = self.MIN_EVERY, 0

    def admit(self, acceptance: AcceptanceEstimate, costs: BatchCosts, batch: int,
              max_tokens: int = 0, prompt_tokens: int = 0) -> AcceptanceEstimate | None:
        """The acceptance estimate a request admitted now (joining a batch of `batch` rows; asking for
        `max_tokens`, 0 if it didn't say) starts drafting from; None: it decodes plainly."""
        measured = costs.by_bucket.get(1)
        model = measured if measured is not None and measured.ratios() is not None else costs.for_batch(batch)
        ratios = model.ratios()
        if model.measuring:  # not measured yet: draft, and measure
            return acceptance.prior()
        overheads = model.overheads()
        alpha = min(1.0, acceptance.alpha + self.MARGIN)
        if choose_k(alpha, *ratios, self.k_max, parallel=model.parallel, **overheads) > 0:
            self.every, self.skipped = self.MIN_EVERY, 0
            return acceptance.prior()
        if batch <= 1 and max_tokens >= max(self.EXPLORE_TOKENS, 4 * prompt_tokens) and \
                choose_k(1.0, *ratios, self.k_max, parallel=model.parallel, **overheads) > 0:
            return AcceptanceEstimate(accepted=1.0, trials=1.0)  # one draft, accepted
        self.skipped += 1
        if self.skipped < self.every or batch > 1:
            return None
        self.every, self.skipped = min(self.MAX_EVERY, 2 * self.every), 0
        return acceptance.prior()


def adaptive_k(estimate: AcceptanceEstimate, costs: CostModel, k_max: int) -> int:
    if costs.measuring:  # measure a plain step first, then drafts of one token
        return 0 if not costs.verify_s[0] else min(1, k_max)
    c, v = costs.ratios()
    if estimate.steps_without_drafts >= estimate.probe_every:
        if not drafting_can_pay(costs, k_max):  # a probe could teach nothing
            return 0
        estimate.probe_every = min(MAX_PROBE_EVERY, 2 * estimate.probe_every)
        return 1
    k = choose_k(estimate.alpha, c, v, k_max, parallel=costs.parallel, **costs.overheads())
    if k > 0:
        estimate.probe_every = PROBE_EVERY
    return k
