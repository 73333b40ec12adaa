"""Draft-ahead (`draft_ahead: true`): while the target verifies a block, the draft group drafts the next
one as if the block were accepted whole; the next step verifies it at once when the target's bonus
token is that block's first proposal, else it is discarded and the row drafts afresh (its draft cache
rolls back). Whatever happens to the blocks, the output is the target's: greedy identity with
draft-ahead on / off / plain (tiny and real pairs, sequential and parallel drafting, block
verification, adaptive K, TLI, Ray with tensor parallelism), and chi-squared on a token that a
draft-ahead block proposed. The policy that turns it off where it loses is tested on its own."""
import os
import random

import numpy as np
import pytest
import ray
import torch

from engine.kv_cache import static_tables
from engine import LLM, SamplingParams
from engine.ahead_policy import AheadPolicy, AheadRound
from engine.step import DraftOutput, merge_drafts
from stats import ALPHA, chi_squared_pvalue
from tli_models import write_pair

TARGET = "random:tiny-llama:1"
PROMPTS = ["hello world", "the cat sat on the mat", "a", "numbers 1 2 3", "zebra"]
MAX_TOKENS = [40, 23, 37, 31, 9]
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
GEMMA3 = "google/gemma-3-270m"


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def run(llm, prompts=PROMPTS, max_tokens=MAX_TOKENS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, [greedy(n) for n in max_tokens])]


def ahead_llm(model: str, spec: dict, **kw) -> LLM:
    """Draft-ahead on every step (the policy pinned: these tests are about what it outputs)."""
    llm = LLM(model=model, speculative_config={**spec, "draft_ahead": True}, **kw)
    llm.core.scheduler.policy.ahead = AheadPolicy(fixed=True)
    return llm


@pytest.fixture(scope="module")
def reference():
    return run(LLM(model=TARGET))


@pytest.mark.parametrize("spec", [
    {"model": TARGET, "num_speculative_tokens": 3},  # self-draft: every block is used
    {"model": TARGET, "num_speculative_tokens": 1},
    {"model": "random:tiny-llama:2", "num_speculative_tokens": 3},  # blocks mostly discarded
    {"model": TARGET, "num_speculative_tokens": 4, "rejection_sample_method": "block"},
    {"model": TARGET, "num_speculative_tokens": 5, "adaptive": True},
    {"model": TARGET, "num_speculative_tokens": 3, "draft_sample_method": "probabilistic"},
    {"model": "random:tiny-llama-pard:1", "num_speculative_tokens": 3, "parallel_drafting": True},
    {"model": "random:tiny-llama-pard:2", "num_speculative_tokens": 4, "parallel_drafting": True},
], ids=["self-k3", "self-k1", "other-k3", "block-k4", "adaptive-k5", "probabilistic-k3", "pard-self", "pard-other"])
def test_greedy_output_equals_plain_decoding(reference, spec):
    llm = ahead_llm(TARGET, spec, max_num_seqs=4)  # 5 prompts: one joins mid-way
    assert run(llm) == reference
    sched = llm.core.scheduler
    assert sched.ahead_drafted > 0
    if spec["model"] == TARGET and spec.get("draft_sample_method") != "probabilistic":
        # the draft is the target: its blocks continue the target's greedy output (most are used;
        # a row that ends, or can't fit a block, drops its last)
        assert sched.ahead_used >= 0.6 * sched.ahead_drafted


def test_blocks_are_used_and_cut_to_the_budget():
    """A self-draft with max_tokens that end mid-block: every length is exact, and the steps that
    verify a draft-ahead block are as many as the sequential engine's steps with drafts."""
    spec = {"model": TARGET, "num_speculative_tokens": 4}
    lengths = [5, 6, 7, 8, 9]
    prompts = ["hello"] * 5
    ref = run(LLM(model=TARGET), prompts, lengths)
    llm = ahead_llm(TARGET, spec)
    assert run(llm, prompts, lengths) == ref
    assert [len(t) for t in ref] == lengths
    assert llm.core.scheduler.ahead_used > 0
    # with every draft accepted, a row takes one step per 5 tokens either way
    seq = LLM(model=TARGET, speculative_config=spec)
    run(seq, prompts, lengths)
    assert llm.spec_decode_stats.num_drafts == seq.spec_decode_stats.num_drafts


def test_token_level_intersection(tmp_path):
    target, draft = write_pair(tmp_path)
    prompts, lengths = ["the cat sat on", "a big red"], [32, 20]
    ref = run(LLM(model=target), prompts, lengths)
    llm = ahead_llm(target, {"model": draft, "num_speculative_tokens": 3, "use_heterogeneous_vocab": True})
    assert run(llm, prompts, lengths) == ref
    assert llm.core.scheduler.ahead_drafted > 0


