"""How many prompt tokens ride in a step while streams decode.

A step that carries a prompt chunk pauses every decoding stream for as long as the chunk takes. The
token budget (`max_num_batched_tokens`) bounds the chunk in tokens, but what a stream's reader sees is
time, and a token costs 2-3x more on an AVX2 CPU than on an AVX-512 one. So while streams decode, the
chunk is sized from this machine's measured step times to pause them about `target_s`
(`prefill_stall_ms`), within the budget: Sarathi-Serve's token budget from a latency target, with the
costs measured as the engine runs instead of profiled ahead. With no stream decoding, nobody waits: a
chunk takes the whole budget, for the prompt's TTFT.

Model: a step's time = the decode round's time at its row count + the prompt tokens x a cost per token.
The decode time is learnt from steps with no prompt, the cost per token from steps with one, weighted by
their tokens. Steps that carry fewer than `min_tokens` prompt tokens are kept apart: their fixed costs
read as a cost per token 2-6x the real one (2.6-6.6 ms a token from 9-token chat prompts on a Xeon, where
a 256-token chunk costs about 1 ms a token), so they only stand in, as a cautious guess, until a
chunk of `min_tokens` or more has been measured; after that, however many short prompts come, they
don't move the estimate.
"""
from __future__ import annotations


class PrefillPacer:
    def __init__(self, target_s: float, min_tokens: int = 32, decay: float = 0.8):
        self.target_s = target_s  # 0: off, chunks of the whole budget
        self.min_tokens = min_tokens  # a prompt always moves on, however slow the machine
        self.decay = decay
        self._decode_s: dict[int, float] = {}  # decoding rows -> a round's seconds (EWMA)
        # decayed sums, [seconds beyond the decode round, the prompt tokens they bought], of steps that
        # carried at least min_tokens prompt tokens, and of those that carried fewer
        self._chunks = [0.0, 0.0]
        self._short = [0.0, 0.0]

    @property
    def per_token_s(self) -> float | None:
        """A prompt token's measured cost in a step, or None before any step carried one."""
        extra_s, tokens = self._chunks if self._chunks[1] > 0 else self._short
        return extra_s / tokens if tokens > 0 else None

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
        sums = self._chunks if prompt_tokens >= self.min_tokens else self._short
        sums[0] = self.decay * sums[0] + max(0.0, seconds - self.decode_s(rows))
        sums[1] = self.decay * sums[1] + prompt_tokens
