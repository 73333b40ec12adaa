"""Verification on the target side: one forward over [pending, d1..dk] per row, then sampling and
rejection for the whole step in a few tensor ops (engine/rejection.py), so full target logits never
leave the target group and the step's results cross to the host once."""
from __future__ import annotations

import torch

from engine.config import SpeculativeConfig
from engine.grammar_masks import GrammarMasks, apply_bitmask
from engine.rejection import block_sample, rejection_sample, synthetic_sample
from engine.sampling import INVALID_DISTRIBUTION, SamplingTensors, apply_penalties, held_back_pairs, mask_tokens, \
    processed_logprobs, step_probs
from engine.step import DraftOutput, TokenLogprob, VerifyBatch, VerifyOutput, merge_drafts, scored_positions
from engine.worker import ModelWorker


class Verifier:
    def __init__(self, worker: ModelWorker, spec: SpeculativeConfig | None, grammars: GrammarMasks | None = None):
        self.worker = worker
        self.grammars = grammars  # constrained requests' grammar state (structured outputs)
        self.method = spec.rejection_sample_method if spec else "standard"
        self.synthetic_rates = (torch.tensor(spec.synthetic_rates(), device=worker.device)
                                if spec and self.method == "synthetic" else None)

    @torch.inference_mode()
    def verify(self, batch: VerifyBatch, drafts: DraftOutput | None, ahead: DraftOutput | None = None) -> VerifyOutput:
        """`drafts`: this step's fresh proposals; `ahead`: the previous step's draft-ahead blocks, for
        the rows batch.ahead_counts names."""
        B = len(batch.seq_ids)
        dev = self.worker.device
        row_drafts, q = merge_drafts(batch.seq_ids, drafts, ahead, batch.ahead_counts or [0] * B)
        counts = [len(d) for d in row_drafts]
        feed = [batch.pending[b] + row_drafts[b] for b in range(B)]
        # row b's k_b + 1 verified positions, flat: vLLM's [num_draft_tokens + B, V]
        chunks = batch.prefill
        # prompt chunks, or a row whose pending tokens are a prompt's rest: rows unpadded where they can be
        if (chunks or any(len(p) > 1 for p in batch.pending)) and self.worker.takes_ragged_rows:
            flat, firsts = self.worker.forward_ragged(
                batch.tables + [c.table for c in chunks], batch.starts + [c.start for c in chunks],
                feed + [c.tokens for c in chunks], [(len(p) - 1, k + 1) for p, k in zip(batch.pending, counts)])
        else:
            if chunks:  # the same keys and values, in a forward of their own first
                self.worker.prefill(chunks)
            logits = self.worker.forward(batch.tables, batch.starts, feed)  # [B, T, V]
            flat, firsts = scored_positions(logits, batch.pending, [k + 1 for k in counts])
        flat = mask_tokens(flat, held_back_pairs(batch.sampling, firsts, [k + 1 for k in counts]), inplace=True)
        params = [row.params for row in batch.sampling]
        apply_penalties(flat, batch.sampling, firsts, [k + 1 for k in counts], row_drafts)
        # after the penalties, which leave -inf at -inf: the same logits as masking first
        constrained = [b for b in range(B) if batch.sampling[b].params.structured_outputs is not None]
        grammar_errors = self._mask_grammar(flat, batch, constrained, row_drafts, firsts) if constrained else {}
        # rows that report log-probabilities: their positions, kept before sampling overwrites flat
        lp_rows = [b for b in range(B) if params[b].logprobs is not None]
        if not any(counts) and not lp_rows and self.method != "synthetic" and all(x.greedy for x in params):
            # plain greedy step: the token is the argmax (what sampling the one-hot distribution gives)
            out = [[t] for t in flat.argmax(-1).tolist()]
            errors = dict(grammar_errors)
            if drafts is not None:
                for b in range(B):
                    if batch.seq_ids[b] in drafts.errors:
                        errors[b] = drafts.errors[batch.seq_ids[b]]
            for b in errors:
                out[b] = []
            self._advance_grammar(batch, constrained, out, errors)
            return VerifyOutput(tokens=out, num_accepted=[0] * B, errors=errors, logprobs={})
        lp_logits = None
        if lp_rows:
            lp_index = [firsts[b] + j for b in lp_rows for j in range(counts[b] + 1)]
            lp_logits = flat[torch.tensor(lp_index, dtype=torch.long, device=dev)]
        # overwrites flat (ours: the forward's output, or a copy of its rows)
        p, bad = step_probs(flat, SamplingTensors.build(params, dev, repeats=[k + 1 for k in counts]))
        row_of = torch.repeat_interleave(torch.arange(B, device=dev), torch.tensor(counts, device=dev) + 1)
        bad_row = torch.zeros(B, device=dev).index_add_(0, row_of, bad.float()) > 0

        draft_ids = torch.tensor([t for d in row_drafts for t in d], dtype=torch.long, device=dev)
        width = max(1, max(counts, default=0))
        greedy = [x.greedy for x in params]
        draws = [1 if self.method == "synthetic" else k for k in counts]
        uniforms, final = self.worker.draws([r.request_id for r in batch.sampling], greedy, draws, width,
                                            greedy_uniforms=self.method == "synthetic")
        if self.method == "synthetic":
            tokens, accepted = synthetic_sample(p, draft_ids, counts, self.synthetic_rates, uniforms, final)
        else:
            fn = block_sample if self.method == "block" else rejection_sample
            tokens, accepted = fn(p, draft_ids, counts, q, uniforms, final)
        # the step's one device-to-host transfer
        result = torch.cat([tokens, accepted[:, None], bad_row[:, None].long()], 1).tolist()
        out, num_accepted, errors = [], [], {}
        for b, row in enumerate(result):
            n = row[-2]
            if b in grammar_errors:
                errors[b] = grammar_errors[b]
                out.append([])
                num_accepted.append(0)
            elif row[-1] or (drafts is not None and batch.seq_ids[b] in drafts.errors):
                errors[b] = drafts.errors.get(batch.seq_ids[b], INVALID_DISTRIBUTION) if drafts else INVALID_DISTRIBUTION
                out.append([])
                num_accepted.append(0)
            else:
                out.append(row[: n + 1])
                num_accepted.append(n)
        logprobs = self._logprobs(lp_rows, lp_logits, params, counts, out) if lp_rows else {}
        self._advance_grammar(batch, constrained, out, errors)
        return VerifyOutput(tokens=out, num_accepted=num_accepted, errors=errors, logprobs=logprobs)

    def _mask_grammar(self, flat: torch.Tensor, batch: VerifyBatch, rows: list[int], row_drafts: list[list[int]],
                      firsts: list[int]) -> dict[int, str]:
        """In place: -inf at every position of a constrained row outside its grammar (the state after
        the drafts before that position); row -> error for rows whose grammar state is lost.

        A greedy row (without log-probabilities) needs a mask only where the grammar refuses its
        argmax: elsewhere the masked argmax is the same token. Its positions are walked along its
        drafts until the verdict is known (a draft that differs from an allowed argmax is rejected
        there: what follows is never emitted), and only the refused ones are masked."""
        lazy = [b for b in rows if batch.sampling[b].params.greedy and batch.sampling[b].params.logprobs is None
                and self.method != "synthetic"]
        lazy_rows = set(lazy)
        full = [b for b in rows if b not in lazy_rows]
        errors = {}
        if lazy:  # the argmax of each lazy row's own positions (contiguous in flat: no copy)
            best = torch.cat([flat[firsts[b]: firsts[b] + len(row_drafts[b]) + 1].argmax(-1) for b in lazy]).tolist()
            at, rows_best = 0, []
            for b in lazy:
                rows_best.append(best[at: at + len(row_drafts[b]) + 1])
                at += len(row_drafts[b]) + 1
            bitmask, refused, failed = self.grammars.greedy_masks(
                [(batch.sampling[b].request_id, batch.sampling[b].num_output, row_drafts[b], u)
                 for b, u in zip(lazy, rows_best)])
            apply_bitmask(flat, [firsts[lazy[i]] + j for i, j in refused], bitmask, kernel=self.grammars.kernel)
            errors.update({lazy[i]: message for i, message in failed.items()})
        if full:
            bitmask, failed = self.grammars.masks([(batch.sampling[b].request_id, batch.sampling[b].num_output,
                                                    row_drafts[b]) for b in full])
            apply_bitmask(flat, [firsts[b] + j for b in full for j in range(len(row_drafts[b]) + 1)], bitmask,
                          kernel=self.grammars.kernel)
            errors.update({full[i]: message for i, message in failed.items()})
        return errors

    def _advance_grammar(self, batch: VerifyBatch, rows: list[int], out: list[list[int]], errors: dict) -> None:
        for b in rows:
            if b not in errors:
                self.grammars.advance(batch.sampling[b].request_id, out[b])

    def _logprobs(self, rows: list[int], logits: torch.Tensor, params, counts: list[int],
                  tokens: list[list[int]]) -> dict[int, list[TokenLogprob]]:
        """Each emitted token's log-probability and the top ones at its position, for `rows`."""
        dev = logits.device
        lp = processed_logprobs(logits, [params[b] for b in rows for _ in range(counts[b] + 1)])
        starts, at, chosen = [], [], []
        offset = 0
        for b in rows:
            starts.append(len(at))
            at.extend(range(offset, offset + len(tokens[b])))
            chosen.extend(tokens[b])
            offset += counts[b] + 1
        if not at:
            return {}
        at_t = torch.tensor(at, dtype=torch.long, device=dev)
        picked = lp[at_t, torch.tensor(chosen, dtype=torch.long, device=dev)]
        rank = ((lp[at_t] > picked[:, None]).sum(-1) + 1).tolist()  # 1 = the most likely
        width = max(params[b].logprobs for b in rows)
        top = torch.topk(lp[at_t], width, dim=-1) if width else None
        picked = picked.tolist()
        top_values, top_ids = (top.values.tolist(), top.indices.tolist()) if top is not None else ([], [])
        result = {}
        for b, start in zip(rows, starts):
            n, want = len(tokens[b]), params[b].logprobs
            result[b] = [TokenLogprob(picked[start + i], rank[start + i],
                                      list(zip(top_ids[start + i][:want], top_values[start + i][:want])) if want else [])
                         for i in range(n)]
        return result
