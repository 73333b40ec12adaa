"""One engine step as data: the plan Scheduler.schedule() makes, and what running it gave back.

EngineCore.step is where they meet: `plan = scheduler.schedule()`, `output = executor.execute(plan)`,
`scheduler.update(plan, output)` (vLLM v1's SchedulerOutput / ModelRunnerOutput). A plan runs in
this order: removals, starts, prefill calls, then the round. Every position in it is fixed when it
is made, so a plan that raised can be cut per sequence (`parts()`) and each part run again alone:
it writes the same keys and values at the same positions.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

from engine.step import AheadBatch, DraftBatch, Prefill, RequestGrammar, TokenLogprob, VerifyBatch, VerifyOutput

if TYPE_CHECKING:
    from engine.scheduler import Sequence


@dataclass(frozen=True)
class RequestStart:
    """A new request's state on the workers (its random streams, its grammar)."""

    seq_id: int
    request_id: str
    seed: int
    draft: bool  # on the draft group too (False: the request never drafts)
    grammar: RequestGrammar | None = None


@dataclass
class PrefillCall:
    """Prompt chunks written in one call per group. A scored chunk (prompt logprobs: its logits span
    the vocabulary) is a call of its own."""

    target: list[Prefill]
    draft: list[Prefill]
    scored: tuple[int, int] | None = None  # (the token after the chunk, top n)


@dataclass
class RoundPlan:
    """One propose / verify round of the decoding rows (and the prompt chunks riding in its forward)."""

    verify: VerifyBatch
    ks: list[int]  # [B] drafts each row verifies (0: plain decoding)
    draft: DraftBatch | None = None  # fresh drafts, for the rows that don't verify a draft-ahead block
    ahead: AheadBatch | None = None  # the next blocks, drafted while the target verifies
    # a drafting row first feeds the draft the tokens it missed: that call's time is not a draft step's
    catches_up: bool = False
    plan_s: float = 0.0  # the time making it took (a round's cost counts the engine's own work too)

    def only(self, seq_id: int) -> "RoundPlan | None":
        """The round of one row, drafting afresh or not at all (None: the sequence has no row here)."""
        if seq_id not in self.verify.seq_ids:
            return None
        b = self.verify.seq_ids.index(seq_id)
        from_ahead = bool(self.verify.ahead_counts) and self.verify.ahead_counts[b] > 0
        verify = _rows(self.verify, [b], prefill=[], ahead_counts=[])
        draft = None
        if self.draft is not None and seq_id in self.draft.seq_ids and not from_ahead:
            draft = _rows(self.draft, [self.draft.seq_ids.index(seq_id)])
        k = self.ks[b] if draft is not None else 0
        return RoundPlan(verify, [k], draft, None, self.catches_up, self.plan_s)


@dataclass
class StepPlan:
    remove: list[str] = field(default_factory=list)  # finished requests whose state the workers drop
    start: list[RequestStart] = field(default_factory=list)
    prefills: list[PrefillCall] = field(default_factory=list)
    round: RoundPlan | None = None
    # the sequences it touches, by seq_id: what update() applies the output to (the executor reads none)
    requests: dict[int, "Sequence"] = field(default_factory=dict)
    isolated: bool = False  # a part of a plan that raised, run alone

    def empty(self) -> bool:
        return not (self.remove or self.start or self.prefills or self.round)

    def prompt_chunks(self) -> int:
        """Prompt chunks it writes: before the round, and riding in its forward."""
        riding = len(self.round.verify.prefill) if self.round else 0
        return sum(len(p.target) + len(p.draft) for p in self.prefills) + riding

    def parts(self) -> list["StepPlan"]:
        """This plan cut per sequence, the removals a part of their own: each part runs alone, so that
        what raises fails only its own sequence. A part's round has no draft-ahead (the block a
        row would verify went with the call that raised: it verifies no drafts)."""
        parts = [StepPlan(remove=self.remove, isolated=True)] if self.remove else []
        for seq_id, seq in self.requests.items():
            part = StepPlan(start=[s for s in self.start if s.seq_id == seq_id], requests={seq_id: seq}, isolated=True)
            for call in self.prefills:
                target = [c for c in call.target if c.seq_id == seq_id]
                draft = [c for c in call.draft if c.seq_id == seq_id]
                if target or draft:
                    part.prefills.append(PrefillCall(target, draft, call.scored))
            if self.round is not None:
                riding = [c for c in self.round.verify.prefill if c.seq_id == seq_id]
                if riding:
                    part.prefills.append(PrefillCall(riding, []))
                part.round = self.round.only(seq_id)
            if not part.empty():
                parts.append(part)
        return parts


def _rows(batch, keep: list[int], **changes):
    """A batch dataclass with only rows `keep` of each per-row list field (the others as they are)."""
    n = len(batch.seq_ids)
    cut = {f.name: [getattr(batch, f.name)[i] for i in keep] for f in fields(batch)
           if f.name not in changes and isinstance(getattr(batch, f.name), list) and len(getattr(batch, f.name)) == n}
    return replace(batch, **cut, **changes)


@dataclass
class StepOutput:
    """What running a plan gave back."""

    round: VerifyOutput | None = None
    prompt_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)  # seq_id -> a scored chunk's
    draft_prefill: list[tuple[float, int]] = field(default_factory=list)  # (seconds, tokens): calls of draft chunks only
    round_s: float = 0.0  # the round's call, wall-clock
    execute_s: float = 0.0  # the whole plan, wall-clock (0: not measured)
    failed: dict[int, str] = field(default_factory=dict)  # seq_id -> what raised in its part (it fails)
