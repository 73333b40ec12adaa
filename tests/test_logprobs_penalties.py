"""The OpenAI surface inside the engine: log-probabilities (generated and prompt), penalties and
logit_bias, n > 1 and LLM.chat. Speculation changes none of it: the same logprobs with it on and
off, greedy identity and chi-squared with penalties on (they count the drafts a position follows);
values are checked against the target model computed from scratch, with vLLM's formulas written
out here independently of the engine."""
import numpy as np
import pytest
import torch

from engine.kv_cache import static_tables
from engine import LLM, SamplingParams
from engine.chat import chat_prompt_ids
from engine.models.loading import resolve_model
from engine.sampling import probs_from_logits
from engine.worker import ModelWorker
from stats import ALPHA, chi_squared_pvalue

TARGET, DRAFT = "random:tiny-llama:1", "random:tiny-llama:2"
PROMPTS = ["the cat", "hello world 12", "zebra zebra zebra"]
N = 4000
PENALTIES = [dict(presence_penalty=1.5), dict(frequency_penalty=1.0), dict(repetition_penalty=1.8),
             dict(logit_bias={7: 4.0, 22: -3.0}),
             dict(presence_penalty=0.5, frequency_penalty=-0.4, repetition_penalty=1.3, logit_bias={5: 2.0})]


@pytest.fixture(scope="module")
def plain():
    return LLM(model=TARGET, max_num_seqs=64)


@pytest.fixture(scope="module")
def spec():
    return LLM(model=TARGET, max_num_seqs=64, seed=2,
               speculative_config={"model": DRAFT, "num_speculative_tokens": 3})


@pytest.fixture(scope="module")
def reference():
    """The target's logits over a whole sequence, from a fresh cache: logits[i] predicts ids[i + 1]."""
    worker = ModelWorker(resolve_model(TARGET), num_blocks=17, block_size=16, dtype=torch.float32)
    return lambda ids: worker.forward(static_tables(1, 256, 16), [0], [ids])[0]


def penalized(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """vLLM's order: logit_bias, then repetition, frequency, presence."""
    x = logits.clone()
    for token, bias in (p.logit_bias or {}).items():
        x[token] += bias
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=x.shape[-1]).float()
    seen = counts > 0
    seen_any = seen.clone()
    seen_any[torch.tensor(prompt, dtype=torch.long)] = True
    x = torch.where(seen_any, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
    return x - p.frequency_penalty * counts - p.presence_penalty * seen.float()


def test_logprobs_are_the_targets_and_speculation_changes_nothing(plain, spec, reference):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    a, b = plain.generate(PROMPTS, params), spec.generate(PROMPTS, params)
    assert spec.spec_decode_stats.num_accepted_tokens > 0
    for x, y in zip(a, b):
        ox, oy = x.outputs[0], y.outputs[0]
        assert ox.token_ids == oy.token_ids and len(ox.logprobs) == len(ox.token_ids)
        lp = torch.log_softmax(reference(x.prompt_token_ids + ox.token_ids), -1)[len(x.prompt_token_ids) - 1:]
        for i, token in enumerate(ox.token_ids):
            assert set(ox.logprobs[i]) == set(oy.logprobs[i])
            for t, entry in ox.logprobs[i].items():
                assert abs(entry.logprob - oy.logprobs[i][t].logprob) < 1e-4
                assert abs(entry.logprob - float(lp[i, t])) < 1e-4
            top = torch.topk(lp[i], 5).indices.tolist()
            assert [t for t, e in sorted(ox.logprobs[i].items(), key=lambda kv: kv[1].rank)][:5] == top
            assert ox.logprobs[i][token].rank == 1  # greedy: the argmax
            assert ox.logprobs[i][token].decoded_token == plain.get_tokenizer().decode([token])
        assert ox.cumulative_logprob == pytest.approx(sum(ox.logprobs[i][t].logprob for i, t in enumerate(ox.token_ids)))


def test_sampled_logprobs_are_of_the_distribution_sampled_from(spec, reference):
    """After temperature and top-p, as the token was drawn: -inf outside the nucleus."""
    params = SamplingParams(temperature=0.7, top_p=0.8, max_tokens=16, ignore_eos=True, seed=3, logprobs=20)
    out = spec.generate("the cat", params)[0]
    ids, tokens = out.prompt_token_ids, out.outputs[0].token_ids
    logits = reference(ids + tokens)[len(ids) - 1:]
    expected = probs_from_logits(logits, 0.7, top_p=0.8).log()
    for i, token in enumerate(tokens):
        entry = out.outputs[0].logprobs[i]
        assert abs(entry[token].logprob - float(expected[i, token])) < 1e-4
        assert np.isfinite(entry[token].logprob)
        outside = [t for t, e in entry.items() if not np.isfinite(e.logprob)]
        assert all(float(expected[i, t]) == float("-inf") for t in outside)


def test_prompt_logprobs(plain, spec, reference):
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    a, b = plain.generate("hello world", params)[0], spec.generate("hello world", params)[0]
    ids = a.prompt_token_ids
    assert a.prompt_logprobs[0] is None and len(a.prompt_logprobs) == len(ids)
    lp = torch.log_softmax(reference(ids), -1)
    for i in range(1, len(ids)):
        assert abs(a.prompt_logprobs[i][ids[i]].logprob - float(lp[i - 1, ids[i]])) < 1e-4
        assert abs(a.prompt_logprobs[i][ids[i]].logprob - b.prompt_logprobs[i][ids[i]].logprob) < 1e-5
        assert len(a.prompt_logprobs[i]) in (3, 4)  # the top 3, and the prompt's token if not among them


@pytest.mark.parametrize("penalty", PENALTIES, ids=[",".join(p) for p in PENALTIES])
def test_penalized_greedy_decoding_is_vllms_and_speculation_keeps_it(plain, spec, reference, penalty):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, **penalty)
    a = plain.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, params)] == [o.outputs[0].token_ids for o in a]
    unpenalized = plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in a] != [o.outputs[0].token_ids for o in unpenalized]
    for out in a:  # the same tokens from a decoding loop written here
        ids, want = out.prompt_token_ids, []
        for _ in range(8):
            want.append(int(penalized(reference(ids + want)[-1], ids, want, params).argmax()))
        assert out.outputs[0].token_ids[:8] == want


