"""The CUDA path: every tensor and generator on the worker's GPU. Skipped without CUDA; run on a GPU
machine by scripts/gpu_check.sh. float32 so speculative and plain decoding are comparable bit for bit."""
import pytest
import torch

from engine import LLM, SamplingParams
from stats import ALPHA, chi_squared_pvalue, exact_first_two

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TARGET, DRAFT = "random:tiny-llama:1", "random:tiny-llama:2"
PROMPTS = ["hello world", "the cat sat on the mat", "numbers 1 2 3", "zebra"]


def cuda_llm(spec: dict | None = None, **kw) -> LLM:
    return LLM(model=TARGET, device="cuda", dtype="float32", max_num_seqs=64, seed=1,
               speculative_config={"model": DRAFT, "num_speculative_tokens": 3, **spec} if spec is not None else None,
               **kw)


def test_workers_live_on_the_gpu():
    llm = cuda_llm({})
    llm.generate("hi", SamplingParams(temperature=0.8, max_tokens=4, seed=1))
    for rank in (llm.core.executor.target, llm.core.executor.draft):
        assert next(rank.worker.model.parameters()).is_cuda
        assert all(g.device.type == "cuda" for g in rank.worker.generators.values()) or not rank.worker.generators


@pytest.mark.parametrize("spec", [{}, {"rejection_sample_method": "block"}, {"draft_sample_method": "probabilistic"},
                                  {"draft_ahead": True}, {"draft_ahead": True, "model": TARGET}])
def test_greedy_speculation_equals_plain_decoding(spec):
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in cuda_llm().generate(PROMPTS, greedy)]
    fast = [o.outputs[0].token_ids for o in cuda_llm(spec).generate(PROMPTS, greedy)]
    assert fast == plain


@pytest.mark.parametrize("draft_sample_method", ["greedy", "probabilistic"])
def test_sampling_is_lossless_on_cuda(draft_sample_method):
    plain = LLM(model=TARGET, device="cpu", dtype="float32", max_num_seqs=8)  # exact distributions, on the CPU
    llm = cuda_llm({"draft_sample_method": draft_sample_method})
    n = 4000
    params = [SamplingParams(temperature=t, top_p=tp, max_tokens=2, ignore_eos=True, seed=s)
              for s, (t, tp) in enumerate([(1.0, 1.0), (0.7, 0.9)] * (n // 2))]
    outs = [o.outputs[0].token_ids for o in llm.generate(["the cat"] * n, params)]
    ids = plain.get_tokenizer().encode("the cat")
    for k, (t, tp) in enumerate([(1.0, 1.0), (0.7, 0.9)]):
        p1, p2 = exact_first_two(plain, ids, t, tp)
        rows = outs[k::2]
        assert chi_squared_pvalue([r[0] for r in rows], p1) > ALPHA
        assert chi_squared_pvalue([r[1] for r in rows], p2) > ALPHA


def test_seeded_request_alone_equals_in_batch_on_cuda():
    llm = cuda_llm({"draft_sample_method": "probabilistic"})
    seeded = SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True, seed=77)
    alone = llm.generate("hello world", seeded)[0].outputs[0].token_ids
    mixed = llm.generate(["zebra", "hello world"], [SamplingParams(temperature=1.2, max_tokens=30), seeded])
    assert mixed[1].outputs[0].token_ids == alone


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_2_over_nccl_equals_tp1():
    ray = pytest.importorskip("ray")
    ray.init(ignore_reinit_error=True, include_dashboard=False, log_to_driver=False)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tp1 = [o.outputs[0].token_ids for o in cuda_llm().generate(PROMPTS, greedy)]
    tp2 = LLM(model=TARGET, device="cuda", dtype="float32", tensor_parallel_size=2, seed=1)
    assert [o.outputs[0].token_ids for o in tp2.generate(PROMPTS, greedy)] == tp1


@pytest.mark.parametrize("placement", ["colocated", "separate"])
def test_one_gpu_speculates_with_a_colocated_draft_over_ray(placement):
    """One GPU: the draft in the target's actor (the default on CUDA) speculates; separate actors
    need a second GPU (skipped on one)."""
    ray = pytest.importorskip("ray")
    if placement == "separate" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    ray.init(ignore_reinit_error=True, include_dashboard=False, log_to_driver=False)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in cuda_llm().generate(PROMPTS, greedy)]
    llm = cuda_llm({"draft_placement": placement}, distributed_executor_backend="ray")
    try:
        assert len(llm.core.executor.placement.bundle_specs) == (1 if placement == "colocated" else 2)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)] == plain
    finally:
        llm.core.executor.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_colocated_draft_shares_the_target_tensor_parallel_group():
    ray = pytest.importorskip("ray")
    ray.init(ignore_reinit_error=True, include_dashboard=False, log_to_driver=False)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tp1 = [o.outputs[0].token_ids for o in cuda_llm().generate(PROMPTS, greedy)]
    llm = LLM(model=TARGET, device="cuda", dtype="float32", tensor_parallel_size=2, seed=1,
              speculative_config={"model": DRAFT, "num_speculative_tokens": 3, "draft_placement": "colocated"})
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)] == tp1
    finally:
        llm.core.executor.shutdown()


@pytest.mark.parametrize("spec", [{}, {"parallel_drafting": True, "model": "random:tiny-llama-pard:2"}])
def test_penalties_and_logprobs_on_cuda(spec):
    """Penalties, logit_bias and logprobs on the GPU path: greedy identity with speculation (sequential
    and parallel drafting), logprobs equal to plain decoding's."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3, prompt_logprobs=2,
                            presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3,
                            logit_bias={5: 2.0})
    plain = cuda_llm().generate(PROMPTS, params)
    fast = cuda_llm(spec).generate(PROMPTS, params)
    for a, b in zip(plain, fast):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert set(x) == set(y) and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
        assert len(a.prompt_logprobs) == len(a.prompt_token_ids)


def test_the_paged_cache_on_the_gpu_hits_prefixes_and_preempts_without_changing_tokens():
    """Block tables on the PyTorch path: a cache of 24 blocks forces preemption, a repeated prompt hits."""
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [f"request {i} " + "lorem ipsum " * (3 + i % 4) for i in range(7)]
    roomy = cuda_llm({}, max_model_len=128)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, greedy)]
    block = sum(r.worker.block_bytes() for r in (roomy.core.executor.target, roomy.core.executor.draft))
    small = cuda_llm({}, max_model_len=128, kv_cache_memory_bytes=25 * block)
    assert [o.outputs[0].token_ids for o in small.generate(prompts, greedy)] == want
    assert small.core.scheduler.target_kv.counters.preemptions > 0
    assert [o.outputs[0].token_ids for o in roomy.generate(prompts[:2], greedy)] == want[:2]
    assert roomy.core.scheduler.target_kv.counters.hits > 0


def test_cuda_graphs_give_the_eager_tokens():
    """The default on a GPU: decode and verify steps compiled and replayed as a CUDA graph per padded
    batch; enforce_eager runs PyTorch op by op. Greedy tokens equal, with speculation and without."""
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    eager = [o.outputs[0].token_ids for o in cuda_llm(enforce_eager=True).generate(PROMPTS, greedy)]
    graphs = cuda_llm({})
    assert [o.outputs[0].token_ids for o in graphs.generate(PROMPTS, greedy)] == eager
    for rank in (graphs.core.executor.target, graphs.core.executor.draft):
        step = rank.worker.step
        assert step is not None and step.cuda_graphs and all(s.graph is not None for s in step.shapes.values())
    assert cuda_llm(enforce_eager=True).core.executor.target.worker.step is None
