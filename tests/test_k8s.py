"""The RayService manifests in k8s/ validate strictly against KubeRay's CRD, and their serveConfigV2
is the application of serve_config.yaml (the CPU demo) or a valid config (the GPU example).

CRDs come from ../shared/kuberay/ or $KUBERAY_CRD_DIR.
"""
import copy
import json
import os
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from deployments.app import parse_args

ROOT = Path(__file__).resolve().parent.parent
CRD_DIR = Path(os.environ.get("KUBERAY_CRD_DIR", ROOT.parent / "shared" / "kuberay"))
MANIFESTS = sorted((ROOT / "k8s").glob("*.yaml"))


def strict(schema):
    """OpenAPI 3.0 -> JSON Schema, rejecting unknown fields (the API server would prune them)."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
        if schema.pop("nullable", False) and "type" in schema:
            schema["type"] = [schema["type"], "null"]
        if schema.get("type") == "object" and "properties" in schema:
            schema.setdefault("additionalProperties", False)
        return schema
    if isinstance(schema, list):
        return [strict(x) for x in schema]
    return schema


@pytest.fixture(scope="module")
def validator():
    crd_file = CRD_DIR / "ray.io_rayservices.yaml"
    if not crd_file.exists():
        pytest.skip(f"KubeRay CRD not found at {crd_file}: set KUBERAY_CRD_DIR to a folder with "
                    f"ray.io_rayservices.yaml to validate the manifests")
    crd = yaml.safe_load(crd_file.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return jsonschema.Draft7Validator(strict(version["schema"]["openAPIV3Schema"]))


def load(path):
    return yaml.safe_load(path.read_text())


def test_manifests_exist():
    assert {p.name for p in MANIFESTS} == {"rayservice-cpu.yaml", "rayservice-gpu.yaml"}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates_strictly(validator, path):
    doc = load(path)
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayService"
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_a_typo_is_caught(validator):
    doc = load(ROOT / "k8s" / "rayservice-cpu.yaml")
    bad = copy.deepcopy(doc)
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replica"] = 1  # "replicas"
    assert list(validator.iter_errors(bad))
    bad = copy.deepcopy(doc)
    bad["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0  # must be a string
    assert list(validator.iter_errors(bad))


def serve_config_of(path):
    return yaml.safe_load(load(path)["spec"]["serveConfigV2"])


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_serve_config_parses(path):
    config = serve_config_of(path)
    ServeDeploySchema.model_validate(config)  # Ray's own schema
    app = config["applications"][0]
    assert app["import_path"] == "deployments.app:build_app"
    parse_args(app["args"])  # and ours: every key and rule of the speculative config
    assert config["http_options"]["port"] == 8000 and app["args"]["grpc_port"] == 9000
    assert "grpc_options" not in config  # Serve's gRPC proxy binds every interface; the coordinator serves gRPC
    assert "api_key" not in app["args"]  # Ray logs args: keys come from the environment


def test_cpu_demo_is_serve_config_yaml():
    ours = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    k8s = serve_config_of(ROOT / "k8s" / "rayservice-cpu.yaml")
    cluster_only = ("grpc_host", "grpc_share_port", "coordinator_resources")  # where a pod serves from
    strip = lambda app: {**app, "args": {k: v for k, v in app["args"].items() if k not in cluster_only}}  # noqa: E731
    assert [strip(a) for a in k8s["applications"]] == [strip(a) for a in ours["applications"]]
    # reachable from the Service, unlike the local default (loopback for both)
    assert k8s["http_options"]["host"] == "0.0.0.0" and k8s["applications"][0]["args"]["grpc_host"] == "0.0.0.0"
    assert ours["http_options"]["host"] == "127.0.0.1" and ours["applications"][0]["args"]["grpc_host"] == "127.0.0.1"


def test_gpu_example_shows_both_draft_placements_and_fits_its_gpus():
    from engine.executor import bundles_needed

    path = ROOT / "k8s" / "rayservice-gpu.yaml"
    doc = load(path)
    apps = serve_config_of(path)["applications"]
    configs = {a["name"]: parse_args(a["args"]).engine_config() for a in apps}
    colocated, separate = configs["tandem"], configs["tandem-separate"]
    assert colocated.model == "Qwen/Qwen3-8B" and colocated.speculative_config.model == "Qwen/Qwen3-0.6B"
    assert colocated.colocated_draft() and not separate.colocated_draft()
    assert bundles_needed(colocated) == 2 and bundles_needed(separate) == 2  # a GPU per bundle
    worker = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    limits = worker["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) >= sum(bundles_needed(c) for c in configs.values())
    assert worker["rayStartParams"]["num-gpus"] == limits["nvidia.com/gpu"]
    # each app its own gRPC port (a shared port would mix the apps' requests), open on the head
    ports = [parse_args(a["args"]).grpc_port for a in apps]
    head = doc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert len(set(ports)) == len(ports) and set(ports) <= {p["containerPort"] for p in head["ports"]}
    # the Hub token comes from a Secret into every pod that loads models, never from args
    for container in [head, worker["template"]["spec"]["containers"][0]]:
        env = {e["name"]: e for e in container["env"]}
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "hf-token"
    assert "HF_TOKEN" not in json.dumps(apps) and "hf_" not in json.dumps(apps)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_ports_and_readiness(path):
    spec = load(path)["spec"]
    ports = {p["port"] for p in spec["serveService"]["spec"]["ports"]}
    assert {8000, 8080} <= ports
    # gRPC: the coordinator replicas are pinned to the head pod and share its port 9000 (reached via
    # the head Service); the serve Service would send gRPC to worker pods, where nothing listens
    args = parse_args(serve_config_of(path)["applications"][0]["args"])
    assert args.grpc_share_port and 9000 not in ports
    head_group = spec["rayClusterConfig"]["headGroupSpec"]
    head_resources = json.loads(json.loads(head_group["rayStartParams"]["resources"]))
    for name, amount in args.coordinator_resources.items():
        assert head_resources[name] >= amount
        assert all(name not in w["rayStartParams"].get("resources", "")
                   for w in spec["rayClusterConfig"]["workerGroupSpecs"])
    head = head_group["template"]["spec"]["containers"][0]
    assert 9000 in {p["containerPort"] for p in head["ports"]}
    assert head["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
