"""What crosses between the scheduler and the model groups in one step.

Lists are per sequence (rows are ragged: each has its own start position and token count).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from engine.config import SamplingParams


class TokenLogprob(NamedTuple):
    """A token's log-probability where it was sampled (or scored, in a prompt), its rank there
    (1 = the most likely) and the `logprobs` most likely (token, log-probability) pairs."""

    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass(frozen=True)
class Prefill:
    """Prompt tokens one model writes at positions start.. of one sequence, through its block table."""

    table: list[int]
    start: int
    tokens: list[int]
    seq_id: int = -1  # the sequence it belongs to (a failing step is retried per sequence)


@dataclass(frozen=True)
class RequestGrammar:
    """A constrained request's grammar as the workers get it (compiled and checked at the edge)."""

    grammar: str  # llguidance's grammar text
    output_ids: tuple[int, ...] = ()  # tokens already emitted (a request restarted on new groups)
    stop_token_ids: tuple[int, ...] = ()  # allowed wherever the grammar may end, as EOS is


@dataclass(frozen=True)
class RowSampling:
    """How one sequence samples at the positions of this step."""

    request_id: str
    params: SamplingParams
    # Token ids held back (EOS, stop_token_ids) at step positions j < hold_back_until (min_tokens).
    held_back_ids: tuple[int, ...] = ()
    hold_back_until: int = 0
    # With penalties: the tokens they count (the prompt's only for repetition_penalty), else empty.
    prompt_ids: tuple[int, ...] = ()
    output_ids: tuple[int, ...] = ()
    # with structured outputs: the output tokens committed so far (the grammar state stands there),
    # and for the draft the last of them, which its grammar state may not have seen yet
    num_output: int = 0
    grammar_tail: tuple[int, ...] = ()


@dataclass
class DraftBatch:
    seq_ids: list[int]  # [B] each row's sequence (rows are matched across calls by it)
    starts: list[int]  # [B] cache position of pending[b][0]
    pending: list[list[int]]  # [B][>=1] draft-vocabulary tokens the draft cache has not seen yet
    num_drafts: list[int]  # [B] k_b >= 1 tokens to propose
    sampling: list[RowSampling]  # [B]
    tables: list[list[int]]  # [B] block table in the draft's cache, covering every position the row writes


@dataclass
class DraftOutput:
    seq_ids: list[int]  # [B] as in the DraftBatch (the verifier matches rows by seq_id)
    tokens: list[list[int]]  # [B][k_b] proposals, in the target's vocabulary
    # [sum k_b, V_target]: the draft distributions, flat in row order (probabilistic drafting), else None
    probs: Tensor | None = None
    elapsed_s: float = 0.0  # the draft group's compute time for this batch
    errors: dict[int, str] = field(default_factory=dict)  # seq_id -> why that row failed (its drafts are void)
    # [B] positions of each row's draft cache that now hold what was fed to it in order (its pending
    # tokens, then its own proposals but the last; with parallel drafting the pending tokens only)
    cached: list[int] = field(default_factory=list)

    def for_seqs(self, seq_ids: list[int], spans: list[tuple[int, int]] | None = None) -> tuple[list[list[int]], Tensor | None]:
        """Drafts in the order of `seq_ids` (none for a seq_id that was not drafted, or failed), and
        their distributions flat in that order. `spans[i]` = (first, count): only those of seq_id i's
        drafts (a draft-ahead block is a row's drafts after its first); count 0: none."""
        index = {seq_id: i for i, seq_id in enumerate(self.seq_ids)}
        rows = [index.get(seq_id) if seq_id not in self.errors else None for seq_id in seq_ids]
        spans = spans or [(0, len(self.tokens[i]) if i is not None else 0) for i in rows]
        tokens = [self.tokens[i][a: a + n] if i is not None else [] for i, (a, n) in zip(rows, spans)]
        if self.probs is None:
            return tokens, None
        starts = [0]
        for t in self.tokens:
            starts.append(starts[-1] + len(t))
        order = [starts[i] + a + j for i, (a, n) in zip(rows, spans) if i is not None for j in range(n)]
        return tokens, self.probs[torch.tensor(order, dtype=torch.long, device=self.probs.device)]

    def summary(self) -> "DraftOutput":
        """The proposals without their distributions (what the scheduler reads of a draft-ahead block)."""
        return DraftOutput(self.seq_ids, self.tokens, None, self.elapsed_s, self.errors, self.cached)


