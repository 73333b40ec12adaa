"""The paged KV cache (engine/kv/, engine/memory.py): the block pool's reference counts, hashes and
LRU eviction; blocks sized from the memory budget; prefix caching with cache_salt; preemption when
blocks run out. Engine tests compare greedy tokens with an engine that has room for everything."""
import logging

import pytest

from engine import LLM, SamplingParams
from engine.kv.block_pool import NULL_BLOCK, BlockPool
from engine.kv.cache_manager import KVCacheManager, SeqCache
from engine.memory import DeviceMemory, plan_blocks

TARGET, DRAFT = "random:tiny-llama:1", "random:tiny-llama:2"
SPEC = {"model": DRAFT, "num_speculative_tokens": 3}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


# -- the block pool and the cache manager, alone ---------------------------------------------------

def test_the_pool_never_hands_out_the_null_block_and_counts_holders():
    pool = BlockPool(5)
    got = pool.allocate(4)
    assert sorted(got) == [1, 2, 3, 4] and NULL_BLOCK not in got and pool.num_free == 0
    assert pool.allocate(1) is None  # short: nothing taken
    pool.take([got[0]])  # a second holder
    pool.release(got)
    assert pool.num_free == 3 and pool.ref_count[got[0]] == 1
    pool.release([got[0]])
    assert pool.num_free == 4 and pool.usage() == 0.0
    with pytest.raises(AssertionError):
        pool.release([got[0]])


def test_free_cached_blocks_are_evicted_least_recently_freed_first_and_plain_ones_before_them():
    pool = BlockPool(6)
    a, b = pool.allocate(2), pool.allocate(2)
    for block, h in zip(a + b, [b"a0", b"a1", b"b0", b"b1"]):
        pool.cache(block, h)
    pool.release(a)  # freed first: evicted first; a sequence's tail before its head
    pool.release(b)
    plain = pool.allocate(1)  # the one never-used block goes first
    assert pool.lookup([b"a0", b"a1"]) == a and pool.evictions == 0
    pool.release(plain)  # nothing cached in it: handed out again before any cached block
    assert pool.allocate(1) == plain and pool.evictions == 0
    assert pool.allocate(1) == [a[1]] and pool.evictions == 1
    assert pool.lookup([b"a0", b"a1"]) == [a[0]]  # the head outlives the tail
    assert pool.lookup([b"b0", b"b1"]) == b


def test_a_hit_takes_a_free_cached_block_out_of_the_free_queue():
    pool = BlockPool(4)
    [x] = pool.allocate(1)
    pool.cache(x, b"x")
    pool.release([x])
    assert pool.num_free == 3
    pool.take(pool.lookup([b"x"]))
    assert pool.num_free == 2 and pool.ref_count[x] == 1
    assert x not in (pool.allocate(2) or [])  # held: never evicted


def test_the_manager_hashes_only_full_committed_blocks_and_shares_them_by_chain_and_salt():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    ids = list(range(100, 111))  # 11 tokens: two full blocks and a partial one
    first = SeqCache()
    assert kv.admit(first, ids, len(ids) - 1, salt=None) and first.computed == 0
    first.computed = 10
    kv.commit(first, ids, None, upto=10)
    assert first.hashed == 2  # the partial third block is never hashed
    second = SeqCache()
    assert kv.admit(second, ids + [7, 8], len(ids) + 1, salt=None)
    assert second.computed == 8 and second.blocks[:2] == first.blocks[:2]
    assert kv.pool.ref_count[first.blocks[0]] == 2
    other_chain = SeqCache()  # the same second block after another first block: no hit
    assert kv.admit(other_chain, [1, 2, 3, 4] + ids[4:], 9, salt=None) and other_chain.computed == 0
    salted = SeqCache()
    assert kv.admit(salted, ids, len(ids) - 1, salt="tenant-b") and salted.computed == 0
    assert kv.counters.hits == 8 and kv.counters.queries == 10 + 12 + 9 + 10
    for seq in (first, second, other_chain, salted):
        kv.free(seq)
    assert kv.pool.num_free == 19


