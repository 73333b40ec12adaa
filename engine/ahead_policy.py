"""When to draft ahead: draft-ahead on or off, per batch size, predicted by the cost model and kept
only while measured faster.

Rounds, from the sequential rounds' own timings (D: drafting K, V: the verify, O: the rest of the
round) and the draft-ahead call's A (drafting K + 1 beside the verify):
    sequential                    D + V + O
    draft-ahead, block used       max(V, A) + O      (probability p: every draft accepted, and the
    draft-ahead, block discarded  D + max(V, A) + O   block's first proposal is the bonus token)
A round's expected tokens are the same in both modes (acceptance doesn't depend on who drafted when),
so the faster mode is the one with the shorter expected round.

Sequential rounds predict draft-ahead as if the groups overlapped perfectly (A estimated as K + 1
draft steps until measured): where even that can't pay by ENTER (A >= D + V, low acceptance) draft-ahead
is never tried, since trying costs rounds. Where it might, it runs and is judged on its measured
rounds instead: medians of used-block and discarded-block rounds, weighted by the measured share of
used blocks (the two kinds differ by D, so a mean over a few rounds is mostly the luck of the draw).
While it wins it stays, ever longer, with a short sequential phase between stays to keep the
comparison current; when it loses (groups sharing cores slow each other) it is tried again ever more
rarely.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from statistics import median

from engine.adaptive import BatchCosts


@dataclass(frozen=True)
class AheadRound:
    """What the scheduler saw of one round (seconds)."""

    ahead: bool  # the draft group drafted the next blocks beside the verify
    fresh: bool  # a fresh draft ran before the verify (every sequential round; a discarded block)
    drafts: int  # the longest row's drafts
    draft_s: float
    verify_s: float
    ahead_s: float
    wall_s: float
    all_accepted: bool  # every drafting row accepted all its drafts


class RoundTimes:
    """The last `window` rounds' timings of one batch size, by kind."""

    def __init__(self, window: int):
        def q():
            return deque(maxlen=window)
        self.seq_wall, self.draft_step, self.seq_verify = q(), q(), q()
        self.drafts = q()
        # shares, over more rounds: at a = 0.7, K = 3 a share of 16 rounds ran from 0.08 to 0.48
        self.all_accepted = deque(maxlen=4 * window)
        self.hits = deque(maxlen=4 * window)  # draft-ahead rounds after one: did it verify blocks only?
        self.hit_wall, self.miss_wall, self.miss_draft, self.ahead_s = q(), q(), q(), q()

    def add(self, r: AheadRound, after_ahead: bool) -> None:
        if r.drafts > 0:
            self.drafts.append(r.drafts)
            self.all_accepted.append(r.all_accepted)
        if not r.ahead:
            if r.fresh:
                self.seq_wall.append(r.wall_s)
                self.draft_step.append(r.draft_s / r.drafts)
                self.seq_verify.append(r.verify_s)
            return
        self.ahead_s.append(r.ahead_s)
        (self.miss_wall if r.fresh else self.hit_wall).append(r.wall_s)
        if r.fresh:
            self.miss_draft.append(r.draft_s)
        if after_ahead:
            self.hits.append(not r.fresh)

    def sequential(self) -> float | None:
        """The median sequential round, once there are enough rounds to say how often blocks
        would be used (a share of 3 rounds is mostly luck)."""
        enough = len(self.seq_wall) >= 3 and len(self.all_accepted) >= self.seq_wall.maxlen
        return median(self.seq_wall) if enough else None

    def hit_rate(self, k: float, prior_weight: float = 16.0) -> float:
        """The chance a round verifies blocks only: measured, shrunk towards what acceptance predicts.
        With P the share of rounds whose K drafts were all accepted, a block's first proposal is taken
        at the per-draft rate P^(1/K) (exact for synthetic acceptance; every row's, in a batch)."""
        share = sum(self.all_accepted) / len(self.all_accepted)
        prior = share ** ((k + 1) / k)
        return (sum(self.hits) + prior_weight * prior) / (len(self.hits) + prior_weight)

    def ahead_round(self, measured: bool) -> float | None:
        """Expected draft-ahead round time; measured=False: from the sequential rounds, as if the
        groups overlapped perfectly (A measured if it ever was, else K + 1 draft steps)."""
        if not self.seq_wall:
            return None
        k = median(self.drafts)
        d, v, wall = median(self.draft_step) * k, median(self.seq_verify), median(self.seq_wall)
        a = median(self.ahead_s) if self.ahead_s else d * (k + 1) / k
        p = self.hit_rate(k)
        if not measured:
            other = max(0.0, wall - d - v)
            return p * (max(v, a) + other) + (1 - p) * (d + max(v, a) + other)
        if not self.miss_wall:
            return None
        miss = median(self.miss_wall)
        hit = median(self.hit_wall) if self.hit_wall else miss - median(self.miss_draft)
        return p * hit + (1 - p) * miss