@pytest.mark.parametrize("target, draft, tli", [(SMOLLM2, SMOLLM2, False), (GEMMA3, SMOLLM2, True)],
                         ids=["smollm2-self", "gemma3-smollm2-tli"])
def test_real_pairs(target, draft, tli):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    lengths = [24, 24]
    plain = LLM(model=target, max_model_len=256)
    ref = run(plain, prompts, lengths)
    spec = {"model": draft, "num_speculative_tokens": 3, "use_heterogeneous_vocab": tli}
    off = LLM(model=target, max_model_len=256, speculative_config=spec)
    on = ahead_llm(target, spec, max_model_len=256)
    assert run(off, prompts, lengths) == ref
    assert run(on, prompts, lengths) == ref
    assert on.core.scheduler.ahead_drafted > 0
    if target == draft:
        assert on.core.scheduler.ahead_used > 0


def test_sampled_token_from_an_ahead_block_follows_the_target():
    """Token 3 of each sample, K = 1 and a probabilistic self-draft: step 1 verifies one draft (tokens
    1-2) and drafts ahead; step 2 verifies the block's second proposal (token 3) when token 2 was
    its first. Among samples whose first two tokens are the most common pair, token 3 must follow
    the target's distribution given that pair (the blocks' q and tokens must line up)."""
    n, temperature = 8000, 0.7
    llm = ahead_llm(TARGET, {"model": TARGET, "num_speculative_tokens": 1,
                             "draft_sample_method": "probabilistic"}, max_num_seqs=64, seed=3)
    prompt = "the cat"
    params = [SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True, seed=s) for s in range(n)]
    outs = [o.outputs[0].token_ids for o in llm.generate([prompt] * n, params)]
    pairs = {}
    for o in outs:
        pairs[tuple(o[:2])] = pairs.get(tuple(o[:2]), 0) + 1
    pair = max(pairs, key=pairs.get)
    third = [o[2] for o in outs if tuple(o[:2]) == pair]
    assert len(third) >= 500, pairs[pair]
    assert llm.core.scheduler.ahead_used >= 0.1 * n, llm.core.scheduler.ahead_used  # many third tokens came from a block
    ids = llm.get_tokenizer().encode(prompt) + list(pair)
    with torch.no_grad():
        logits = LLM(model=TARGET).core.executor.target.worker.forward(static_tables(1, len(ids), 16), [0], [ids])[0, -1]
    p3 = torch.softmax(logits / temperature, -1).numpy()
    assert chi_squared_pvalue(third, p3) > ALPHA


def test_each_row_verifies_its_own_drafts_with_their_distributions():
    """merge_drafts: rows from the last draft-ahead block take its proposals after the first, with
    those proposals' own distributions; the other rows this step's fresh drafts; all in row order."""
    def out(slots, tokens):  # each proposal's distribution row holds its token id (to see it)
        flat = [t for row in tokens for t in row]
        return DraftOutput(seq_ids=slots, tokens=tokens, probs=torch.tensor(flat, dtype=torch.float32)[:, None])
    fresh = out([3, 5], [[1, 2], [4]])
    ahead = out([5, 7, 9], [[10, 11, 12], [20, 21], [30, 31, 32]])
    tokens, probs = merge_drafts([7, 3, 9, 5], fresh, ahead, [1, 0, 2, 0])
    assert tokens == [[21], [1, 2], [31, 32], [4]]
    assert probs[:, 0].tolist() == [21, 1, 2, 31, 32, 4]
    tokens, probs = merge_drafts([9], fresh, ahead, [1])  # cut to the row's budget
    assert tokens == [[31]] and probs[:, 0].tolist() == [31]
    assert merge_drafts([3, 5], fresh, None, [0, 0])[0] == [[1, 2], [4]]


def simulate(policy: AheadPolicy, rounds: int, d: float, v: float, a: float, o: float, alpha: float, k: int,
             overlap: bool = True, rows: int = 1, seed: int = 0) -> tuple[list[bool], float]:
    """Rounds as the cost model has them (module docstring of engine/ahead_policy.py), each time +-10%
    noise, acceptance drawn per draft; without `overlap` the draft-ahead call runs after the verify
    (groups sharing cores). Returns each round's mode and the total time."""
    rng = random.Random(seed)
    modes, total, block = [], 0.0, False
    for _ in range(rounds):
        ahead = policy.use(rows)
        fresh = not (ahead and block)
        all_accepted = all(rng.random() < alpha for _ in range(k))

        def noisy(t):
            return t * rng.uniform(0.9, 1.1)
        draft_s, verify_s, ahead_s, other = noisy(d) if fresh else 0.0, noisy(v), noisy(a) if ahead else 0.0, noisy(o)
        middle = (max(verify_s, ahead_s) if overlap else verify_s + ahead_s) if ahead else verify_s
        wall = draft_s + middle + other
        block = ahead and all_accepted and rng.random() < alpha
        policy.observe(rows, AheadRound(ahead, fresh, k, draft_s, verify_s, ahead_s, wall, all_accepted))
        modes.append(ahead)
        total += wall
    return modes, total


