"""vLLM's GET /tokenizer_info: the tokenizer's config (tokenizer_config.json's fields, from its init
arguments), so that a client can tokenize through /tokenize with no local copy of the tokenizer
(lm-evaluation-harness's remote tokenizer needs `eos_token`; its chat template renders `chat_template`).

Where the files were and how they were fetched are not part of it: paths and loader arguments (a Hub
token among them) are left out.
"""
from __future__ import annotations

import math
from typing import Any

# loader arguments, not configuration: local paths, cache and download settings, credentials
LOADER_KEYS = frozenset({
    "name_or_path", "cache_dir", "token", "use_auth_token", "local_files_only", "is_local", "revision",
    "subfolder", "proxies", "force_download", "resume_download", "trust_remote_code", "_commit_hash",
})
PATH_SUFFIXES = ("_file", "_path", "_dir")  # vocab_file, merges_file, tokenizer_file, ...
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")
DROP = object()


def tokenizer_info(tokenizer, max_model_len: int) -> dict[str, Any]:
    config = {}
    for key, value in (getattr(tokenizer, "init_kwargs", None) or {}).items():
        if key in LOADER_KEYS or key.endswith(PATH_SUFFIXES):
            continue
        value = plain(value)
        if value is not DROP and not (isinstance(value, str) and looks_like_path(value)):
            config[key] = value
    for role in SPECIAL_TOKENS:  # set on the tokenizer after loading, or given as objects
        token = getattr(tokenizer, role, None)
        if isinstance(token, str):
            config[role] = token
    config["tokenizer_class"] = type(tokenizer).__name__
    # what encode() does, which is what a client must match: the GGUF Gemma tokenizer adds BOS with
    # add_bos_token False on the object
    with_special, bare = tokenizer.encode("a"), tokenizer.encode("a", add_special_tokens=False)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    config["add_bos_token"] = bos is not None and with_special[:1] == [bos] and bare[:1] != [bos]
    config["add_eos_token"] = eos is not None and with_special[-1:] == [eos] and bare[-1:] != [eos]
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):  # the one chat completions use, however it was set
        config["chat_template"] = template
    # the tokenizer's own limit is often HF's "unset" (1e30); no longer prompt than the server's fits
    limit = config.get("model_max_length")
    config["model_max_length"] = min(limit, max_model_len) if isinstance(limit, int) else max_model_len
    return config


def plain(value: Any) -> Any:
    """JSON's types only: an AddedToken becomes its text (as vLLM sends it); anything else is DROP."""
    if isinstance(value, float):
        return value if math.isfinite(value) else DROP  # JSON has no infinity
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(getattr(value, "content", None), str):
        return value.content
    if isinstance(value, dict):
        items = ((str(k), plain(v)) for k, v in value.items())
        return {k: v for k, v in items if v is not DROP}
    if isinstance(value, (list, tuple)):
        return [v for v in map(plain, value) if v is not DROP]
    return DROP


def looks_like_path(text: str) -> bool:
    return "\n" not in text and len(text) > 1 and (
        text.startswith(("/", "~", "./", "../", "\\\\")) or (text[1:3] in (":\\", ":/") and text[0].isalpha()))
