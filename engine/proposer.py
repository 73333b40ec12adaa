"""Drafting: the draft model proposes k_b tokens per sequence, batched across sequences.

The first draft step feeds each row's pending tokens (ragged: the last committed token, plus the
last draft when all drafts were accepted); the next steps feed the previous draft of every row
still drafting, as a device tensor. `draft_sample_method` greedy takes the argmax (the verifier
then treats q as one-hot); probabilistic samples from q, the draft's distribution after the
request's temperature/top-k/top-p, and hands q to the verifier. The proposals cross to the host
once, at the end.

With `parallel_drafting` (PARD) one forward proposes all k_b: each row feeds its pending tokens and
k_b - 1 copies of the draft's mask token, and its proposals come from the logits at its last
pending token and at each mask. Draft i then doesn't see drafts 1..i-1; rejection sampling stays
exact, as any draft distribution q_i does, given the q_i it was sampled from.
"""
from __future__ import annotations

import torch

from engine.config import SpeculativeConfig, parallel_drafting_token
from engine.grammar_masks import GrammarMasks, allowed_at, apply_bitmask
from engine.sampling import INVALID_DISTRIBUTION, SamplingTensors, batch_probs, held_back_pairs, invalid_rows, \
    mask_tokens, sample_inverse_cdf
from engine.step import AheadBatch, DraftBatch, DraftOutput, scored_positions
from engine.vocab_mapping import VocabMapping
from engine.worker import ModelWorker