class BucketState:
    def __init__(self, policy: "AheadPolicy"):
        self.times = RoundTimes(policy.window)
        self.phase, self.left = "sequential", policy.probe_steps  # or "try", "stay" (draft-ahead)
        self.stays = policy.stay_steps  # the next winning stay's length
        self.wait = 0  # sequential rounds before draft-ahead may be tried again after it lost
        self.last_ahead = False

    @property
    def mode(self) -> bool:
        return self.phase != "sequential"


class AheadPolicy:
    """Draft-ahead on or off for each round, per batch size (1, 2-3, 4-7, ...: a batch's rounds cost
    more, and its blocks are used only when every row's is). `fixed` pins the mode (tests,
    benchmarks); `overlaps=False` (both groups in one process, one after the other) pins it off."""

    ENTER = 1.05  # predicted speedup (perfect overlap) for draft-ahead to be tried
    STAY = 1.02  # measured speedup for it to stay; below 1.0 a stay ends early

    def __init__(self, probe_steps: int = 6, stay_steps: int = 24, max_stay_steps: int = 768,
                 window: int = 16, fixed: bool | None = None, overlaps: bool = True):
        self.probe_steps, self.stay_steps, self.max_stay = probe_steps, stay_steps, max_stay_steps
        self.window = window
        self.fixed = fixed if overlaps else False
        self.by_bucket: dict[int, BucketState] = {}
        self.rounds = {True: 0, False: 0}

    def _state(self, rows: int) -> BucketState:
        return self.by_bucket.setdefault(BatchCosts.bucket(rows), BucketState(self))

    def use(self, rows: int = 1) -> bool:
        return self.fixed if self.fixed is not None else self._state(rows).mode

    def speedup(self, rows: int, measured: bool) -> float | None:
        """Sequential round time / draft-ahead's: measured, or predicted from sequential rounds."""
        st = self._state(rows)
        seq = st.times.sequential()
        if seq is None:
            return None
        ahead = st.times.ahead_round(measured)
        return seq / ahead if ahead else None

    def observe(self, rows: int, r: AheadRound) -> None:
        self.rounds[r.ahead] += 1
        st = self._state(rows)
        st.times.add(r, st.last_ahead)
        st.last_ahead = r.ahead
        if self.fixed is not None or r.ahead != st.mode:
            return
        st.left -= 1
        if not st.mode:
            st.wait -= 1
        if st.phase == "stay" and st.left > 0 and st.left % self.probe_steps == 0:
            measured = self.speedup(rows, measured=True)
            if measured is not None and measured < 1.0:  # lost during the stay: end it as a loss
                st.phase, st.left, st.wait = "sequential", self.probe_steps, st.stays
            return
        if st.left > 0:
            return
        measured = self.speedup(rows, measured=True)
        wins = measured is not None and measured >= self.STAY
        if st.phase == "stay":  # a short sequential phase keeps the comparison current
            st.phase, st.left = "sequential", self.probe_steps
        elif wins:  # measured (now, or before and the sequential rounds still say so)
            st.phase, st.left = "stay", st.stays
            st.stays = min(self.max_stay, 2 * st.stays)
        elif st.phase == "try":  # lost: try again ever more rarely
            st.phase, st.left = "sequential", self.probe_steps
            st.wait, st.stays = st.stays, min(self.max_stay, 2 * st.stays)
        elif st.wait <= 0 and (self.speedup(rows, measured=False) or 0.0) >= self.ENTER:
            st.phase, st.left = "try", self.probe_steps + 1  # its first round has no block yet
        else:
            st.left = self.probe_steps
