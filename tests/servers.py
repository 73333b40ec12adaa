"""Helpers for tests that run servers: free loopback ports, waiting for health, and proof that the
process answering on a port is the test's own (a server someone else left on the port must not be
tested in its place)."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from pathlib import Path

import httpx
import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listener(port: int):
    """The listening TCP socket on `port` (psutil's connection record), or None."""
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return conn
    return None


def owned_by_session(port: int, session_leader: int | None = None) -> bool:
    """Whether the process listening on `port` is in the session of `session_leader` (a server started
    with start_new_session=True), or in this test process's own session (Ray started in-process)."""
    conn = listener(port)
    expected = session_leader if session_leader is not None else os.getsid(0)
    return conn is not None and os.getsid(conn.pid) == expected


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout_s: float = 420.0,
                 log: Path | None = None) -> None:
    """Wait until `url` answers 200. On failure the message carries the tail of the server's `log`
    (its stdout and stderr), so a CI run that failed says why."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the server exited early (rc {proc.returncode}){_tail(log)}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"{url} did not become healthy in {timeout_s:.0f} s{_tail(log)}")


def _tail(log: Path | None, chars: int = 6000) -> str:
    if log is None or not log.exists():
        return ""
    return "\n--- the server's output, last lines ---\n" + log.read_text(errors="replace")[-chars:]


@contextlib.contextmanager
def serve_app(name: str, args: dict):
    """One application of the default deployment on a local Ray cluster of this process, HTTP and
    gRPC on free loopback ports: yields (HTTP base URL, gRPC address), after checking that this
    process's Ray is what listens on both; shuts Serve and Ray down after."""
    import ray
    from ray import serve

    from deployments.app import build_app

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    port, grpc_port = free_port(), free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({**args, "grpc_port": grpc_port}), name=name, route_prefix="/")
        assert owned_by_session(port) and owned_by_session(grpc_port)  # our own server answers
        yield f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@contextlib.contextmanager
def serve_run(config_file: Path, folder: Path, timeout_s: float = 420.0):
    """`serve run <config_file>` as a user starts it, with only its two ports moved to free ones, on a
    fresh local Ray cluster: yields (HTTP base URL, gRPC port) once /health answers and the processes on
    both ports are this run's; SIGINT (as Ctrl-C) and `ray stop` after. The server's output is in
    folder/serve.log, and a failed start shows its tail."""
    import signal
    import sys

    import yaml

    http_port, grpc_port = free_port(), free_port()  # taken now: a port free at collection may not be later
    config = yaml.safe_load(config_file.read_text())
    config["http_options"]["port"] = http_port
    config["applications"][0]["args"]["grpc_port"] = grpc_port
    path, log = folder / config_file.name, folder / "serve.log"
    path.write_text(yaml.safe_dump(config))
    bin_dir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a fresh local cluster
    with log.open("wb") as out:
        proc = subprocess.Popen([str(bin_dir / "serve"), "run", str(path)], cwd=config_file.parent, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{http_port}/health", proc, timeout_s=timeout_s, log=log)
        assert owned_by_session(http_port, proc.pid), "another process answers on the HTTP port"
        assert owned_by_session(grpc_port, proc.pid), "another process answers on the gRPC port"
        yield f"http://127.0.0.1:{http_port}", grpc_port
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        subprocess.run([str(bin_dir / "ray"), "stop", "--force"], capture_output=True)
