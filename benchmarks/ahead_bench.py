"""Draft-ahead against sequential speculation, each model group on cores of its own (as if each had
its own device), and the speedup the cost model predicts.

    .venv/bin/python benchmarks/ahead_bench.py [--alphas 0.5 0.7 0.9] [--ks 3 5] [--max-tokens 48]
                                               [--prompts 6] [--no-real]

Ray executor with `disjoint_cores: true` (2 cores here: the target rank on one, the draft rank on the
other), one request at a time, float32. Synthetic rows: random 1.7B Llama-shape target <- random
SmolLM2-135M-shape draft, synthetic acceptance with per-token rate a (unconditional rates
a^(i+1); a draft-ahead block's first proposal is taken with rate a too). Real row: Gemma 3 270M <-
SmolLM2-135M (TLI), greedy. The modes run on one engine, taking turns prompt by prompt: sequential
and draft-ahead (AheadPolicy pinned), and auto (draft_ahead: true as shipped: the policy predicts,
measures and keeps the faster; one policy across its turns, as an engine keeps it). Each prompt has
its own seed, so its three turns draw the same acceptances and take the same rounds (checked and
reported); a speedup is the median over prompts of the turns' own ratio (with the range).

Predicted (from the sequential turns' own timings: draft D, verify V, the rest of a step O): a step
takes D + V + O sequentially; with draft-ahead max(V, A) + O when the last step's block is used
(probability a^(k+1): every draft accepted and the block's first proposal taken), else
D + max(V, A) + O, A = the draft-ahead call's time. The bound is their ratio.
Writes benchmarks/results/ahead_bench.json and ahead_bench.png.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from engine import LLM, SamplingParams  # noqa: E402
from engine.ahead_policy import AheadPolicy  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PROMPTS = ["The history of the printing press", "def quicksort(items):", "Dear team, following our meeting",
           "The mitochondria is", "In 1969 the first", "Once upon a time, in a village"]


class StepTimes:
    """Each executor step's draft, verify, draft-ahead and wall times, per mode."""

    def __init__(self, llm: LLM):
        self.llm, self.rows = llm, {True: [], False: [], None: []}
        executor, step = llm.core.executor, llm.core.executor.step

        def timed(verify, draft, ahead=None):
            start = time.perf_counter()
            out = step(verify, draft, ahead)
            policy = llm.core.scheduler.policy.ahead
            self.rows[policy.fixed if policy is not self.auto else None].append(
                (out.draft_elapsed_s, out.elapsed_s, out.ahead.elapsed_s if out.ahead is not None else 0.0,
                 time.perf_counter() - start, draft is not None))
            return out
        executor.step = timed
        self.auto = None


def run_pair(target: str, spec: dict, prompts: list[str], max_tokens: int, temperature: float) -> dict:
    llm = LLM(model=target, max_model_len=512, max_num_seqs=1, distributed_executor_backend="ray",
              disjoint_cores=True, speculative_config={**spec, "draft_ahead": True})
    times = StepTimes(llm)
    llm.core.scheduler.policy.ahead = AheadPolicy(fixed=False)
    llm.generate(prompts[0], SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True))  # warm-up
    times.rows = {True: [], False: [], None: []}
    totals = {True: [0, 0.0, 0], False: [0, 0.0, 0], None: [0, 0.0, 0]}  # tokens, seconds, steps
    per_prompt = {True: [], False: [], None: []}  # tokens/s of each mode's turn, prompt by prompt
    times.auto = AheadPolicy()
    rounds = {}  # (prompt, mode) -> rounds
    modes = [False, True, None]
    for i, prompt in enumerate(prompts):
        # one seed per prompt: every mode draws the same acceptances (the target's uniforms), so a
        # prompt's turns take the same rounds and their ratio is all timing, not the luck of the draw
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=1000 + i)
        for mode in modes[i % 3:] + modes[: i % 3]:
            llm.core.scheduler.policy.ahead = times.auto if mode is None else AheadPolicy(fixed=mode)
            before = len(times.rows[mode])
            start = time.perf_counter()
            out = llm.generate(prompt, params)[0].outputs[0]
            seconds = time.perf_counter() - start
            totals[mode][0] += len(out.token_ids)
            totals[mode][1] += seconds
            per_prompt[mode].append(len(out.token_ids) / seconds)
            rounds[i, mode] = len(times.rows[mode]) - before
            totals[mode][2] += rounds[i, mode]
    used, drafted = llm.core.scheduler.ahead_used, llm.core.scheduler.ahead_drafted
    llm.core.shutdown()

    seq, ahead = times.rows[False], times.rows[True]
    d = statistics.mean(r[0] for r in seq)
    v = statistics.mean(r[1] for r in seq)
    a = statistics.mean(r[2] for r in ahead if r[2] > 0)
    v_ahead = statistics.mean(r[1] for r in ahead)  # the target's verify while the draft runs beside it
    wall_ahead = statistics.mean(r[3] for r in ahead)
    wall_seq = statistics.mean(r[3] for r in seq)
    step_seq = totals[False][1] / totals[False][2]
    other = step_seq - d - v
    tokens_per_step = totals[False][0] / totals[False][2]
    hit = used / drafted if drafted else 0.0  # measured: the share of drafted blocks that were used
    # a prompt's turns ran back to back: the median of their ratios is steadier than ratios of totals
    ahead_ratios = [a / s for a, s in zip(per_prompt[True], per_prompt[False])]
    auto_ratios = [a / s for a, s in zip(per_prompt[None], per_prompt[False])]
    return {"seq_tok_s": totals[False][0] / totals[False][1], "ahead_tok_s": totals[True][0] / totals[True][1],
            "auto_tok_s": totals[None][0] / totals[None][1],
            "speedup": statistics.median(ahead_ratios), "speedup_range": [min(ahead_ratios), max(ahead_ratios)],
            "auto": statistics.median(auto_ratios), "auto_range": [min(auto_ratios), max(auto_ratios)],
            "auto_rounds_ahead": times.auto.rounds[True] / max(1, sum(times.auto.rounds.values())),
            "same_rounds_every_mode": all(rounds[i, m] == rounds[i, False] for i in range(len(prompts))
                                          for m in modes),
            "rounds": {"sequential": totals[False][2], "ahead": totals[True][2], "auto": totals[None][2]},
            "draft_ms": d * 1e3, "verify_ms": v * 1e3, "ahead_ms": a * 1e3, "other_ms": other * 1e3,
            "verify_overlapped_ms": v_ahead * 1e3, "executor_step_ms": {"sequential": wall_seq * 1e3,
                                                                       "ahead": wall_ahead * 1e3},
            "tokens_per_step": tokens_per_step, "blocks_used": hit, "step_seq_ms": step_seq * 1e3,
            "_parts": (d, v, a, other, step_seq)}


