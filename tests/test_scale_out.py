"""Several coordinator replicas on one local Ray cluster: each replica owns its model groups, Serve
spreads HTTP requests across them, gRPC shares its port among them (grpc_share_port), and scaling
down finishes every in-flight stream of the replica it removes. Tiny random models."""
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
import ray
from ray import serve

from deployments.app import parse_args
from deployments.coordinator import Coordinator
from engine import LLM, SamplingParams
from servers import free_port, owned_by_session
from tandem_proto import tandem_pb2 as pb
from tandem_proto import tandem_pb2_grpc

TARGET, DRAFT = "random:tiny-llama:1", "random:tiny-llama:2"
PROMPTS = ["hello world", "the cat sat", "zebra", "numbers 1 2 3", "a b c", "why", "ok then", "x y"]
APP = "scaled"


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    port, grpc_port = free_port(), free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield {"http": port, "grpc": grpc_port}
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def reference():
    llm = LLM(model=TARGET)
    return lambda prompt, n: llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].outputs[0].text


def deploy(cluster, replicas: int) -> None:
    args = parse_args({"model": TARGET, "speculative_config": {"model": DRAFT, "num_speculative_tokens": 3},
                       "grpc_port": cluster["grpc"], "grpc_share_port": True})
    serve.run(Coordinator.options(num_replicas=replicas).bind(args), name=APP, route_prefix=f"/{APP}")


def running_replicas() -> int:
    return serve.status().applications[APP].deployments["Coordinator"].replica_states.get("RUNNING", 0)


def complete(cluster, prompt: str, n: int, stream: bool = False) -> str:
    client = openai.OpenAI(api_key="EMPTY", base_url=f"http://127.0.0.1:{cluster['http']}/{APP}/v1", max_retries=0)
    kw = dict(model=TARGET, prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True})
    if not stream:
        return client.completions.create(**kw).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)


def test_replicas_each_own_their_groups_and_scale_down_drains(cluster, reference):
    deploy(cluster, 2)
    assert running_replicas() == 2
    assert owned_by_session(cluster["http"]) and owned_by_session(cluster["grpc"])

    with ThreadPoolExecutor(8) as pool:  # concurrent HTTP requests, routed across both replicas
        texts = list(pool.map(lambda p: complete(cluster, p, 40), PROMPTS))
    assert texts == [reference(p, 40) for p in PROMPTS]

    def over_grpc(prompt: str) -> str:  # a connection each: the kernel spreads them over the replicas
        with grpc.insecure_channel(f"127.0.0.1:{cluster['grpc']}") as channel:
            stub = tandem_pb2_grpc.TandemServiceStub(channel)
            return stub.Generate(pb.GenerateRequest(model=TARGET, prompt=prompt, max_tokens=40, temperature=0,
                                                    ignore_eos=True)).text
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(over_grpc, PROMPTS)) == texts

    # scale down while streams run on both replicas: none is cut short (they must end within the
    # replica's grace period, graceful_shutdown_timeout_s: past it Serve stops the replica anyway)
    def timed(prompt: str) -> tuple[str, float]:
        text = complete(cluster, prompt, 400, True)
        return text, time.monotonic()
    with ThreadPoolExecutor(6) as pool:
        streams = [pool.submit(timed, p) for p in PROMPTS[:6]]
        time.sleep(1.0)  # let them start
        scale_started = time.monotonic()
        deploy(cluster, 1)
        finished = [s.result(timeout=300) for s in streams]
    assert [text for text, _ in finished] == [reference(p, 400) for p in PROMPTS[:6]]
    assert all(end > scale_started for _, end in finished)  # they were in flight while it scaled down
    assert running_replicas() == 1
    assert complete(cluster, PROMPTS[0], 40) == texts[0]
