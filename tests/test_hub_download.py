"""Hugging Face ids download from the Hub when online; offline, the cache and the embedded copies stay.

A small stdlib HTTP server plays the Hub: just the endpoints huggingface_hub's `snapshot_download`
calls (repo info, file tree, HEAD/GET of /resolve/), serving a tiny random model. Each resolution
runs in a subprocess with its own environment, because huggingface_hub reads HF_ENDPOINT, HF_HOME
and HF_HUB_OFFLINE once, at import.
"""
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from safetensors.torch import save_file

from conftest import SMOLLM2
from engine.models.loading import ModelSource, load_state_dict
from engine.models.presets import random_checkpoint

REPO = Path(__file__).resolve().parents[1]
SHA = "0123456789abcdef0123456789abcdef01234567"  # the served commit
TOKEN = "hf_tandemTestSecret42"
WRONG = "hf_wrongTokenValue77"
NOT_FETCHED = ["pytorch_model.bin", "model.gguf", "onnx/model.onnx", "flax_model.msgpack", "README.md"]


def write_tiny(directory: Path) -> Path:
    config, tokenizer, state = random_checkpoint("tiny-llama", 3)
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    save_file(state, directory / "model.safetensors")
    tokenizer.save_pretrained(directory)
    for name in NOT_FETCHED:  # weights in forms we never load, and a file nobody needs
        (directory / name).parent.mkdir(exist_ok=True)
        (directory / name).write_bytes(b"not for Tandem")
    return directory


class FakeHub(ThreadingHTTPServer):
    """repos: id -> (directory, access) with access "public", "private" (every endpoint needs the
    token) or "gated" (metadata public, files need the token). Records (method, path, Authorization)."""

    daemon_threads = True

    def __init__(self, repos: dict[str, tuple[Path, str]]):
        super().__init__(("127.0.0.1", 0), Handler)
        self.repos = repos
        self.seen: list[tuple[str, str, str | None]] = []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def files(self, repo: str) -> dict[str, bytes]:
        root = self.repos[repo][0]
        return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


