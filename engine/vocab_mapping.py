"""Token-Level Intersection (TLI): speculation with a draft whose tokenizer differs from the target's.

Tokens are compared by the bytes they stand for, so `Ġthe` (byte-level BPE), `▁the`
(SentencePiece) and ` the` (no marker) all meet as b" the", and a byte-fallback token `<0x41>`
as b"A". Special tokens never match by text; EOS and BOS match by role. Tokens whose bytes exist
in both vocabularies form the intersection: the draft may only propose those (its logits are
masked to them), and proposals are translated into target ids before verification. Because the
translation is one-to-one on the intersection, the draft's distribution restricted to it and
renormalised is a proper distribution over target ids, so standard rejection sampling stays
lossless with probabilistic drafting too (vLLM allows TLI only with greedy drafting).
"""
from __future__ import annotations

import logging
from functools import lru_cache

import torch

log = logging.getLogger(__name__)

MIN_COMMON_TOKENS = 100


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable stand-in character -> the byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def word_start_marker(tokenizer) -> str | None:
    """'Ġ' (byte-level BPE), '▁' (SentencePiece) or None, found by encoding " a"."""
    ids = tokenizer.encode(" a", add_special_tokens=False)
    for piece in tokenizer.convert_ids_to_tokens(ids):
        if piece and piece[0] in ("Ġ", "▁"):
            return piece[0]
    return None


def token_bytes(tokenizer, vocab_size: int) -> tuple[list[bytes | None], list[bool]]:
    """The bytes each id stands for (None for special tokens and ids the tokenizer lacks), and
    whether each id is a byte-fallback token like <0x41>."""
    marker = word_start_marker(tokenizer)
    special = set(tokenizer.all_special_ids)
    special.update(i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special)
    pieces = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
    decoder = _byte_decoder()
    out: list[bytes | None] = [None] * vocab_size
    byte_fallback = [False] * vocab_size
    for i, piece in enumerate(pieces):
        if piece is None or i in special:
            continue
        if marker == "Ġ":
            if all(c in decoder for c in piece):
                out[i] = bytes(decoder[c] for c in piece)
            else:
                out[i] = piece.encode()
        elif _is_byte_piece(piece):
            out[i] = bytes([int(piece[3:5], 16)])
            byte_fallback[i] = True
        elif marker == "▁":
            out[i] = piece.replace("▁", " ").encode()
        else:
            out[i] = piece.encode()
    return out, byte_fallback


def _is_byte_piece(piece: str | None) -> bool:
    return piece is not None and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")


def fallback_id(tokenizer, side: str) -> int:
    """The id to use for a token the other side lacks: unk, else EOS (with a warning), else an error."""
    if tokenizer.unk_token_id is not None:
        return tokenizer.unk_token_id
    if tokenizer.eos_token_id is not None:
        log.warning("%s tokenizer has no unk token: tokens outside the intersection map to EOS", side)
        return tokenizer.eos_token_id
    raise ValueError(f"{side} tokenizer has neither an unk nor an EOS token to stand for tokens "
                     f"outside the vocabulary intersection")


class VocabMapping:
    def __init__(self, target_tokenizer, draft_tokenizer, target_vocab: int, draft_vocab: int,
                 retokenize: bool = True):
        self.target_tokenizer, self.draft_tokenizer = target_tokenizer, draft_tokenizer
        self.retokenize = retokenize  # False: tokens the draft lacks become its unk (plain TLI)
        self.target_bytes, target_is_byte = token_bytes(target_tokenizer, target_vocab)
        draft_bytes, draft_is_byte = token_bytes(draft_tokenizer, draft_vocab)
        by_bytes: dict[bytes, int] = {}
        # regular tokens first, so b"A" maps to the token "A" rather than its byte-fallback twin <0x41>
        for i in sorted(range(target_vocab), key=target_is_byte.__getitem__):
            b = self.target_bytes[i]
            if b is not None:
                by_bytes.setdefault(b, i)
        self.target_to_draft = torch.full((target_vocab,), -1, dtype=torch.long)
        self.draft_to_target = torch.full((draft_vocab,), -1, dtype=torch.long)
        for d in sorted(range(draft_vocab), key=draft_is_byte.__getitem__):
            b = draft_bytes[d]
            t = by_bytes.get(b) if b is not None else None
            if t is not None and self.target_to_draft[t] < 0:  # one-to-one: first draft id wins
                self.target_to_draft[t], self.draft_to_target[d] = d, t
        for role in ("eos_token_id", "bos_token_id"):
            t, d = getattr(target_tokenizer, role), getattr(draft_tokenizer, role)
            if t is not None and d is not None and t < target_vocab and d < draft_vocab \
                    and self.target_to_draft[t] < 0 and self.draft_to_target[d] < 0:
                self.target_to_draft[t], self.draft_to_target[d] = d, t
        self.draft_mask = self.draft_to_target >= 0  # [V_draft]
        common = int(self.draft_mask.sum())
        self.num_common = common
        log.info("TLI: %d common tokens (%.1f%% of the target's %d, %.1f%% of the draft's %d)", common,
                 100 * common / target_vocab, target_vocab, 100 * common / draft_vocab, draft_vocab)
        if common < MIN_COMMON_TOKENS:
            log.warning("TLI: only %d tokens in common (< %d): expect very low acceptance",
                        common, MIN_COMMON_TOKENS)
        self.draft_unk = fallback_id(draft_tokenizer, "draft")

    # -- sequence side ------------------------------------------------------------------------

    def draft_prompt(self, text: str | None, target_ids: list[int]) -> list[int]:
        """The prompt as the draft tokenizes it (text prompts), or the target ids' text re-tokenized."""
        if text is None:
            text = self.target_tokenizer.decode(target_ids, skip_special_tokens=True)
        ids = self.draft_tokenizer.encode(text)
        return ids or [self.draft_unk]

    def to_draft(self, target_ids: list[int], retokenize: bool | None = None) -> list[int]:
        """New target tokens in the draft's vocabulary. Runs of tokens with no draft id are
        re-tokenized from their bytes by the draft tokenizer (so the draft sees the same text);
        with retokenize=False they become the draft's unk (the plain TLI fallback)."""
        retokenize = self.retokenize if retokenize is None else retokenize
        out: list[int] = []
        run: list[int] = []

        def flush():
            if not run:
                return
            if retokenize:
                text = b"".join(self.target_bytes[t] or b"" for t in run).decode("utf-8", errors="replace")
                ids = self.draft_tokenizer.encode(text, add_special_tokens=False) if text else []
                out.extend(ids or [self.draft_unk])  # never nothing: the draft needs a token to feed
            else:
                out.extend([self.draft_unk] * len(run))
            run.clear()

        for t in target_ids:
            d = int(self.target_to_draft[t])
            if d >= 0:
                flush()
                out.append(d)
            else:
                run.append(t)
        flush()
        return out
