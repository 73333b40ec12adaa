"""Structured outputs with speculation: every output follows its grammar, greedy output is the same
with speculation on and off (every drafting mode), sampled tokens follow the target's distribution
masked by the grammar (chi-squared), and bad or hostile grammars are refused with a clear error,
in bounded time, without harming other requests."""
import json
import time

import jsonschema
import pytest
import torch

from engine import LLM, SamplingParams
from engine.grammar_masks import GrammarMasks, apply_bitmask, unpack
from engine.structured import GrammarCompiler, StructuredOutputsParams
from stats import ALPHA, chi_squared_pvalue, exact_first_two

SMOLLM2, GEMMA3 = "HuggingFaceTB/SmolLM2-135M-Instruct", "google/gemma-3-270m"

JSON_TARGET, JSON_DRAFT = "random:tiny-llama-json:1", "random:tiny-llama-json:2"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0,
                                                                            "maximum": 150},
                         "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "bc", "def"]}},
                         "ok": {"type": "boolean"}}}
JSON_SO = {"json": SCHEMA, "disable_any_whitespace": True}
# vocab 48 (lowercase, digits, " .,!?'-:\n"): a grammar every tiny model can write
REGEX = r"(yes|no), [a-z]{2,6}( [a-z0-9]{1,5}){0,4}\."
PROMPTS = ["hello world", "the cat sat on the mat", "a", "numbers 1 2 3"]


def greedy(so, n: int = 48, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, structured_outputs=so, **kw)


def texts(llm, params, prompts=PROMPTS) -> list[str]:
    return [o.outputs[0].text for o in llm.generate(prompts, params)]


# -- masks alone -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def json_tokenizer():
    return LLM(model=JSON_TARGET).get_tokenizer()


def test_unpacked_mask_is_llguidances_own(json_tokenizer):
    """Bit order: the bool mask equals llguidance's byte-per-token one, at several grammar states."""
    from llguidance import LLMatcher

    from engine.structured import ll_tokenizer, parser_limits

    tok = json_tokenizer
    grammar = GrammarCompiler(tok, {tok.eos_token_id}).compile(StructuredOutputsParams(**JSON_SO))
    matcher = LLMatcher(ll_tokenizer(tok, {tok.eos_token_id}), grammar, log_level=0, limits=parser_limits())
    for token in tok.encode('{"name":"ab', add_special_tokens=False) + [None]:
        bits = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)[None]
        reference = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8) > 0
        assert torch.equal(unpack(bits, len(tok))[0], reference[: len(tok)])
        if token is not None:
            assert matcher.consume_token(token)


def test_masks_of_drafts_are_the_states_after_them(json_tokenizer):
    """A row's k + 1 masks are those of the grammar after each prefix of its drafts; after a refused
    draft every token is allowed (those positions are never sampled), and the state rolls back."""
    tok = json_tokenizer
    grammar = GrammarCompiler(tok, {tok.eos_token_id}).compile(StructuredOutputsParams(**JSON_SO))
    masks = GrammarMasks(tok, {tok.eos_token_id}, len(tok))
    masks.add("r", grammar, [])
    good = tok.encode('{"na', add_special_tokens=False)
    bitmask, errors = masks.masks([("r", 0, good)])
    allowed = unpack(bitmask, len(tok))
    assert not errors and allowed.shape == (len(good) + 1, len(tok))
    for j in range(len(good) + 1):  # position j: after good[:j]; the draft there is allowed
        step = GrammarMasks(tok, {tok.eos_token_id}, len(tok))
        step.add("s", grammar, good[:j])
        assert torch.equal(allowed[j], unpack(step.masks([("s", j, [])])[0], len(tok))[0])
        if j < len(good):
            assert allowed[j, good[j]]
    refused = tok.encode('{x', add_special_tokens=False)
    allowed = unpack(masks.masks([("r", 0, refused)])[0], len(tok))
    assert allowed[0, refused[0]] and not allowed[1, refused[1]] and allowed[2].all()
    assert torch.equal(unpack(masks.masks([("r", 0, [])])[0], len(tok))[0], allowed[0])  # rolled back


