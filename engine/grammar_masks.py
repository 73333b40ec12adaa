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


@dataclass
class _Matcher:
    matcher: object
    consumed: int  # output tokens it has consumed
    extra_end_ids: tuple[int, ...] = ()  # stop_token_ids: allowed wherever the grammar may end
    drafted: int = 0  # drafts consumed on top (the draft side, within one propose call)
    drafting: bool = False  # every draft so far was the grammar's: its masks still apply


class GrammarMasks:
    def __init__(self, hf_tokenizer, eos_ids: set[int], vocab_size: int, threads: int = 1, kernel: bool = True):
        self.hf_tokenizer, self.eos_ids, self.vocab = hf_tokenizer, sorted(eos_ids), vocab_size
        self.kernel = kernel  # apply_bitmask's C++ kernel (EngineConfig.cpu_kernels)
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
        """rows: (request_id, committed output tokens, drafts). -> (bitmask [sum(len(drafts) + 1),
        ceil(tokens / 32)] int32, row index -> error): row i's positions in order, every token allowed
        after a refused draft (and on a failed row)."""
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
        at = 0
        for request_id, _, drafts in rows:
            state = self._matchers.get(request_id)
            if state is not None and state.extra_end_ids and self.eos_ids:
                _allow_where_ending(bitmask[at: at + len(drafts) + 1], self.eos_ids, state.extra_end_ids)
            at += len(drafts) + 1
        return bitmask, errors

    def greedy_masks(self, rows: list[tuple[str, int, list[int], list[int]]]
                     ) -> tuple[Tensor, list[tuple[int, int]], dict[int, str]]:
        """Greedy rows: (request_id, committed, drafts, argmax at each of the k + 1 positions). Walks
        each row's drafts while the verdict is open and returns the masks of only the positions whose
        argmax the grammar refuses: (bitmask [M, W], their (row index, position j), row -> error)."""
        tokenizer = self._ll()
        width = (tokenizer.vocab_size + 31) // 32
        masks, where, errors = [], [], {}
        for i, (request_id, committed, drafts, best) in enumerate(rows):
            state = self._matchers.get(request_id)
            if state is None or not self._sync(state, committed):
                errors[i] = _failure(state)
                continue
            matcher, walked = state.matcher, 0
            for j, argmax in enumerate(best):
                allowed = matcher.validate_tokens([argmax]) == 1
                if not allowed:
                    row = torch.empty(width, dtype=torch.int32)
                    matcher.unsafe_compute_mask_ptr(row.data_ptr(), width * 4)
                    if state.extra_end_ids and self.eos_ids:
                        _allow_where_ending(row[None], self.eos_ids, state.extra_end_ids)
                    masks.append(row)
                    where.append((i, j))
                # the next position matters only if draft j + 1 may be accepted here, and follows the grammar
                if j == len(drafts) or (allowed and drafts[j] != argmax) or matcher.try_consume_tokens([drafts[j]]) != 1:
                    break
                walked += 1
            if walked:
                matcher.rollback(walked)
        bitmask = torch.stack(masks) if masks else torch.empty(0, width, dtype=torch.int32)
        return bitmask, where, errors

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
        """bitmask [n, ceil(tokens / 32)] at each request's state now (committed output and drafts so far)."""
        tokenizer = self._ll()
        width = (tokenizer.vocab_size + 31) // 32
        bitmask = torch.full((len(request_ids), width), -1, dtype=torch.int32)
        jobs = [(self._matchers[r].matcher, i) for i, r in enumerate(request_ids)]
        self._executor.unsafe_compute_mask_ptr(jobs, bitmask.data_ptr(), width * 4, len(request_ids))
        return bitmask

    def allows(self, request_id: str, token: int) -> bool:
        """Whether the grammar takes `token` next (nothing consumed)."""
        state = self._matchers[request_id]
        return state.drafting and state.matcher.validate_tokens([token]) == 1

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


def _allow_where_ending(bitmask: Tensor, end_ids: list[int], extra: tuple[int, ...]) -> None:
    """In place: the `extra` tokens are allowed at the positions where an end token is."""
    ends = allowed_at(bitmask, torch.tensor(end_ids)).any(-1)
    for token in extra:
        if token < 32 * bitmask.shape[1]:
            bit = torch.tensor(1 << (token & 31), dtype=torch.int64).to(torch.int32)  # bit 31 wraps to the sign
            bitmask[ends, token >> 5] |= bit


