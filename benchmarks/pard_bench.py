"""Parallel drafting (PARD) against sequential drafting: the draft's cost per step, and the speedup.

    .venv/bin/python benchmarks/pard_bench.py [--ks 3 5 8] [--alphas 0.7 0.9] [--max-tokens 32]

Random 1.7B Llama-shape target <- random SmolLM2-135M-shape draft that declares a mask token
(`random:smollm2-135m-pard`), float32, 2 threads, one request at a time.
  costs    the proposer itself at 64 cached tokens: sequential (k draft forwards of one token) vs
           parallel (one forward of k tokens: the pending token and k-1 masks), beside one target
           step; medians of 7.
  speedup  synthetic acceptance with per-token rate a (unconditional rates a^(i+1), vLLM's form):
           tokens/s of plain decoding, sequential and parallel drafting, taking turns prompt by
           prompt on one engine. Random drafts accept nothing on their own; synthetic acceptance
           stands in for a trained PARD draft, as it does for vLLM's benchmarks.
Writes benchmarks/results/pard_bench.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_bench import PROMPTS, RESULTS, SpecState, generate, take_turns  # noqa: E402

from engine.kv_cache import static_tables
from engine import SamplingParams  # noqa: E402
from engine.config import EngineConfig, SpeculativeConfig  # noqa: E402
from engine.core import EngineCore  # noqa: E402
from engine.step import DraftBatch, RowSampling  # noqa: E402

TARGET, DRAFT = "random:llama-1.7b", "random:smollm2-135m-pard"


class DraftingState(SpecState):
    """A speculative config on the shared engine, with the proposer set to its drafting mode."""

    def __init__(self, core: EngineCore, spec: SpeculativeConfig | None, mask_token: int | None):
        super().__init__(core, spec)
        if spec is not None:
            self.costs.parallel = spec.parallel_drafting
        self.mask_token = mask_token if spec is not None and spec.parallel_drafting else None

    def activate(self, core: EngineCore) -> None:
        super().activate(core)
        core.executor.draft.proposer.mask_token = self.mask_token


@torch.inference_mode()
def propose_ms(core: EngineCore, k: int, mask_token: int | None, context: int = 64, repeats: int = 7) -> float:
    proposer = core.executor.draft.proposer
    proposer.mask_token = mask_token
    table = static_tables(1, context + k + 1, proposer.worker.block_size)
    proposer.worker.forward(table, [0], [[1] * context])
    batch = DraftBatch(seq_ids=[0], starts=[context], pending=[[1]], num_drafts=[k],
                       sampling=[RowSampling("bench", SamplingParams(temperature=0.0))], tables=table)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        proposer.propose(batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


@torch.inference_mode()
def target_step_ms(core: EngineCore, context: int = 64, repeats: int = 7) -> float:
    worker = core.executor.target.worker
    table = static_tables(1, context + 1, worker.block_size)
    worker.forward(table, [0], [[1] * context])
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        worker.forward(table, [context], [[1]])
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", type=int, nargs="+", default=[3, 5, 8])
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.7, 0.9])
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(2)
    k_max = max(args.ks)
    base = {"model": DRAFT, "num_speculative_tokens": k_max, "parallel_drafting": True}
    core = EngineCore(EngineConfig(model=TARGET, max_model_len=512, max_num_seqs=1,
                                   speculative_config=SpeculativeConfig.model_validate(base)), use_ray=False)
    mask_token = core.executor.draft.proposer.mask_token

    target_ms = target_step_ms(core)
    costs = []
    for k in args.ks:
        sequential, parallel = propose_ms(core, k, None), propose_ms(core, k, mask_token)
        costs.append({"k": k, "sequential_ms": sequential, "parallel_ms": parallel, "target_step_ms": target_ms,
                      "sequential_over_parallel": sequential / parallel})

    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
    plain = DraftingState(core, None, None)
    plain.activate(core)
    generate(core, SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True), PROMPTS[0])  # warm-up
    speedups = []
    for alpha in args.alphas:
        for k in args.ks:
            states = [plain]
            for parallel in (False, True):
                cfg = {**base, "num_speculative_tokens": k, "parallel_drafting": parallel,
                       "rejection_sample_method": "synthetic",
                       "synthetic_acceptance_rates": [alpha ** (i + 1) for i in range(k)]}
                states.append(DraftingState(core, SpeculativeConfig.model_validate(cfg), mask_token))
            plain_tps, seq_tps, par_tps = take_turns(core, states, params, PROMPTS)
            speedups.append({"alpha": alpha, "k": k, "plain_tok_s": plain_tps, "sequential_tok_s": seq_tps,
                             "parallel_tok_s": par_tps, "sequential_speedup": seq_tps / plain_tps,
                             "parallel_speedup": par_tps / plain_tps, "parallel_over_sequential": par_tps / seq_tps,
                             "mean_acceptance_length": states[2].stats.mean_acceptance_length})
    core.shutdown()

    print(f"draft cost per step (target step {target_ms:.1f} ms)")
    print(f"{'K':>3}{'sequential ms':>15}{'parallel ms':>13}{'ratio':>7}")
    for r in costs:
        print(f"{r['k']:>3}{r['sequential_ms']:>15.1f}{r['parallel_ms']:>13.1f}{r['sequential_over_parallel']:>6.2f}x")
    print(f"\n{'a':>4}{'K':>3}{'plain tok/s':>12}{'seq tok/s':>10}{'par tok/s':>10}{'seq':>7}{'par':>7}{'par/seq':>8}")
    for r in speedups:
        print(f"{r['alpha']:>4.1f}{r['k']:>3}{r['plain_tok_s']:>12.2f}{r['sequential_tok_s']:>10.2f}"
              f"{r['parallel_tok_s']:>10.2f}{r['sequential_speedup']:>6.2f}x{r['parallel_speedup']:>6.2f}x"
              f"{r['parallel_over_sequential']:>7.2f}x")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pard_bench.json").write_text(json.dumps({"target": TARGET, "draft": DRAFT, "costs": costs,
                                                         "speedups": speedups}, indent=2) + "\n")


if __name__ == "__main__":
    main()
