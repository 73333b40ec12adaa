"""Spec-decode counters, with vLLM's names and meaning."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verification steps that had at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.num_accepted_tokens_per_pos) < num_draft_tokens:
            self.num_accepted_tokens_per_pos += [0] * (num_draft_tokens - len(self.num_accepted_tokens_per_pos))
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    def merge(self, other: "SpecDecodeStats") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        n = max(len(self.num_accepted_tokens_per_pos), len(other.num_accepted_tokens_per_pos))
        a = self.num_accepted_tokens_per_pos + [0] * (n - len(self.num_accepted_tokens_per_pos))
        b = other.num_accepted_tokens_per_pos + [0] * (n - len(other.num_accepted_tokens_per_pos))
        self.num_accepted_tokens_per_pos = [x + y for x, y in zip(a, b)]

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification step: 1 + accepted / drafts (1.0 before any draft)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def per_position_rates(self) -> list[float]:
        return [a / self.num_drafts for a in self.num_accepted_tokens_per_pos] if self.num_drafts else []


# Step-time buckets (seconds): CPU steps of small models take 10-500 ms.
STEP_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# vLLM's buckets for time to first token and inter-token latency
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = STEP_TIME_BUCKETS
    counts: list[int] = field(default_factory=list)  # one per bucket, then +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self):
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        i = next((j for j, b in enumerate(self.buckets) if value <= b), len(self.buckets))
        self.counts[i] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, n in zip([*map(str, self.buckets), "+Inf"], self.counts):
            running += n
            out.append((bound, running))
        return out


@dataclass
class EngineCounters:
    """Request/token counters and step timings of one engine (spec-decode counters: SpecDecodeStats)."""

    num_requests_finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    step_time: Histogram = field(default_factory=Histogram)
    # per request, from its arrival to its first streamed token; and between the deltas it streams
    # (a verify step's accepted tokens arrive together: one gap per delta, as a client sees them)
    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    inter_token_latency: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))

    def finished(self, reason: str) -> None:
        self.num_requests_finished[reason] = self.num_requests_finished.get(reason, 0) + 1


@dataclass(frozen=True)
class CacheStats:
    """One model's KV cache, as metrics show it."""

    usage: float  # share of blocks in use (0-1)
    queries: int  # prompt tokens looked up in the prefix cache
    hits: int  # ... and found there
    preemptions: int


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of one engine's counters (EngineCore.stats()): what metrics and logs read."""

    spec_decode: SpecDecodeStats
    counters: EngineCounters
    num_running: int
    num_waiting: int  # admitted to the engine's queue, not yet running (new or preempted)
    caches: dict[str, CacheStats]  # "target", and "draft" with speculation
    rebuild_failed: bool  # the model groups failed and could not be rebuilt


class SpecDecodeLogger:
    """A periodic log line like vLLM's: acceptance over the last interval."""

    def __init__(self, interval_s: float = 10.0):
        self.interval_s = interval_s
        self.last_time = None
        self.last = SpecDecodeStats()

    def due(self, now: float) -> bool:
        return self.last_time is None or now - self.last_time >= self.interval_s

    def maybe_log(self, stats: SpecDecodeStats, now: float, log) -> str | None:
        if self.last_time is None:
            self.last_time = now
            return None
        if now - self.last_time < self.interval_s or stats.num_drafts == self.last.num_drafts:
            return None
        delta = SpecDecodeStats(
            stats.num_drafts - self.last.num_drafts,
            stats.num_draft_tokens - self.last.num_draft_tokens,
            stats.num_accepted_tokens - self.last.num_accepted_tokens,
            [a - b for a, b in zip(stats.num_accepted_tokens_per_pos,
                                   self.last.num_accepted_tokens_per_pos + [0] * len(stats.num_accepted_tokens_per_pos))],
        )
        line = (f"SpecDecoding metrics: Mean acceptance length: {delta.mean_acceptance_length:.2f}, "
                f"Accepted: {delta.num_accepted_tokens} tokens, Drafted: {delta.num_draft_tokens} tokens, "
                f"Per-position acceptance rate: {', '.join(f'{r:.3f}' for r in delta.per_position_rates())}, "
                f"Avg Draft acceptance rate: {100 * delta.acceptance_rate:.1f}%")
        log.info(line)
        self.last_time = now
        self.last = SpecDecodeStats(stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
                                    list(stats.num_accepted_tokens_per_pos))
        return line


class CacheLogger:
    """A periodic log line of each model's KV cache: usage and the prefix cache's hit rate over the
    last interval (vLLM's "GPU KV cache usage ... Prefix cache hit rate"), and preemptions."""

    def __init__(self, interval_s: float = 10.0):
        self.interval_s = interval_s
        self.last_time: float | None = None
        self.last: dict[str, tuple[int, int, int]] = {}

    def due(self, now: float) -> bool:
        return self.last_time is None or now - self.last_time >= self.interval_s

    def maybe_log(self, caches: dict[str, CacheStats], now: float, log) -> str | None:
        if not self.due(now):
            return None
        current = {name: (c.queries, c.hits, c.preemptions) for name, c in caches.items()}
        first = self.last_time is None
        self.last_time = now
        if first or current == self.last:
            self.last = current
            return None
        parts = []
        for name, (queries, hits, preemptions) in current.items():
            q0, h0, p0 = self.last.get(name, (0, 0, 0))
            rate = 100 * (hits - h0) / (queries - q0) if queries > q0 else 0.0
            parts.append(f"{name} KV cache usage: {100 * caches[name].usage:.1f}%, prefix cache hit rate: "
                         f"{rate:.1f}%")
        preempted = current["target"][2] - self.last.get("target", (0, 0, 0))[2]
        line = "; ".join(parts) + f"; preemptions: {preempted}"
        log.info(line)
        self.last = current
        return line
