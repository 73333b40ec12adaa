"""Speculative decoding, timed: measured speedup against the cost model, per K, plus adaptive K.

    .venv/bin/python benchmarks/spec_bench.py [--pairs real synthetic] [--max-tokens 32]
    .venv/bin/python benchmarks/spec_bench.py --pairs qwen-coder --ks 2 3 4 5 6 --max-tokens 96
    .venv/bin/python benchmarks/spec_bench.py --pairs qwen-coder --chat --ks 3 4 --max-tokens 96 \
        --temperatures 0 0.7 --draft-head-tokens 0 32768 --out spec_bench_qwen-coder_chat

--chat sends code and prose requests in the model's chat template; --draft-head-tokens compares FR-Spec
draft heads (0: the whole vocabulary), each taking turns with plain decoding in one stretch.

For each pair and K: acceptance rate, mean acceptance length, per-position acceptance, tokens/s
with and without speculation, the speedup; the measured cost ratios c = draft step / target step
and v = target step with K+1 tokens / with 1; and the predicted speedup E / (K*c + v) with
E = (1 - a^(K+1)) / (1 - a). Pairs:
  qwen-coder target Qwen2.5-Coder-1.5B-Instruct <- draft Qwen2.5-Coder-0.5B-Instruct (one tokenizer), greedy
  real       target google/gemma-3-270m <- draft SmolLM2-135M-Instruct (TLI), greedy
  synthetic  random 1.7B Llama-shape target <- random SmolLM2-135M-shape draft,
             rejection_sample_method synthetic with per-token acceptance a in {0.1, 0.5, 0.7, 0.9}
Writes benchmarks/results/spec_bench.json and spec_bench.png (spec_bench_<pairs>.json/png for other pairs).

One engine per pair is built once; between configurations only the speculative config changes
(building a random 1.7B model takes longer than a whole configuration's run). Each configuration
takes turns with plain decoding prompt by prompt, so every speedup is a ratio of one stretch of time.
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

from engine import SamplingParams
from engine.adaptive import expected_tokens
from engine.config import EngineConfig, SpeculativeConfig
from engine.core import EngineCore
from engine.spec_policy import SpeculationPolicy
from engine.verifier import Verifier

RESULTS = Path(__file__).parent / "results"
PROMPTS = ["The history of the printing press begins", "def quicksort(items):\n", "Dear team, thank you for"]
# chat-format prompts (--chat): code and prose, as the default app's users send them
CHAT_PROMPTS = ["Write a Python function that merges two sorted lists, with a docstring.",
                "Explain in a paragraph what a hash map is and when to use one.",
                "Write a bash script that counts the lines of every .py file in a directory."]
PAIRS = {
    "qwen-coder": ("Qwen/Qwen2.5-Coder-1.5B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct", {}),
    "real": ("google/gemma-3-270m", "HuggingFaceTB/SmolLM2-135M-Instruct", {"use_heterogeneous_vocab": True}),
    "synthetic": ("random:llama-1.7b", "random:smollm2-135m", {}),
}


class SpecState:
    """What the scheduler keeps per speculative config (stats, its speculation policy, the
    verifier), so configs can take turns on one engine without resetting each other."""

    def __init__(self, core: EngineCore, spec: SpeculativeConfig | None):
        self.spec = spec
        self.policy = SpeculationPolicy(spec, core.executor.overlaps_groups)
        self.stats = type(core.scheduler.stats)()
        self.verifier = Verifier(core.executor.target.worker, spec)

        self.head = None  # the draft's LM head for this state (FR-Spec rows); None: as it is

    def activate(self, core: EngineCore) -> None:
        sched = core.scheduler
        sched.spec, sched.policy, sched.stats = self.spec, self.policy, self.stats
        core.executor.target.verifier = self.verifier
        if self.head is not None:
            core.executor.draft.worker.model.lm_head = self.head


def draft_heads(core: EngineCore, draft: str, sizes: list[int]) -> dict[int, torch.nn.Module]:
    """The draft's LM head per FR-Spec size (0: the whole vocabulary), built once."""
    from engine.frequent_tokens import FrequentTokenHead, frequent_token_ids
    from engine.models.loading import load_tokenizer, resolve_model

    model = core.executor.draft.worker.model
    full, vocab = model.lm_head, model.args.vocab_size
    tokenizer = load_tokenizer(resolve_model(draft))
    return {n: full if not n or n >= vocab else FrequentTokenHead(full, frequent_token_ids(tokenizer, vocab, n), vocab)
            for n in sizes}


