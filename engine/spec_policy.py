"""When and how far to speculate: one place for the policies the scheduler consults while it plans
a step, and for the measurements it feeds them after update().

Consulted while planning: the speculation gate (`start`: does a new request draft at all?), the
draft's prefill (`draft_prefill`: now, later, never), the round (`round`: draft-ahead on? can
drafting pay at this batch size?) and each row's K (`num_drafts`: adaptive K or the configured K).
Fed after update: acceptance (`observe_acceptance`), the draft's prompt cost (`observe_draft_prefill`)
and each round's measured times (`observe_round`). The models behind them are engine/adaptive.py's
(costs, acceptance) and engine/ahead_policy.py's.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from engine.adaptive import AcceptanceEstimate, BatchCosts, PrefillCost, SpeculationGate, adaptive_k, prefill_pays
from engine.ahead_policy import AheadPolicy, AheadRound
from engine.config import SpeculativeConfig
from engine.step import VerifyOutput


class DraftPrefill(enum.Enum):
    NOW = "now"  # prefill the draft's view of the prompt with the target's
    LATER = "later"  # drafting can't pay at this batch size now: it catches up if it ever does
    NEVER = "never"  # its output can't repay the draft's prefill: the request decodes plainly


@dataclass(frozen=True)
class RoundPolicy:
    ahead: bool  # draft the next blocks while the target verifies
    pays: bool  # adaptive K: drafting can pay at this batch size (once per round, not per row)


@dataclass(frozen=True)
class MeasuredRound:
    """A round's shape and times, as update() saw them."""

    rows: int
    ks: list[int]
    result: VerifyOutput
    wall_s: float  # the whole round: planning, the call, applying it
    catches_up: bool  # a drafting row first fed the draft the tokens it missed
    ahead: bool  # it drafted the next blocks
    fresh: bool  # it made fresh drafts