def test_a_whole_prompt_in_the_cache_still_leaves_its_last_token_to_compute():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    ids = list(range(8))
    seq = SeqCache()
    kv.admit(seq, ids, 7, None)
    seq.computed = 8
    kv.commit(seq, ids, None, upto=8)
    again = SeqCache()
    kv.admit(again, ids, 7, None)  # at most 7 computable: one full block hits, not two
    assert again.computed == 4


# -- sizing ----------------------------------------------------------------------------------------

def test_blocks_are_what_the_tightest_device_holds_and_no_more_than_the_batch_can_use():
    roomy = DeviceMemory(block_bytes=100, budget_bytes=1_000_000, weight_bytes=1, where="GPU 0")
    tight = DeviceMemory(block_bytes=100, budget_bytes=35_000, weight_bytes=1, where="GPU 1")
    assert plan_blocks([roomy, tight], 16, 1024, 8, 0.9) == 350
    assert plan_blocks([roomy], 16, 1024, 8, 0.9) == 8 * 64 + 1  # 8 sequences of 1024 tokens, + the null block
    cpu = DeviceMemory(block_bytes=1 << 20, budget_bytes=None, weight_bytes=1, where="CPU")
    assert plan_blocks([cpu], 16, 1 << 20, 64, 0.9) == 4096  # the CPU default: 4 GiB


def test_not_two_blocks_is_an_error_with_the_numbers():
    small = DeviceMemory(block_bytes=3 << 30, budget_bytes=1 << 30, weight_bytes=5 << 30, where="GPU 0 (8.0 GiB)")
    with pytest.raises(ValueError) as err:
        plan_blocks([small], 16, 4100, 8, 0.9)
    message = str(err.value)
    for part in ("GPU 0 (8.0 GiB)", "16 tokens", "3.0000 GiB", "1.000 GiB", "gpu_memory_utilization=0.9",
                 "weights 5.00 GiB"):
        assert part in message


def joint_block_bytes() -> int:
    llm = LLM(model=TARGET, max_model_len=64, speculative_config=SPEC)
    return sum(r.worker.block_bytes() for r in (llm.core.executor.target, llm.core.executor.draft))


def test_max_model_len_defaults_to_the_targets_own_limit():
    llm = LLM(model=TARGET)
    assert llm.max_model_len == llm.core.executor.target.worker.hf_config.max_position_embeddings


def test_an_explicit_max_model_len_the_cache_cannot_hold_refuses_to_start_and_a_default_one_shrinks(caplog):
    budget = 20 * joint_block_bytes()  # 20 blocks of 16: 304 usable tokens
    with pytest.raises(ValueError, match=r"the KV cache holds 304 tokens.*max_model_len 1000"):
        LLM(model=TARGET, max_model_len=1000, kv_cache_memory_bytes=budget, speculative_config=SPEC)
    with caplog.at_level(logging.WARNING, logger="engine.core"):
        llm = LLM(model=TARGET, kv_cache_memory_bytes=budget, speculative_config=SPEC)
    assert llm.max_model_len == 304 - 4 and "max_model_len lowered to 300" in caplog.text


def test_the_offline_api_passes_gpu_memory_utilization_to_the_memory_plan():
    """It used to be dropped by LLM(); the plan's error names the value it used."""
    llm = LLM(model=TARGET, gpu_memory_utilization=0.5, max_model_len=64)
    assert llm.config.gpu_memory_utilization == 0.5
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.37"):
        LLM(model=TARGET, gpu_memory_utilization=0.37, kv_cache_memory_bytes=10, max_model_len=64)


# -- the engine on a small cache: preemption, prefix hits ------------------------------------------

PROMPTS = [f"request {i} " + "lorem ipsum " * (3 + i % 4) for i in range(7)]