def allowed_at(bitmask: Tensor, token_ids: Tensor) -> Tensor:
    """[N, len(token_ids)] bool: whether each token is allowed (ids past the bitmask: never)."""
    inside = token_ids < 32 * bitmask.shape[1]
    ids = token_ids.clamp(max=32 * bitmask.shape[1] - 1)
    bits = (bitmask[:, ids >> 5] >> (ids & 31).to(torch.int32)) & 1
    return (bits != 0) & inside


def unpack(bitmask: Tensor, vocab: int) -> Tensor:
    """bitmask [N, W] int32 -> allowed [N, vocab] bool (tokens past its 32 W bits never allowed)."""
    n = bitmask.shape[0]
    allowed = (bitmask.view(torch.uint8).unsqueeze(-1) & _POWERS).view(n, -1)[:, :vocab] != 0
    if vocab > allowed.shape[1]:
        allowed = torch.cat([allowed, allowed.new_zeros(n, vocab - allowed.shape[1])], 1)
    return allowed


def apply_bitmask(logits: Tensor, rows: list[int], bitmask: Tensor, kernel: bool = True) -> None:
    """In place: -inf at every token bitmask[i] refuses, in logits row rows[i] (V may differ from
    the bitmask's 32 W bits: past them every token is refused).

    Reads whole 32-token words and touches only a row's minority: a row that allows few tokens
    (a grammar's usual state) is filled with -inf and its allowed logits put back; one that allows
    most (inside a string) gets -inf at the tokens it refuses. No [N, V] temporary: that and a dense
    masked_fill cost ~1 ms a row at 262k tokens, a tenth of a Gemma verify at batch 8. On a CPU
    our C++ kernel does the same in one pass (csrc/token_mask.cpp), ~10x faster again; `kernel`
    False: this PyTorch version (accelerators, CPUs without the kernel)."""
    if not rows:
        return
    dev, vocab = logits.device, logits.shape[1]
    index = torch.tensor(rows, dtype=torch.long, device=dev)
    if kernel and dev.type == "cpu" and logits.dtype == torch.float32 and logits.stride(1) == 1 and \
            (kernels := _kernels()) is not None:
        kernels.ops.apply_token_bitmask(logits, index, bitmask.contiguous())
        return
    n, width = bitmask.shape
    words = bitmask.to(dev)
    if vocab > 32 * width:
        logits[index, 32 * width:] = float("-inf")
    some = words != 0
    sparse = some.sum(-1) * 8 <= width  # rows whose allowed tokens sit in few words
    # sparse rows: allowed tokens, from their nonzero words
    r, w = (some & sparse[:, None]).nonzero(as_tuple=True)
    r_tok, tok = _tokens_of(words, r, w, allowed=True, vocab=vocab)
    saved = logits[index[r_tok], tok]
    sparse_rows = index[sparse]
    logits.index_fill_(0, sparse_rows, float("-inf"))
    logits[index[r_tok], tok] = saved
    # dense rows: refused tokens, from their words that aren't all ones
    r, w = ((words != -1) & ~sparse[:, None]).nonzero(as_tuple=True)
    r_tok, tok = _tokens_of(words, r, w, allowed=False, vocab=vocab)
    logits[index[r_tok], tok] = float("-inf")


def _kernels():
    """This process's CPU kernels (its engine's cpu_isa), else the best this machine runs, else None."""
    from engine import kernels

    return kernels.active() or kernels.choose()


# llguidance's bitmask: bit i of word w is token 32 w + i (bytes little-endian: bit j of byte k is 8 k + j)
_SHIFTS = torch.arange(32, dtype=torch.int32)
_POWERS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def _tokens_of(words: Tensor, r: Tensor, w: Tensor, allowed: bool, vocab: int) -> tuple[Tensor, Tensor]:
    """(row, token) of the allowed (or refused) tokens in words[r, w], tokens below vocab."""
    bits = (words[r, w][:, None] >> _SHIFTS.to(words.device)) & 1  # [M, 32]
    hit = bits != 0 if allowed else bits == 0
    m, b = hit.nonzero(as_tuple=True)
    tokens = w[m] * 32 + b
    keep = tokens < vocab
    return r[m][keep], tokens[keep]
