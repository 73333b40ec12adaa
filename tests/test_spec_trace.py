"""Per-request speculation controls, offline: `spec_trace` (each token's origin) and `speculative`
(drafting off for one request). The HTTP and gRPC shapes are tested with the apps
(test_serve_app.py, test_serve_config.py)."""
import pytest

from engine import LLM, SamplingParams

TINY = "random:tiny-llama:1"
K = 3


@pytest.fixture(scope="module")
def self_drafted():
    # the target drafts for itself: every greedy draft is accepted, so each round's shape is known
    return LLM(model=TINY, max_model_len=128, speculative_config={"model": TINY, "num_speculative_tokens": K})


@pytest.fixture(scope="module")
def other_drafted():
    # an unrelated draft: rounds end in rejections and corrections
    return LLM(model=TINY, max_model_len=128,
               speculative_config={"model": "random:tiny-llama:2", "num_speculative_tokens": K})


def traced(llm, prompt="hello", **kw):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, spec_trace=True, **kw)
    out = llm.generate(prompt, params)[0]
    return out, out.outputs[0]


def check_shape(out, o):
    assert len(o.origins) == len(o.token_ids)
    ends = [x.end for x in o.origins]
    assert ends == sorted(ends) and ends[-1] == len(o.text)
    rounds = [x.round for x in o.origins]
    assert rounds == sorted(rounds) and rounds[0] == 0
    # each round: its accepted drafts, then exactly one target token (the last round may be cut short)
    for r in set(rounds):
        mine = [x for x in o.origins if x.round == r]
        drafts = [x for x in mine if x.draft]
        assert mine[:len(drafts)] == drafts
        if r != rounds[-1]:
            assert len(mine) == len(drafts) + 1 and 0 <= len(drafts) <= mine[-1].k
    assert sum(x.draft for x in o.origins) == out.spec_decode_stats.num_accepted_tokens


def test_a_self_drafted_greedy_run_is_rounds_of_k_accepted_drafts_and_a_bonus(self_drafted):
    out, o = traced(self_drafted)
    check_shape(out, o)
    # the first round verifies the prompt and K drafts at once; the last may propose fewer
    # (max_tokens left no room for K)
    expected = []
    for r in range(o.origins[-1].round):
        expected += [(r, True, 0)] * K + [(r, False, K)]
    assert [(x.round, x.draft, x.k) for x in o.origins[:len(expected)]] == expected
    assert len(o.token_ids) - len(expected) <= K + 1


def test_an_unrelated_draft_leaves_corrections_and_the_counts_agree_with_the_stats(other_drafted):
    out, o = traced(other_drafted)
    check_shape(out, o)
    assert out.spec_decode_stats.num_drafts > 0
    assert sum(not x.draft for x in o.origins) > 1  # corrections, besides the prefill's token


def test_token_text_spans_cover_the_text_and_a_stop_string_cuts_them(self_drafted):
    _, free = traced(self_drafted)
    stop = free.text[12:14]
    _, cut = traced(self_drafted, stop=[stop])
    assert cut.text == free.text[:free.text.index(stop)]
    assert cut.origins[-1].end == len(cut.text)
    assert all(x.end <= len(cut.text) for x in cut.origins)


def test_no_trace_unless_asked(self_drafted):
    out = self_drafted.generate("hello", SamplingParams(temperature=0, max_tokens=8))[0]
    assert out.outputs[0].origins is None


def test_speculative_false_drafts_nothing_and_greedy_gives_the_same_tokens(other_drafted):
    out_spec, spec = traced(other_drafted)
    out_plain, plain = traced(other_drafted, speculative=False)
    assert out_spec.spec_decode_stats.num_drafts > 0
    assert out_plain.spec_decode_stats.num_drafts == 0 and not any(x.draft for x in plain.origins)
    assert [x.round for x in plain.origins] == list(range(len(plain.token_ids)))  # one token a round
    assert plain.token_ids == spec.token_ids
