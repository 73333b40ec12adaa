"""The decode / verify step compiled whole (engine/models/compiled_step.py), tested on the CPU with
inductor: the GPU's step (static shapes, padded buckets, no host read: torch.compile fullgraph=True
refuses a graph break) gives the eager forward's tokens, with speculation and without.

The engines run in a child process (`run_engines` below): inductor's compiled libraries and their
OpenMP stay out of the suite's process, which goes on to load our own kernels."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.models.compiled_step import BATCH_BUCKETS, batch_bucket, table_bucket

ROOT = Path(__file__).resolve().parents[1]
TARGET, DRAFT = "random:tiny-llama:1", "random:tiny-llama:2"
# three prompts: the step's batch of 3 pads to 4 (a padded row writes only the null block)
PROMPTS = ["hello world", "the cat sat on the mat and looked at the dog for a while", "zebra"]

CHILD = """
import json, sys
from engine import LLM, SamplingParams
job = json.loads(sys.argv[1])
out = {}
for name, engine in job["engines"].items():
    llm = LLM(job["model"], **engine)
    outs = {}
    for label, params in job["params"].items():
        params = [SamplingParams(**p) for p in params]
        outs[label] = [o.outputs[0].token_ids for o in llm.generate(job["prompts"], params)]
    step = llm.core.executor.target.worker.step
    draft = llm.core.executor.draft.worker.step if llm.core.executor.draft is not None else None
    stats = llm.spec_decode_stats
    out[name] = {"tokens": outs, "accepted": stats.num_accepted_tokens if stats else 0,
                 "target_shapes": sorted(step.shapes) if step else None,
                 "draft_shapes": sorted(draft.shapes) if draft else None}
print("RESULT " + json.dumps(out))
"""


def run_engines(model: str, engines: dict, params: dict, prompts: list[str], timeout: int) -> dict:
    """Each engine's tokens for each list of SamplingParams kwargs (one per prompt), its accepted
    drafts and its compiled steps' padded shapes (batch, tokens, table blocks), from a child process."""
    job = {"model": model, "engines": engines, "params": params, "prompts": prompts}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(job)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(done.stdout.split("RESULT ", 1)[1])


def test_compiled_speculation_gives_the_eager_tokens_and_samples():
    spec = {"model": DRAFT, "num_speculative_tokens": 3}
    common = {"cpu_kernels": False, "max_num_seqs": 8, "seed": 3}
    greedy = [{"temperature": 0, "max_tokens": 40, "ignore_eos": True}] * 3
    # the same logits (to float rounding) and the same draws: a seeded request samples the same tokens
    seeded = [{"temperature": 0.8, "top_p": 0.9, "max_tokens": 24, "ignore_eos": True, "seed": s} for s in (1, 2, 3)]
    got = run_engines(TARGET, {
        "compiled": {**common, "enforce_eager": False, "speculative_config": spec},
        "eager": {**common, "enforce_eager": True, "speculative_config": spec},
        "plain": {**common, "enforce_eager": True},
    }, {"greedy": greedy, "seeded": seeded}, PROMPTS, timeout=600)
    compiled, eager, plain = got["compiled"], got["eager"], got["plain"]
    assert compiled["tokens"]["greedy"] == eager["tokens"]["greedy"] == plain["tokens"]["greedy"]
    assert compiled["tokens"]["seeded"] == eager["tokens"]["seeded"]
    assert compiled["accepted"] > 0  # the draft's tokens went through verify steps
    assert eager["target_shapes"] is None  # enforce_eager: no compiled step
    # both models stepped through padded shapes: batch buckets, tables at least MIN_TABLE_BLOCKS wide
    for shapes in (compiled["target_shapes"], compiled["draft_shapes"]):
        assert shapes and all(b in BATCH_BUCKETS and w >= 8 for b, _, w in shapes)
    assert any(b == 4 for b, _, _ in compiled["target_shapes"])  # 3 rows padded to 4
    assert any(t == 4 for _, t, _ in compiled["target_shapes"])  # a verify of K+1 = 4 tokens a row


def test_a_real_model_compiled_gives_the_eager_tokens():
    """SmolLM2-135M's real weights, greedy, two streams: the compiled decode step's tokens are the
    eager forward's (both PyTorch float32). One graph (rows of 1 token); the speculative shapes are
    the test above's. Inductor compiles it in ~2.5 minutes on 2 cores with a cold cache."""
    common = {"cpu_kernels": False, "max_model_len": 256, "max_num_seqs": 4}
    greedy = [{"temperature": 0, "max_tokens": 32, "ignore_eos": True}] * 2
    got = run_engines("HuggingFaceTB/SmolLM2-135M-Instruct", {
        "compiled": {**common, "enforce_eager": False}, "eager": {**common, "enforce_eager": True},
    }, {"greedy": greedy}, ["The capital of France is", "def fibonacci(n):"], timeout=900)
    assert got["compiled"]["tokens"] == got["eager"]["tokens"]
    assert got["compiled"]["target_shapes"] == [[2, 1, 8]]


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
