"""Structured outputs: a request's output held to a grammar (JSON schema, regex, choice, Lark/GBNF).

llguidance does the grammar work: it compiles each kind to one grammar form, bounds what a grammar
may cost (lexer fuel, grammar size: a hostile schema fails to compile instead of hanging), computes
a token mask in well under a millisecond even for a 262k vocabulary, and rolls back consumed tokens,
which speculation needs. The edge compiles (GrammarCompiler, off the step thread, cached by text);
the workers hold one matcher per request (engine/grammar_masks.py).
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from typing import Any

from dataclasses import asdict, fields

from pydantic import ConfigDict, model_validator
from pydantic.dataclasses import dataclass

from engine.errors import InvalidRequest

log = logging.getLogger(__name__)

# bounds on what one request may ask the compiler to read (a schema is also bounded by the body limit)
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_CHOICES = 4096
# llguidance's resource limits: fuel is ~50k units a millisecond, so a grammar's lexer gets at most
# ~0.2 s to build and each token's mask ~4 ms of lexer work; past them the grammar is refused.
LEXER_FUEL = 10_000_000
STEP_LEXER_FUEL = 200_000
MAX_GRAMMAR_SIZE = 2_000_000
# JSON's whitespace when a request names none: a space, or a line break and an indent (pretty-printed
# JSON), between two tokens; never the unbounded run llguidance otherwise allows, in which a weak model
# (or a sampled one) can spend its whole max_tokens (llama.cpp's schema grammars bound it the same
# way). `whitespace_pattern` opts out, e.g. "[ \t\n\r]*".
DEFAULT_JSON_WHITESPACE = "(?: ?|\n{1,2}[ \t]{0,20})"
COMPILED_CACHE = 256  # grammars kept compiled (or refused), least recently used out
# Each worker builds a request's grammar again (on its step, the first time it sees it): a grammar
# slower than this to compile at the edge is refused, so no request can stall the others for longer.
MAX_COMPILE_S = 0.5


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class StructuredOutputsParams:
    """vLLM's StructuredOutputsParams: exactly one of json, regex, choice, grammar, json_object."""

    json: dict | str | None = None  # a JSON schema (a dict, or its text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF/EBNF (llama.cpp's)
    json_object: bool | None = None  # any JSON object
    disable_any_whitespace: bool = False  # JSON without whitespace between tokens
    whitespace_pattern: str | None = None  # JSON whitespace as this regex (None: DEFAULT_JSON_WHITESPACE)
    # the grammar applies after a reasoning model's thinking (free text up to </think>); set by the
    # server's reasoning parser, or offline (Tandem's; vLLM tracks it in its engine)
    after_reasoning: bool = False

    @model_validator(mode="after")
    def _one_kind(self) -> "StructuredOutputsParams":
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError("structured_outputs: give exactly one of json, regex, choice, grammar, json_object"
                             + (f" (got {', '.join(given)})" if given else ""))
        if self.choice is not None and not 1 <= len(self.choice) <= MAX_CHOICES:
            raise ValueError(f"structured_outputs.choice: 1 to {MAX_CHOICES} strings")
        if self.choice is not None and not all(self.choice):
            raise ValueError("structured_outputs.choice: the strings must not be empty")
        if self.disable_any_whitespace and self.whitespace_pattern is not None:
            raise ValueError("structured_outputs: give at most one of disable_any_whitespace, whitespace_pattern")
        return self

    def key(self) -> str:
        """The grammar's identity: equal keys compile to the same grammar."""
        given = {f.name: v for f, v in zip(fields(self), asdict(self).values()) if v not in (None, False)}
        return json.dumps(given, sort_keys=True, separators=(",", ":"))


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for `params` (not yet checked against a tokenizer); InvalidRequest."""
    grammar = _kind_grammar(params)
    if params.after_reasoning:
        from engine.reasoning import after_reasoning

        grammar = after_reasoning(grammar)
    return grammar


def _kind_grammar(params: StructuredOutputsParams) -> str:
    import llguidance
    from llguidance import LLMatcher

    if params.json is not None or params.json_object:
        schema = params.json if params.json is not None else {"type": "object"}
        text = schema if isinstance(schema, str) else json.dumps(schema)
        _check_size(text, "json")
        options: dict[str, Any] = {}
        if params.disable_any_whitespace:
            options["whitespace_flexible"] = False
        else:
            options["whitespace_pattern"] = params.whitespace_pattern or DEFAULT_JSON_WHITESPACE
        try:
            return LLMatcher.grammar_from_json_schema(text, overrides=options or None)
        except ValueError as e:
            raise InvalidRequest.of_field("structured_outputs.json", f"not a JSON schema object ({_short(e)})") from None
    if params.regex is not None:
        _check_size(params.regex, "regex")
        return LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        _check_size("".join(params.choice), "choice")
        return llguidance.grammar_from("choice", params.choice)
    _check_size(params.grammar, "grammar")
    try:
        return llguidance.grammar_from("grammar", params.grammar)
    except ValueError as e:
        raise InvalidRequest.of_field("structured_outputs.grammar", _short(e)) from None


def _check_size(text: str, field: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise InvalidRequest.of_field(f"structured_outputs.{field}", f"at most {MAX_GRAMMAR_CHARS} characters, got {len(text)}")


def _short(e: Exception, limit: int = 300) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit] + "..."


def parser_limits():
    from llguidance import LLParserLimits

    return LLParserLimits(initial_lexer_fuel=LEXER_FUEL, step_lexer_fuel=STEP_LEXER_FUEL,
                          max_grammar_size=MAX_GRAMMAR_SIZE)


_tokenizers: dict[tuple, Any] = {}
_tokenizers_lock = threading.Lock()


def ll_tokenizer(hf_tokenizer, eos_ids: set[int] | list[int]):
    """llguidance's view of a tokenizer (~4 s for Gemma's 262k tokens): built once per process.
    The end tokens (EOS, end of turn) are what a finished grammar allows."""
    import llguidance.hf

    key = (getattr(hf_tokenizer, "name_or_path", None) or id(hf_tokenizer), len(hf_tokenizer), tuple(sorted(eos_ids)))
    with _tokenizers_lock:
        if key not in _tokenizers:
            start = time.perf_counter()
            try:
                _tokenizers[key] = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=len(hf_tokenizer),
                                                                eos_token=sorted(eos_ids))
            except ValueError as e:  # a decoder llguidance doesn't read: each token's own text
                log.info("grammar tokenizer from token texts (%s)", _short(e))
                _tokenizers[key] = llguidance.LLTokenizer(
                    llguidance.TokenizerWrapper(_TokenTexts(hf_tokenizer)), n_vocab=len(hf_tokenizer),
                    eos_token=sorted(eos_ids))
            log.info("grammar tokenizer ready in %.1f s (%d tokens)", time.perf_counter() - start, len(hf_tokenizer))
        return _tokenizers[key]


class _TokenTexts:
    """A tokenizer as llguidance's TokenizerWrapper reads one: every token's bytes and an encoder.
    A token's text is what it adds after another token (decoders drop a word marker's space at the
    start of a text). Exact for tokenizers whose tokens decode whole (character and word level)."""

    def __init__(self, hf_tokenizer):
        self.eos_token_id, self.bos_token_id = hf_tokenizer.eos_token_id, hf_tokenizer.bos_token_id
        specials = set(hf_tokenizer.all_special_ids)
        self.special_token_ids = sorted(specials)
        anchor = next(i for i in range(len(hf_tokenizer)) if i not in specials)
        prefix = hf_tokenizer.decode([anchor])
        self.tokens = []
        for i in range(len(hf_tokenizer)):
            text = hf_tokenizer.decode([anchor, i]) if i not in specials else None
            text = text[len(prefix):] if text is not None and text.startswith(prefix) else hf_tokenizer.decode([i])
            self.tokens.append(text.encode("utf-8"))
        self._encode = hf_tokenizer.encode

    def __call__(self, text: str) -> list[int]:
        return self._encode(text, add_special_tokens=False)


class GrammarCompiler:
    """Checks and compiles requests' grammars against the target's tokenizer, cached by their text.
    Thread-safe; call it off the step thread (the request layer's pool, the offline caller)."""

    def __init__(self, hf_tokenizer, eos_ids: set[int]):
        self._hf_tokenizer, self._eos_ids = hf_tokenizer, eos_ids
        self._cache: OrderedDict[str, str | InvalidRequest] = OrderedDict()  # a grammar, or why it was refused
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> str:
        """The checked llguidance grammar; InvalidRequest with what is wrong (param: the kind of input,
        "structured_outputs.json" ...).
        Refusals are cached too: a costly grammar sent again costs nothing more."""
        key = params.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                found = self._cache[key]
                if isinstance(found, InvalidRequest):
                    raise InvalidRequest(found.param, str(found), found.reason)
                return found
        try:
            grammar = self._compile(params)
        except InvalidRequest as e:
            grammar = e
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > COMPILED_CACHE:
                self._cache.popitem(last=False)
        if isinstance(grammar, InvalidRequest):
            raise InvalidRequest(grammar.param, str(grammar), grammar.reason)
        return grammar

    def _compile(self, params: StructuredOutputsParams) -> str:
        from llguidance import LLMatcher

        grammar = grammar_text(params)
        field = f"structured_outputs.{_kind(params)}"
        tokenizer = ll_tokenizer(self._hf_tokenizer, self._eos_ids)
        start = time.perf_counter()
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer, limits=parser_limits())
        if is_error:
            raise InvalidRequest.of_field(field, f"the grammar does not compile: {_short(messages[0])}")
        # the lexer is built lazily: a first mask proves that the grammar's first step fits its limits
        matcher = LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
        first = matcher.compute_bitmask()
        if not matcher.is_error() and not any(first):
            raise InvalidRequest.of_field(field, "no token of this model's vocabulary can begin an output the "
                                          "grammar allows")
        if matcher.is_error():
            raise InvalidRequest.of_field(field, f"the grammar does not compile: {matcher_error(matcher.get_error())}")
        elapsed = time.perf_counter() - start
        if elapsed > MAX_COMPILE_S:
            raise InvalidRequest.of_field(field, f"the grammar took {elapsed:.1f} s to compile, more than the "
                                          f"{MAX_COMPILE_S} s allowed; simplify it (fewer alternatives, smaller enums)")
        log.debug("grammar compiled in %.1f ms", 1e3 * elapsed)
        return grammar


def matcher_error(message: str) -> str:
    """llguidance's error without its parser-state dump."""
    head = message.split("<state>")[0].strip()
    if head.startswith("NoExtension"):
        return "no token of this model's vocabulary can begin an output it allows"
    return _short(head or message)


def _kind(params: StructuredOutputsParams) -> str:
    for name in ("json", "regex", "choice", "grammar"):
        if getattr(params, name) is not None:
            return name
    return "json_object"
