"""Chunked prefill under a token budget (max_num_batched_tokens): running rows decode while a long
prompt is prefilled over several steps; greedy tokens, prompt logprobs and aborts are as with the
prompt prefilled at once, at every chunk boundary (budget 1, the block size, prompts just above
and below the budget, TLI chunks that end inside the draft's re-tokenized text)."""
import pytest
import torch

from engine import LLM, SamplingParams
from conftest import needs_kernels
from engine.worker import SMALL_ROWS, padded_groups

TARGET, DRAFT = "random:tiny-llama:1", "random:tiny-llama:2"
GEMMA3, SMOLLM2 = "google/gemma-3-270m", "HuggingFaceTB/SmolLM2-135M-Instruct"
SPEC = {"model": DRAFT, "num_speculative_tokens": 3}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def prompt_of(llm: LLM, n: int) -> dict:
    ids = llm.get_tokenizer().encode("one two three four five six seven eight nine ten " * 40)[:n]
    assert len(ids) == n
    return {"prompt_token_ids": ids}


@pytest.fixture(scope="module")
def reference():
    """Tokens with each prompt prefilled in one step (a budget above every prompt), no speculation."""
    llm = LLM(model=TARGET, max_model_len=256, max_num_batched_tokens=4096, enable_prefix_caching=False)
    return llm, {n: llm.generate(prompt_of(llm, n), GREEDY)[0].outputs[0].token_ids for n in (1, 2, 15, 16, 17, 39, 40, 41, 120)}


@pytest.mark.parametrize("budget,lengths", [(1, [2, 16]), (16, [15, 16, 17, 41]), (40, [39, 40, 41, 120]),
                                            (256, [1, 120])])
