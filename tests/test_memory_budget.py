"""KV cache sizing from a memory budget (engine/memory.py): slots that fit, max_num_seqs lowered
with a log line, a clear error when not one sequence fits."""
import logging

import pytest

from engine import LLM, SamplingParams
from engine.memory import DeviceMemory, plan_slots

TARGET, DRAFT = "random:tiny-llama:1", "random:tiny-llama:2"
SPEC = {"model": DRAFT, "num_speculative_tokens": 3}


def test_slots_are_what_the_tightest_device_holds_at_most_max_num_seqs():
    roomy = DeviceMemory(slot_bytes=100, budget_bytes=10_000, weight_bytes=1, where="GPU 0")
    tight = DeviceMemory(slot_bytes=100, budget_bytes=350, weight_bytes=1, where="GPU 1")
    unlimited = DeviceMemory(slot_bytes=100, budget_bytes=None, weight_bytes=1, where="CPU")
    assert plan_slots([roomy, tight], 8, 64, 0.9) == 3
    assert plan_slots([roomy], 8, 64, 0.9) == 8
    assert plan_slots([unlimited], 8, 64, 0.9) == 8


def test_not_one_sequence_fits_is_an_error_with_the_numbers():
    small = DeviceMemory(slot_bytes=3 << 30, budget_bytes=1 << 30, weight_bytes=5 << 30, where="GPU 0 (8.0 GiB)")
    with pytest.raises(ValueError) as err:
        plan_slots([small], 8, 4100, 0.9)
    message = str(err.value)
    for part in ("GPU 0 (8.0 GiB)", "4100 tokens", "3.000 GiB", "1.000 GiB", "gpu_memory_utilization=0.9",
                 "weights 5.00 GiB", "max_model_len"):
        assert part in message


def joint_slot_bytes() -> int:
    llm = LLM(model=TARGET, max_model_len=60, speculative_config=SPEC)
    return sum(r.worker.slot_bytes() for r in (llm.executor.target, llm.executor.draft))


def test_a_byte_budget_caps_the_engine_and_it_still_serves_every_request(caplog):
    budget = 3 * joint_slot_bytes() + 100  # both models' caches share this process's device
    with caplog.at_level(logging.INFO, logger="engine.memory"):
        llm = LLM(model=TARGET, max_model_len=60, max_num_seqs=8, kv_cache_memory_bytes=budget,
                  speculative_config=SPEC)
    assert llm.executor.num_slots == 3
    assert llm.executor.target.worker.cache.k[0].shape[0] == 3
    assert "maximum concurrency for 64 tokens per request: 3x" in caplog.text
    assert "max_num_seqs 8 lowered to 3" in caplog.text
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([f"prompt {i}" for i in range(7)], params)  # more than fit at once: they queue
    assert [len(o.outputs[0].token_ids) for o in outs] == [10] * 7


def test_a_budget_below_one_sequence_refuses_to_start():
    with pytest.raises(ValueError, match="not enough memory for the KV cache on kv_cache_memory_bytes"):
        LLM(model=TARGET, max_model_len=60, kv_cache_memory_bytes=1000, speculative_config=SPEC)
