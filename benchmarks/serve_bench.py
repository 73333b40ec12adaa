"""Serving benchmark, like `vllm bench serve`: N streamed requests at concurrency C over HTTP,
and the same prompts through an in-process engine, in alternating batches of one run.

    .venv/bin/python benchmarks/serve_bench.py [--num-requests 8] [--concurrency 1 4] [--max-tokens 64]
    .venv/bin/python benchmarks/serve_bench.py --url http://127.0.0.1:8000   # an already running server
    .venv/bin/python benchmarks/serve_bench.py --vs-plain --concurrency 1 4 8
    .venv/bin/python benchmarks/serve_bench.py --vs-llama [--concurrency 8] [--max-tokens 96]
    .venv/bin/python benchmarks/serve_bench.py --local --concurrency 1   # where a served token's time goes

--vs-plain: the default application against the same application without speculation (a second
Serve app at /plain), both over HTTP, taking turns; reports each one's output tokens/s and, as the
ratio, the median of each round's own ratio (its two batches back to back: the machine's slow and
fast phases cancel) with their range.

--vs-llama: the default application against llama.cpp's server (`-np` = the concurrency) on the same
GGUF files (the app's target, and with speculation its draft too: `-md`, `--spec-draft-n-max` = the app's
num_speculative_tokens), with the same client: both servers up at once, idle while the other runs, their
batches taking turns; reports aggregate output tokens/s and median TTFT per side and the median of the
rounds' ratios. `--llama-plain`: llama-server without the draft (its plain decoding). Needs
benchmarks/llamacpp_setup.sh (llama-server). Writes one row per CPU, model and concurrency to
benchmarks/results/serve_vs_llama.json.

--local: a third path, the same engine with its models in this process (no Ray actors, as
`LLM.generate` runs them), taking turns with the other two: HTTP - engine is what Serve's proxy and
replica add to a token, engine - local what the Ray actor calls add.

Without --url it starts the application of serve_config.yaml in this process's Ray cluster on a
free port. Reports TTFT, TPOT, ITL and end-to-end latency (mean, p50, p90, p99), request and
output-token throughput, and acceptance from /metrics. Writes benchmarks/results/serve_bench.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
PROMPTS = ["The future of AI is", "Write a short poem about the sea.", "def fibonacci(n):",
           "The three primary colors are", "Explain photosynthesis in one paragraph.", "Dear customer,",
           "List five fruits:", "Once upon a time in a small village,"]


def percentiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    s = sorted(xs)
    pick = lambda q: s[min(len(s) - 1, int(round(q * (len(s) - 1))))]  # noqa: E731
    return {"mean": statistics.fmean(s), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


def summarize(records: list[dict], wall: float) -> dict:
    tokens = sum(r["tokens"] for r in records)
    return {
        "ttft_ms": percentiles([r["ttft"] * 1e3 for r in records]),
        "tpot_ms": percentiles([(r["e2e"] - r["ttft"]) / (r["tokens"] - 1) * 1e3 for r in records if r["tokens"] > 1]),
        "itl_ms": percentiles([x * 1e3 for r in records for x in r["itl"]]),
        "e2e_ms": percentiles([r["e2e"] * 1e3 for r in records]),
        "request_throughput": len(records) / wall,
        "output_throughput": tokens / wall,
    }


async def timed(events) -> dict:
    """One request's timings from its stream of (new text, new tokens) events."""
    start = time.perf_counter()
    first, last, itl, tokens = None, None, [], 0
    async for text, new_tokens in events:
        now = time.perf_counter()
        tokens += new_tokens
        if not text:
            continue
        if first is None:
            first = now
        else:
            itl.append(now - last)
        last = now
    return {"ttft": first - start, "e2e": time.perf_counter() - start, "itl": itl, "tokens": tokens}


async def measure(streams, concurrency: int) -> dict:
    """Run the request streams (zero-argument async-iterator factories) `concurrency` at a time."""
    sem = asyncio.Semaphore(concurrency)

    async def one(stream):
        async with sem:
            return await timed(stream())

    start = time.perf_counter()
    records = await asyncio.gather(*(one(s) for s in streams))
    return {"records": list(records), "wall": time.perf_counter() - start}


async def http_run(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int,
                   prefix: str = "") -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        def stream(prompt):
            async def events():
                body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                async with client.stream("POST", f"{url}{prefix}/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if chunk.get("usage"):  # the last chunk: token count, no text
                            yield "", chunk["usage"]["completion_tokens"]
                        elif chunk.get("choices"):
                            yield chunk["choices"][0]["text"], 0
            return events

        return await measure([stream(p) for p in prompts], concurrency)


async def engine_run(engine, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def stream(prompt):
        async def events():
            async for delta in engine.add_request(prompt, params):
                yield delta.text, len(delta.token_ids)
        return events

    return await measure([stream(p) for p in prompts], concurrency)


def paired(http_batches: list[dict], engine_batches: list[dict]) -> dict:
    """The same prompt in the same round through both paths: median of the per-request TTFT
    differences and TPOT ratios (records come back in prompt order), less noisy than comparing
    the two paths' own medians."""
    pairs = [(h, e) for hb, eb in zip(http_batches, engine_batches) for h, e in zip(hb["records"], eb["records"])]
    tpot = lambda r: (r["e2e"] - r["ttft"]) / max(1, r["tokens"] - 1)  # noqa: E731
    return {"ttft_overhead_ms": statistics.median((h["ttft"] - e["ttft"]) * 1e3 for h, e in pairs),
            "tpot_ratio": statistics.median(tpot(h) / tpot(e) for h, e in pairs)}


def acceptance(url: str) -> dict:
    values = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        for name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                     "spec_decode_num_accepted_tokens_total"):
            if line.startswith(f"tandem:{name}"):
                values[name] = float(line.split()[-1])
    drafts = values.get("spec_decode_num_drafts_total", 0)
    draft_tokens = values.get("spec_decode_num_draft_tokens_total", 0)
    accepted = values.get("spec_decode_num_accepted_tokens_total", 0)
    return {"acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def openai_run(server, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    """The same streamed greedy completions against either server; tokens from the usage both send last."""
    from openai_servers import client_for

    async with client_for(server, 900) as client:
        def stream(prompt):
            async def events():
                body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        raise RuntimeError(f"{server.name}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if chunk.get("choices") and chunk["choices"][0].get("text"):
                            yield chunk["choices"][0]["text"], 0
                        if chunk.get("usage"):
                            yield "", chunk["usage"]["completion_tokens"]
            return events

        return await measure([stream(p) for p in prompts], concurrency)


def vs_llama(args, prompts: list[str]) -> None:
    """--vs-llama: see the module's docstring."""
    import yaml

    from engine.models.loading import resolve_model
    from machine import cpu_model, save
    from openai_servers import BUILDS, TANDEM_ISA, start_llama, start_tandem

    if not (BUILDS[args.isa] / "llama-server").exists():
        raise SystemExit(f"no llama-server in {BUILDS[args.isa]}: run benchmarks/llamacpp_setup.sh first "
                         f"(LLAMACPP_ISA=avx2 for --isa avx2)")
    app = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["args"]
    gguf = Path(resolve_model(app["model"]).path)
    spec = app.get("speculative_config") or {}
    draft = ["-md", str(resolve_model(spec["model"]).path), "--spec-draft-n-max", str(spec["num_speculative_tokens"]),
             "-td", str(args.threads)] if spec and not args.llama_plain else []
    c = max(args.concurrency)
    ray_started: list = []
    tandem, stop_tandem = start_tandem(TANDEM_ISA[args.isa], ray_started)
    llama, stop_llama = start_llama(gguf, args.threads, ["-np", str(c), "-c", str(c * 2048), *draft], args.isa)
    sides = {"tandem": tandem, "llama.cpp": llama}
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    try:
        for server in sides.values():  # warm-up
            asyncio.run(openai_run(server, prompts[:c], c, 8))
        for r in range(args.rounds):
            for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                runs[name].append(asyncio.run(openai_run(sides[name], prompts, c, args.max_tokens)))
    finally:
        stop_llama()
        stop_tandem()
    for name, batches in runs.items():
        for b in batches:
            short = [rec["tokens"] for rec in b["records"] if rec["tokens"] != args.max_tokens]
            if short:
                raise SystemExit(f"{name} returned {short} tokens, not {args.max_tokens}: not the same work")
    summary = {name: summarize([rec for b in batches for rec in b["records"]], sum(b["wall"] for b in batches))
               for name, batches in runs.items()}
    tps = lambda b: summarize(b["records"], b["wall"])["output_throughput"]  # noqa: E731
    ratios = [tps(t) / tps(l) for t, l in zip(runs["tandem"], runs["llama.cpp"])]
    pair = f"{app['model']} <- {spec['model']}" if spec else app["model"]
    result = {"cpu": cpu_model(), "isa": args.isa, "threads": args.threads, "date": time.strftime("%Y-%m-%d"),
              "concurrency": c, "model": pair, "llama_cpp_draft": bool(draft),
              "requests": len(prompts), "max_tokens": args.max_tokens, "rounds": args.rounds,
              **summary, "round_ratios": ratios, "tandem_over_llama": statistics.median(ratios)}
    print(f"{len(prompts)} greedy streams x {args.max_tokens} tokens at concurrency {c}, {args.rounds} rounds; "
          f"{result['cpu']}")
    print(f"{'server':<11}{'tok/s':>8}{'TTFT p50':>10}{'TTFT p90':>10}{'TPOT p50':>10}")
    for name, s in summary.items():
        print(f"{name:<11}{s['output_throughput']:>8.1f}{s['ttft_ms']['p50']:>10.0f}{s['ttft_ms']['p90']:>10.0f}"
              f"{s['tpot_ms']['p50']:>10.1f}")
    print(f"tandem / llama.cpp, output tokens/s, median of the rounds' ratios: {result['tandem_over_llama']:.2f}x "
          f"({min(ratios):.2f}-{max(ratios):.2f}); TTFT p50 {summary['tandem']['ttft_ms']['p50']:.0f} vs "
          f"{summary['llama.cpp']['ttft_ms']['p50']:.0f} ms")
    print(f"wrote {save('serve_vs_llama', result, key=('cpu', 'concurrency', 'isa', 'model', 'llama_cpp_draft'))}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=None)
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2,
                    help="HTTP and in-process batches alternate this many times per concurrency")
    ap.add_argument("--vs-plain", action="store_true",
                    help="compare the default app with itself without speculation, instead of HTTP with in-process")
    ap.add_argument("--local", action="store_true",
                    help="also run the engine with its models in this process (no Ray actors): where a served token's time goes")
    ap.add_argument("--vs-llama", action="store_true",
                    help="compare the default app with llama.cpp's server on the same Gemma GGUF file")
    ap.add_argument("--threads", type=int, default=2, help="--vs-llama: llama-server's threads")
    ap.add_argument("--llama-plain", action="store_true", help="--vs-llama: llama-server without the app's draft")
    ap.add_argument("--isa", choices=["native", "avx2"], default="native",
                    help="--vs-llama: native, or both servers on AVX2 only (Tandem cpu_isa avx2, llama.cpp's AVX2 build)")
    args = ap.parse_args()
    app_args = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["args"]
    model = app_args["model"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.num_requests)]
    if args.vs_llama:
        return vs_llama(args, prompts)

    import ray
    from ray import serve

    url, engine, local = args.url, None, None
    if url is None:
        # Both engines live at once so their batches can alternate and see the same machine noise;
        # each reserves one CPU per model group, hence the logical CPUs beyond the physical ones.
        ray.init(include_dashboard=False, log_to_driver=False, num_cpus=max(4, 2 * (os.cpu_count() or 1)))
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        from deployments.app import build_app, parse_args
        from engine.async_engine import AsyncEngine

        serve.run(build_app(app_args), name="tandem", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        if args.vs_plain:
            plain_args = {k: v for k, v in app_args.items() if k != "speculative_config"}
            serve.run(build_app({**plain_args, "grpc_port": None}), name="plain", route_prefix="/plain")
        else:
            engine = AsyncEngine(parse_args(app_args).engine_config(), use_ray=True)
            asyncio.run(engine_run(engine, prompts[:1], 1, 8))  # warm-up
            if args.local:
                local = AsyncEngine(parse_args(app_args).engine_config(), use_ray=False)
                asyncio.run(engine_run(local, prompts[:1], 1, 8))
    asyncio.run(http_run(url, model, prompts[:1], 1, 8))  # warm-up
    second = "plain" if args.vs_plain else "engine"
    if args.vs_plain:
        asyncio.run(http_run(url, model, prompts[:1], 1, 8, "/plain"))

    paths = ["http", second] + (["local"] if local is not None else [])
    results = {path: {} for path in paths}
    for c in args.concurrency:
        runs = {path: [] for path in paths}
        for r in range(args.rounds):
            order = paths if r % 2 == 0 else paths[::-1]
            for path in order:
                if path == "http":
                    runs[path].append(asyncio.run(http_run(url, model, prompts, c, args.max_tokens)))
                elif path == "plain":
                    runs[path].append(asyncio.run(http_run(url, model, prompts, c, args.max_tokens, "/plain")))
                elif path == "engine" and engine is not None:
                    runs[path].append(asyncio.run(engine_run(engine, prompts, c, args.max_tokens)))
                elif path == "local":
                    runs[path].append(asyncio.run(engine_run(local, prompts, c, args.max_tokens)))
        for path, batches in runs.items():
            if batches:
                results[path][c] = summarize([rec for b in batches for rec in b["records"]],
                                             sum(b["wall"] for b in batches))
        if runs.get("engine"):
            results.setdefault("paired", {})[c] = paired(runs["http"], runs["engine"])
        if runs.get("local"):
            results.setdefault("paired_engine_local", {})[c] = paired(runs["engine"], runs["local"])
        if runs.get("plain"):  # each round's own ratio: its two batches ran back to back
            results.setdefault("round_ratios", {})[c] = [
                summarize(h["records"], h["wall"])["output_throughput"] / summarize(p["records"], p["wall"])["output_throughput"]
                for h, p in zip(runs["http"], runs["plain"])]
    results["acceptance"] = acceptance(url)
    for e in (engine, local):
        if e is not None:
            e.shutdown()
    if args.url is None:
        serve.shutdown()

    print(f"{args.num_requests} requests x {args.max_tokens} tokens x {args.rounds} rounds, greedy; model {model}; "
          f"acceptance rate {results['acceptance']['acceptance_rate']:.2f}, "
          f"mean acceptance length {results['acceptance']['mean_acceptance_length']:.2f}")
    print(f"{'path':<8}{'C':>3}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'ITL p50':>9}{'E2E p50':>10}"
          f"{'req/s':>7}{'tok/s':>7}")
    for path, by_c in results.items():
        if path in ("acceptance", "paired", "paired_engine_local", "speculative_over_plain", "round_ratios"):
            continue
        for c, r in by_c.items():
            print(f"{path:<8}{c:>3}{r['ttft_ms']['p50']:>10.1f}{r['ttft_ms']['p99']:>10.1f}{r['tpot_ms']['p50']:>10.1f}"
                  f"{r['itl_ms'].get('p50', 0):>9.1f}{r['e2e_ms']['p50']:>10.1f}{r['request_throughput']:>7.2f}"
                  f"{r['output_throughput']:>7.1f}")
    if args.vs_plain:
        ratios = {c: statistics.median(results["round_ratios"][c]) for c in args.concurrency}
        results["speculative_over_plain"] = ratios
        print("default app / plain, output tokens/s, median of the rounds' ratios (range): " + ", ".join(
            f"C={c} {r:.2f}x ({min(results['round_ratios'][c]):.2f}-{max(results['round_ratios'][c]):.2f})"
            for c, r in ratios.items()))
    elif results["engine"]:
        c = args.concurrency[0]
        h, e = results["http"][c], results["engine"][c]
        p = results["paired"][c]
        print(f"at concurrency {c}: TPOT http/in-process {h['tpot_ms']['p50'] / e['tpot_ms']['p50']:.2f}x, "
              f"TTFT overhead p50 {h['ttft_ms']['p50'] - e['ttft_ms']['p50']:+.1f} ms; paired by request: "
              f"TPOT {p['tpot_ratio']:.2f}x, TTFT {p['ttft_overhead_ms']:+.1f} ms (medians)")
        if results.get("local"):
            local, q = results["local"][c], results["paired_engine_local"][c]
            print(f"a token's time at concurrency {c} (TPOT p50): {local['tpot_ms']['p50']:.1f} ms models in this "
                  f"process, {e['tpot_ms']['p50']:.1f} behind Ray actors, {h['tpot_ms']['p50']:.1f} over HTTP; "
                  f"paired by request: actors {q['tpot_ratio']:.2f}x in-process")
    from machine import cpu_model, save

    spec = app_args.get("speculative_config") or {}
    app = f"{model} <- {spec['model']}" if spec and args.url is None else model  # what serve_config.yaml served
    row = {"cpu": cpu_model(), "date": time.strftime("%Y-%m-%d"), "paths": " ".join(paths), "model": app,
           "requests": args.num_requests, "max_tokens": args.max_tokens, "rounds": args.rounds,
           **json.loads(json.dumps(results))}  # concurrency keys as the file holds them (strings)
    print(f"wrote {save('serve_bench_vs_plain' if args.vs_plain else 'serve_bench', row, key=('cpu', 'paths', 'model'))}")


if __name__ == "__main__":
    main()
