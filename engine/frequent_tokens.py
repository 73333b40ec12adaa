"""FR-Spec (Zhao et al. 2025): the draft's LM head scores only its most frequent tokens.

A small draft spends a large share of its step in the LM head (Qwen2.5-Coder 0.5B: 151,936 x 896,
~28% of its weights), most of whose rows are tokens it almost never proposes. With
`draft_head_tokens: N` the draft's head computes N rows; the other tokens' logits are -inf, so the
draft proposes from the subset and its distribution q is renormalised over it. The target still
verifies against its full distribution: greedy output is unchanged, and rejection sampling stays
lossless (any q works, given the q a draft was sampled from), as for a TLI draft's intersection.

Frequency comes from text every install has: token counts over the Python standard library's
sources (code, comments and docstrings: ~13 MB, tokenized once per tokenizer in ~4 s and cached),
then, for tokens the corpus lacks, the tokenizer's own order: a BPE's merge ranks (a merge learned
earlier joined a more frequent pair), a Unigram's scores, else ids. Special and added tokens and the
base alphabet are always in the subset. The subset changes only how much the draft is accepted,
never the output.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import sysconfig
from collections import Counter
from pathlib import Path

import torch
from torch import Tensor, nn

from engine.models.linear import take_rows
from engine.models.loading import cache_dir

log = logging.getLogger(__name__)


def frequency_order(tokenizer, vocab_size: int) -> tuple[list[int], int]:
    """(every id below vocab_size once, most frequent first; how many lead it that are always kept:
    the special and added tokens, then the base alphabet)."""
    kept = [i for i in sorted(set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {})))
            if 0 <= i < vocab_size]
    model = _tokenizer_model(tokenizer)
    vocab = model.get("vocab") or {}
    if model.get("type") == "BPE" and isinstance(vocab, dict):
        merged: dict[str, int] = {}
        for rank, pair in enumerate(model.get("merges") or []):
            left, right = pair if isinstance(pair, list) else pair.split(" ", 1)
            merged.setdefault(left + right, rank)
        ranked = sorted((merged.get(token, -1), i, token) for token, i in vocab.items() if i < vocab_size)
        kept += [i for rank, i, token in ranked if rank < 0 and len(token) == 1]  # the alphabet
        rest = [i for rank, i, _ in ranked if rank >= 0]
    elif model.get("type") == "Unigram" and isinstance(vocab, list):
        rest = [i for _, i in sorted((-score, i) for i, (_, score) in enumerate(vocab) if i < vocab_size)]
    else:
        rest = []
    seen: set[int] = set()
    kept = [i for i in kept if not (i in seen or seen.add(i))]
    counted = [i for i in corpus_order(tokenizer) if i < vocab_size]
    order = kept + [i for i in counted + rest + list(range(vocab_size)) if not (i in seen or seen.add(i))]
    return order, len(kept)


CORPUS_BYTES = 16 << 20


def corpus_order(tokenizer) -> list[int]:
    """The ids seen in the standard library's sources, most counted first (cached per tokenizer)."""
    model = json.dumps(_tokenizer_model(tokenizer), sort_keys=True)
    key = hashlib.sha256(f"{sys.version_info[:2]}\0{model}".encode()).hexdigest()[:16]
    path = cache_dir() / "frequent_tokens" / f"{key}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    counts: Counter[int] = Counter()
    for text in _corpus(CORPUS_BYTES):
        counts.update(tokenizer.encode(text, add_special_tokens=False))
    order = [i for i, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(order))
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache: count again next start
        log.warning("FR-Spec: could not cache the token counts (%s)", e)
    return order


def _corpus(limit: int):
    """The standard library's .py files (no tests), in a fixed order, up to `limit` bytes, in pieces."""
    root = Path(sysconfig.get_paths()["stdlib"])
    left = limit
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if left <= 0:
            return
        if parts[0] in ("site-packages", "dist-packages") or any(p in ("test", "tests", "idle_test") for p in parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")[:left]
        except (OSError, UnicodeDecodeError):
            continue
        left -= len(text)
        yield text


def _tokenizer_model(tokenizer) -> dict:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return json.loads(backend.to_str())["model"] if backend is not None else {}


def frequent_token_ids(tokenizer, vocab_size: int, count: int) -> Tensor:
    """The `count` most frequent ids, sorted (more where the always-kept tokens need it)."""
    if count >= vocab_size:
        return torch.arange(vocab_size)
    order, always = frequency_order(tokenizer, vocab_size)
    return torch.tensor(sorted(order[:max(count, always)]), dtype=torch.long)


class FrequentTokenHead(nn.Module):
    """An LM head that computes the rows of `ids` only and gives -inf to every other token."""

    def __init__(self, head: nn.Module, ids: Tensor, vocab_size: int):
        super().__init__()
        self.head = take_rows(head, ids)
        self.register_buffer("ids", ids, persistent=False)
        self.vocab_size = vocab_size

    def forward(self, x: Tensor) -> Tensor:
        scores = self.head(x)
        out = scores.new_full((*scores.shape[:-1], self.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.ids, scores)


def restrict_head(model: nn.Module, tokenizer, count: int) -> int:
    """Give `model` (a Transformer) a FrequentTokenHead over its `count` most frequent tokens;
    returns how many rows it computes (at least the always-kept tokens)."""
    vocab = model.args.vocab_size
    if count >= vocab:
        return vocab
    ids = frequent_token_ids(tokenizer, vocab, count)
    head = model.lm_head
    model.lm_head = FrequentTokenHead(head, ids.to(_device(head)), vocab)
    log.info("FR-Spec: the draft's LM head computes %d of its %d tokens", len(ids), vocab)
    return len(ids)


def _device(layer: nn.Module) -> torch.device:
    weight = getattr(layer, "weight", None)
    return weight.device if isinstance(weight, Tensor) and weight.numel() else torch.device("cpu")