class DraftModelProposer:
    def __init__(self, worker: ModelWorker, spec: SpeculativeConfig, target_vocab: int,
                 vocab_mapping: VocabMapping | None = None, grammars: GrammarMasks | None = None):
        self.worker = worker
        self.grammars = grammars  # constrained requests' grammar state, in the target's tokens
        self.probabilistic = spec.draft_sample_method == "probabilistic"
        self.mask_token = parallel_drafting_token(worker.hf_config) if spec.parallel_drafting else None
        self.target_vocab = target_vocab
        self.mapping = vocab_mapping
        if vocab_mapping is not None:  # the tables on this worker's device
            dev = worker.device
            self.draft_mask = vocab_mapping.draft_mask.to(dev)
            self.draft_to_target = vocab_mapping.draft_to_target.to(dev)
            self.mapped_draft = vocab_mapping.draft_mask.nonzero()[:, 0].to(dev)
            self.mapped_target = vocab_mapping.draft_to_target[vocab_mapping.draft_mask].to(dev)
            # grammar bitmasks live on the host: each draft token's target id there (0 outside the
            # intersection, which the mask refuses anyway)
            self.grammar_ids = vocab_mapping.draft_to_target.clamp(min=0)

    @torch.inference_mode()
    def propose(self, batch: DraftBatch, grammar: bool = True) -> DraftOutput:
        """grammar: mask constrained rows by their grammar state (structured outputs; sequential
        drafting from the committed output only: PARD's and draft-ahead's drafts go unmasked,
        which the verifier's masks keep exact)."""
        if self.mask_token is not None:
            return self._propose_parallel(batch)
        constrained = self._begin_grammar(batch) if grammar else []
        try:
            return self._propose_sequential(batch, constrained)
        finally:
            for b in constrained:
                self.grammars.end_drafts(batch.sampling[b].request_id)

    def _propose_sequential(self, batch: DraftBatch, constrained: list[int]) -> DraftOutput:
        B, K = len(batch.seq_ids), max(batch.num_drafts)
        dev = self.worker.device
        params = [row.params for row in batch.sampling]
        drafts = torch.zeros(B, K, dtype=torch.long, device=dev)
        bad = torch.zeros(B, dtype=torch.bool, device=dev)
        q_steps: list[tuple[list[int], torch.Tensor]] = []  # (rows, q [rows, V]) per draft step
        for step in range(K):
            active = [b for b in range(B) if batch.num_drafts[b] > step]
            if step == 0:
                feed = [batch.pending[b] for b in active]
                starts = [batch.starts[b] for b in active]
            else:
                feed = drafts[torch.tensor(active, device=dev), step - 1][:, None]
                starts = [batch.starts[b] + len(batch.pending[b]) + step - 1 for b in active]
            logits = self.worker.forward([batch.tables[b] for b in active], starts, feed, last_only=True)[:, 0]
            rows = [batch.sampling[b] for b in active]
            logits = self._allowed(logits, rows, list(range(len(active))), [1] * len(active), step)
            index = torch.tensor(active, device=dev)
            if not self.probabilistic:
                masked = self._greedy_grammar(logits, batch, active, constrained)
                drafts[index, step] = logits.argmax(-1)
                self._push_grammar(batch, drafts, active, masked, step)
                continue
            masked = self._mask_grammar(logits, batch, active, self._under_grammar(batch, active, constrained))
            q, invalid = self._distributions(logits, [params[b] for b in active])
            bad[index] |= invalid
            _, u = self.worker.draws([r.request_id for r in rows], [params[b].greedy for b in active],
                                     [0] * len(active), 0)
            drafts[index, step] = sample_inverse_cdf(q, u)
            self._push_grammar(batch, drafts, active, masked, step)
            q_steps.append((active, q))
        if self.mapping is not None:
            drafts = self.draft_to_target[drafts]
        # the proposals' one device-to-host transfer
        host = torch.cat([drafts, bad[:, None].long()], 1).tolist()
        tokens = [row[: batch.num_drafts[b]] for b, row in enumerate(host)]
        errors = {batch.seq_ids[b]: INVALID_DISTRIBUTION for b, row in enumerate(host) if row[-1]}
        # fed: each row's pending tokens and its proposals but the last
        cached = [batch.starts[b] + len(batch.pending[b]) + batch.num_drafts[b] - 1 for b in range(B)]
        probs = self._flat_probs(batch, q_steps) if self.probabilistic else None
        return DraftOutput(seq_ids=batch.seq_ids, tokens=tokens, errors=errors, probs=probs, cached=cached)

    def propose_ahead(self, ahead: AheadBatch, fresh: DraftOutput | None) -> DraftOutput:
        """The next blocks (engine/step.py AheadBatch): rows whose fresh proposals failed are left out."""
        batch = ahead.draft
        fresh_tokens = {} if fresh is None else {s: t for s, t in zip(fresh.seq_ids, fresh.tokens)
                                                 if s not in fresh.errors}
        keep, pending = [], []
        for b, seq_id in enumerate(batch.seq_ids):
            j = ahead.fresh_from[b]
            if j is None:
                keep.append(b)
                pending.append(batch.pending[b])
            elif seq_id in fresh_tokens:
                keep.append(b)
                pending.append(batch.pending[b] + self._draft_ids(tuple(fresh_tokens[seq_id][j:])))
        if not keep:
            return DraftOutput(seq_ids=[], tokens=[])
        return self.propose(DraftBatch(seq_ids=[batch.seq_ids[b] for b in keep], starts=[batch.starts[b] for b in keep],
                                       pending=pending, num_drafts=[batch.num_drafts[b] for b in keep],
                                       sampling=[batch.sampling[b] for b in keep],
                                       tables=[batch.tables[b] for b in keep]), grammar=False)

    def _propose_parallel(self, batch: DraftBatch) -> DraftOutput:
        B, ks = len(batch.seq_ids), batch.num_drafts
        dev = self.worker.device
        feed = [batch.pending[b] + [self.mask_token] * (ks[b] - 1) for b in range(B)]
        logits = self.worker.forward(batch.tables, batch.starts, feed)  # [B, T, V]
        # row b's k_b proposing positions: its last pending token, then its masks
        logits, firsts = scored_positions(logits, batch.pending, ks)  # [sum k_b, V]
        logits = self._allowed(logits, batch.sampling, firsts, ks, 0)
        row_of = torch.repeat_interleave(torch.arange(B, device=dev), torch.tensor(ks, device=dev))
        bad = torch.zeros(B, dtype=torch.bool, device=dev)
        q = None
        if not self.probabilistic:
            drafts = logits.argmax(-1)
        else:
            params = [row.params for row in batch.sampling]
            q, invalid = self._distributions(logits, params, ks)
            bad = torch.zeros(B, device=dev).index_add_(0, row_of, invalid.float()) > 0
            uniforms, _ = self.worker.draws([r.request_id for r in batch.sampling], [p.greedy for p in params],
                                            ks, max(ks))
            column = torch.arange(len(logits), device=dev) - torch.tensor(firsts, device=dev)[row_of]
            drafts = sample_inverse_cdf(q, uniforms[row_of, column])
        if self.mapping is not None:
            drafts = self.draft_to_target[drafts]
        # the proposals' one device-to-host transfer
        host = torch.cat([drafts, bad.long()]).tolist()
        tokens = [host[firsts[b]: firsts[b] + ks[b]] for b in range(B)]
        errors = {batch.seq_ids[b]: INVALID_DISTRIBUTION for b in range(B) if host[len(logits) + b]}
        if q is not None and self.mapping is not None:
            q = self._to_target(q)
        cached = [batch.starts[b] + len(batch.pending[b]) for b in range(B)]  # the masks' keys are not the drafts'
        return DraftOutput(seq_ids=batch.seq_ids, tokens=tokens, errors=errors, probs=q, cached=cached)

    def _begin_grammar(self, batch: DraftBatch) -> list[int]:
        """Rows whose drafts the grammar masks (their grammar state brought to the committed output)."""
        if self.grammars is None:
            return []
        return [b for b, row in enumerate(batch.sampling) if row.params.structured_outputs is not None
                and self.grammars.begin_drafts(row.request_id, row.num_output, row.grammar_tail)]

    def _under_grammar(self, batch: DraftBatch, active: list[int], constrained: list[int]) -> list[int]:
        """Indexes in `active` of the rows whose grammar state still follows their drafts."""
        if not constrained:
            return []
        keep = set(constrained)
        return [i for i, b in enumerate(active) if b in keep and self.grammars.drafting(batch.sampling[b].request_id)]

    def _greedy_grammar(self, logits: torch.Tensor, batch: DraftBatch, active: list[int], constrained: list[int]) -> list[int]:
        """Greedy drafting: the argmax stands where the grammar allows it (the masked argmax is the
        same token); only rows whose argmax it refuses are masked. Returns the rows under a grammar."""
        at = self._under_grammar(batch, active, constrained)
        if not at:
            return []
        best = logits[torch.tensor(at, device=logits.device)].argmax(-1)
        if self.mapping is not None:
            best = self.draft_to_target[best]
        refused = [i for i, token in zip(at, best.tolist())
                   if not self.grammars.allows(batch.sampling[active[i]].request_id, token)]
        if refused:
            self._mask_grammar(logits, batch, active, refused)
        return at

    def _mask_grammar(self, logits: torch.Tensor, batch: DraftBatch, active: list[int], at: list[int]) -> list[int]:
        """In place: -inf outside the grammar for rows `at` (indexes in `active`; a TLI draft: the
        target's allowed tokens, mapped into the draft's vocabulary); returns the rows masked. A row
        with no allowed draft token drafts unmasked (the verifier rejects what the grammar refuses)."""
        if not at:
            return []
        bitmask = self.grammars.next_masks([batch.sampling[active[i]].request_id for i in at])
        if self.mapping is None:
            some = (bitmask != 0).any(-1).tolist()
            rows = [i for i, ok in zip(at, some) if ok]
            apply_bitmask(logits, rows, bitmask[torch.tensor(some)], kernel=self.grammars.kernel)
            return rows
        # TLI: a draft token is allowed when its target token is (outside the intersection: never)
        allowed = (allowed_at(bitmask, self.grammar_ids) & self.mapping.draft_mask).to(logits.device)
        some = allowed.any(-1).tolist()
        rows = [i for i, ok in zip(at, some) if ok]
        if rows:
            index = torch.tensor(rows, dtype=torch.long, device=logits.device)
            logits[index] = logits[index].masked_fill_(~allowed[torch.tensor(some, device=logits.device)], float("-inf"))
        return rows

    def _push_grammar(self, batch: DraftBatch, drafts: torch.Tensor, active: list[int], masked: list[int], step: int) -> None:
        """The grammar states of the masked rows consume this step's drafts (in the target's tokens)."""
        if not masked:
            return
        rows = [active[i] for i in masked]
        tokens = drafts[torch.tensor(rows, device=drafts.device), step]
        if self.mapping is not None:
            tokens = self.draft_to_target[tokens]
        for b, token in zip(rows, tokens.tolist()):
            self.grammars.push_draft(batch.sampling[b].request_id, token)

    def _allowed(self, logits: torch.Tensor, rows, firsts: list[int], counts: list[int], offset: int) -> torch.Tensor:
        """In place: -inf outside the intersection (TLI) and for tokens held back before min_tokens."""
        if self.mapping is not None:
            logits.masked_fill_(~self.draft_mask, float("-inf"))
        return mask_tokens(logits, held_back_pairs(rows, firsts, counts, offset, self._draft_ids), inplace=True)

    def _distributions(self, logits: torch.Tensor, params, repeats: list[int] | None = None):
        """(q after each row's sampling parameters, rows with no valid distribution: held uniform)."""
        q = batch_probs(logits, SamplingTensors.build(params, self.worker.device, repeats), inplace=True)
        invalid = invalid_rows(q)
        return q.masked_fill_(invalid[:, None], 1.0 / q.shape[-1]), invalid

    def _to_target(self, q: torch.Tensor) -> torch.Tensor:
        """Draft distributions [N, V_draft] -> [N, V_target] (TLI: zero outside the intersection)."""
        out = q.new_zeros(q.shape[0], self.target_vocab)
        out[:, self.mapped_target] = q[:, self.mapped_draft]
        return out

    def _flat_probs(self, batch: DraftBatch, q_steps) -> torch.Tensor:
        """[sum k_b, V_target]: row b's draft distributions in order, rows in batch order."""
        per_row: list[list[torch.Tensor]] = [[] for _ in batch.seq_ids]
        for active, q in q_steps:
            for i, b in enumerate(active):
                per_row[b].append(q[i])
        q = torch.stack([x for row in per_row for x in row])
        return q if self.mapping is None else self._to_target(q)

    def _draft_ids(self, target_ids: tuple[int, ...]) -> list[int]:
        if self.mapping is None:
            return list(target_ids)
        return [d for d in self.mapping.target_to_draft[list(target_ids)].tolist() if d >= 0]