@pytest.mark.parametrize("kernel", [True, False], ids=["cpp", "pytorch"])
@pytest.mark.parametrize("vocab", [100, 104, 262144])
def test_bitmask_applied_sparse_or_dense_equals_a_dense_mask(vocab, kernel):
    """Rows that allow few tokens and rows that allow most, scattered rows, a vocabulary past the
    bitmask's bits: the same logits as a plain masked_fill with the unpacked mask (our C++ kernel and
    the PyTorch version)."""
    from engine import kernels

    if kernel and kernels.choose() is None:
        pytest.skip("no C++ kernels on this CPU (no AVX2, or not x86): the PyTorch case covers it")
    g = torch.Generator().manual_seed(0)
    width = (min(vocab, 100) + 31) // 32 if vocab < 1000 else vocab // 32
    bitmask = torch.zeros(6, width, dtype=torch.int32)
    bitmask[0, 1] = 0b1011  # a few tokens
    bitmask[1] = -1  # everything
    bitmask[2] = torch.randint(-2**31, 2**31 - 1, (width,), generator=g, dtype=torch.int32)  # dense mix
    bitmask[3] = -1
    bitmask[3, 0] = 0x7FFFFFFE  # most, with bits 0 and 31 refused
    bitmask[5, -1] = -2**31  # only the last bit (sign)
    logits = torch.randn(9, vocab, generator=g)
    rows = [7, 0, 3, 5, 1, 8]
    expected = logits.clone()
    allowed = unpack(bitmask, vocab)
    for i, r in enumerate(rows):
        expected[r] = expected[r].masked_fill(~allowed[i], float("-inf"))
    apply_bitmask(logits, rows, bitmask, kernel=kernel)
    assert torch.equal(logits, expected)


# -- greedy identity, every drafting mode ----------------------------------------------------------

@pytest.fixture(scope="module")
def regex_reference():
    return texts(LLM(model="random:tiny-llama:1"), greedy({"regex": REGEX}))


@pytest.mark.parametrize("spec", [
    {"model": "random:tiny-llama:2", "num_speculative_tokens": 3},
    {"model": "random:tiny-llama:1", "num_speculative_tokens": 4},  # self-draft: drafts accepted
    {"model": "random:tiny-llama:2", "num_speculative_tokens": 3, "draft_sample_method": "probabilistic"},
    {"model": "random:tiny-llama:2", "num_speculative_tokens": 3, "rejection_sample_method": "block"},
    {"model": "random:tiny-llama:2", "num_speculative_tokens": 5, "adaptive": True},
    {"model": "random:tiny-llama:1", "num_speculative_tokens": 3, "draft_ahead": True},
    {"model": "random:tiny-llama-pard:2", "num_speculative_tokens": 3, "parallel_drafting": True},
], ids=["other-k3", "self-k4", "probabilistic", "block", "adaptive", "draft-ahead", "pard"])
def test_greedy_regex_output_equals_plain(regex_reference, spec):
    import re

    llm = LLM(model="random:tiny-llama:1", speculative_config=spec)
    if spec.get("draft_ahead"):
        from engine.ahead_policy import AheadPolicy

        llm.core.scheduler.policy.ahead = AheadPolicy(fixed=True)
    out = texts(llm, greedy({"regex": REGEX}))
    assert out == regex_reference
    assert all(re.fullmatch(REGEX, t) for t in out), out


def test_greedy_json_with_penalties_equals_plain():
    params = greedy(JSON_SO, 64, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3)
    plain = texts(LLM(model=JSON_TARGET), params)
    spec = texts(LLM(model=JSON_TARGET, speculative_config={"model": JSON_DRAFT, "num_speculative_tokens": 3}), params)
    assert spec == plain
    for t in plain:
        jsonschema.validate(json.loads(t), SCHEMA)


# -- sampling: the masked target distribution, and valid output every time -------------------------