@pytest.mark.parametrize("spec", [None, SPEC])
def test_greedy_tokens_do_not_depend_on_where_chunks_end(reference, budget, lengths, spec):
    ref_llm, want = reference
    llm = LLM(model=TARGET, max_model_len=256, max_num_batched_tokens=budget, speculative_config=spec,
              enable_prefix_caching=False)
    outs = llm.generate([prompt_of(ref_llm, n) for n in lengths], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [want[n] for n in lengths]


def test_running_streams_get_a_token_every_step_while_a_long_prompt_is_prefilled():
    llm = LLM(model=TARGET, max_model_len=1024, max_num_batched_tokens=32, speculative_config=SPEC)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    short = llm.core.add_request("short", None, prompt_of(llm, 5)["prompt_token_ids"], params)
    for _ in range(3):
        llm.core.step()
    long = llm.core.add_request("long", None, prompt_of(llm, 400)["prompt_token_ids"], params)
    steps = 0
    while long.prefilling or not long.started:
        before = len(short.output_ids)
        llm.core.step()
        steps += 1
        assert len(short.output_ids) > before  # the short stream never waits for the long prompt
    assert steps >= 400 // 32  # the prompt took several steps: at most 32 - 4 tokens each
    # its last chunk's step decoded it too: the first token came with the prefill's end
    assert len(long.output_ids) >= 1 and long.target.computed == long.num_tokens - 1


def test_prompt_logprobs_are_the_same_in_chunks():
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    whole = LLM(model=TARGET, max_model_len=256, max_num_batched_tokens=4096)
    prompt = prompt_of(whole, 70)
    want = whole.generate(prompt, params)[0].prompt_logprobs
    got = LLM(model=TARGET, max_model_len=256, max_num_batched_tokens=9).generate(prompt, params)[0].prompt_logprobs
    assert len(got) == len(want) == 70 and got[0] is None
    for g, w in zip(got[1:], want[1:]):
        assert g.keys() == w.keys()
        assert all(g[t].logprob == pytest.approx(w[t].logprob, abs=1e-5) for t in g)


def test_an_abort_in_mid_prefill_frees_its_blocks():
    llm = LLM(model=TARGET, max_model_len=512, max_num_batched_tokens=16)
    sched = llm.core.scheduler
    seq = llm.core.add_request("long", None, prompt_of(llm, 300)["prompt_token_ids"], GREEDY)
    llm.core.step()
    llm.core.step()
    assert seq.prefilling and 0 < seq.target.computed < 299
    sched.abort("long")
    assert sched.target_kv.pool.num_free == sched.target_kv.pool.num_blocks - 1 and not sched.running


def test_real_pair_chunks_inside_the_drafts_retokenized_text_keep_greedy_tokens():
    """TLI: the draft prefills its own tokens in chunks of the same budget, ending at other places."""
    prompts = ["The history of the printing press begins in", "def quicksort(items):\n    if len(items) <= 1:"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(model=GEMMA3, max_model_len=256).generate(prompts, params)
    spec = {"model": SMOLLM2, "num_speculative_tokens": 3, "use_heterogeneous_vocab": True}
    llm = LLM(model=GEMMA3, max_model_len=256, max_num_batched_tokens=7, speculative_config=spec)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert llm.spec_decode_stats.num_accepted_tokens > 0


def _prompt_kv(llm: LLM, seq, n: int):
    """The keys and values of a sequence's first n positions in every layer of the target's cache."""
    cache, bs = llm.core.executor.target.worker.cache, llm.core.scheduler.target_kv.block_size
    blocks = seq.target.blocks[: -(-n // bs)]
    return [c[layer][blocks].permute(0, 2, 1, 3).flatten(0, 1)[:n] for c in (cache.k, cache.v)
            for layer in range(len(cache.k))]


def test_one_step_prefills_its_requests_together_with_the_keys_and_values_of_each_alone(cpu_isa):
    """Short prompts admitted at once are prefilled in one forward per model (a longer one beside
    them alone); every key and value is the one a prefill of that prompt alone writes, bit for bit
    (rows never depend on each other: the CPU kernels' property, on each target; oneDNN's GEMM, the
    path without them, blocks its rows together and keeps no such promise)."""
    lengths = [5, 12, 9, 3, 40]
    together = LLM(model=TARGET, max_model_len=256, max_num_batched_tokens=256, enable_prefix_caching=False,
                   cpu_isa=cpu_isa)
    alone = LLM(model=TARGET, max_model_len=256, max_num_batched_tokens=256, enable_prefix_caching=False,
                cpu_isa=cpu_isa)
    prompts = [prompt_of(together, n)["prompt_token_ids"] for n in lengths]
    seqs = [together.core.add_request(f"r{i}", None, p, GREEDY) for i, p in enumerate(prompts)]
    together.core.step()
    assert all(not s.prefilling and len(s.output_ids) == 1 for s in seqs)  # one step: prefill, first token
    for i, p in enumerate(prompts):
        seq = alone.core.add_request(f"a{i}", None, p, GREEDY)
        alone.core.step()
        for got, want in zip(_prompt_kv(together, seqs[i], len(p)), _prompt_kv(alone, seq, len(p))):
            assert torch.equal(got, want)
        assert seq.output_ids == seqs[i].output_ids
        alone.core.scheduler.abort(f"a{i}")


@pytest.mark.parametrize("model", [GEMMA3, SMOLLM2])
def test_on_int8_every_chunking_writes_the_same_keys_and_values_bit_for_bit(model, cpu_isa):
    """On the int8 kernel (the default) every forward runs the per-row C++ layers, so a token's keys
    and values are the same whatever chunk it came in: budgets of 5 (the decode path's row counts),
    16 and 17 (around the old 16-row switch to PyTorch attention), 100 and one chunk of 300."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    kv, steps = {}, {}
    for budget in (4096, 5, 16, 17, 100):
        llm = LLM(model=model, max_model_len=512, max_num_batched_tokens=budget, enable_prefix_caching=False,
                  cpu_isa=cpu_isa)
        assert llm.core.executor.target.worker.model.layers_take_any_rows
        prompt = prompt_of(llm, 300)["prompt_token_ids"]
        seq = llm.core.add_request("r", None, prompt, params)
        steps[budget] = 0
        while not seq.output_ids:  # the first token comes from the step of the last chunk
            llm.core.step()
            steps[budget] += 1
        kv[budget] = _prompt_kv(llm, seq, len(prompt))
    assert steps == {b: -(-299 // b) for b in steps}  # the prompt but its last token, in chunks of the budget
    assert all(k.abs().sum() > 0 for k in kv[4096])  # written: the comparison is not of empty blocks
    for budget, got in kv.items():
        assert all(torch.equal(a, b) for a, b in zip(got, kv[4096])), budget


def test_on_int8_chunks_ride_in_the_decode_steps_forward_with_the_same_bits(cpu_isa):
    """While a stream decodes, a long prompt's chunks are written by the decode step's own forward
    (ragged rows, no prefill forward of their own), its last as its row's pending tokens (its first
    token from that forward); its keys and values are those of a prefill alone, bit for bit, and
    both requests' greedy tokens are those they get alone."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    alone = LLM(model=GEMMA3, max_model_len=512, max_num_batched_tokens=4096, enable_prefix_caching=False,
                cpu_isa=cpu_isa)
    prompt = prompt_of(alone, 300)["prompt_token_ids"]
    want_stream = alone.generate(prompt_of(alone, 9), params)[0].outputs[0].token_ids
    seq = alone.core.add_request("long", None, prompt, params)
    alone.core.step()  # admitted and prefilled in one step
    want_kv = _prompt_kv(alone, seq, len(prompt))
    while not seq.finished:
        alone.core.step()

    # chunks of the whole budget (no pacing by measured times: the step count is what's checked)
    llm = LLM(model=GEMMA3, max_model_len=512, max_num_batched_tokens=64, enable_prefix_caching=False,
              cpu_isa=cpu_isa, prefill_stall_ms=0)
    worker = llm.core.executor.target.worker
    assert worker.takes_ragged_rows
    prefill_calls = []
    real_prefill = worker.prefill
    worker.prefill = lambda chunks, *a, **k: (prefill_calls.append(len(chunks)), real_prefill(chunks, *a, **k))[1]
    stream = llm.core.add_request("stream", None, prompt_of(llm, 9)["prompt_token_ids"], params)
    llm.core.step()
    assert len(stream.output_ids) == 1 and not prefill_calls  # its prompt: its first round's pending tokens
    long = llm.core.add_request("long", None, prompt, params)
    steps = 0
    while long.prefilling or not long.started:
        llm.core.step()
        steps += 1
    assert steps == -(-299 // 63) and not prefill_calls  # no chunk had a forward of its own
    assert len(long.output_ids) == 1  # from the step of its last chunk
    for got, want in zip(_prompt_kv(llm, long, len(prompt)), want_kv):
        assert torch.equal(got, want)
    while not (stream.finished and long.finished):
        llm.core.step()
    assert stream.output_ids == want_stream and long.output_ids == seq.output_ids


def test_a_chunk_that_raises_in_a_decode_steps_forward_fails_its_request_alone(reference, caplog):
    """A prompt chunk riding in the decode step (here prefilled inside the target's call, before its
    forward) that raises: the step's chunks are prefilled on their own and its rows retried, so
    only that request fails; the running stream's tokens are those it gets alone."""
    ref_llm, want = reference
    llm = LLM(model=TARGET, max_model_len=256, max_num_batched_tokens=32, enable_prefix_caching=False)
    sched = llm.core.scheduler
    stream = llm.core.add_request("stream", None, prompt_of(ref_llm, 15)["prompt_token_ids"], GREEDY)
    llm.core.step()
    poisoned = llm.core.add_request("poisoned", None, [5] * 100 + [10**6] + [5] * 100, GREEDY)
    while not stream.finished:
        llm.core.step()
    assert stream.output_ids == want[15]
    assert poisoned.finish_reason == "error" and "Traceback" not in poisoned.error.message
    assert "prompt chunks raised" in caplog.text
    assert not sched.running and sched.target_kv.pool.num_free == sched.target_kv.pool.num_blocks - 1


def test_padded_groups_bound_the_padding_and_keep_every_chunk_once():
    for lengths in ([7, 6, 8, 5, 7, 9, 6], [256, 7, 7, 7], [100, 90, 95, 30, 29], [1] * 20, [300, 300, 1], [1]):
        groups = padded_groups(lengths, max_rows=512)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        for g in groups:
            padded, held = len(g) * max(lengths[i] for i in g), sum(lengths[i] for i in g)
            assert len(g) == 1 or (padded <= 512 and (padded <= SMALL_ROWS or padded <= 1.25 * held))
    assert padded_groups([256, 7, 7, 7], 512) == [[0], [1, 2, 3]]  # the short ones aren't padded to 256
    assert len(padded_groups([7, 6, 8, 5, 7, 9, 6], 512)) <= 2


@needs_kernels
def test_on_int8_a_step_computes_at_most_the_budget_in_the_target():
    """With drafts: a prompt whose last chunk becomes its row's pending tokens verifies its first
    drafts in the same forward; those count against the step's budget like a running row's, so
    the next prompt's chunk gets what is left and no forward exceeds max_num_batched_tokens."""
    budget = 64
    llm = LLM(model=GEMMA3, max_model_len=512, max_num_batched_tokens=budget, enable_prefix_caching=False,
              speculative_config={"model": SMOLLM2, "num_speculative_tokens": 3, "use_heterogeneous_vocab": True})
    worker = llm.core.executor.target.worker
    assert worker.takes_ragged_rows
    computed = []
    for name in ("forward_ragged", "prefill"):
        real = getattr(worker, name)

        def counted(tables, *args, real=real, name=name, **kwargs):
            chunks = tables if name == "prefill" else args[1]
            computed[-1] += sum(len(c.tokens) for c in chunks) if name == "prefill" else sum(len(t) for t in chunks)
            return real(tables, *args, **kwargs)
        setattr(worker, name, counted)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    stream = llm.core.add_request("stream", None, prompt_of(llm, 9)["prompt_token_ids"], params)
    computed.append(0)
    llm.core.step()
    # two prompts at once: the first's last chunk (100 - 60 = 40 tokens) and its drafts share a step
    # with the second's first chunk
    firsts = [llm.core.add_request(f"long{i}", None, prompt_of(llm, 100)["prompt_token_ids"], params) for i in range(2)]
    while not all(s.finished for s in [stream, *firsts]):
        computed.append(0)
        llm.core.step()
    assert max(computed) <= budget, computed
    assert all(s.finish_reason == "length" for s in [stream, *firsts])