@pytest.fixture(scope="module")
def reference():
    """Greedy tokens from an engine with room for every request (no hits: prefix caching off)."""
    llm = LLM(model=TARGET, max_model_len=128, enable_prefix_caching=False)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_a_cache_too_small_for_the_batch_preempts_and_every_request_still_gets_its_own_tokens(reference, caplog):
    # 24 blocks of 16 (+ the null block): the 7 requests need ~5 blocks each at their longest
    budget = 25 * joint_block_bytes()
    with caplog.at_level(logging.INFO, logger="engine.memory"):
        llm = LLM(model=TARGET, max_model_len=128, max_num_seqs=8, kv_cache_memory_bytes=budget,
                  speculative_config=SPEC)
    assert llm.core.executor.num_blocks == 25 and llm.core.executor.target.worker.cache.k[0].shape[0] == 25
    assert "384 tokens" in caplog.text and "maximum concurrency for 132 tokens per request: 2.91x" in caplog.text
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    counters = llm.core.scheduler.target_kv.counters
    assert counters.preemptions > 0
    assert llm.core.scheduler.target_kv.pool.num_free == 24 and llm.core.scheduler.draft_kv.pool.num_free == 24


def test_a_shared_prefix_is_computed_once_and_outputs_do_not_change(reference):
    llm = LLM(model=TARGET, max_model_len=128, speculative_config=SPEC)
    first = llm.generate(PROMPTS[:1], GREEDY)[0].outputs[0].token_ids
    counters = llm.core.scheduler.target_kv.counters
    assert counters.hits == 0
    again = llm.generate(PROMPTS[:1], GREEDY)[0].outputs[0].token_ids
    prompt_len = len(llm.tokenizer.encode(PROMPTS[0]))
    assert counters.hits == (prompt_len - 1) // 16 * 16 > 0  # every full block of the prompt
    assert llm.core.scheduler.draft_kv.counters.hits > 0  # the draft's prefix too
    assert first == again == reference[0]


def test_the_next_turn_hits_the_blocks_of_the_previous_output():
    llm = LLM(model=TARGET, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    out = llm.generate(PROMPTS[1], params)[0]
    turn = out.prompt_token_ids + out.outputs[0].token_ids + llm.tokenizer.encode(" and then")
    before = llm.core.scheduler.target_kv.counters.hits
    llm.generate({"prompt_token_ids": turn}, params)
    hit = llm.core.scheduler.target_kv.counters.hits - before
    assert hit >= (len(out.prompt_token_ids) + 40 - 1) // 16 * 16 - 16  # the prompt's blocks and the reply's


def test_requests_with_different_cache_salts_never_share_a_block():
    llm = LLM(model=TARGET, max_model_len=128)
    counters = llm.core.scheduler.target_kv.counters
    a = llm.generate({"prompt": PROMPTS[2], "cache_salt": "tenant-a"}, GREEDY)[0].outputs[0].token_ids
    b = llm.generate({"prompt": PROMPTS[2], "cache_salt": "tenant-b"}, GREEDY)[0].outputs[0].token_ids
    assert counters.hits == 0 and a == b
    llm.generate({"prompt": PROMPTS[2], "cache_salt": "tenant-a"}, GREEDY)
    assert counters.hits > 0
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt": PROMPTS[2], "cache_salt": ""}, GREEDY)


def test_prompt_logprobs_are_the_same_when_the_prompt_is_in_the_cache():
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    fresh = LLM(model=TARGET, max_model_len=128).generate(PROMPTS[3], params)[0].prompt_logprobs
    llm = LLM(model=TARGET, max_model_len=128)
    llm.generate(PROMPTS[3], GREEDY)  # the prompt's blocks are cached now
    warm = llm.generate(PROMPTS[3], params)[0].prompt_logprobs
    assert len(warm) == len(fresh) and warm[0] is None
    for w, f in zip(warm[1:], fresh[1:]):
        assert w.keys() == f.keys()
        for token in w:
            assert w[token].logprob == pytest.approx(f[token].logprob, abs=1e-5)
