"""Soak: N clients at twice the engine's knee for minutes, over HTTP and gRPC, with hostile requests
mixed in. Every greedy response is compared with its idle reference.

Reports sent / ok / 429 / expected 4xx / errors / corrupted, model-worker restarts, and the RSS of the
coordinator and worker processes before and after. Its own Ray cluster and Serve app, on free
loopback ports; bounded in time. Tiny random models by default (the machine has 2 cores).

    .venv/bin/python benchmarks/soak.py --duration 120
    .venv/bin/python benchmarks/soak.py --duration 120 --default-app --out soak_default_app.json

The knee is taken as max_num_seqs (every slot busy), not measured; clients = 2 x knee.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import time
from pathlib import Path

import grpc
import httpx
import psutil
import ray
from ray import serve

from deployments.app import build_app
from tandem_proto import tandem_pb2 as pb
from tandem_proto import tandem_pb2_grpc

RESULTS = Path(__file__).parent / "results"
PROMPTS = ["hello world", "the cat sat on the mat", "numbers 1 2 3", "zebra crossing", "quiet night",
           "a long time ago", "def add(a, b):", "once upon"]
HOSTILE = [{"temperature": -1}, {"stop_token_ids": [10**6], "min_tokens": 4}, {"prompt": "\ud800x"},
           {"presence_penalty": 1.5}, {"max_tokens": 10**9}, {"prompt": [10**6]}, {"top_p": 0}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_processes() -> dict[str, int]:
    from ray._private.state import actors

    return {a["ActorID"]: a["Pid"] for a in actors().values()
            if (a.get("ActorClassName") == "GroupRank" or str(a.get("ActorClassName")).startswith("ServeReplica:"))
            and a["State"] == "ALIVE"}


def rss_mb(pids) -> float:
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


async def main(args) -> dict:
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    port, grpc_port = free_port(), free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    if args.default_app:  # serve_config.yaml's application, on our own ports
        import yaml

        app_args = yaml.safe_load((Path(__file__).parent.parent / "serve_config.yaml").read_text())
        app_args = {**app_args["applications"][0]["args"], "grpc_port": grpc_port}
    else:
        app_args = {"model": args.model, "max_num_seqs": args.max_num_seqs, "max_model_len": 256,
                    "max_queued_requests": args.max_num_seqs * 4, "grpc_port": grpc_port,
                    "speculative_config": {"model": args.draft, "num_speculative_tokens": 3}}
    model = app_args["model"]
    args.max_num_seqs = app_args["max_num_seqs"]
    serve.run(build_app(app_args), name="soak", route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    knee = args.max_num_seqs  # throughput stops growing once every slot is busy
    clients = 2 * knee
    counts = {"sent": 0, "ok": 0, "429": 0, "expected_4xx": 0, "errors": 0, "corrupted": 0}
    error_samples: list[str] = []

    async with httpx.AsyncClient(timeout=120) as http, grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
        stub = tandem_pb2_grpc.TandemServiceStub(ch)

        async def http_text(prompt: str, stream: bool, extra: dict | None = None) -> tuple[int, str]:
            body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": stream, **(extra or {})}
            content = json.dumps(body).encode()  # ASCII escapes: a lone surrogate travels as \ud800
            headers = {"content-type": "application/json"}
            if not stream:
                r = await http.post(f"{base}/v1/completions", content=content, headers=headers)
                return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
            text = ""
            async with http.stream("POST", f"{base}/v1/completions", content=content, headers=headers) as r:
                if r.status_code != 200:
                    return r.status_code, (await r.aread()).decode()
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        if "error" in event:
                            return 500, line
                        text += event["choices"][0]["text"]
            return 200, text

        async def grpc_text(prompt: str) -> tuple[int, str]:
            request = pb.GenerateRequest(model=model, prompt=prompt, max_tokens=args.max_tokens, temperature=0,
                                         ignore_eos=True)
            try:
                return 200, "".join([m.text async for m in stub.GenerateStream(request)])
            except grpc.aio.AioRpcError as e:
                return {grpc.StatusCode.RESOURCE_EXHAUSTED: 429}.get(e.code(), 500), e.details()

        reference = {p: (await http_text(p, False))[1] for p in PROMPTS}
        before = worker_processes()
        rss_before = rss_mb(before.values())
        deadline = time.monotonic() + args.duration
        rng = random.Random(0)

        async def client(i: int) -> None:
            while time.monotonic() < deadline:
                prompt = rng.choice(PROMPTS)
                counts["sent"] += 1
                if rng.random() < args.hostile_fraction:
                    status, _ = await http_text(prompt, rng.random() < 0.5, rng.choice(HOSTILE))
                    counts["expected_4xx" if status in (400, 404) else "errors"] += 1
                    continue
                transport = rng.choice(("http", "http-stream", "grpc"))
                status, text = await (grpc_text(prompt) if transport == "grpc"
                                      else http_text(prompt, transport == "http-stream"))
                if status == 429:
                    counts["429"] += 1
                    await asyncio.sleep(0.05)
                elif status != 200:
                    counts["errors"] += 1
                    error_samples.append(f"{transport} {status} {text[:200]}")
                elif text != reference[prompt]:
                    counts["corrupted"] += 1
                else:
                    counts["ok"] += 1

        start = time.monotonic()
        await asyncio.gather(*(client(i) for i in range(clients)))
        elapsed = time.monotonic() - start
    after = worker_processes()
    result = {"model": model, "draft": app_args["speculative_config"]["model"], "max_num_seqs": args.max_num_seqs, "clients": clients,
              "duration_s": round(elapsed, 1), "max_tokens": args.max_tokens, **counts,
              "worker_restarts": len(set(before.values()) - set(after.values())),
              "rss_before_mb": round(rss_before, 1), "rss_after_mb": round(rss_mb(after.values()), 1),
              "error_samples": error_samples[:5]}
    serve.shutdown()
    ray.shutdown()
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=120.0)
    parser.add_argument("--model", default="random:tiny-llama:1")
    parser.add_argument("--draft", default="random:tiny-llama:2")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--hostile-fraction", type=float, default=0.1)
    parser.add_argument("--default-app", action="store_true", help="serve_config.yaml's app (real models)")
    parser.add_argument("--out", default="soak.json", help="file name under benchmarks/results/")
    args = parser.parse_args()
    result = asyncio.run(main(args))
    print(f"{'clients':>8} {'secs':>6} {'sent':>6} {'ok':>6} {'429':>5} {'4xx':>5} {'errors':>6} "
          f"{'corrupt':>7} {'restarts':>8} {'RSS MB before->after':>22}")
    print(f"{result['clients']:>8} {result['duration_s']:>6} {result['sent']:>6} {result['ok']:>6} "
          f"{result['429']:>5} {result['expected_4xx']:>5} {result['errors']:>6} {result['corrupted']:>7} "
          f"{result['worker_restarts']:>8} {result['rss_before_mb']:>10} -> {result['rss_after_mb']:<9}")
    for sample in result["error_samples"]:
        print("error:", sample)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / args.out).write_text(json.dumps(result, indent=2) + "\n")
