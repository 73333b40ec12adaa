"""The decode / verify step compiled whole (engine/models/compiled_step.py), tested on the CPU with
inductor: the GPU's step (static shapes, padded buckets, no host read: torch.compile fullgraph=True
refuses a graph break) gives the eager forward's tokens, with speculation and without."""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.models.compiled_step import BATCH_BUCKETS, batch_bucket, table_bucket

TARGET, DRAFT = "random:tiny-llama:1", "random:tiny-llama:2"
# three prompts: the step's batch of 3 pads to 4 (a padded row writes only the null block)
PROMPTS = ["hello world", "the cat sat on the mat and looked at the dog for a while", "zebra"]


def llm(enforce_eager: bool, spec: bool = True) -> LLM:
    return LLM(TARGET, enforce_eager=enforce_eager, cpu_kernels=False, max_num_seqs=8, seed=3,
               speculative_config={"model": DRAFT, "num_speculative_tokens": 3} if spec else None)


@pytest.fixture(scope="module")
def compiled() -> LLM:
    return llm(enforce_eager=False)


def test_compiled_speculation_gives_the_eager_tokens(compiled):
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    eager = [o.outputs[0].token_ids for o in llm(enforce_eager=True).generate(PROMPTS, greedy)]
    plain = [o.outputs[0].token_ids for o in llm(enforce_eager=True, spec=False).generate(PROMPTS, greedy)]
    fast = [o.outputs[0].token_ids for o in compiled.generate(PROMPTS, greedy)]
    assert fast == eager == plain
    target, draft = compiled.core.executor.target.worker, compiled.core.executor.draft.worker
    assert compiled.spec_decode_stats.num_accepted_tokens > 0  # the draft's tokens went through verify steps
    # both models stepped through padded shapes: batch buckets, tables at least MIN_TABLE_BLOCKS wide
    for worker in (target, draft):
        assert worker.step is not None and worker.step.shapes
        assert all(b in BATCH_BUCKETS and w >= 8 for b, _, w in worker.step.shapes)
    assert any(t == 4 for _, t, _ in target.step.shapes)  # a verify of K+1 = 4 tokens a row


def test_seeded_sampling_is_the_eager_engines(compiled):
    # the same logits (to float rounding) and the same draws: a seeded request samples the same tokens
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, ignore_eos=True, seed=s) for s in (1, 2, 3)]
    eager = [o.outputs[0].token_ids for o in llm(enforce_eager=True).generate(PROMPTS, params)]
    assert [o.outputs[0].token_ids for o in compiled.generate(PROMPTS, params)] == eager


def test_enforce_eager_defaults_by_device():
    assert EngineConfig(model=TARGET, device="cpu").compiled_step() is False  # the C++ decode layer
    assert EngineConfig(model=TARGET, device="cuda").compiled_step() is True  # CUDA graphs
    assert EngineConfig(model=TARGET, device="cuda", enforce_eager=True).compiled_step() is False
    assert EngineConfig(model=TARGET, device="cpu", enforce_eager=False).compiled_step() is True
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(model=TARGET, enforce_eager="sometimes")


def test_buckets():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 9, 200)] == [1, 2, 4, 8, 16, 256]
    assert batch_bucket(BATCH_BUCKETS[-1] + 1) is None  # past the largest: the step runs eager
    assert [table_bucket(n, 64) for n in (1, 8, 9, 33, 64)] == [8, 8, 16, 64, 64]
    assert table_bucket(5, 4) == 5  # never narrower than the table itself


def test_a_real_model_compiled_gives_the_eager_tokens():
    """SmolLM2-135M's real weights, drafting for itself (every draft verified, rows of 1, 2 and K+1
    tokens): the compiled step's greedy tokens are the eager forward's (both PyTorch float32). The
    costliest test here: inductor compiles both models' steps on 2 cores in ~5 minutes."""
    model = "HuggingFaceTB/SmolLM2-135M-Instruct"
    kw = dict(speculative_config={"model": model, "num_speculative_tokens": 3}, max_model_len=256,
              cpu_kernels=False, max_num_seqs=4)
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    eager = [o.outputs[0].token_ids for o in LLM(model, enforce_eager=True, **kw).generate(prompts, greedy)]
    compiled = LLM(model, enforce_eager=False, **kw)
    assert [o.outputs[0].token_ids for o in compiled.generate(prompts, greedy)] == eager
    assert compiled.spec_decode_stats.num_accepted_tokens > 0