class Handler(BaseHTTPRequestHandler):
    server: FakeHub

    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self.answer(body=False)

    def do_GET(self):
        self.answer(body=True)

    def reply(self, status: int, data: bytes = b"", headers: dict | None = None, body: bool = True):
        self.send_response(status)
        for key, value in {"Content-Length": str(len(data)), **(headers or {})}.items():
            self.send_header(key, value)
        self.end_headers()
        if body:
            self.wfile.write(data)

    def error(self, status: int, code: str | None, message: str, body: bool):
        headers = {"Content-Type": "application/json", "X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        self.reply(status, json.dumps({"error": message}).encode(), headers, body)

    def answer(self, body: bool):
        auth = self.headers.get("Authorization")
        self.server.seen.append((self.command, self.path, auth))
        path = self.path.split("?")[0]
        api = re.fullmatch(r"/api/models/([^/]+/[^/]+)(/revision/[^/]+|/tree/[^/]+)?", path)
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/[^/]+/(.+)", path)
        repo = (api or resolve).group(1) if (api or resolve) else None
        if repo not in self.server.repos:
            return self.error(404, "RepoNotFound", "Repository not found", body)
        access = self.server.repos[repo][1]
        if access == "private" or (access == "gated" and resolve):
            if auth is None:
                code = "GatedRepo" if access == "gated" else "RepoNotFound"
                return self.error(401, code, "Access restricted: you must be authenticated", body)
            if auth != f"Bearer {TOKEN}":
                return self.error(401, None, "Invalid credentials in Authorization header", body)
        files = self.server.files(repo)
        oids = {name: hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() for name, data in files.items()}
        if api and api.group(2) and api.group(2).startswith("/tree/"):
            tree = [{"type": "file", "path": name, "size": len(data), "oid": oids[name]} for name, data in files.items()]
            return self.reply(200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, body)
        if api:
            info = {"id": repo, "sha": SHA, "private": access == "private", "gated": access == "gated" and "auto",
                    "siblings": [{"rfilename": name} for name in files]}
            return self.reply(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
        name = resolve.group(2)
        if name not in files:
            return self.error(404, "EntryNotFound", "Entry not found", body)
        self.reply(200, files[name], {"X-Repo-Commit": SHA, "ETag": f'"{oids[name]}"'}, body)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    server = FakeHub({"acme/tiny": (write_tiny(root / "tiny"), "public"),
                      "acme/other": (write_tiny(root / "other"), "public"),
                      "acme/private": (write_tiny(root / "private"), "private"),
                      "acme/gated": (write_tiny(root / "gated"), "gated"),
                      SMOLLM2: (write_tiny(root / "smol"), "public")})
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once the socket closes


RESOLVE = """
import json, sys, time
from engine.models.loading import resolve_model
out = []
for name in sys.argv[1:]:
    start = time.monotonic()
    try:
        source = resolve_model(name)
        out.append({"kind": source.kind, "path": source.path})
    except ValueError as err:
        out.append({"error": str(err)})
    out[-1]["seconds"] = time.monotonic() - start
print(json.dumps(out))
"""


def resolve(names: list[str], endpoint: str, hf_home: Path, cwd: Path = REPO, **env: str):
    """Resolves names in a fresh interpreter: ([result per name], all it printed, logs included)."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("HF_", "HUGGING_FACE_")) and k != "TRANSFORMERS_OFFLINE"}
    clean.update(HF_ENDPOINT=endpoint, HF_HOME=str(hf_home), NO_PROXY="127.0.0.1,localhost",
                 PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]), **env)
    run = subprocess.run([sys.executable, "-c", RESOLVE, *names], env=clean, cwd=cwd, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stdout + run.stderr


def requests_since(hub: FakeHub, start: int) -> list[str]:
    return [f"{method} {path}" for method, path, _ in hub.seen[start:]]


def test_download_then_cache(hub, tmp_path):
    home, start = tmp_path / "hf", len(hub.seen)
    (tiny, smol), _ = resolve(["acme/tiny", SMOLLM2], hub.url, home)
    fetched = requests_since(hub, start)
    assert any(r.startswith("GET /api/models/acme/tiny") for r in fetched), fetched  # our server answered
    # an id with an embedded copy downloads too when the Hub has it: the Hub's copy is the real model
    assert smol["kind"] == tiny["kind"] == "hf_dir"
    directory = Path(tiny["path"])
    assert directory.is_relative_to(home)
    served = hub.files("acme/tiny")
    got = {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()}
    assert got == set(served) - set(NOT_FETCHED)
    assert all((directory / name).read_bytes() == served[name] for name in got)
    assert not [r for r in fetched if any(r.endswith("/" + name) for name in NOT_FETCHED)], fetched
    config, state = load_state_dict(ModelSource("hf_dir", str(directory)))  # loadable as downloaded
    assert config.model_type == "llama" and len(state) == len(random_checkpoint("tiny-llama", 3)[2])

    # a cached copy wins over a download: not one request while the Hub is up
    start = len(hub.seen)
    again, _ = resolve(["acme/tiny", SMOLLM2], hub.url, home)
    assert [r["path"] for r in again] == [tiny["path"], smol["path"]]
    assert requests_since(hub, start) == []
    # and over the embedded copy with the Hub gone, offline or not
    for env in ({}, {"HF_HUB_OFFLINE": "1"}):
        again, _ = resolve(["acme/tiny", SMOLLM2], closed_port(), home, **env)
        assert [r.get("path") for r in again] == [tiny["path"], smol["path"]], again


def test_offline_fetches_nothing(hub, tmp_path):
    start = len(hub.seen)
    (tiny, smol), _ = resolve(["acme/tiny", SMOLLM2], hub.url, tmp_path / "hf", HF_HUB_OFFLINE="1")
    assert requests_since(hub, start) == []
    assert "unknown model 'acme/tiny'" in tiny["error"] and "HF_HUB_OFFLINE" in tiny["error"]
    assert smol["kind"] == "gguf" and smol["path"].endswith(".gguf")  # the embedded copy


def test_unreachable_hub(tmp_path):
    (missing, smol, smol_again), out = resolve(["acme/tiny", SMOLLM2, SMOLLM2], closed_port(), tmp_path / "hf")
    assert "unknown model 'acme/tiny'" in missing["error"] and "unreachable" in missing["error"]
    assert "HF_HUB_OFFLINE=1" in missing["error"] and "local" in missing["error"]
    assert smol["kind"] == smol_again["kind"] == "gguf"
    assert smol["seconds"] < 20 and smol_again["seconds"] < 1  # one try per process, then straight on
    assert out.count("using its embedded copy") == 1 and "unreachable" in out


def test_token(hub, tmp_path):
    start = len(hub.seen)
    results, _ = resolve(["acme/private", "acme/gated"], hub.url, tmp_path / "ok", HF_TOKEN=TOKEN)
    assert [r["kind"] for r in results] == ["hf_dir", "hf_dir"], results
    auths = {auth for _, path, auth in hub.seen[start:] if "/acme/" in path}
    assert auths == {f"Bearer {TOKEN}"}

    for env in ({}, {"HF_TOKEN": WRONG}):
        start = len(hub.seen)
        results, out = resolve(["acme/private", "acme/gated"], hub.url, tmp_path / "refused", **env)
        assert {auth for _, path, auth in hub.seen[start:] if "/acme/" in path} == {f"Bearer {WRONG}" if env else None}
        for name, result in zip(["acme/private", "acme/gated"], results):
            error = result["error"]
            assert f"unknown model '{name}'" in error and "gated or private" in error and "HF_TOKEN" in error
        assert WRONG not in out and TOKEN not in out


def test_gated_embedded_id_falls_back(hub, tmp_path):
    served = hub.repos[SMOLLM2]
    hub.repos[SMOLLM2] = (served[0], "gated")  # like google/gemma-3-270m on the Hub, without a token
    try:
        (smol,), out = resolve([SMOLLM2], hub.url, tmp_path / "hf")
    finally:
        hub.repos[SMOLLM2] = served
    assert smol["kind"] == "gguf"
    assert "gated or private" in out and "using its embedded copy" in out


def test_local_directory_wins(hub, tmp_path):
    write_tiny(tmp_path / "acme" / "tiny")  # a relative path that spells the id
    start = len(hub.seen)
    (local,), _ = resolve(["acme/tiny"], hub.url, tmp_path / "hf", cwd=tmp_path)
    assert local == {"kind": "hf_dir", "path": "acme/tiny", "seconds": local["seconds"]}
    assert requests_since(hub, start) == []


def test_unknown_id(hub, tmp_path):
    (missing,), _ = resolve(["acme/missing"], hub.url, tmp_path / "hf")
    assert "unknown model 'acme/missing'" in missing["error"]
    assert f"the Hub ({hub.url}) has no model acme/missing" in missing["error"]