@pytest.mark.parametrize("draft_sample_method,method", [("greedy", "standard"), ("probabilistic", "block")])
def test_sampled_tokens_follow_the_masked_target(draft_sample_method, method):
    """Regex [a-e][a-z]: token 1 from the target's distribution masked to a..e, token 2 from the
    target's masked to a..z given token 1 (exact, chi-squared; the draft is another model)."""
    n = 3000
    plain = LLM(model="random:tiny-llama:1")
    llm = LLM(model="random:tiny-llama:1", max_num_seqs=64, seed=3,
              speculative_config={"model": "random:tiny-llama:2", "num_speculative_tokens": 3,
                                  "draft_sample_method": draft_sample_method, "rejection_sample_method": method})
    so = {"regex": "[a-e][a-z]"}
    params = [SamplingParams(temperature=1.0, max_tokens=2, seed=s, structured_outputs=so) for s in range(n)]
    outs = llm.generate(["the cat"] * n, params)
    tok = plain.get_tokenizer()
    vocab = plain.core.executor.target.worker.vocab_size
    letters = lambda chars: torch.tensor([i in set(tok.convert_tokens_to_ids(list(chars))) for i in range(vocab)])
    p1, p2 = exact_first_two(plain, tok.encode("the cat"), 1.0, allowed=(letters("abcde"),
                                                                       letters("abcdefghijklmnopqrstuvwxyz")))
    first = [o.outputs[0].token_ids[0] for o in outs]
    second = [o.outputs[0].token_ids[1] for o in outs]
    assert chi_squared_pvalue(first, p1) > ALPHA
    assert chi_squared_pvalue(second, p2) > ALPHA
    assert 0.0 < llm.spec_decode_stats.acceptance_rate < 1.0


def test_fifty_sampled_requests_validate():
    llm = LLM(model=JSON_TARGET, speculative_config={"model": JSON_DRAFT, "num_speculative_tokens": 3})
    params = [SamplingParams(temperature=1.0, max_tokens=120, seed=s, structured_outputs=JSON_SO) for s in range(50)]
    outs = llm.generate(["person:"] * 50, params)
    for o in outs:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)


def test_real_pair_schema_greedy_identity_and_validity():
    """The default pair (Gemma 3 target, SmolLM2 draft through TLI): greedy equal to plain under a
    schema, and 50 sampled requests (T = 1) that all validate."""
    gemma_plain = LLM(model=GEMMA3, max_model_len=1024)
    default_pair = LLM(model=GEMMA3, max_model_len=1024, speculative_config={
        "model": SMOLLM2, "num_speculative_tokens": 3, "use_heterogeneous_vocab": True})
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
              "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"},
                             "city": {"type": "string", "maxLength": 16}}}
    so = {"json": schema, "whitespace_pattern": r"[ \n]{0,2}"}
    prompts = ["Alice is 30 and lives in Paris. As JSON:\n", "Bob, 42, Berlin. JSON:\n"]
    assert texts(default_pair, greedy(so, 64), prompts) == texts(gemma_plain, greedy(so, 64), prompts)
    params = [SamplingParams(temperature=1.0, max_tokens=96, seed=s, structured_outputs=so) for s in range(50)]
    for o in default_pair.generate([prompts[s % 2] for s in range(50)], params):
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        jsonschema.validate(json.loads(o.outputs[0].text), schema)


# -- bad input ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    return LLM(model=JSON_TARGET, speculative_config={"model": JSON_DRAFT, "num_speculative_tokens": 2})


@pytest.mark.parametrize("so,words", [
    ({"json": {"type": "nope"}}, "nope"),
    ({"json": "{not json"}, "json"),
    ({"regex": "(a"}, "regex"),
    ({"grammar": "start: undefined_rule"}, "undefined_rule"),
])
def test_a_grammar_that_does_not_compile_is_refused(tiny, so, words):
    with pytest.raises(ValueError, match="structured_outputs") as info:
        tiny.generate(["x"], greedy(so))
    assert words in str(info.value)


@pytest.mark.parametrize("kind,so", [
    ("nested", {"json": json.loads('{"type": "array", "items": ' * 60 + '{"type": "integer"}' + "}" * 60)}),
    ("huge enum", {"json": {"enum": [f"value{i}" for i in range(20000)]}}),
    ("regex", {"regex": "((a|aa)*|b{1,999}){1,999}c{99999}"}),
])
def test_a_hostile_grammar_is_bounded(tiny, kind, so):
    """Refused at once, usable, or failed alone when a step passes the grammar's limits, within
    seconds; and the engine serves the next request as before."""
    start = time.perf_counter()
    try:
        out = tiny.generate(["x"], greedy(so, 8))[0].outputs[0]
        assert out.token_ids
    except (ValueError, RuntimeError) as e:  # refused / failed in a step, with the grammar named
        assert "structured_outputs" in str(e)
    assert time.perf_counter() - start < 20.0, kind
    ok = tiny.generate(["x"], greedy({"regex": "[a-z]{3}"}))[0].outputs[0].text
    assert len(ok) == 3


def test_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["b"]})
    with pytest.raises(ValueError):
        SamplingParams(structured_outputs={"json_schema": {}})  # not a field: a typo is refused
