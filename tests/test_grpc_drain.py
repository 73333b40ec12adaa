"""A replica's gRPC server being shut down (scale-down, redeploy): calls in flight finish, new ones are
refused with UNAVAILABLE (a client retries them on another replica), and the stop returns as soon
as nothing is in flight, not after the whole grace period."""
import asyncio
import threading
import time

import grpc
import pytest

from deployments.app import ServeArgs
from deployments.grpc_service import GrpcServer, TandemServicer
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from tandem_proto import tandem_pb2 as pb
from tandem_proto import tandem_pb2_grpc

MODEL = "random:tiny-llama"


def stop(server: GrpcServer, grace_s: float) -> None:
    """server.stop awaited on a loop of its own thread, as a Serve replica awaits it (on its loop
    thread, not the process's main thread)."""
    waiter = threading.Thread(target=lambda: asyncio.run(server.stop(grace_s)))
    waiter.start()
    waiter.join(grace_s + 30)
    assert not waiter.is_alive(), "the stop did not return"


@pytest.fixture
def server():
    engine = AsyncEngine(EngineConfig(model=MODEL), use_ray=False)
    server = GrpcServer(TandemServicer(engine, ServeArgs(model=MODEL), None), "127.0.0.1", 0, 4 << 20)
    yield server
    stop(server, 0)
    engine.shutdown()


def test_an_idle_server_stops_at_once(server):
    started = time.monotonic()
    stop(server, 30)
    assert time.monotonic() - started < 5  # not the 30 s grace


def test_calls_in_flight_finish_and_new_ones_are_refused_while_it_stops(server):
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = tandem_pb2_grpc.TandemServiceStub(channel)
    request = pb.GenerateRequest(model=MODEL, prompt="ab", max_tokens=300, ignore_eos=True, temperature=0)
    first, parts = threading.Event(), []

    def stream():
        for part in stub.GenerateStream(request):
            parts.append(part)
            first.set()
    reader = threading.Thread(target=stream)
    reader.start()
    assert first.wait(60)
    stopped = {}

    def stopping():
        stop(server, 60)
        stopped["at"] = time.monotonic()
    stopper = threading.Thread(target=stopping)
    stopper.start()
    time.sleep(0.2)
    with pytest.raises(grpc.RpcError) as refused:  # a new call while draining
        stub.Generate(pb.GenerateRequest(model=MODEL, prompt="cd", max_tokens=4))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in refused.value.details()
    reader.join(120)
    ended = time.monotonic()
    stopper.join(60)
    assert sum(len(p.token_ids) for p in parts) == 300 and parts[-1].finish_reason == "length"
    assert stopped["at"] - ended < 5  # the stop returned once the call had ended, well before its grace
    channel.close()
