"""Scale-out: 1 vs 2 coordinator replicas under the same open-loop load (tiny random models, so
both fit on this machine's 2 cores; what it shows is the serving path, not the models).

    .venv/bin/python benchmarks/scale_bench.py [--rate 12] [--seconds 30] [--max-tokens 32]

Requests arrive as a Poisson process at --rate per second for --seconds (the same arrival times
and prompts for both runs), each streamed over HTTP to 127.0.0.1; TTFT is the time to the first
content chunk. Every response is compared with plain greedy decoding of its prompt. Writes
benchmarks/results/scale_bench_rate<rate>.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import httpx
import ray
from ray import serve

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from servers import free_port  # noqa: E402

from deployments.app import parse_args  # noqa: E402
from deployments.coordinator import Coordinator  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

TARGET, DRAFT = "random:tiny-llama:1", "random:tiny-llama:2"
PROMPTS = ["hello world", "the cat sat", "zebra", "numbers 1 2 3", "a b c", "why not", "ok then", "x y z"]


async def one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, at: float, t0: float) -> dict:
    await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
    start = time.perf_counter()
    body = {"model": TARGET, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    text, first, status = "", None, 0
    try:
        async with client.stream("POST", url, json=body) as r:
            status = r.status_code
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    status = 500
                    break
                piece = event["choices"][0]["text"] if event.get("choices") else ""
                if piece and first is None:
                    first = time.perf_counter()
                text += piece
    except httpx.HTTPError:
        status = -1
    end = time.perf_counter()
    return {"prompt": prompt, "status": status, "text": text, "ttft": (first or end) - start, "latency": end - start}


async def load(url: str, arrivals: list[tuple[float, str]], max_tokens: int) -> tuple[list[dict], float]:
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(client, url, p, max_tokens, at, t0) for at, p in arrivals))
        return results, time.perf_counter() - t0


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=12.0)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rank-threads", type=int, default=1, help="torch threads per model-group rank")
    args = ap.parse_args()
    rng = random.Random(0)
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(args.rate)
        if t > args.seconds:
            break
        arrivals.append((t, rng.choice(PROMPTS)))
    reference_llm = LLM(model=TARGET)
    reference = {p: reference_llm.generate(p, SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                                             ignore_eos=True))[0].outputs[0].text for p in PROMPTS}

    # one torch thread per rank: with 2 replicas, 4 model-group actors share these 2 cores (their
    # default, the node's cores per rank, oversubscribes it: measured TTFT p50 30 s instead of 3 s)
    os.environ.setdefault("TANDEM_RANK_THREADS", str(args.rank_threads))
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    rows = []
    try:
        for replicas in (1, 2):
            serve_args = parse_args({"model": TARGET, "speculative_config": {"model": DRAFT, "num_speculative_tokens": 3},
                                     "grpc_port": None, "max_queued_requests": 1024})
            serve.run(Coordinator.options(num_replicas=replicas).bind(serve_args), name=f"r{replicas}",
                      route_prefix=f"/r{replicas}")
            url = f"http://127.0.0.1:{port}/r{replicas}/v1/completions"
            asyncio.run(load(url, [(0.0, p) for p in PROMPTS * replicas], args.max_tokens))  # warm-up
            results, wall = asyncio.run(load(url, arrivals, args.max_tokens))
            ok = [r for r in results if r["status"] == 200]
            rows.append({"replicas": replicas, "requests": len(results), "ok": len(ok),
                         "incorrect": sum(r["text"] != reference[r["prompt"]] for r in ok),
                         "tokens_per_s": len(ok) * args.max_tokens / wall, "wall_s": wall,
                         "ttft_p50_ms": pct([r["ttft"] for r in ok], 0.5) * 1e3,
                         "ttft_p99_ms": pct([r["ttft"] for r in ok], 0.99) * 1e3,
                         "latency_p50_ms": statistics.median(r["latency"] for r in ok) * 1e3 if ok else float("nan"),
                         "latency_p99_ms": pct([r["latency"] for r in ok], 0.99) * 1e3})
            serve.delete(f"r{replicas}")
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"{len(arrivals)} requests at {args.rate}/s for {args.seconds:.0f} s, {args.max_tokens} tokens each")
    print(f"{'replicas':>8}{'ok':>6}{'wrong':>6}{'tok/s':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'lat p50':>9}{'lat p99':>9}")
    for r in rows:
        print(f"{r['replicas']:>8}{r['ok']:>6}{r['incorrect']:>6}{r['tokens_per_s']:>8.1f}{r['ttft_p50_ms']:>9.0f}ms"
              f"{r['ttft_p99_ms']:>8.0f}ms{r['latency_p50_ms']:>7.0f}ms{r['latency_p99_ms']:>7.0f}ms")
    out = ROOT / "benchmarks" / "results" / f"scale_bench_rate{args.rate:g}.json"
    out.write_text(json.dumps({"rate": args.rate, "seconds": args.seconds, "max_tokens": args.max_tokens,
                               "rank_threads": os.environ["TANDEM_RANK_THREADS"], "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
