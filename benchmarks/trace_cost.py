"""What `spec_trace` costs a stream: the default app (serve_config.yaml), the same greedy chat requests
streamed with and without the trace, alternating (ABAB, so drift on this shared machine hits both
alike), one at a time. Reports each side's median stream time and bytes on the wire, and the ratio.

    .venv/bin/python benchmarks/trace_cost.py [--rounds 4] [--max-tokens 64]

Writes benchmarks/results/trace_cost.json (one row per CPU).
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
from openai_servers import client_for, start_tandem  # noqa: E402

PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.",
           "Write a Python class for a stack with push, pop and peek.",
           "Write a SQL query that lists the ten most recent orders with their customer names."]


async def stream_once(client, model: str, prompt: str, max_tokens: int, traced: bool) -> tuple[float, int, str]:
    """(seconds to the end of the stream, bytes received, text)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, **({"spec_trace": True} if traced else {})}
    start, size, text = time.perf_counter(), 0, []
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.status_code
        async for line in r.aiter_lines():
            size += len(line) + 1
            if '"content"' in line:
                choices = json.loads(line[6:]).get("choices") or []
                text.append((choices[0].get("delta") or {}).get("content") or "" if choices else "")
    return time.perf_counter() - start, size, "".join(text)


async def measure(server, rounds: int, max_tokens: int) -> dict:
    sides = {False: {"s": [], "bytes": []}, True: {"s": [], "bytes": []}}
    async with client_for(server, 600) as client:
        for p in PROMPTS:  # warm-up: the prefix cache and both paths
            await stream_once(client, server.model, p, 8, False)
        for r in range(rounds):
            for p in PROMPTS:
                texts = {}
                for traced in ((False, True) if r % 2 == 0 else (True, False)):
                    took, size, texts[traced] = await stream_once(client, server.model, p, max_tokens, traced)
                    sides[traced]["s"].append(took)
                    sides[traced]["bytes"].append(size)
                assert texts[True] == texts[False], "the trace changed the text"
    out = {}
    for traced, name in ((False, "without"), (True, "with")):
        out[name] = {"median_s": statistics.median(sides[traced]["s"]),
                     "median_bytes": statistics.median(sides[traced]["bytes"])}
    out["time_ratio_with_over_without"] = statistics.median(
        a / b for a, b in zip(sides[True]["s"], sides[False]["s"]))
    out["bytes_ratio_with_over_without"] = out["with"]["median_bytes"] / out["without"]["median_bytes"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args()
    server, stop = start_tandem({}, [])
    try:
        result = asyncio.run(measure(server, a.rounds, a.max_tokens))
    finally:
        stop()
    row = {"cpu": cpu_model(), "model": server.model, "requests_per_side": a.rounds * len(PROMPTS),
           "max_tokens": a.max_tokens, **result}
    print(f"{'':10}{'median stream s':>17}{'median bytes':>14}")
    for name in ("without", "with"):
        print(f"{name:10}{row[name]['median_s']:>17.3f}{row[name]['median_bytes']:>14.0f}")
    print(f"time with/without (median of paired ratios): {row['time_ratio_with_over_without']:.3f}; "
          f"bytes: {row['bytes_ratio_with_over_without']:.2f}x   ({row['cpu']})")
    print("wrote", save("trace_cost", row))


if __name__ == "__main__":
    main()