@pytest.mark.parametrize("draft_sample_method", ["greedy", "probabilistic"])
def test_penalized_sampling_is_lossless(plain, reference, draft_sample_method):
    """First two tokens under penalties (the second's depend on the first): the exact distribution,
    from the target computed here, against 4000 samples through speculation (K = 3)."""
    params = dict(temperature=1.0, presence_penalty=1.2, frequency_penalty=0.6, repetition_penalty=1.5,
                  logit_bias={4: 1.5})
    llm = LLM(model=TARGET, max_num_seqs=64, seed=4,
              speculative_config={"model": DRAFT, "num_speculative_tokens": 3,
                                  "draft_sample_method": draft_sample_method})
    outs = llm.generate(["the cat"] * N, [SamplingParams(max_tokens=2, ignore_eos=True, seed=s, **params)
                                          for s in range(N)])
    first = [o.outputs[0].token_ids[0] for o in outs]
    second = [o.outputs[0].token_ids[1] for o in outs]
    ids = plain.get_tokenizer().encode("the cat")
    p = SamplingParams(**params)
    p1 = torch.softmax(penalized(reference(ids)[-1], ids, [], p), -1)
    vocab = p1.shape[0]
    p2 = sum(p1[t] * torch.softmax(penalized(reference(ids + [t])[-1], ids, [t], p), -1) for t in range(vocab))
    assert chi_squared_pvalue(first, p1.numpy()) > ALPHA
    assert chi_squared_pvalue(second, p2.numpy()) > ALPHA
    assert 0.0 < llm.spec_decode_stats.acceptance_rate < 1.0


def test_logit_bias_forces_and_forbids(spec):
    forced = spec.generate("the cat", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                    logit_bias={9: 100.0}))[0].outputs[0].token_ids
    assert forced == [9] * 10
    free = spec.generate("the cat", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0].token_ids
    banned = spec.generate("the cat", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                    logit_bias={free[0]: -100.0}))[0].outputs[0].token_ids
    assert free[0] not in banned


def test_n_samples_offline(plain):
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, ignore_eos=True, seed=7)
    out = plain.generate("the cat", params)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    texts = [o.token_ids for o in out.outputs]
    assert len({tuple(t) for t in texts}) > 1
    assert [o.token_ids for o in plain.generate("the cat", params)[0].outputs] == texts  # reproducible
    one = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=9)  # sample i has seed + i
    assert plain.generate("the cat", one)[0].outputs[0].token_ids == texts[2]


def test_chat_offline(plain):
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    chat = plain.chat(conversation, params)[0]
    ids = chat_prompt_ids(plain.get_tokenizer(), conversation)
    assert chat.prompt_token_ids == ids
    assert chat.outputs[0].token_ids == plain.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids
    two = plain.chat([conversation, [{"role": "user", "content": "x"}]], params)
    assert len(two) == 2 and two[0].outputs[0].token_ids == chat.outputs[0].token_ids


def test_real_pair_logprobs_and_penalties_with_speculation_on_and_off():
    """Gemma 3 270M with the SmolLM2 draft (TLI), as the default app serves it: the same tokens and
    log-probabilities (to float noise: a verify step computes K+1 rows at once) with penalties on."""
    from conftest import GEMMA3, SMOLLM2

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3, prompt_logprobs=2,
                            presence_penalty=0.5, repetition_penalty=1.2)
    prompts = ["The history of the printing press", "def fibonacci(n):"]
    off = LLM(model=GEMMA3, max_model_len=256).generate(prompts, params)
    spec = LLM(model=GEMMA3, max_model_len=256, speculative_config={
        "model": SMOLLM2, "num_speculative_tokens": 3, "use_heterogeneous_vocab": True})
    on = spec.generate(prompts, params)
    assert spec.spec_decode_stats.num_accepted_tokens > 0
    for a, b in zip(off, on):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert set(x) == set(y) and all(abs(x[t].logprob - y[t].logprob) < 2e-4 for t in x)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert all(abs(x[t].logprob - y[t].logprob) < 2e-4 for t in x)