def chat_prompt(core: EngineCore, text: str) -> str:
    return core.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                              add_generation_prompt=True)


def generate(core: EngineCore, params: SamplingParams, prompt: str) -> tuple[int, float]:
    """One request alone (the latency-bound case speculation is for): (output tokens, seconds)."""
    start = time.perf_counter()
    seq = core.add_request(f"bench-{time.monotonic_ns()}", prompt, core.tokenizer.encode(prompt), params)
    while not seq.finished:
        core.step()
    return len(seq.output_ids), time.perf_counter() - start


def take_turns(core: EngineCore, states: list[SpecState], params: SamplingParams, prompts: list[str]) -> list[float]:
    """tok/s of each state, the states taking turns prompt by prompt (rotating which goes first) so
    all see the same machine noise."""
    totals = [[0, 0.0] for _ in states]
    for i, prompt in enumerate(prompts):
        for j in range(len(states)):
            turn = (i + j) % len(states)
            states[turn].activate(core)
            tokens, seconds = generate(core, params, prompt)
            totals[turn][0] += tokens
            totals[turn][1] += seconds
    return [n / t for n, t in totals]


def bench_pair(name: str, ks: list[int], alphas: list[float | None], max_tokens: int, chat: bool = False,
               temperatures: list[float] | None = None, head_sizes: list[int] = (0,)) -> list[dict]:
    target, draft, extra = PAIRS[name]
    base = {"model": draft, "num_speculative_tokens": max(ks), **extra}
    core = EngineCore(EngineConfig(model=target, max_model_len=512, max_num_seqs=1,
                                   speculative_config=SpeculativeConfig.model_validate(base)), use_ray=False)
    temperatures = temperatures or [0.0 if name != "synthetic" else 1.0]
    prompts = [chat_prompt(core, p) for p in CHAT_PROMPTS] if chat else PROMPTS
    heads = draft_heads(core, draft, list(head_sizes))
    plain = SpecState(core, None)
    plain.activate(core)
    generate(core, SamplingParams(max_tokens=4, ignore_eos=True), prompts[0])  # warm-up
    rows = []
    for alpha, temperature, k in itertools.product(alphas, temperatures, [*ks, "adaptive"]):
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=0)
        cfg = {**base, "num_speculative_tokens": max(ks) if k == "adaptive" else k,
               "adaptive": k == "adaptive"}
        if alpha is not None:
            cfg.update(rejection_sample_method="synthetic",
                       synthetic_acceptance_rates=[alpha ** (i + 1) for i in range(cfg["num_speculative_tokens"])])
        states = []
        for head in heads.values():  # every head takes turns with plain decoding in one stretch
            states.append(SpecState(core, SpeculativeConfig.model_validate(cfg)))
            states[-1].head = head
        *rates, plain_tps = take_turns(core, [*states, plain], params, prompts)
        for head_size, state, tps in zip(heads, states, rates):
            stats = state.stats
            row = {"pair": name, "alpha_config": alpha, "k": k, "tok_s": tps, "plain_tok_s": plain_tps,
                   "speedup": tps / plain_tps, "acceptance_rate": stats.acceptance_rate,
                   "mean_acceptance_length": stats.mean_acceptance_length, "draft_head_tokens": head_size or None,
                   "chat": chat, "temperature": temperature, "per_position": stats.per_position_rates(),
                   "mean_k": stats.num_draft_tokens / max(1, stats.num_drafts)}
            if k != "adaptive":
                state.activate(core)
                c, v = measure_costs(core, k)
                # per-token acceptance: the configured rate, else the one that explains the measured length
                a = alpha if alpha is not None else solve_alpha(stats.mean_acceptance_length, k)
                row.update(c=c, v=v, alpha=a, predicted=expected_tokens(a, k) / (k * c + v))
            rows.append(row)
    core.shutdown()
    return rows


@torch.inference_mode()
def measure_costs(core: EngineCore, k: int, context: int = 64, repeats: int = 7) -> tuple[float, float]:
    """c = draft step / target step and v = target step with k+1 tokens / with 1, timed directly on
    the engine's workers (blocks 1.., free between requests) at `context` cached tokens."""
    import statistics

    from engine.kv_cache import static_tables

    def ms(worker, n):
        table = static_tables(1, context + n, worker.block_size)
        worker.forward(table, [0], [[1] * context])  # fill the cache up to `context`
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            worker.forward(table, [context], [[1] * n])
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    target, draft = core.executor.target.worker, core.executor.draft.worker
    one = ms(target, 1)
    return ms(draft, 1) / one, ms(target, k + 1) / one