def predicted(parts: tuple, p_hit: float) -> float:
    d, v, a, other, step_seq = parts
    hit_step = max(v, a) + other
    miss_step = d + max(v, a) + other
    return step_seq / (p_hit * hit_step + (1 - p_hit) * miss_step)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.5, 0.7, 0.9])
    ap.add_argument("--ks", type=int, nargs="+", default=[3, 5])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--no-real", action="store_true")
    ap.add_argument("--target", default="random:llama-1.7b")
    ap.add_argument("--draft", default="random:smollm2-135m")
    args = ap.parse_args()
    prompts = PROMPTS[: args.prompts]
    rows = []
    for k in args.ks:
        for alpha in args.alphas:
            spec = {"model": args.draft, "num_speculative_tokens": k,
                    "rejection_sample_method": "synthetic",
                    "synthetic_acceptance_rates": [alpha ** (i + 1) for i in range(k)]}
            r = run_pair(args.target, spec, prompts, args.max_tokens, 1.0)
            r.update(pair=f"{args.target} <- {args.draft}".replace("random:", ""), alpha=alpha, k=k,
                     predicted=predicted(r.pop("_parts"), alpha ** (k + 1)))
            rows.append(r)
            print(f"a={alpha} K={k}: {r['speedup']:.2f}x (predicted {r['predicted']:.2f}x), auto {r['auto']:.2f}x "
                  f"({r['auto_rounds_ahead']:.0%} of its rounds ahead); same rounds in every mode: "
                  f"{r['same_rounds_every_mode']}",
                  flush=True)
    if not args.no_real:
        for k in args.ks:
            spec = {"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "num_speculative_tokens": k,
                    "use_heterogeneous_vocab": True}
            r = run_pair("google/gemma-3-270m", spec, prompts, args.max_tokens, 0.0)
            parts = r.pop("_parts")
            r.update(pair="gemma-3-270m <- SmolLM2-135M (TLI)", alpha=None, k=k,
                     predicted=predicted(parts, r["blocks_used"]))
            rows.append(r)
            print(f"real K={k}: {r['speedup']:.2f}x (predicted {r['predicted']:.2f}x), auto {r['auto']:.2f}x "
                  f"({r['auto_rounds_ahead']:.0%} of its rounds ahead); same rounds in every mode: "
                  f"{r['same_rounds_every_mode']}", flush=True)

    print(f"\n{'pair':<36}{'a':>5}{'K':>3}{'seq tok/s':>10}{'ahead tok/s':>12}{'speedup':>8}{'bound':>7}{'auto':>7}"
          f"{'ahead%':>7}{'of bound':>9}{'D ms':>7}{'V ms':>7}{'V|A ms':>7}{'A ms':>7}{'used':>6}")
    for r in rows:
        speedup = r["speedup"]
        r["of_bound"] = speedup / r["predicted"]
        alpha = f"{r['alpha']:.1f}" if r["alpha"] is not None else "real"
        print(f"{r['pair']:<36}{alpha:>5}{r['k']:>3}{r['seq_tok_s']:>10.2f}{r['ahead_tok_s']:>12.2f}"
              f"{speedup:>7.2f}x{r['predicted']:>6.2f}x{r['auto']:>6.2f}x{r['auto_rounds_ahead']:>7.0%}"
              f"{r['of_bound']:>8.0%}{r['draft_ms']:>7.0f}{r['verify_ms']:>7.0f}"
              f"{r['verify_overlapped_ms']:>7.0f}{r['ahead_ms']:>7.0f}{r['blocks_used']:>6.0%}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ahead_bench.json").write_text(json.dumps({"max_tokens": args.max_tokens, "prompts": len(prompts),
                                                          "rows": rows}, indent=2) + "\n")
    plot(rows)


def plot(rows: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"a={r['alpha']:.1f}\nK={r['k']}" if r["alpha"] is not None else f"real\nK={r['k']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.9), 4))
    width = 0.4
    ax.bar([i - width / 2 for i in x], [r["speedup"] for r in rows], width, color="#4C72B0",
           label="draft-ahead on every step / sequential")
    ax.bar([i + width / 2 for i in x], [r["auto"] for r in rows], width, color="#55A868",
           label="draft_ahead: true (auto) / sequential")
    ax.scatter([i - width / 2 for i in x], [r["predicted"] for r in rows], color="#DD8452", zorder=3,
               label="cost-model bound (draft-ahead)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("speedup over sequential")
    ax.set_title("Draft-ahead, each group on its own core")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "ahead_bench.png", dpi=120)


if __name__ == "__main__":
    main()
