"""Continuous batching throughput, and the cost of running the model groups as Ray actors.

    .venv/bin/python benchmarks/batch_bench.py [--max-tokens 64] [--concurrency 1 4 8]

Target SmolLM2-135M-Instruct, speculation off and on (self-draft, K=3), greedy: aggregate output
tokens/s with 1, 4 and 8 requests in flight through the scheduler; then ms per engine step at
batch 1 with RayExecutor vs LocalExecutor (same process, same request). Writes
benchmarks/results/batch_bench.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from engine import SamplingParams
from engine.config import EngineConfig
from engine.core import EngineCore

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SPEC = {"model": MODEL, "num_speculative_tokens": 3}
PROMPTS = ["The future of AI is", "def fibonacci(n):", "List three colors:", "Once upon a time",
           "The capital of France is", "import numpy as np\n", "Dear team,", "Q: What is 2+2?\nA:"]


def throughput(core: EngineCore, concurrency: int, max_tokens: int, rounds: int = 2) -> float:
    """Output tokens/s with `concurrency` requests in flight, `rounds` waves of them."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    produced, start = 0, time.perf_counter()
    for r in range(rounds):
        seqs = [core.add_request(f"r{r}-{i}", None, core.tokenizer.encode(PROMPTS[i % len(PROMPTS)]), params)
                for i in range(concurrency)]
        while any(not s.finished for s in seqs):
            core.step()
        produced += sum(len(s.output_ids) for s in seqs)
    return produced / (time.perf_counter() - start)


def step_ms(core: EngineCore, max_tokens: int) -> float:
    """Median ms of one engine step for a single running request."""
    seq = core.add_request("step", None, core.tokenizer.encode(PROMPTS[0]),
                           SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    core.step()  # admission + first step
    times = []
    while not seq.finished:
        t = time.perf_counter()
        core.step()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    args = ap.parse_args()
    torch.set_num_threads(2)

    rows = []
    for spec in (None, SPEC):
        core = EngineCore(EngineConfig(model=MODEL, max_num_seqs=8, max_model_len=512, speculative_config=spec),
                          use_ray=False)
        throughput(core, 1, 8, rounds=1)  # warm-up
        for c in args.concurrency:
            rows.append({"speculation": spec is not None, "concurrency": c,
                         "tok_s": throughput(core, c, args.max_tokens)})
    single = {r["speculation"]: r["tok_s"] for r in rows if r["concurrency"] == 1}
    for r in rows:
        r["vs_single"] = r["tok_s"] / single[r["speculation"]]

    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    steps = {}
    for name, use_ray in (("local", False), ("ray", True)):
        core = EngineCore(EngineConfig(model=MODEL, max_num_seqs=8, max_model_len=512, speculative_config=SPEC),
                          use_ray=use_ray)
        step_ms(core, 16)  # warm-up
        steps[name] = step_ms(core, args.max_tokens)
        core.shutdown()
    ray.shutdown()

    print(f"{'speculation':<12}{'in flight':>10}{'tok/s':>8}{'vs 1':>7}")
    for r in rows:
        print(f"{'on (K=3)' if r['speculation'] else 'off':<12}{r['concurrency']:>10}{r['tok_s']:>8.1f}"
              f"{r['vs_single']:>6.2f}x")
    print(f"ms per step at batch 1 (spec on): local {steps['local']:.1f}, ray {steps['ray']:.1f} "
          f"({steps['ray'] / steps['local']:.2f}x)")
    out = Path(__file__).parent / "results" / "batch_bench.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "step_ms": steps, "max_tokens": args.max_tokens}, indent=2))


if __name__ == "__main__":
    main()
