"""Executors run the model groups. LocalExecutor keeps both in this process.

The scheduler talks only to this interface, so a RayExecutor (one actor per tensor-parallel rank)
can take its place without the scheduler knowing.
"""
from __future__ import annotations

import logging

from engine.config import EngineConfig
from engine.models.loading import resolve_model
from engine.proposer import DraftModelProposer
from engine.step import DraftBatch, DraftOutput, VerifyBatch, VerifyOutput
from engine.verifier import Verifier
from engine.vocab_mapping import VocabMapping
from engine.worker import ModelWorker

log = logging.getLogger(__name__)


class LocalExecutor:
    def __init__(self, config: EngineConfig, cache_len: int, vocab_mapping: VocabMapping | None = None):
        spec = config.speculative_config
        device, dtype = config.resolved_device(), config.torch_dtype()
        slots = config.max_num_seqs
        self.target = ModelWorker(resolve_model(config.model), slots, cache_len, dtype, device, "target")
        self.draft = None
        self.proposer = None
        if spec is not None:
            self.draft = ModelWorker(resolve_model(spec.model), slots, cache_len, dtype, device, "draft")
            self.proposer = DraftModelProposer(self.draft, spec, self.target.vocab_size, vocab_mapping)
        self.verifier = Verifier(self.target, spec)

    def add_request(self, request_id: str, seed: int) -> None:
        for w in (self.target, self.draft):
            if w is not None:
                w.add_request(request_id, seed)

    def remove_request(self, request_id: str) -> None:
        for w in (self.target, self.draft):
            if w is not None:
                w.remove_request(request_id)

    def prefill(self, slot: int, target_tokens: list[int], draft_tokens: list[int] | None) -> None:
        if target_tokens:
            self.target.prefill(slot, target_tokens)
        if self.draft is not None and draft_tokens:
            self.draft.prefill(slot, draft_tokens)

    def step(self, verify: VerifyBatch, draft: DraftBatch | None) -> tuple[VerifyOutput, DraftOutput | None]:
        drafts = self.proposer.propose(draft) if draft is not None else None
        if drafts is not None:
            # the draft batch covers only rows with k > 0: spread its output over the verify rows
            drafts = _align(drafts, draft, verify)
        return self.verifier.verify(verify, drafts), drafts


def _align(drafts: DraftOutput, draft: DraftBatch, verify: VerifyBatch) -> DraftOutput:
    by_slot = {slot: i for i, slot in enumerate(draft.slots)}
    tokens, probs = [], [] if drafts.probs is not None else None
    for slot in verify.slots:
        i = by_slot.get(slot)
        tokens.append(drafts.tokens[i] if i is not None else [])
        if probs is not None:
            probs.append(drafts.probs[i] if i is not None else None)
    return DraftOutput(tokens=tokens, probs=probs)
