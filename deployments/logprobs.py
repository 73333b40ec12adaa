"""Log-probabilities in OpenAI's two wire shapes: completions' (tokens, token_logprobs,
top_logprobs, text_offset) and chat's (content: [{token, logprob, bytes, top_logprobs}]).

Entries come from the engine as engine.step.TokenLogprob (logprob, rank, top [(token id, logprob)]);
a token's text is its own decoding. -inf (a token outside top-k/top-p) is not JSON: it is sent as -9999.0, as vLLM does.
"""
from __future__ import annotations

import math

FLOOR = -9999.0


def finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR


class LogprobFormatter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def completion(self, token_ids: list[int], entries: list, offset: int,
                   prompt_ids: list[int] | None = None, prompt_entries: list | None = None) -> dict:
        """Completions' object for these tokens, text offsets starting at `offset`; with prompt
        entries (echo), the prompt's tokens come first (the first one's values are null)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        pairs = list(zip(prompt_ids or [], prompt_entries or [])) + list(zip(token_ids, entries))
        for token, entry in pairs:
            text = self.text(token)
            out["tokens"].append(text)
            out["text_offset"].append(offset)
            offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(finite(entry.logprob))
            out["top_logprobs"].append({self.text(t): finite(v) for t, v in entry.top})
        return out

    def chat(self, token_ids: list[int], entries: list) -> dict:
        content = []
        for token, entry in zip(token_ids, entries):
            content.append({**self._token(token, entry.logprob),
                            "top_logprobs": [self._token(t, v) for t, v in entry.top]})
        return {"content": content}

    def _token(self, token: int, logprob: float) -> dict:
        text = self.text(token)
        return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8"))}
