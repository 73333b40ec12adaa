"""A sequence's output text, built token by token (tokenizers' DecodeStream, as vLLM's fast
incremental detokenizer), and its stop strings matched on the new text only.

Each token costs the same however long the output is: DecodeStream decodes a few tokens around the
new one, never the whole output. A character split across tokens (UTF-8 bytes of one emoji) appears
once it is complete. Stop strings: text that might be the start of one is held back (at most the
longest stop string less one character), so a stop string never reaches a client, even in part.
"""
from __future__ import annotations

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str] | None = None, skip_special_tokens: bool = True):
        self._backend = tokenizer.backend_tokenizer  # the fast tokenizer underneath transformers'
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.stop = [s for s in (stop or []) if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # everything decoded so far, up to a stop string (excluded)
        self.stop_hit: str | None = None

    def add(self, token: int) -> str | None:
        """Decode one more token; the stop string it completes, or None. After a stop string, `text`
        ends before it and further tokens are ignored."""
        if self.stop_hit is not None:
            return self.stop_hit
        piece = self._stream.step(self._backend, token)
        if not piece:
            return None
        start = max(0, len(self.text) - self._hold)  # a stop string may begin in the held-back tail
        self.text += piece
        if self.stop:
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                cut, self.stop_hit = min(hits)
                self.text = self.text[:cut]
        return self.stop_hit

    def visible(self, finished: bool) -> int:
        """How much of `text` may be sent now: all once finished or stopped, else all but what could
        still turn out to begin a stop string."""
        if finished or self.stop_hit is not None or not self.stop:
            return len(self.text)
        tail = self.text[-self._hold:] if self._hold else ""
        firsts = {s[0] for s in self.stop}
        # the longest tail that begins some stop string: only where a stop string's first char is
        keep = next((len(tail) - i for i, c in enumerate(tail)
                     if c in firsts and any(s.startswith(tail[i:]) for s in self.stop)), 0)
        return len(self.text) - keep
