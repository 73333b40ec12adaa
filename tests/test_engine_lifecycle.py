"""An engine releases what it holds: Ray-backed engines built one after another in one process
(a script, a notebook) each get the cluster, whether the one before was shut down, left by a
`with` block or garbage collected; and one that can never fit the Ray cluster this process started
is refused at once, saying why."""
import gc
import time

import pytest
import ray

from engine import LLM, SamplingParams
from engine.errors import ExecutorError

TARGET = "random:tiny-llama:1"
PROMPTS = ["hello world", "the cat sat"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def outputs(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def reference():
    return outputs(LLM(model=TARGET))


def test_engines_one_after_another(reference):
    ray.shutdown()
    # this process's own Ray, one TP-2 engine's worth whatever the machine's cores
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with LLM(model=TARGET, tensor_parallel_size=2) as llm:
            assert outputs(llm) == reference
        llm = LLM(model=TARGET, tensor_parallel_size=2)
        assert outputs(llm) == reference
        llm.shutdown()
        llm.shutdown()  # twice is fine
        llm = LLM(model=TARGET, tensor_parallel_size=2)
        assert outputs(llm) == reference
        del llm
        gc.collect()
        llm = LLM(model=TARGET, tensor_parallel_size=2)
        assert outputs(llm) == reference
        del llm
        gc.collect()
        start = time.monotonic()
        with pytest.raises(ExecutorError, match="ray.shutdown"):  # 4 ranks in a Ray of 2 CPUs
            LLM(model=TARGET, tensor_parallel_size=2, speculative_config={
                "model": TARGET, "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2,
                "draft_placement": "separate"})
        assert time.monotonic() - start < 30
    finally:
        ray.shutdown()
