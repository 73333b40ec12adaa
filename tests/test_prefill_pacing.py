"""Prompt chunks beside decoding streams (engine/prefill_pacing.py): sized from measured step times so
a step that carries one pauses the streams about prefill_stall_ms. The pacer alone; in the scheduler
with hand-made step times: tests/test_scheduler_plan.py."""
import pytest

from engine.config import EngineConfig
from engine.prefill_pacing import PrefillPacer


def test_the_pacer_sizes_a_chunk_from_the_measured_decode_round_and_token_cost():
    pacer = PrefillPacer(0.3)
    assert pacer.tokens(3, 252) == 252  # nothing measured yet: the budget
    pacer.observe(3, 0, 0.04)  # a decode round of 3 rows: 40 ms
    pacer.observe(3, 200, 0.44)  # 200 prompt tokens beside them: 2 ms a token
    assert pacer.per_token_s == pytest.approx(0.002)
    assert pacer.tokens(3, 252) == 130  # (300 - 40) ms / 2 ms
    assert pacer.tokens(0, 256) == 256  # nobody decoding: nobody waits
    assert pacer.tokens(5, 100) == 100  # never above the budget; 5 rows: the 3-row round as the guess
    pacer.observe(3, 100, 1.04)  # 10 ms a token now: weighted by tokens, (0.8 * 400 + 1000) / 260 ms a token
    assert pacer.tokens(3, 252) == 51
    pacer.observe(3, 100, 30.04)  # a step that stalled (swapping, another process): the floor
    assert pacer.tokens(3, 252) == 32  # a prompt always moves on
    assert PrefillPacer(0.0).tokens(3, 252) == 252  # off


def test_short_prompts_only_stand_in_until_a_chunk_is_measured():
    pacer = PrefillPacer(0.3)
    pacer.observe(0, 9, 0.026)  # short prompts arriving one by one beside new streams (8 HTTP requests
    pacer.observe(1, 15, 0.027)  # at once): mostly fixed costs, ~2 ms a token if read as a cost per token
    assert pacer.per_token_s == pytest.approx((0.8 * 0.026 + 0.027) / (0.8 * 9 + 15))
    assert pacer.tokens(1, 256) == int(0.3 / pacer.per_token_s) < 256  # a cautious first chunk
    pacer.observe(2, 0, 0.03)
    pacer.observe(2, 256, 0.03 + 256 * 0.001)  # a real chunk: 1 ms a token
    assert pacer.per_token_s == pytest.approx(0.001)
    for _ in range(20):  # chat traffic: many short prompts beside the streams
        pacer.observe(2, 4, 0.03 + 0.02)  # 5 ms a token if taken alone
    assert pacer.per_token_s == pytest.approx(0.001)  # they don't move the chunks' estimate
    assert pacer.tokens(2, 512) == 270
    pacer.observe(2, 0, 0.0)  # not measured: ignored
    assert pacer.decode_s(2) == pytest.approx(0.03)


def test_the_default_is_300_ms_on_a_cpu_and_off_on_a_gpu():
    assert EngineConfig(model="random:tiny-llama", device="cpu").resolved_prefill_stall_s() == 0.3
    assert EngineConfig(model="random:tiny-llama", device="cpu", prefill_stall_ms=0).resolved_prefill_stall_s() == 0
    with pytest.raises(ValueError):
        EngineConfig(model="random:tiny-llama", prefill_stall_ms=-1)
