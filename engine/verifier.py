"""Verification on the target side: one forward over [pending, d1..dk] per row, then rejection
sampling per row, so full target logits never leave the target group."""
from __future__ import annotations

import torch

from engine.config import SpeculativeConfig
from engine.rejection import verify_block, verify_greedy, verify_standard, verify_synthetic
from engine.sampling import mask_tokens, probs_from_logits
from engine.step import DraftOutput, VerifyBatch, VerifyOutput
from engine.worker import ModelWorker


class Verifier:
    def __init__(self, worker: ModelWorker, spec: SpeculativeConfig | None):
        self.worker = worker
        self.method = spec.rejection_sample_method if spec else "standard"
        self.synthetic_rates = spec.synthetic_rates() if spec and self.method == "synthetic" else None

    @torch.inference_mode()
    def verify(self, batch: VerifyBatch, drafts: DraftOutput | None) -> VerifyOutput:
        B = len(batch.slots)
        row_drafts, row_probs = drafts.for_slots(batch.slots) if drafts else ([[]] * B, [None] * B)
        feed = [batch.pending[b] + row_drafts[b] for b in range(B)]
        logits = self.worker.forward(batch.slots, batch.starts, feed)  # [B, T, V]
        out, accepted = [], []
        for b in range(B):
            d, row = row_drafts[b], batch.sampling[b]
            first = len(batch.pending[b]) - 1
            row_logits = logits[b, first : first + len(d) + 1]  # [k+1, V]
            if row.hold_back_until > 0:
                held = torch.arange(len(d) + 1) < row.hold_back_until
                row_logits = mask_tokens(row_logits, list(row.held_back_ids), held)
            params = row.params
            gen = self.worker.generators[row.request_id]
            if params.greedy:
                tokens = verify_greedy(row_logits, d)
            else:
                p = probs_from_logits(row_logits, params.temperature, params.top_k, params.top_p)
                if self.method == "synthetic" and d:
                    tokens = verify_synthetic(p, d, self.synthetic_rates, gen)
                elif self.method == "block" and d:
                    tokens = verify_block(p, d, row_probs[b], gen)
                else:
                    tokens = verify_standard(p, d, row_probs[b], gen)
            out.append(tokens)
            accepted.append(len(tokens) - 1)
        return VerifyOutput(tokens=out, num_accepted=accepted)
