"""Grammar state on a worker: one llguidance matcher per constrained request, and the token masks
of a step's positions.

A matcher stands at the request's committed output. For a verify row with drafts d1..dk, the mask
at position j is the grammar's after d1..dj (llguidance computes all k + 1 and rolls back); a draft
the grammar refuses ends the masks there (the positions after it can't be sampled: the refused
draft is rejected, p(d) = 0). After the step the matcher consumes the tokens the row emitted.
The scheduler's count of committed tokens travels with each row, so a matcher that ran ahead (a
step retried row by row) rolls back to it.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.structured import parser_limits

log = logging.getLogger(__name__)

GRAMMAR_FAILED = "the output could not continue under the request's structured_outputs grammar"
_TEMPLATES = 64  # compiled matchers kept per worker, by grammar text; a request gets a copy
# byte -> its 8 bits, least significant first (llguidance's bitmask: bit i of word w is token 32 w + i)
_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)[None, :]) & 1).bool()


@dataclass
class _Matcher:
    matcher: object
    consumed: int  # output tokens it has consumed
    extra_end_ids: tuple[int, ...] = ()  # stop_token_ids: allowed wherever the grammar may end
    drafted: int = 0  # drafts consumed on top (the draft side, within one propose call)
    drafting: bool = False  # every draft so far was the grammar's: its masks still apply


class GrammarMasks:
    def __init__(self, hf_tokenizer, eos_ids: set[int], vocab_size: int, threads: int = 1):
        self.hf_tokenizer, self.eos_ids, self.vocab = hf_tokenizer, sorted(eos_ids), vocab_size
        self.threads = max(1, threads)
        self._executor = None
        self._tokenizer = None
        self._templates: OrderedDict[str, object] = OrderedDict()
        self._matchers: dict[str, _Matcher] = {}

    def _ll(self):
        from llguidance import LLExecutor

        from engine.structured import ll_tokenizer

        if self._tokenizer is None:
            self._tokenizer = ll_tokenizer(self.hf_tokenizer, self.eos_ids)
            self._executor = LLExecutor(num_threads=self.threads)
        return self._tokenizer

    def warm(self) -> None:
        """Build the tokenizer view now (seconds for a large vocabulary) rather than in a step."""
        try:
            self._ll()
        except Exception:  # noqa: BLE001 - the edge refuses grammars for this tokenizer with its reason
            log.exception("structured outputs unavailable: llguidance can't read this tokenizer")

    def add(self, request_id: str, grammar: str, output_ids: list[int], stop_token_ids: list[int] = ()) -> None:
        """A request's matcher, at its output so far (a request restarted on new groups has one)."""
        from llguidance import LLMatcher

        tokenizer = self._ll()
        template = self._templates.get(grammar)
        if template is None:
            template = LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
            self._templates[grammar] = template
            while len(self._templates) > _TEMPLATES:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(grammar)
        matcher = template.deep_copy()
        if output_ids and not matcher.consume_tokens(list(output_ids)):
            raise ValueError(GRAMMAR_FAILED)
        extra = tuple(t for t in stop_token_ids if t not in self.eos_ids)
        self._matchers[request_id] = _Matcher(matcher, len(output_ids), extra)

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def masks(self, rows: list[tuple[str, int, list[int]]]) -> tuple[Tensor, dict[int, str]]:
        """rows: (request_id, committed output tokens, drafts). -> (allowed [sum(len(drafts) + 1), V]
        bool, row index -> error): row i's positions in order, all True after a refused draft."""
        tokenizer = self._ll()
        width = (tokenizer.vocab_size + 31) // 32
        total = sum(len(d) + 1 for _, _, d in rows)
        bitmask = torch.full((total, width), -1, dtype=torch.int32)
        plain, drafted, errors, at = [], [], {}, 0
        for i, (request_id, committed, drafts) in enumerate(rows):
            state = self._matchers.get(request_id)
            if state is None or not self._sync(state, committed):
                errors[i] = _failure(state)
            elif drafts:
                drafted.append((state.matcher, at, list(drafts)))
            else:
                plain.append((state.matcher, at))
            at += len(drafts) + 1
        if plain:  # on llguidance's threads, without the GIL
            self._executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), width * 4, total)
        if drafted:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(drafted, bitmask.data_ptr(), width * 4, total)
        allowed = unpack(bitmask, tokenizer.vocab_size, self.vocab)
        at = 0
        for i, (request_id, _, drafts) in enumerate(rows):
            state = self._matchers.get(request_id)
            if state is not None and state.extra_end_ids and self.eos_ids:
                block = allowed[at: at + len(drafts) + 1]
                ends = block[:, self.eos_ids].any(-1)  # positions where the grammar may end
                block[ends.nonzero()[:, 0, None], torch.tensor(state.extra_end_ids)] = True
            at += len(drafts) + 1
        return allowed, errors

    def advance(self, request_id: str, tokens: list[int]) -> None:
        """The tokens a row emitted this step (its end token included, when it ended). One the
        grammar refuses (a stop token that ended the request) is not consumed; if the request went
        on, the next step finds the count short and fails the row."""
        state = self._matchers.get(request_id)
        if state is None:
            return
        for token in tokens:
            if token in state.extra_end_ids or not state.matcher.try_consume_tokens([token]):
                break
            state.consumed += 1

    # -- the draft side: masks one position at a time, as the draft proposes ----------------------

    def begin_drafts(self, request_id: str, committed: int, tail: tuple[int, ...]) -> bool:
        """Bring the matcher to the committed output (`tail`: its last tokens, which this worker
        may not have seen); False when it can't (the drafts then go unmasked: still exact)."""
        state = self._matchers.get(request_id)
        if state is None:
            return False
        state.drafted, state.drafting = 0, self._sync(state, committed, tail)
        return state.drafting

    def next_masks(self, request_ids: list[str]) -> Tensor:
        """allowed [n, V] at each request's state now (its committed output and its drafts so far)."""
        tokenizer = self._ll()
        width = (tokenizer.vocab_size + 31) // 32
        bitmask = torch.full((len(request_ids), width), -1, dtype=torch.int32)
        jobs = [(self._matchers[r].matcher, i) for i, r in enumerate(request_ids)]
        self._executor.unsafe_compute_mask_ptr(jobs, bitmask.data_ptr(), width * 4, len(request_ids))
        return unpack(bitmask, tokenizer.vocab_size, self.vocab)

    def push_draft(self, request_id: str, token: int) -> bool:
        """Consume a draft; False (nothing consumed, masks stop for this row) when the grammar refuses it."""
        state = self._matchers[request_id]
        if state.drafting and state.matcher.try_consume_tokens([token]) == 1:
            state.drafted += 1
            return True
        state.drafting = False
        return False

    def end_drafts(self, request_id: str) -> None:
        state = self._matchers.get(request_id)
        if state is not None and state.drafted:
            state.matcher.rollback(state.drafted)
        if state is not None:
            state.drafted, state.drafting = 0, False

    def drafting(self, request_id: str) -> bool:
        state = self._matchers.get(request_id)
        return state is not None and state.drafting

    def _sync(self, state: _Matcher, committed: int, tail: tuple[int, ...] = ()) -> bool:
        """Bring the matcher to `committed` output tokens: roll back what it consumed beyond them, or
        consume the missing ones from `tail` (the last len(tail) of them). False: it can't."""
        if state.matcher.is_error():
            return False
        if state.consumed > committed:
            state.matcher.rollback(state.consumed - committed)
            state.consumed = committed
        start = committed - len(tail)
        if state.consumed < start:
            return False
        missing = list(tail[state.consumed - start:])
        if missing:
            consumed = state.matcher.try_consume_tokens(missing)
            state.consumed += consumed
        return state.consumed == committed


def _failure(state: _Matcher | None) -> str:
    from engine.structured import matcher_error

    if state is not None and state.matcher.is_error():  # e.g. a step past the grammar's limits
        return f"{GRAMMAR_FAILED}: {matcher_error(state.matcher.get_error())}"
    return GRAMMAR_FAILED


def unpack(bitmask: Tensor, tokens: int, vocab: int) -> Tensor:
    """llguidance bitmask [N, ceil(tokens / 32)] int32 -> allowed [N, vocab] bool (a model's rows
    past the tokenizer's tokens are never allowed)."""
    n = bitmask.shape[0]
    allowed = _BITS[bitmask.view(torch.uint8).long()].view(n, -1)[:, :min(tokens, vocab)]
    if vocab > allowed.shape[1]:
        allowed = torch.cat([allowed, allowed.new_zeros(n, vocab - allowed.shape[1])], 1)
    return allowed


def apply_masks(logits: Tensor, positions: list[int], allowed: Tensor) -> None:
    """In place: -inf at every token `allowed` refuses, at logits rows `positions`."""
    if not positions:
        return
    index = torch.tensor(positions, dtype=torch.long, device=logits.device)
    if positions == list(range(positions[0], positions[0] + len(positions))):
        logits[positions[0]: positions[0] + len(positions)].masked_fill_(~allowed.to(logits.device), float("-inf"))
        return
    logits[index] = logits[index].masked_fill_(~allowed.to(logits.device), float("-inf"))
