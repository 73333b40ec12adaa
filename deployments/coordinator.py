"""The coordinator deployment: owns one engine (model groups as Ray actors) and serves it over HTTP
and gRPC: both share one engine and one queue.

The step loop runs in the engine's own thread; the replica's event loop only parses requests
and streams deltas. Nothing here computes a token.
"""
from __future__ import annotations

import logging
import threading
import time

from ray import serve

from deployments.app import ServeArgs
from deployments.grpc_service import GrpcService
from deployments.metrics_export import RayMetricsPusher
from deployments.openai_api import create_app
from engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)


# Serve runs user code on a second event loop thread by default; each streamed chunk then hops
# threads. Our handlers never block (the engine steps in its own thread), so run them on the
# replica's own loop: ~10 ms less TTFT over HTTP here (serve_bench.py). Serve merges these env
# vars with an application's runtime_env.
REPLICA_ENV = {"env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}}


@serve.deployment(
    # the model groups reserve their own CPUs/GPUs in a placement group; the coordinator needs none
    ray_actor_options={"num_cpus": 0, "runtime_env": REPLICA_ENV},
    # admission is the engine's job (max_num_seqs, max_queued_requests -> 429), not Serve's queue
    max_ongoing_requests=1024,
    health_check_period_s=10,
)
@serve.ingress()
class Coordinator:
    def __init__(self, args: ServeArgs):
        self.args = args
        self.engine = AsyncEngine(args.engine_config(), use_ray=True, max_queued_requests=args.max_queued_requests)
        log.info("Tandem serving %s as %r (max_model_len %d)", args.model, args.model_name,
                 self.engine.max_model_len)

        self.grpc = GrpcService(self.engine, args)
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
        return create_app(self.engine, self.args)

    # gRPC (proto/tandem.proto): Ray Serve's gRPC proxy calls the method named like the RPC.
    async def Generate(self, request, grpc_context=None):  # noqa: N802 - RPC names
        return await self.grpc.generate(request, grpc_context)

    async def GenerateStream(self, request, grpc_context=None):  # noqa: N802
        async for message in self.grpc.generate_stream(request, grpc_context):
            yield message

    def ListModels(self, request, grpc_context=None):  # noqa: N802
        return self.grpc.list_models(request, grpc_context)

    def Health(self, request, grpc_context=None):  # noqa: N802
        return self.grpc.health(request, grpc_context)

    def check_health(self) -> None:
        if not self.engine.alive():
            raise RuntimeError("engine step loop is not running")

    def __del__(self):
        try:
            self.engine.shutdown()
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass
