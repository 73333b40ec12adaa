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
