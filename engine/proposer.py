"""Drafting: the draft model proposes k tokens per sequence, batched across sequences.

The first draft step feeds each row's pending tokens (ragged: the last committed token, plus the
last draft when all drafts were accepted); the next k-1 steps feed one token each.
`draft_sample_method` greedy takes the argmax (the verifier then treats q as one-hot);
probabilistic samples from q, the draft's distribution after the request's temperature/top-k/top-p,
and hands q to the verifier.
"""
from __future__ import annotations

from typing import Protocol

import torch

from engine.config import SpeculativeConfig
from engine.errors import row_error_message
from engine.sampling import check_distribution, mask_tokens, probs_from_logits, sample
from engine.step import DraftBatch, DraftOutput
from engine.vocab_mapping import VocabMapping
from engine.worker import ModelWorker


class Proposer(Protocol):
    def propose(self, batch: DraftBatch) -> DraftOutput: ...


class DraftModelProposer:
    def __init__(self, worker: ModelWorker, spec: SpeculativeConfig, target_vocab: int,
                 vocab_mapping: VocabMapping | None = None):
        self.worker = worker
        self.probabilistic = spec.draft_sample_method == "probabilistic"
        self.target_vocab = target_vocab
        self.mapping = vocab_mapping

    @torch.inference_mode()
    def propose(self, batch: DraftBatch) -> DraftOutput:
        B = len(batch.slots)
        drafts: list[list[int]] = [[] for _ in range(B)]
        probs: list[list[torch.Tensor]] = [[] for _ in range(B)]
        errors: dict[int, str] = {}  # slot -> message; a failed row drafts no further
        for step in range(max(batch.num_drafts)):
            active = [b for b in range(B) if batch.num_drafts[b] > step and batch.slots[b] not in errors]
            if not active:
                break
            if step == 0:
                feed = [batch.pending[b] for b in active]
                starts = [batch.starts[b] for b in active]
            else:
                feed = [[drafts[b][-1]] for b in active]
                starts = [batch.starts[b] + len(batch.pending[b]) + step - 1 for b in active]
            logits = self.worker.forward([batch.slots[b] for b in active], starts, feed, last_only=True)[:, 0]
            if self.mapping is not None:
                logits = self.mapping.constrain_draft_logits(logits)
            for i, b in enumerate(active):
                try:
                    self._draft_row(logits[i : i + 1], batch.sampling[b], step, drafts[b], probs[b])
                except Exception as e:  # noqa: BLE001 - one row's failure is its own, not the step's
                    errors[batch.slots[b]] = row_error_message(e, batch.sampling[b].request_id, "draft")
        for b in range(B):
            if batch.slots[b] in errors:
                drafts[b], probs[b] = [], []
        if self.mapping is not None:
            drafts = [self.mapping.draft_to_target_ids(d) for d in drafts]
        if not self.probabilistic:
            return DraftOutput(slots=batch.slots, tokens=drafts, errors=errors)
        return DraftOutput(slots=batch.slots, tokens=drafts, errors=errors,
                           probs=[self._target_probs(torch.stack(p)) if p else None for p in probs])

    def _draft_row(self, row_logits: torch.Tensor, row, step: int, drafts: list[int],
                   probs: list[torch.Tensor]) -> None:
        if step < row.hold_back_until:
            row_logits = mask_tokens(row_logits, self._draft_ids(row.held_back_ids), torch.ones(1, dtype=torch.bool))
        params = row.params
        if not self.probabilistic or params.greedy:
            drafts.append(int(row_logits.argmax()))
            return
        q = probs_from_logits(row_logits, params.temperature, params.top_k, params.top_p)[0]
        check_distribution(q)
        drafts.append(sample(q, self.worker.generators[row.request_id]))
        probs.append(q)

    def _draft_ids(self, target_ids: tuple[int, ...]) -> list[int]:
        if self.mapping is None:
            return list(target_ids)
        return [d for d in self.mapping.target_to_draft[list(target_ids)].tolist() if d >= 0]

    def _target_probs(self, q: torch.Tensor) -> torch.Tensor:
        """q [k, V_draft] -> [k, V_target]: the verifier compares it with the target's p."""
        if self.mapping is None:
            return q
        return self.mapping.draft_probs_to_target(q, self.target_vocab)
