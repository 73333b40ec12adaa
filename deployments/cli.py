"""`tandem serve MODEL --speculative-config JSON ...`: vLLM's `serve` line with only the program name changed."""
from __future__ import annotations

import argparse
import json
import os
import sys

REMOVED_FLAGS = {
    "--speculative-model": "model",
    "--num-speculative-tokens": "num_speculative_tokens",
}


# Ray Serve's controller reconciles every 0.1 s by default: with the GCS traffic it causes, ~15% of a
# core while the app is idle. On a small CPU node that steals from the model's threads at every step:
# 1 s made a streamed token ~10% faster on 2 cores (README, "On a small CPU node"); Serve then
# reacts to a deploy, a scale-up or a failed replica up to 1 s later. A value already set wins.
SERVE_ENV_DEFAULTS = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1"}


def apply_serve_env_defaults(environ=os.environ) -> None:
    """Before Ray starts here: its processes inherit this environment."""
    for name, value in SERVE_ENV_DEFAULTS.items():
        environ.setdefault(name, value)


def serve_parser() -> argparse.ArgumentParser:
    """`tandem serve`'s flags. A flag's dest is the serve arg (ServeArgs) it sets, but for the few
    deployments/reference.py lists as CLI-only; docs/reference/cli.md is generated from this parser."""
    from typing import get_args

    from engine.config import Device, Dtype, GgufWeights, PlacementStrategy
    from engine.kernels.targets import CPU_ISA_CHOICES
    from engine.reasoning import ReasoningParserName
    from engine.tool_parsers import ToolCallParserName

    p = argparse.ArgumentParser(prog="tandem serve", description="Serve MODEL with an OpenAI-compatible API.")
    p.add_argument("model", help="target model: HF id, local HF directory, .gguf file, or random:<preset>")
    p.add_argument("--speculative-config", type=json.loads, default=None,
                   help='JSON object, e.g. \'{"model": "HuggingFaceTB/SmolLM2-135M-Instruct", '
                        '"num_speculative_tokens": 3, "use_heterogeneous_vocab": true}\'')
    p.add_argument("--host", default="127.0.0.1", help="address HTTP and gRPC bind (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--tokenizer", default=None, help="tokenizer to load (default: the model's own)")
    p.add_argument("--seed", type=int, default=0, help="the engine's random seed (a request's seed wins for it)")
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1, help="the target's tensor parallelism")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence, prompt plus output (default: the model's limit, or what the KV cache holds)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="sequences decoding at once (default 16 on a CPU, 256 on a GPU)")
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV cache block (default 16)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens one step computes per model: decode rows first, then prefill chunks "
                        "(default 256 on a CPU, 2048 on a GPU)")
    p.add_argument("--prefill-stall-ms", type=float, default=None,
                   help="while streams decode, size prompt chunks so a step that carries one takes about this long "
                        "(measured; 0: off; default 300 on a CPU, off on a GPU)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="share cached blocks of a common prompt prefix between requests (default on)")
    p.add_argument("--max-queued-requests", type=int, default=64,
                   help="requests that may wait for a place in the batch; beyond it: HTTP 429")
    p.add_argument("--dtype", default="auto", choices=list(get_args(Dtype)),
                   help="weights' and activations' dtype (auto: float32 on a CPU, bfloat16 on a GPU)")
    p.add_argument("--device", default="auto", choices=list(get_args(Device)),
                   help="where the models run (auto: a GPU when there is one)")
    p.add_argument("--placement-strategy", default="PACK", choices=list(get_args(PlacementStrategy)),
                   help="how Ray places the model groups' ranks on a multi-node cluster")
    p.add_argument("--disjoint-cores", action="store_true", default=None,
                   help="CPU: pin each rank of both groups to its own share of the node's cores")
    p.add_argument("--gguf-weights", default=None, choices=list(get_args(GgufWeights)),
                   help="CPU, GGUF models: the file's blocks times int8 activations (default, VNNI), the blocks in float32 "
                        "(bit-identical to float32), or dequantized float32 copies")
    p.add_argument("--cpu-kernels", action=argparse.BooleanOptionalAction, default=None,
                   help="CPU: our C++ kernels for small-row linears, decode layers and grammar masks (default on; "
                        "--no-cpu-kernels: oneDNN and PyTorch for everything)")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                   help="eager PyTorch steps; --no-enforce-eager compiles decode and verify steps whole (default: "
                        "CUDA graphs on a GPU, eager on a CPU)")
    p.add_argument("--cpu-isa", default=None, choices=list(CPU_ISA_CHOICES),
                   help="CPU: which build of our kernels (default auto: the best this CPU runs; a name forces one, "
                        "e.g. avx2 on an AVX-512 machine; none = --no-cpu-kernels)")
    p.add_argument("--rank-threads", type=int, default=None,
                   help="CPU: torch threads per model rank (default: the node's cores over a group's ranks)")
    p.add_argument("--placement-timeout-s", type=float, default=None,
                   help="how long the model groups wait for the Ray cluster to have room (default 120)")
    p.add_argument("--omp-spin-count", type=int, default=None,
                   help="CPU: GOMP_SPINCOUNT of the model ranks (default 30000)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="share of each GPU for weights and KV cache (default 0.9); the KV cache gets what is left")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="KV cache bytes per device (unset: gpu-memory-utilization on a GPU, 4 GiB on a CPU)")
    p.add_argument("--served-model-name", default=None, help="the model's name in the API (default: MODEL)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' on /v1 and gRPC (visible in ps: prefer "
                        "$TANDEM_API_KEY or --api-key-file)")
    p.add_argument("--api-key-file", default=None, help="read the API key from this file")
    p.add_argument("--grpc-port", type=int, default=9000, help="gRPC port, on --host (0: any free port)")
    p.add_argument("--no-grpc", action="store_true", help="serve HTTP only")
    p.add_argument("--max-request-bytes", type=int, default=None, help="larger request bodies get 413 (default 4 MiB)")
    p.add_argument("--enable-auto-tool-choice", action="store_true", default=None,
                   help="let the model decide whether to call tools (tool_choice 'auto'); needs --tool-call-parser")
    p.add_argument("--tool-call-parser", default=None, choices=list(get_args(ToolCallParserName)),
                   help="how the model writes tool calls (vLLM's names)")
    p.add_argument("--reasoning-parser", default=None, choices=list(get_args(ReasoningParserName)),
                   help="split a reasoning model's thinking into reasoning_content (vLLM's names)")
    p.add_argument("--chat-template", default=None,
                   help="a chat template (a file, or the template's text) instead of the model's own")
    p.add_argument("--disable-playground", action="store_true", default=None,
                   help="serve no playground page at /playground (the API alone)")
    return p


def refuse_removed_flags(argv: list[str]) -> None:
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag in REMOVED_FLAGS:
            sys.exit(f"tandem serve: error: {flag} is not supported; put every speculative setting in "
                     f"--speculative-config, e.g. --speculative-config '{{\"model\": \"...\", "
                     f"\"num_speculative_tokens\": 3}}' (this flag's key: \"{REMOVED_FLAGS[flag]}\")")


def serve_args_from_cli(argv: list[str]) -> dict:
    refuse_removed_flags(argv)
    ns = serve_parser().parse_args(argv)
    args = {k: v for k, v in vars(ns).items() if k not in ("host", "port", "no_grpc") and v is not None}
    args["grpc_host"] = ns.host  # gRPC binds where HTTP binds
    if ns.no_grpc:
        args["grpc_port"] = None
    return {"args": args, "host": ns.host, "port": ns.port}


def serve_main(argv: list[str]) -> None:
    parsed = serve_args_from_cli(argv)
    from deployments.app import make_app, parse_args
    from deployments.auth import resolve_api_key

    try:
        args = parse_args(parsed["args"])  # validates everything before Ray starts
        # resolved here and handed to the replica (pickled, never logged): a replica on a cluster
        # started elsewhere would not see this shell's $TANDEM_API_KEY and would serve without one
        key = resolve_api_key(args.api_key, args.api_key_env, args.api_key_file)
    except (ValueError, OSError) as e:
        sys.exit(f"tandem serve: error: {e}")
    app = make_app(args.model_copy(update={"api_key": key, "api_key_env": None, "api_key_file": None}))
    from ray import serve

    from engine.executor import init_ray

    apply_serve_env_defaults()
    init_ray(args.engine_config())
    serve.start(http_options={"host": parsed["host"], "port": parsed["port"]})
    serve.run(app, name="tandem", route_prefix="/", blocking=True)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: tandem serve MODEL [--speculative-config JSON] [options]\n"
              "       tandem serve --help   for the options")
        return
    if argv[0] != "serve":
        sys.exit(f"tandem: unknown command {argv[0]!r}; commands: serve")
    serve_main(argv[1:])


if __name__ == "__main__":
    main()