def solve_alpha(mean_length: float, k: int) -> float:
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < mean_length else (lo, mid)
    return lo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", nargs="+", default=["real", "synthetic"], choices=list(PAIRS))
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 5])
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.1, 0.5, 0.7, 0.9])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--chat", action="store_true", help="chat-format code and prose prompts (the model's template)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=None,
                    help="default: 0 (real pairs), 1 (synthetic)")
    ap.add_argument("--draft-head-tokens", type=int, nargs="+", default=[0],
                    help="FR-Spec draft heads to compare (0: the whole vocabulary)")
    ap.add_argument("--out", default=None, help="results file stem (default: from the pairs)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    rows = []
    for name in args.pairs:
        rows += bench_pair(name, args.ks, [None] if name != "synthetic" else args.alphas, args.max_tokens,
                           args.chat, args.temperatures, args.draft_head_tokens)

    print(f"{'pair':<10}{'a':>5}{'K':>9}{'head':>7}{'accept':>7}{'len':>6}{'tok/s':>7}{'plain':>7}{'speedup':>8}"
          f"{'c':>6}{'v':>6}{'pred':>6}")
    for r in rows:
        pred = f"{r['predicted']:>6.2f}" if "predicted" in r else f"{'':>6}"
        cv = f"{r['c']:>6.2f}{r['v']:>6.2f}" if "c" in r else f"{'':>12}"
        alpha = "" if r["alpha_config"] is None else f"{r['alpha_config']:.1f}"
        head = str(r["draft_head_tokens"] or "all")
        print(f"{r['pair']:<10}{alpha:>5}{str(r['k']):>9}{head:>7}{r['acceptance_rate']:>7.2f}{r['mean_acceptance_length']:>6.2f}"
              f"{r['tok_s']:>7.1f}{r['plain_tok_s']:>7.1f}{r['speedup']:>7.2f}x{cv}{pred}")
    RESULTS.mkdir(exist_ok=True)
    from machine import cpu_model

    for r in rows:
        r.update(cpu=cpu_model(), max_tokens=args.max_tokens)
    # one file per set of pairs: a run of one pair leaves the others' rows as they were
    name = args.out or ("spec_bench" if args.pairs == ["real", "synthetic"] else "spec_bench_" + "_".join(args.pairs))
    (RESULTS / f"{name}.json").write_text(json.dumps(rows, indent=2))
    plot(rows, RESULTS / f"{name}.png")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = lambda r: (r["pair"], r["alpha_config"], r.get("temperature"), r.get("draft_head_tokens"))  # noqa: E731
    groups = sorted({key(r) for r in rows}, key=str)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for pair, alpha, temperature, head in groups:
        mine = [r for r in rows if key(r) == (pair, alpha, temperature, head)]
        sel = [r for r in mine if r["k"] != "adaptive"]
        label = (pair if alpha is None else f"{pair} a={alpha}") + (f" T={temperature:g}" if temperature else "") \
            + (f" head {head}" if head else "")
        line, = ax1.plot([r["k"] for r in sel], [r["speedup"] for r in sel], "o-", label=f"{label} measured")
        ax1.plot([r["k"] for r in sel], [r.get("predicted", float("nan")) for r in sel], "x--",
                 color=line.get_color(), label=f"{label} predicted")
        adaptive = [r for r in mine if r["k"] == "adaptive"]
        if adaptive:
            ax1.axhline(adaptive[0]["speedup"], color=line.get_color(), lw=0.8, ls=":")
        best = max(sel, key=lambda r: len(r["per_position"]))
        ax2.plot(range(1, len(best["per_position"]) + 1), best["per_position"], "o-", label=label)
    ax1.axhline(1.0, color="gray", lw=0.8)
    ax1.set(xlabel="K", ylabel="speedup over plain decoding", title="measured (o) vs predicted (x); adaptive (dotted)")
    ax2.set(xlabel="draft position", ylabel="acceptance rate", title="acceptance per position (largest K)")
    ax1.legend(fontsize=6)
    ax2.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
