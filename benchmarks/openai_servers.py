"""What the side-by-side serving benchmarks share: Tandem's default app and llama.cpp's server on free
loopback ports, and a streamed OpenAI request timed as a client sees it."""
from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BIN = Path(os.environ.get("LLAMACPP_DIR", Path.home() / ".cache" / "tandem" / "llama.cpp")) / "build" / "bin"
# --isa: "native" (Tandem's best kernels, llama.cpp built for this CPU) or "avx2" (both on AVX2 only: the
# stand-in for an x86-64-v3 CPU on a machine with AVX-512; LLAMACPP_ISA=avx2 bash benchmarks/llamacpp_setup.sh)
BUILDS = {"native": BIN, "avx2": Path.home() / ".cache" / "tandem" / "llama.cpp-avx2" / "build" / "bin"}
TANDEM_ISA = {"native": {}, "avx2": {"cpu_isa": "avx2"}}
WORDS = ("the river city market winter light history science music garden engine story people village "
         "harbor mountain letter window morning evening teacher student bridge forest ocean island road "
         "machine season journey kitchen library painting festival farmer merchant lantern").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def document(seed: int, words: int) -> str:
    """Deterministic filler text of about `words` words (Gemma: ~1.3 tokens a word)."""
    rng = random.Random(seed)
    sentences = []
    while sum(len(s.split()) for s in sentences) < words:
        n = rng.randint(8, 16)
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + ".")
    return f"Document {seed}.\n" + " ".join(sentences)


def client_for(server: "Server", timeout: float) -> httpx.AsyncClient:
    """A client that opens a connection per request: llama-server (cpp-httplib) closes idle keep-alive
    connections, and a request sent on one it just closed fails with no response."""
    return httpx.AsyncClient(base_url=server.url, timeout=timeout, limits=httpx.Limits(max_keepalive_connections=0))


async def stream_chunks(client: httpx.AsyncClient, path: str, body: dict):
    """Yield (arrival time, text, tokens) for each streamed chunk that carries text. Tokens are counted
    from the chunk's logprobs when the server sends them (ask with logprobs), else 1 (llama.cpp streams
    one a chunk)."""
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{path}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            piece = (choices[0].get("text") or (choices[0].get("delta") or {}).get("content")) if choices else None
            if piece:
                lp = choices[0].get("logprobs") or {}
                yield time.perf_counter(), piece, len(lp.get("tokens") or lp.get("content") or []) or 1


async def ttft(client: httpx.AsyncClient, path: str, body: dict) -> tuple[float, str]:
    """Time to the first streamed text, and the whole text (the stream is read to its end)."""
    start, first, text = time.perf_counter(), None, []
    async for arrival, piece, _ in stream_chunks(client, path, body):
        first = first or arrival
        text.append(piece)
    return (first or time.perf_counter()) - start, "".join(text)


async def token_times(client: httpx.AsyncClient, path: str, body: dict) -> tuple[float, list[tuple[float, int]]]:
    """(start, [(arrival, tokens)]) of each streamed chunk with text."""
    start = time.perf_counter()
    return start, [(arrival, n) async for arrival, _, n in stream_chunks(client, path, body)]


class Server:
    """One side: where it listens, its model name, and how to read what it is running now."""

    def __init__(self, name: str, url: str, model: str):
        self.name, self.url, self.model = name, url, model

    async def running(self, client: httpx.AsyncClient) -> int:
        text = (await client.get("/metrics")).text
        pattern = r"^tandem:num_requests_running\{[^}]*\} ([0-9.]+)" if self.name == "tandem" else \
            r"^llamacpp:requests_processing ([0-9.]+)"
        m = re.search(pattern, text, re.M)
        return int(float(m.group(1))) if m else -1


def start_tandem(args_override: dict, ray_started: list) -> tuple[Server, callable]:
    import ray
    from ray import serve

    from deployments.app import build_app

    app_args = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["args"]
    app_args = {**app_args, **args_override, "grpc_port": None}
    if not ray_started:
        from deployments.cli import apply_serve_env_defaults

        apply_serve_env_defaults()  # as `tandem serve` and the image run Serve
        ray.init(include_dashboard=False, log_to_driver=False)
        ray_started.append(True)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(app_args), name="tandem", route_prefix="/")
    return Server("tandem", f"http://127.0.0.1:{port}", app_args["model"]), serve.shutdown


def start_llama(gguf: Path, threads: int, extra: list[str], isa: str = "native") -> tuple[Server, callable]:
    port = free_port()
    proc = subprocess.Popen([str(BUILDS[isa] / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                             "-t", str(threads), "--metrics", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode} (args {extra})")
        time.sleep(0.5)

    def stop():
        proc.terminate()
        proc.wait(timeout=30)
    return Server("llama.cpp", url, "gemma"), stop


def llama_bytes_per_token(gguf: Path) -> int:
    """llama.cpp's float16 KV bytes per token of this model, from the file's own header."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))

    def field(suffix: str) -> int:
        key = next(k for k in reader.fields if k.endswith(suffix))
        f = reader.fields[key]
        return int(f.parts[f.data[0]][0])
    layers, kv_heads = field(".block_count"), field(".attention.head_count_kv")
    key_dim = field(".attention.key_length")
    return 2 * layers * kv_heads * key_dim * 2



