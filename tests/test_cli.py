"""`tandem serve`: the seed's `vllm serve` line works with only the program name changed."""
import subprocess
import sys
from pathlib import Path

import pytest

from deployments.app import parse_args
from deployments.cli import serve_args_from_cli

TANDEM = str(Path(sys.executable).parent / "tandem")


def test_seed_serve_line_parses_into_the_same_config_as_yaml_and_offline():
    argv = ["Qwen/Qwen3-4B-Thinking-2507", "--host", "0.0.0.0", "--port", "8000", "--seed", "42", "-tp", "1",
            "--max-model-len", "2048", "--gpu-memory-utilization", "0.8", "--speculative-config",
            '{"model": "Qwen/Qwen3-0.6B", "num_speculative_tokens": 5, "method": "draft_model"}']
    parsed = serve_args_from_cli(argv)
    assert parsed["host"] == "0.0.0.0" and parsed["port"] == 8000
    args = parse_args(parsed["args"])
    assert args.seed == 42 and args.max_model_len == 2048 and args.tensor_parallel_size == 1
    spec = args.speculative_config
    assert spec.model == "Qwen/Qwen3-0.6B" and spec.num_speculative_tokens == 5 and spec.method == "draft_model"


@pytest.mark.parametrize("flag", ["--speculative-model", "--num-speculative-tokens"])
def test_old_flags_refused_with_pointer(flag):
    r = subprocess.run([TANDEM, "serve", "m", flag, "x"], capture_output=True, text=True)
    assert r.returncode != 0 and "--speculative-config" in r.stderr and flag in r.stderr


def test_bad_speculative_config_fails_before_starting():
    r = subprocess.run([TANDEM, "serve", "random:tiny-llama", "--speculative-config",
                        '{"model": "random:tiny-llama:2", "num_speculative_tokens": 2, "temperature": 0.5}'],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "sampling parameter, not speculative config" in r.stderr


def test_unknown_command():
    r = subprocess.run([TANDEM, "bench"], capture_output=True, text=True)
    assert r.returncode != 0 and "unknown command" in r.stderr


def test_api_key_in_yaml_args_is_refused():
    from deployments.app import build_app

    with pytest.raises(ValueError, match="api_key_env"):
        build_app({"model": "random:tiny-llama", "api_key": "sk-123"})
    assert "sk-123" not in repr(parse_args({"model": "random:tiny-llama", "api_key": "sk-123"}))


def test_tandem_serve_serves_http_and_grpc_with_a_key_that_never_reaches_a_log():
    """`tandem serve` with the key in $TANDEM_API_KEY: HTTP and gRPC on the host given, both demand the
    key, and the key is in no file Ray wrote and in no process's command line."""
    import os
    import shutil
    import signal
    import tempfile
    import uuid

    import grpc
    import httpx
    import psutil

    from servers import free_port, listener, owned_by_session, wait_healthy
    from tandem_proto import tandem_pb2 as pb
    from tandem_proto import tandem_pb2_grpc

    tmp_path = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    secret = f"sk-{uuid.uuid4().hex}"
    port, grpc_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(TANDEM_API_KEY=secret, RAY_TMPDIR=str(tmp_path))  # Ray's logs in a folder we can search
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([TANDEM, "serve", "random:tiny-llama", "--host", "127.0.0.1", "--port", str(port),
                                 "--grpc-port", str(grpc_port), "--max-model-len", "128"], env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", proc, timeout_s=300, log=log)
        assert owned_by_session(port, proc.pid) and owned_by_session(grpc_port, proc.pid)  # ours
        assert listener(grpc_port).laddr.ip in ("127.0.0.1", "::ffff:127.0.0.1")  # gRPC binds where HTTP binds
        url = f"http://127.0.0.1:{port}/v1/completions"
        body = {"model": "random:tiny-llama", "prompt": "hi", "max_tokens": 3}
        assert httpx.post(url, json=body).status_code == 401
        assert httpx.post(url, json=body, headers={"Authorization": f"Bearer {secret}"}).status_code == 200
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = tandem_pb2_grpc.TandemServiceStub(channel)
            request = pb.GenerateRequest(model="random:tiny-llama", prompt="hi", max_tokens=3)
            with pytest.raises(grpc.RpcError) as denied:
                stub.Generate(request)
            assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert stub.Generate(request, metadata=[("authorization", f"Bearer {secret}")]).usage.completion_tokens == 3
        for p in psutil.process_iter(["cmdline"]):
            assert secret not in " ".join(p.info["cmdline"] or [])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    logs = [f for f in tmp_path.rglob("*") if f.is_file() and not f.is_symlink()]
    assert any(f.suffix in (".log", ".out", ".err") for f in logs)
    leaked = [str(f) for f in logs if secret.encode() in f.read_bytes()]
    shutil.rmtree(tmp_path, ignore_errors=True)
    assert leaked == []


def test_placement_settings_are_checked_before_anything_starts():
    parsed = serve_args_from_cli(["random:tiny-llama", "--placement-strategy", "STRICT_SPREAD"])
    assert parse_args(parsed["args"]).engine_config().placement_strategy == "STRICT_SPREAD"
    with pytest.raises(ValueError, match="placement_strategy"):
        parse_args({"model": "random:tiny-llama", "placement_strategy": "EVERYWHERE"})
    # a coordinator asks for custom resources only: CPUs and GPUs belong to its model groups
    with pytest.raises(ValueError, match="coordinator_resources"):
        parse_args({"model": "random:tiny-llama", "coordinator_resources": {"GPU": 1}})
    with pytest.raises(ValueError, match="coordinator_resources"):
        parse_args({"model": "random:tiny-llama", "coordinator_resources": {"tandem_coordinator": 0}})


def test_serve_env_defaults_fill_unset_names_only_and_match_the_image():
    from deployments.cli import SERVE_ENV_DEFAULTS, apply_serve_env_defaults

    environ = {}
    apply_serve_env_defaults(environ)
    assert environ == SERVE_ENV_DEFAULTS and environ["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "1"
    mine = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1"}  # an operator's own setting wins
    apply_serve_env_defaults(mine)
    assert mine == {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1"}
    # the image (KubeRay's pods) and scripts/run.sh (`serve run`) run Serve the way `tandem serve` does
    root = Path(__file__).resolve().parent.parent
    dockerfile, run_sh = (root / "Dockerfile").read_text(), (root / "scripts" / "run.sh").read_text()
    for name, value in SERVE_ENV_DEFAULTS.items():
        assert f"ENV {name}={value}" in dockerfile
        assert f'export {name}="${{{name}:-{value}}}"' in run_sh