class SpeculationPolicy:
    def __init__(self, spec: SpeculativeConfig | None, overlaps_groups: bool):
        self.spec = spec
        self.k = spec.num_speculative_tokens if spec else 0
        self.adaptive = spec is not None and spec.adaptive
        self.costs = BatchCosts(self.k, parallel=spec.parallel_drafting) if spec else None
        self.acceptance = AcceptanceEstimate(decay=0.98)  # engine-wide: a new request's prior
        self.prefill_cost = PrefillCost()  # what the draft's prompt tokens cost (adaptive: worth it?)
        self.gate = SpeculationGate(self.k) if self.adaptive else None
        # in one process the groups take turns: drafting ahead can't overlap anything there
        self.ahead = AheadPolicy(overlaps=overlaps_groups)

    # -- consulted while planning ----------------------------------------------------------------

    def prior(self) -> AcceptanceEstimate:
        return self.acceptance.prior()

    def start(self, acceptance: AcceptanceEstimate, running: int, max_new: int,
              prompt_tokens: int) -> AcceptanceEstimate | None:
        """A new request's starting acceptance estimate; None: it never drafts (no speculation, or the
        gate found drafting can't pay at the acceptance measured)."""
        if self.spec is None:
            return None
        if self.gate is None:
            return acceptance
        return self.gate.admit(self.acceptance, self.costs, running, max_new, prompt_tokens)

    def draft_prefill(self, max_new: int, prompt_tokens: int, batch: int, alpha: float) -> DraftPrefill:
        """Whether a request's draft prefills its prompt, in the batch it will decode in. With
        adaptive K, a request whose output can't repay the draft's prefill at the measured costs (a
        long prompt, a short answer) never drafts. In a batch of two or more it prefills now only
        where that batch would draft at this acceptance (batch_k): that drafts that are always
        accepted could pay is not enough (Qwen pair, AVX-512 EPYC, 4 streams: every request
        prefilled a draft that never drafted, 0.98x plain)."""
        if not self.adaptive:
            return DraftPrefill.NOW
        if not prefill_pays(max_new, prompt_tokens, self.costs.saving_per_token(batch, alpha),
                            self.prefill_cost.per_token()):
            return DraftPrefill.NEVER
        if not self.costs.can_pay(batch):
            return DraftPrefill.LATER
        costs = self.costs.for_batch(batch)
        if batch <= 1 or costs.measuring:  # (measuring rounds need the rows' drafts)
            return DraftPrefill.NOW
        return DraftPrefill.NOW if costs.batch_cap([alpha] * batch, [self.k] * batch) > 0 else DraftPrefill.LATER

    def round(self, rows: int, any_drafts: bool) -> RoundPolicy:
        ahead = self.spec is not None and self.spec.draft_ahead and self.ahead.use(rows)
        return RoundPolicy(ahead, self.adaptive and any_drafts and self.costs.can_pay(rows))

    def num_drafts(self, acceptance: AcceptanceEstimate, rows: int, pays: bool, remaining: int = 0,
                   behind: int = 0) -> int:
        """A row's K before its own limits: adaptive K's choice at this batch size, or the configured K.

        With adaptive K, the `behind` tokens the draft must be fed before it drafts (those it missed
        while the row decoded plainly, or its whole prompt if it never prefilled) are a prefill:
        the row drafts, or probes, only if its `remaining` output could repay them at the best
        saving drafting has at this batch size (prefill_pays, as for a prompt). A probe whose
        catch-up could never pay cost a batch of 8 a step 3.6x a plain one (95 ms against 26)."""
        if not self.adaptive:
            return self.k
        if not pays:
            return 0
        catching_up = acceptance.steps_without_drafts > 0 or behind > self.k + 1  # as RoundPlan.catches_up
        if catching_up and not prefill_pays(remaining, behind, self.costs.saving_per_token(rows, 1.0),
                                            self.prefill_cost.per_token()):
            return 0
        return adaptive_k(acceptance, self.costs.for_batch(rows), self.k)

    def batch_drafts(self, acceptances: list[AcceptanceEstimate], ks: list[int]) -> list[int]:
        """The rows' own Ks (num_drafts), capped where the batch as a whole gains more with fewer:
        adaptive K's choice for the step, not for each row alone (batch_k). Batches of one, and a
        batch size whose costs are still being measured, keep the rows' choices."""
        if not self.adaptive or len(ks) <= 1 or max(ks) == 0:
            return ks
        costs = self.costs.for_batch(len(ks))
        if costs.measuring:
            return ks
        cap = costs.batch_cap([a.alpha for a in acceptances], ks)
        return [min(k, cap) for k in ks]

    # -- fed after update --------------------------------------------------------------------------

    def observe_acceptance(self, acceptance: AcceptanceEstimate, k: int, accepted: int) -> None:
        acceptance.observe(k, accepted)
        self.acceptance.observe(k, accepted)

    def observe_draft_prefill(self, seconds: float, tokens: int) -> None:
        """A call that prefilled only the draft's prompt tokens: their cost."""
        self.prefill_cost.observe(seconds, tokens)

    def observe_round(self, r: MeasuredRound) -> None:
        """A decoding round's times (no prompt in its forward): the cost models' data."""
        result, k = r.result, max(r.ks)
        if self.costs is not None:
            if r.catches_up:  # the draft's call was mostly a prefill: only the verify counts
                self.costs.for_batch(r.rows).observe(k, 0.0, result.elapsed_s)
            else:
                self.costs.for_batch(r.rows).observe(k, result.draft_elapsed_s, result.elapsed_s, r.wall_s)
        if self.spec is not None and self.spec.draft_ahead and k > 0:
            self.ahead.observe(r.rows, AheadRound(
                ahead=r.ahead, fresh=r.fresh, drafts=k, draft_s=result.draft_elapsed_s, verify_s=result.elapsed_s,
                ahead_s=result.ahead.elapsed_s if result.ahead is not None else 0.0, wall_s=r.wall_s,
                all_accepted=all(result.num_accepted[b] == kb for b, kb in enumerate(r.ks)
                                 if kb > 0 and b not in result.errors)))
