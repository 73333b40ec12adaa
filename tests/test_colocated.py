"""draft_placement: colocated (each draft rank inside a target rank's actor, sharing its device and
torch.distributed group) against separate actors and against one process, on a real Ray cluster."""
import pytest
import ray

from engine import LLM, SamplingParams
from engine.config import EngineConfig

TARGET, DRAFT = "random:tiny-llama:1", "random:tiny-llama:2"
PROMPTS = ["hello world", "the cat sat on the mat", "numbers 1 2 3"]


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield
    ray.shutdown()


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return greedy(LLM(model=TARGET, speculative_config={"model": DRAFT, "num_speculative_tokens": 3}))


@pytest.mark.parametrize("tp,draft_tp", [(1, 1), (2, 2), (2, 1)])
def test_a_colocated_draft_gives_the_same_tokens_in_the_target_ranks_bundles(reference, tp, draft_tp):
    spec = {"model": DRAFT, "num_speculative_tokens": 3, "draft_placement": "colocated",
            "draft_tensor_parallel_size": draft_tp}
    llm = LLM(model=TARGET, tensor_parallel_size=tp, distributed_executor_backend="ray", speculative_config=spec)
    try:
        assert len(llm.core.executor.placement.bundle_specs) == tp  # no bundles of the draft's own
        assert len(llm.core.executor.draft) == draft_tp
        assert greedy(llm) == reference
        assert llm.spec_decode_stats.num_draft_tokens > 0  # the draft did run
    finally:
        llm.core.executor.shutdown()


def test_separate_placement_still_takes_bundles_of_its_own(reference):
    spec = {"model": DRAFT, "num_speculative_tokens": 3, "draft_placement": "separate"}
    llm = LLM(model=TARGET, distributed_executor_backend="ray", speculative_config=spec)
    try:
        assert len(llm.core.executor.placement.bundle_specs) == 2
        assert greedy(llm) == reference
    finally:
        llm.core.executor.shutdown()


def test_placement_defaults_and_rules():
    spec = {"model": DRAFT, "num_speculative_tokens": 3}
    assert not EngineConfig(model=TARGET, device="cpu", speculative_config=spec).colocated_draft()
    assert EngineConfig(model=TARGET, device="cuda", speculative_config=spec).colocated_draft()
    ahead = {**spec, "draft_ahead": True}
    assert not EngineConfig(model=TARGET, device="cuda", speculative_config=ahead).colocated_draft()
    with pytest.raises(ValueError, match="draft_ahead.*separate"):
        EngineConfig(model=TARGET, speculative_config={**ahead, "draft_placement": "colocated"})
    with pytest.raises(ValueError, match="draft_placement"):
        EngineConfig(model=TARGET, speculative_config={**spec, "draft_placement": "elsewhere"})
