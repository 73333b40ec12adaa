"""How many prompt tokens ride in a step while streams decode.

A step that carries a prompt chunk pauses every decoding stream for as long as the chunk takes. The
token budget (`max_num_batched_tokens`) bounds the chunk in tokens, but what a stream's reader sees is
time, and a token costs 2-3x more on an AVX2 CPU than on an AVX-512 one. So while streams decode, the
chunk is sized from this machine's measured step times to pause them about `target_s`
(`prefill_stall_ms`), within the budget: Sarathi-Serve's token budget from a latency target, with the
costs measured as the engine runs instead of profiled ahead. With no stream decoding, nobody waits: a
chunk takes the whole budget, for the prompt's TTFT.

Model: a step's time = the decode round's time at its row count + the prompt tokens x a cost per token.
The decode time is learnt from steps with no prompt, the cost per token from steps with one (weighted by
their tokens, so a few-token prompt, where fixed costs dominate, moves it little).
"""
from __future__ import annotations


class PrefillPacer:
    def __init__(self, target_s: float, min_tokens: int = 32, decay: float = 0.8):
        self.target_s = target_s  # 0: off, chunks of the whole budget
        self.min_tokens = min_tokens  # a prompt always moves on, however slow the machine
        self.decay = decay
        self._decode_s: dict[int, float] = {}  # decoding rows -> a round's seconds (EWMA)
        self._extra_s = 0.0  # decayed sums: seconds beyond the decode round, and the prompt tokens they bought
        self._tokens = 0.0

    @property
    def per_token_s(self) -> float | None:
        """A prompt token's measured cost in a step, or None before any step carried one."""
        return self._extra_s / self._tokens if self._tokens > 0 else None

    def decode_s(self, rows: int) -> float:
        """A decode round's measured time at `rows` rows (the nearest smaller count measured; 0 unknown)."""
        if rows in self._decode_s:
            return self._decode_s[rows]
        below = [r for r in self._decode_s if r < rows]
        return self._decode_s[max(below)] if below else 0.0

    def tokens(self, rows: int, budget: int) -> int:
        """The prompt tokens a step with `rows` decoding rows may carry, at most `budget`."""
        per_token = self.per_token_s
        if self.target_s <= 0 or rows == 0 or not per_token or budget <= 0:
            return budget
        fits = int((self.target_s - self.decode_s(rows)) / per_token)
        return max(min(self.min_tokens, budget), min(budget, fits))

    def observe(self, rows: int, prompt_tokens: int, seconds: float) -> None:
        """A step's measured time (seconds <= 0: not measured, e.g. a plan run in parts)."""
        if seconds <= 0:
            return
        if prompt_tokens == 0:
            if rows > 0:
                old = self._decode_s.get(rows)
                self._decode_s[rows] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds
            return
        self._extra_s = self.decay * self._extra_s + max(0.0, seconds - self.decode_s(rows))
        self._tokens = self.decay * self._tokens + prompt_tokens
