"""One speculative round, taken apart: draft forwards, the draft's sampling, the target's verify
forward, rejection sampling, and the engine's host work, each in milliseconds per round and each
forward against its weight-read floor; plain decoding's step beside it. Then the predicted speedup
(Leviathan et al.: E / (K*c + v), c = draft forward / target forward and v = verify forward / target
forward, measured here) beside the measured one, and the speedup the weight-read floors would allow.

    .venv/bin/python benchmarks/round_bench.py [--pairs qwen-coder real] [--ks 3 4] [--max-tokens 96] [--repeats 2]

Offline, batch 1, chat prompts (code and prose), greedy and temperature 0.7. Each configuration takes
turns with plain decoding prompt by prompt, so every ratio comes from one stretch of time. The timers
wrap the engine's own objects in this process (EngineCore without Ray): the draft's and the target's
forward, the draft's propose and the target's verify, and the engine's step. Steps that prefill are
left out. The floor of a forward is the bytes of weights it reads in the engine's own weight forms
(every matrix and the LM head the model uses; the embedding table gives one row) over the highest
read bandwidth this process sees: the best of a float32 sum over 512 MB and the fastest float32
matrix-vector product (benchmarks/decode_step.py), taken before and after each pair, since the
machine is shared. Writes benchmarks/results/round_bench.json (one row per
CPU, pair, K, temperature).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_step import matvec_bandwidth  # noqa: E402
from machine import cpu_model, save  # noqa: E402
from spec_bench import PAIRS, SpecState, chat_prompt, draft_heads, solve_alpha  # noqa: E402

from engine import SamplingParams  # noqa: E402
from engine.adaptive import expected_tokens  # noqa: E402
from engine.config import EngineConfig, SpeculativeConfig  # noqa: E402
from engine.core import EngineCore  # noqa: E402

PROMPTS = ["Write a Python function that merges two sorted lists, with a docstring.",
           "Explain in a paragraph what a hash map is and when to use one.",
           "Write a bash script that counts the lines of every .py file in a directory."]
PARTS = ("draft_forward", "draft_sampling", "verify_forward", "verify_sampling", "engine_host")


class RoundTimer:
    """Seconds spent in each wrapped call during the current engine step."""

    def __init__(self):
        self.now: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, obj, method: str, name: str) -> None:
        inner = getattr(obj, method)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.now[name] += time.perf_counter() - start
                self.calls[name] += 1
        setattr(obj, method, timed)

    def take(self) -> tuple[dict[str, float], dict[str, int]]:
        now, calls = dict(self.now), dict(self.calls)
        self.now.clear()
        self.calls.clear()
        return now, calls


def bytes_read_per_step(model: torch.nn.Module) -> int:
    """The weight bytes one decode step reads: every module's tensors but the embedding table's (a
    lookup reads one row; a tied LM head still counts, through the head)."""
    embed, tensors = model.model.embed_tokens, {}
    for module in model.modules():
        if module is embed:
            continue
        for p in module.parameters(recurse=False):
            tensors[id(p)] = p.numel() * p.element_size()
        blocks = getattr(module, "blocks", None)
        if blocks is not None:
            tensors[id(blocks)] = blocks.nbytes
    return sum(tensors.values())


def instrument(core: EngineCore) -> RoundTimer:
    timer, ex = RoundTimer(), core.executor
    timer.wrap(ex.draft.worker, "forward", "draft_forward")
    timer.wrap(ex.draft, "propose", "propose")
    for method in ("forward", "forward_ragged"):
        timer.wrap(ex.target.worker, method, "verify_forward")
    timer.wrap(ex.target, "verify", "verify")
    timer.wrap(ex, "prefill", "prefill")
    timer.wrap(core, "step", "step")
    return timer


def run(core: EngineCore, timer: RoundTimer, params: SamplingParams, prompt: str) -> list[dict]:
    """One request alone; the parts of each decode step (ms) and the tokens it emitted."""
    seq = core.add_request(f"round-{time.monotonic_ns()}", prompt, core.tokenizer.encode(prompt), params)
    timer.take()
    rounds = []
    while not seq.finished:
        before = len(seq.output_ids)
        core.step()
        now, calls = timer.take()
        if now.get("prefill", 0.0) > 0 or "verify" not in now:
            continue
        parts = {"draft_forward": now.get("draft_forward", 0.0),
                 "draft_sampling": now.get("propose", 0.0) - now.get("draft_forward", 0.0),
                 "verify_forward": now["verify_forward"],
                 "verify_sampling": now["verify"] - now["verify_forward"],
                 "engine_host": now["step"] - now.get("propose", 0.0) - now["verify"]}
        rounds.append({**{k: v * 1e3 for k, v in parts.items()}, "tokens": len(seq.output_ids) - before,
                       "draft_steps": calls.get("draft_forward", 0), "total": now["step"] * 1e3})
    return rounds


def summary(rounds: list[dict]) -> dict:
    """Per-round means (ms), tokens per round, and the per-step medians of the forwards."""
    n = len(rounds)
    out = {k: sum(r[k] for r in rounds) / n for k in (*PARTS, "total", "tokens", "draft_steps")}
    steps = [r["draft_forward"] / r["draft_steps"] for r in rounds if r["draft_steps"]]
    out["draft_step_ms"] = statistics.median(steps) if steps else None
    out["verify_forward_ms"] = statistics.median(r["verify_forward"] for r in rounds)
    out["tok_s"] = 1e3 * sum(r["tokens"] for r in rounds) / sum(r["total"] for r in rounds)
    out["rounds"] = n
    return out


def read_bandwidth(repeats: int = 10) -> float:
    """Bytes/s of the fastest whole read of a 512 MB buffer, far larger than any cache."""
    x = torch.randn(128 * 2**20)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return max(x.numel() * 4 / best, matvec_bandwidth(repeats))


def bench_pair(name: str, ks: list[int], temperatures: list[float], max_tokens: int, head: int,
               repeats: int) -> list[dict]:
    target, draft, extra = PAIRS[name]
    base = {"model": draft, "num_speculative_tokens": max(ks), **extra}
    core = EngineCore(EngineConfig(model=target, max_model_len=1024, max_num_seqs=1,
                                   speculative_config=SpeculativeConfig.model_validate(base)), use_ray=False)
    heads = draft_heads(core, draft, [head])
    prompts = [chat_prompt(core, p) for p in PROMPTS]
    timer = instrument(core)
    plain = SpecState(core, None)
    plain.activate(core)
    run(core, timer, SamplingParams(max_tokens=4, ignore_eos=True), prompts[0])  # warm-up
    target_bytes = bytes_read_per_step(core.executor.target.worker.model)
    rows = []
    for temperature in temperatures:
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=0)
        for k in ks:
            spec = SpecState(core, SpeculativeConfig.model_validate({**base, "num_speculative_tokens": k}))
            spec.head = heads[head]
            spec.activate(core)
            draft_bytes = bytes_read_per_step(core.executor.draft.worker.model)
            sides: dict[str, list[dict]] = {"plain": [], "spec": []}
            for i, prompt in enumerate(prompts * repeats):  # plain and speculation take turns, rotating who goes first
                for side in (("plain", "spec") if i % 2 == 0 else ("spec", "plain")):
                    (plain if side == "plain" else spec).activate(core)
                    sides[side] += run(core, timer, params, prompt)
            p, s = summary(sides["plain"]), summary(sides["spec"])
            target_step = p["verify_forward_ms"]
            c, v = s["draft_step_ms"] / target_step, s["verify_forward_ms"] / target_step
            a = solve_alpha(s["tokens"], k)
            floor_c = draft_bytes / target_bytes
            rows.append({
                "pair": name, "k": k, "temperature": temperature, "draft_head_tokens": head or None,
                "max_tokens": max_tokens, "plain": p, "spec": s,
                "target_read_mb": target_bytes / 1e6, "draft_read_mb": draft_bytes / 1e6,
                "c": c, "v": v, "alpha": a, "measured": s["tok_s"] / p["tok_s"],
                "predicted": expected_tokens(a, k) / (k * c + v),
                "at_floor": expected_tokens(a, k) / (k * floor_c + 1)})
    core.shutdown()
    return rows


def print_table(rows: list[dict], bandwidth: float) -> None:
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; ms per round (plain: per step)")
    print(f"{'pair':<11}{'T':>4}{'K':>3} {'side':<6}{'draft fwd':>10}{'d samp':>7}{'verify':>8}{'v samp':>7}"
          f"{'host':>6}{'total':>7}{'tok/rd':>7}{'tok/s':>7}")
    for r in rows:
        for side in ("plain", "spec"):
            x = r[side]
            print(f"{r['pair']:<11}{r['temperature']:>4g}{r['k']:>3} {side:<6}{x['draft_forward']:>10.1f}"
                  f"{x['draft_sampling']:>7.2f}{x['verify_forward']:>8.1f}{x['verify_sampling']:>7.2f}"
                  f"{x['engine_host']:>6.2f}{x['total']:>7.1f}{x['tokens']:>7.2f}{x['tok_s']:>7.1f}")
    print()
    print(f"{'pair':<11}{'T':>4}{'K':>3}{'draft step':>11}{'floor':>7}{'target':>8}{'floor':>7}{'c':>6}{'v':>6}"
          f"{'alpha':>6}{'measured':>9}{'predicted':>10}{'meas/pred':>10}{'at floor':>9}")
    for r in rows:
        s = r["spec"]
        print(f"{r['pair']:<11}{r['temperature']:>4g}{r['k']:>3}{s['draft_step_ms']:>11.1f}{r['draft_floor_ms']:>7.1f}"
              f"{r['plain']['verify_forward_ms']:>8.1f}{r['target_floor_ms']:>7.1f}{r['c']:>6.2f}{r['v']:>6.2f}"
              f"{r['alpha']:>6.2f}{r['measured']:>8.2f}x{r['predicted']:>9.2f}x{r['measured'] / r['predicted']:>10.0%}"
              f"{r['at_floor']:>8.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", nargs="+", default=["qwen-coder", "real"], choices=[p for p in PAIRS if p != "synthetic"])
    ap.add_argument("--ks", type=int, nargs="+", default=[3, 4])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2, help="times through the prompts, per configuration")
    ap.add_argument("--draft-head-tokens", type=int, default=32768,
                    help="FR-Spec head of the Qwen draft, as the default app (0: the whole vocabulary)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    bandwidth, rows = read_bandwidth(), []
    for name in args.pairs:
        head = args.draft_head_tokens if name == "qwen-coder" else 0
        rows += bench_pair(name, args.ks, args.temperatures, args.max_tokens, head, args.repeats)
        bandwidth = max(bandwidth, read_bandwidth())
    for r in rows:
        r["target_floor_ms"] = r["target_read_mb"] * 1e6 / bandwidth * 1e3
        r["draft_floor_ms"] = r["draft_read_mb"] * 1e6 / bandwidth * 1e3
    print_table(rows, bandwidth)
    cpu = cpu_model()
    for r in rows:
        save("round_bench", {"cpu": cpu, "bandwidth_gb_s": bandwidth / 1e9, **r},
             key=("cpu", "pair", "k", "temperature", "draft_head_tokens"))


if __name__ == "__main__":
    main()
