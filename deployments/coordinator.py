"""The coordinator deployment: owns one engine (model groups as Ray actors) and serves it over HTTP
(through Serve's proxy) and gRPC (its own server, on grpc_host:grpc_port): both share one engine,
one request layer and one queue.

The step loop runs in the engine's own thread; the replica's event loop only parses requests
and streams deltas. Nothing here computes a token.
"""
from __future__ import annotations

import logging
import threading
import time

from ray import serve

from deployments.app import ServeArgs
from deployments.grpc_service import GrpcServer, TandemServicer
from deployments.metrics_export import RayMetricsPusher
from deployments.openai_api import create_app
from deployments.auth import resolve_api_key
from engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)


# Serve runs user code on a second event loop thread by default; each streamed chunk then hops
# threads. Our handlers never block (the engine steps in its own thread), so run them on the
# replica's own loop: ~10 ms less TTFT over HTTP here (serve_bench.py). Serve merges these env
# vars with an application's runtime_env.
REPLICA_ENV = {"env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}}
GRACE_S = 30.0  # how long in-flight requests may take to finish when a replica is shut down


@serve.deployment(
    # the model groups reserve their own CPUs/GPUs in a placement group; the coordinator needs none
    ray_actor_options={"num_cpus": 0, "runtime_env": REPLICA_ENV},
    # admission is the engine's job (max_num_seqs, max_queued_requests -> 429), not Serve's queue
    max_ongoing_requests=1024,
    health_check_period_s=10,
    # a replica being removed (scale-down, redeploy) first finishes what it is serving: Serve waits
    # for its HTTP requests, then __del__ lets gRPC calls finish
    graceful_shutdown_timeout_s=GRACE_S * 2,
)
@serve.ingress()
class Coordinator:
    def __init__(self, args: ServeArgs):
        self.args = args
        self.api_key = resolve_api_key(args.api_key, args.api_key_env, args.api_key_file)
        self.engine = AsyncEngine(args.engine_config(), use_ray=True, max_queued_requests=args.max_queued_requests)
        self.grpc = None
        if args.grpc_port is not None:
            self.grpc = GrpcServer(TandemServicer(self.engine, args, self.api_key), args.grpc_host, args.grpc_port,
                                   args.max_request_bytes, share_port=args.grpc_share_port)
        log.info("Tandem serving %s as %r (max_model_len %d); gRPC %s; API key %s", args.model, args.model_name,
                 self.engine.max_model_len, self.grpc.address if self.grpc else "off",
                 "required" if self.api_key else "not required")
        self._metrics = RayMetricsPusher(self.engine, args.model_name)
        threading.Thread(target=self._push_metrics, name="tandem-ray-metrics", daemon=True).start()

    def _push_metrics(self, interval_s: float = 5.0) -> None:
        while self.engine.alive():
            try:
                self._metrics.push()
            except Exception:  # noqa: BLE001 - metrics must never take serving down
                log.exception("pushing Ray metrics failed")
            time.sleep(interval_s)

    def __serve_build_asgi_app__(self):
        return create_app(self.engine, self.args, self.api_key)

    def check_health(self) -> None:
        problem = self.engine.health()
        if problem is not None:  # Serve replaces this replica (and with it, its model groups)
            raise RuntimeError(problem)

    def __del__(self):
        try:
            if self.grpc is not None:
                self.grpc.stop(GRACE_S)
            self.engine.shutdown()
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass
