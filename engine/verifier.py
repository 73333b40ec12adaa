"""Verification on the target side: one forward over [pending, d1..dk] per row, then rejection
sampling per row, so full target logits never leave the target group."""
from __future__ import annotations

import torch

from engine.config import SpeculativeConfig
from engine.rejection import verify_block, verify_greedy, verify_standard, verify_synthetic
from engine.errors import row_error_message
from engine.sampling import check_distribution, mask_tokens, probs_from_logits
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
        out, accepted, errors = [], [], {}
        for b in range(B):
            slot = batch.slots[b]
            if drafts is not None and slot in drafts.errors:
                errors[b] = drafts.errors[slot]
            else:
                try:
                    tokens = self._verify_row(logits[b], batch, b, row_drafts[b], row_probs[b])
                except Exception as e:  # noqa: BLE001 - one row's failure is its own, not the step's
                    errors[b] = row_error_message(e, batch.sampling[b].request_id, "verify")
            if b in errors:
                out.append([])
                accepted.append(0)
            else:
                out.append(tokens)
                accepted.append(len(tokens) - 1)
        return VerifyOutput(tokens=out, num_accepted=accepted, errors=errors)

    def _verify_row(self, logits: torch.Tensor, batch: VerifyBatch, b: int, d: list[int],
                    q: torch.Tensor | None) -> list[int]:
        row = batch.sampling[b]
        first = len(batch.pending[b]) - 1
        row_logits = logits[first : first + len(d) + 1]  # [k+1, V]
        if row.hold_back_until > 0:
            held = torch.arange(len(d) + 1) < row.hold_back_until
            row_logits = mask_tokens(row_logits, list(row.held_back_ids), held)
        params = row.params
        if params.greedy:
            return verify_greedy(row_logits, d)
        gen = self.worker.generators[row.request_id]
        p = probs_from_logits(row_logits, params.temperature, params.top_k, params.top_p)
        check_distribution(p)
        if self.method == "synthetic" and d:
            return verify_synthetic(p, d, self.synthetic_rates, gen)
        if self.method == "block" and d:
            return verify_block(p, d, q, gen)
        return verify_standard(p, d, q, gen)

