"""A local two-node Ray cluster, as the Ray docs describe for multi-node testing on one machine: a head
raylet on 127.0.0.2 and a second one on 127.0.0.3 (loopback addresses; Ray rewrites 127.0.0.1 to the
machine's outward address, so the head can't use it), started with `ray start`. The model groups land
on different nodes and a tensor-parallel group spans both (gloo over TCP on lo): greedy output equals
the single-node run. Killing the second node (its raylet and everything it runs) fails the in-flight request cleanly, and the app
serves again once the node is back."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest
import ray
from ray import serve

from deployments.app import build_app
from engine import LLM, SamplingParams
from servers import free_port, owned_by_session

TARGET, DRAFT = "random:tiny-llama:1", "random:tiny-llama:2"
HEAD, WORKER = "127.0.0.2", "127.0.0.3"
PROMPTS = ["hello world", "the cat sat on the mat", "numbers 1 2 3"]
RAY = os.path.join(os.path.dirname(sys.executable), "ray")


class LocalCluster:
    """Two raylets of one Ray cluster on this machine. Each `ray start` runs in a session of its own,
    so every process of a node (raylet, agents, workers: some retitle themselves) is in that node's
    process group: the test kills a node, or the whole cluster, by group and touches no other Ray."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="raymn", dir="/tmp")
        self.port = free_port()
        self.groups: dict[str, int] = {}  # node address -> its process group
        self.env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.env.update(RAY_TMPDIR=self.dir, GLOO_SOCKET_IFNAME="lo",  # gloo's traffic stays on loopback
                        # explicit, and this process's: with it unset, `ray start` turns token auth on
                        # whenever ~/.ray/auth_token exists, and a process's first ray.init fixes its
                        # mode for good (a local ray.init turns it on and writes that file)
                        RAY_AUTH_MODE=os.environ.get("RAY_AUTH_MODE") or "disabled",
                        # a dead node is noticed in seconds, not the default ~30 s
                        RAY_health_check_period_ms="1000", RAY_health_check_timeout_ms="1000",
                        RAY_health_check_failure_threshold="3",
                        # a placement that waits for a lost node gives up within the test's time
                        TANDEM_PLACEMENT_TIMEOUT_S="90")
        self._start(HEAD, "--head", "--port", str(self.port), "--resources", json.dumps({"head": 1}),
                    "--include-dashboard", "false")

    @property
    def address(self) -> str:
        return f"{HEAD}:{self.port}"

    def _start(self, node: str, *args: str) -> None:
        proc = subprocess.Popen([RAY, "start", "--node-ip-address", node, "--num-cpus", "2", "--disable-usage-stats",
                                 *args], env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        self.groups[node] = proc.pid
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]

    def start_worker(self) -> None:
        self._start(WORKER, "--address", self.address)
        deadline = time.monotonic() + 60
        while len(self.alive_nodes()) < 2:
            assert time.monotonic() < deadline, "the second node did not join"
            time.sleep(0.5)

    def alive_nodes(self) -> list[str]:
        return [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]

    def kill(self, node: str) -> None:
        """The node is lost: everything on it dies at once."""
        group = self.groups.pop(node, None)
        assert group is not None and group != os.getpgid(0)
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        for node in list(self.groups):
            self.kill(node)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster()
    saved = {k: os.environ.get(k) for k in ("TANDEM_PLACEMENT_TIMEOUT_S", "RAY_AUTH_MODE")}
    os.environ.update({k: c.env[k] for k in saved})
    try:
        ray.init(address=c.address, _node_ip_address=HEAD, log_to_driver=False)
        c.start_worker()
        assert sorted(c.alive_nodes()) == [HEAD, WORKER]
        yield c
    finally:
        ray.shutdown()
        c.stop()
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def reference():
    """One node, one process: LocalExecutor with speculation."""
    llm = LLM(model=TARGET, speculative_config={"model": DRAFT, "num_speculative_tokens": 3})
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(48))]


@pytest.mark.parametrize("tp, strategy", [(1, "STRICT_SPREAD"), (2, "SPREAD")])
def test_groups_across_nodes_match_one_node(cluster, reference, tp, strategy):
    llm = LLM(model=TARGET, tensor_parallel_size=tp, distributed_executor_backend="ray", placement_strategy=strategy,
              speculative_config={"model": DRAFT, "num_speculative_tokens": 3})
    try:
        nodes = llm.core.executor.nodes()
        if tp == 1:  # the draft on a node of its own
            assert {nodes["target"][0], nodes["draft"][0]} == {HEAD, WORKER}
        else:  # each tensor-parallel group's two ranks talk across the nodes
            assert sorted(nodes["target"]) == sorted(nodes["draft"]) == [HEAD, WORKER]
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(48))] == reference
    finally:
        llm.core.shutdown()


def test_losing_a_node_fails_in_flight_requests_and_the_app_recovers(cluster, reference):
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port, "location": "HeadOnly"})
    # the coordinator pinned to the head node (coordinator_resources, as the KubeRay manifests do):
    # the node this test kills holds only a model group
    serve.run(build_app({"model": TARGET, "grpc_port": None, "placement_strategy": "STRICT_SPREAD",
                         "coordinator_resources": {"head": 0.01},
                         "speculative_config": {"model": DRAFT, "num_speculative_tokens": 3}}),
              name="mn", route_prefix="/mn")
    assert ray.available_resources()["head"] == pytest.approx(0.99)  # only the head node has it
    base = f"http://127.0.0.1:{port}/mn/v1"
    assert owned_by_session(port, cluster.groups[HEAD])  # the proxy of this test's head node
    body = {"model": TARGET, "prompt": PROMPTS[0], "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    try:
        with httpx.Client(timeout=180) as http:
            first = http.post(f"{base}/completions", json=body).json()
            assert first["choices"][0]["text"]

            # a long stream in flight when the second node goes away
            events, killed = [], False
            with http.stream("POST", f"{base}/completions",
                             json={**body, "max_tokens": 1500, "stream": True}) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    events.append(json.loads(line[6:]))
                    if len(events) == 5 and not killed:
                        cluster.kill(WORKER)
                        killed = time.monotonic()
            assert killed
            # promptly: not after the engine's attempt to place its groups again (it waits for the node)
            assert time.monotonic() - killed < 45
            errors = [e["error"] for e in events if "error" in e]
            assert len(errors) == 1, events[-3:]
            assert "retry" in errors[0]["message"]
            assert "Traceback" not in json.dumps(errors) and WORKER not in json.dumps(errors)
            tokens = sum(len(e["choices"][0]["text"]) > 0 for e in events if e.get("choices"))
            assert 5 <= tokens < 1500  # cut short, not finished

            cluster.start_worker()  # the node returns: the groups are placed again, requests are served
            deadline, after = time.monotonic() + 150, None
            while time.monotonic() < deadline:
                r = http.post(f"{base}/completions", json=body)
                if r.status_code == 200:
                    after = r.json()
                    break
                assert r.status_code == 503, r.text
                time.sleep(2)
            assert after is not None, "the app did not serve again after the node came back"
            assert after["choices"][0]["text"] == first["choices"][0]["text"]
    finally:
        serve.shutdown()