def merge_drafts(seq_ids: list[int], fresh: DraftOutput | None, ahead: DraftOutput | None,
                 ahead_counts: list[int]) -> tuple[list[list[int]], Tensor | None]:
    """Each row's drafts for one verify step: ahead_counts[b] > 0 takes that many of the previous
    draft-ahead block's proposals after its first (the first stood for the bonus token), else the
    fresh drafts; their distributions flat in row order (None when drafting is greedy)."""
    B = len(seq_ids)
    if ahead is None or not any(ahead_counts):
        return fresh.for_seqs(seq_ids) if fresh is not None else ([[]] * B, None)
    from_ahead = [b for b in range(B) if ahead_counts[b] > 0]
    tokens_a, q_a = ahead.for_seqs([seq_ids[b] for b in from_ahead], [(1, ahead_counts[b]) for b in from_ahead])
    rest = [b for b in range(B) if ahead_counts[b] == 0]
    tokens_f, q_f = fresh.for_seqs([seq_ids[b] for b in rest]) if fresh is not None else ([[]] * len(rest), None)
    tokens: list[list[int]] = [[] for _ in range(B)]
    for b, t in zip(from_ahead, tokens_a):
        tokens[b] = t
    for b, t in zip(rest, tokens_f):
        tokens[b] = t
    if q_a is None and q_f is None:
        return tokens, None
    # distributions back in row order: each source's rows are already in order, interleave them
    parts, cursor = [], {"a": 0, "f": 0}
    for b in range(B):
        src, q = ("a", q_a) if ahead_counts[b] > 0 else ("f", q_f)
        n = len(tokens[b])
        if n:
            parts.append(q[cursor[src]: cursor[src] + n])
            cursor[src] += n
    return tokens, (torch.cat(parts) if parts else None)


@dataclass
class VerifyBatch:
    seq_ids: list[int]  # [B]
    starts: list[int]  # [B] cache position of pending[b][0]
    pending: list[list[int]]  # [B][>=1] target tokens the target cache has not seen (the last committed)
    sampling: list[RowSampling]  # [B]
    tables: list[list[int]]  # [B] block table in the target's cache, covering pending + the row's drafts
    # [B] with draft-ahead: > 0 takes that many drafts from the previous step's draft-ahead block
    # (after its first proposal), 0 the fresh drafts; empty: all fresh
    ahead_counts: list[int] = field(default_factory=list)
    # prompt chunks of sequences still prefilling, written into the target's cache by this step's
    # forward (chunked prefill without a forward of its own; no logits)
    prefill: list[Prefill] = field(default_factory=list)


@dataclass
class AheadBatch:
    """Draft-ahead: the draft group proposes the next block while the target verifies this one, for
    each row as if this step's drafts were accepted whole. `draft.num_drafts[b]` is k_b + 1 (the first
    proposal stands for the target's bonus token). `fresh_from[b]`: None when `draft.pending[b]` is
    everything the draft cache lacks; j: this step's fresh proposals for the row's seq_id from the j-th
    on (in the draft's vocabulary) follow its pending tokens (they are not known before the step)."""

    draft: DraftBatch
    fresh_from: list[int | None]


@dataclass
class VerifyOutput:
    tokens: list[list[int]]  # [B][1..k_b+1] tokens to append
    num_accepted: list[int] = field(default_factory=list)  # [B] accepted drafts
    # [B] positions of each row's target cache that hold committed tokens: its pending ones and the
    # drafts it accepted (the rest of what the forward wrote is rewritten by the next step)
    cached: list[int] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)  # row -> why it failed; its tokens are []
    # row -> one entry per emitted token, for rows that asked
    logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    elapsed_s: float = 0.0  # the target group's compute time (forward + rejection sampling)
    draft_elapsed_s: float = 0.0  # the draft group's, passed through (adaptive K measures both)
    draft_cached: dict[int, int] = field(default_factory=dict)  # seq_id -> the fresh drafts' DraftOutput.cached
    ahead: DraftOutput | None = None  # draft-ahead: the next blocks' proposals (no distributions)


def scored_positions(logits: Tensor, pending: list[list[int]], counts: list[int]) -> tuple[Tensor, list[int]]:
    """A ragged forward's logits [B, T, V] -> the rows that score tokens, flat [sum counts, V]: row b's
    counts[b] positions from its last pending token on (vLLM's layout), and where each row's begin.
    No copy when those are all the positions (every row fed one pending token and counts[b] - 1 more)."""
    B, T, V = logits.shape
    firsts, index = [], []
    for b in range(B):
        firsts.append(len(index))
        start = b * T + len(pending[b]) - 1
        index.extend(range(start, start + counts[b]))
    flat = logits.reshape(B * T, V)
    if index != list(range(B * T)):
        flat = flat[torch.tensor(index, dtype=torch.long, device=logits.device)]
    return flat, firsts