# measured on this machine (benchmarks/ahead_bench.py, seconds): draft K, verify, draft-ahead, rest
SYNTHETIC_K5 = dict(d=0.203, v=0.500, a=0.289, o=0.015, k=5)  # 1.7B-shape <- 135M-shape
REAL_PAIR_K3 = dict(d=0.035, v=0.037, a=0.045, o=0.009, k=3)  # Gemma 3 <- SmolLM2: 9% of blocks used, a ~ 0.55


def test_policy_does_not_try_draft_ahead_where_even_perfect_overlap_loses():
    """Drafting K + 1 ahead takes longer than the verify it hides behind (the real pair), or blocks are
    almost never used (a = 0.5): the sequential rounds' own timings say so, and the policy stays
    sequential (at most a rare short try, when a run of lucky rounds makes blocks look likely)."""
    for case, alpha in [(REAL_PAIR_K3, 0.55), (REAL_PAIR_K3, 0.65), (SYNTHETIC_K5, 0.5), (SYNTHETIC_K5, 0.3)]:
        modes, total = simulate(AheadPolicy(), 600, alpha=alpha, **case)
        _, sequential = simulate(AheadPolicy(fixed=False), 600, alpha=alpha, **case)
        assert np.mean(modes) < 0.02 and total < 1.01 * sequential, (case, alpha)


def test_policy_keeps_draft_ahead_where_it_wins():
    policy = AheadPolicy()
    modes, total = simulate(policy, 1500, alpha=0.9, **SYNTHETIC_K5)
    assert np.mean(modes[300:]) > 0.9
    _, sequential = simulate(AheadPolicy(fixed=False), 1500, alpha=0.9, **SYNTHETIC_K5)
    assert total < 0.91 * sequential  # the model's bound here is 1.14x


def test_policy_falls_back_where_overlapping_loses():
    """Groups sharing cores: the prediction says try, the measured rounds say it loses; it goes back to
    sequential rounds and tries ever more rarely, so the whole run is within 3% of sequential's."""
    policy = AheadPolicy()
    modes, total = simulate(policy, 3000, alpha=0.9, overlap=False, **SYNTHETIC_K5)
    assert any(modes[:100])  # it did try
    assert np.mean(modes[500:]) < 0.05
    _, sequential = simulate(AheadPolicy(fixed=False), 3000, alpha=0.9, overlap=False, **SYNTHETIC_K5)
    assert total < 1.03 * sequential


def test_policy_decides_per_batch_size():
    """A batch's blocks are used only when every row's is: at 4 rows draft-ahead loses what it wins alone."""
    policy = AheadPolicy()
    alone, _ = simulate(policy, 800, alpha=0.9, **SYNTHETIC_K5)
    batched, _ = simulate(policy, 800, alpha=0.9, overlap=False, rows=4, **SYNTHETIC_K5)
    assert np.mean(alone[200:]) > 0.9 and np.mean(batched[200:]) < 0.1
    assert policy.use(1)  # what it learned at 4 rows left batch 1's verdict alone


def test_in_one_process_draft_ahead_never_runs(reference):
    """The local executor runs the groups one after the other: nothing could overlap, so the policy is
    pinned off (blocks would only cost) and the output is plain decoding's."""
    llm = LLM(model=TARGET, speculative_config={"model": TARGET, "num_speculative_tokens": 3, "draft_ahead": True})
    assert run(llm) == reference
    assert llm.core.scheduler.ahead_drafted == 0 and not llm.core.scheduler.policy.ahead.use()


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield
    ray.shutdown()


@pytest.mark.parametrize("tp, extra", [(2, {}), (1, {"disjoint_cores": True})], ids=["tp2", "disjoint-cores"])
def test_ray_groups(ray_cluster, reference, tp, extra):
    llm = ahead_llm(TARGET, {"model": TARGET, "num_speculative_tokens": 3}, tensor_parallel_size=tp,
                    distributed_executor_backend="ray", max_num_seqs=4, **extra)
    try:
        assert run(llm) == reference
        assert llm.core.scheduler.ahead_used > 0
    finally:
        llm.core.shutdown()


def test_disjoint_cores_needs_a_core_per_rank(ray_cluster):
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="disjoint_cores"):
        LLM(model=TARGET, tensor_parallel_size=cores, distributed_executor_backend="ray", disjoint_cores=True,
            speculative_config={"model": TARGET, "num_speculative_tokens": 2})
