"""build_app(args): the Ray Serve application, from serve_config.yaml's `args` or the CLI.

Arguments are validated once, here, into ServeArgs (and its EngineConfig); nothing downstream
re-reads untyped dicts.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from engine.config import CpuIsa, Device, Dtype, EngineConfig, GgufWeights, PlacementStrategy, SpeculativeConfig
from engine.reasoning import ReasoningParserName
from engine.tool_parsers import ToolCallParserName

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024


class ServeArgs(BaseModel):
    """An application's args. A key that is also an engine key (EngineConfig's) means the same there and
    takes its description from there (docs/reference/serve-args.md); the others describe themselves."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    model: str
    served_model_name: str | None = Field(default=None, description=(
        "The model's name in the API (`/v1/models`, a request's `model`). Unset: `model`."))
    tokenizer: str | None = None
    dtype: Dtype = "auto"
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    max_num_seqs: int | None = None  # EngineConfig's: unset, 16 on a CPU and 256 on a GPU
    block_size: int = 16  # EngineConfig's: tokens per KV block
    max_num_batched_tokens: int | None = None  # EngineConfig's: tokens per step (unset: 256 CPU, 2048 GPU)
    prefill_stall_ms: float | None = None  # EngineConfig's: prompt chunks beside decoding streams (unset: 300 CPU)
    enable_prefix_caching: bool = True  # EngineConfig's
    seed: int = 0
    device: Device = "auto"
    speculative_config: SpeculativeConfig | None = None
    placement_strategy: PlacementStrategy = "PACK"  # EngineConfig's
    disjoint_cores: bool = False  # EngineConfig's: each CPU rank on its own share of the node's cores
    gguf_weights: GgufWeights = "int8"  # EngineConfig's
    # EngineConfig's CPU knobs; unset: the engine's default, or the TANDEM_* variable the engine reads
    cpu_kernels: bool | None = None  # our C++ kernels (False: oneDNN and PyTorch for everything)
    cpu_isa: CpuIsa | None = None  # which build of them
    rank_threads: int | None = None  # torch threads per rank
    placement_timeout_s: float | None = None  # how long the groups' placement waits for room (120)
    omp_spin_count: int | None = None  # GOMP_SPINCOUNT of the rank processes (30000)
    enforce_eager: bool | None = None  # EngineConfig's: False compiles the steps (unset: CUDA graphs on a GPU)
    # The key: the CLI's --api-key (never from a YAML: Ray logs an application's args), an
    # environment variable's name, or a file. Unset: $TANDEM_API_KEY when that is set, else open.
    api_key: SecretStr | None = Field(default=None, description=(
        "The API key clients must send as `Authorization: Bearer` on `/v1`, `/tokenize`, `/detokenize`, "
        "`/tokenizer_info` and gRPC. Only from `tandem serve`: Ray logs an application's args, so "
        "serve_config.yaml names the key with `api_key_env` or `api_key_file`."))
    api_key_env: str | None = Field(default=None, description=(
        "The name of an environment variable that holds the API key. Unset (and no other key): "
        "`TANDEM_API_KEY` when that is set, else no key is required."))
    api_key_file: str | None = Field(default=None, description="A file that holds the API key.")
    # gRPC is served from the coordinator on this address (bind it where HTTP binds); None: off.
    grpc_host: str = Field(default="127.0.0.1", description=(
        "The address the gRPC server binds; bind it where HTTP binds."))
    grpc_port: int | None = Field(default=9000, ge=0, le=65535, description=(
        "The gRPC server's port (0: any free port). `null`: no gRPC server."))
    # several coordinator replicas on one node (num_replicas > 1, autoscaling) share grpc_port
    grpc_share_port: bool = Field(default=False, description=(
        "Let several coordinator replicas on one node (more than one replica, autoscaling) share `grpc_port`."))
    max_request_bytes: int = Field(default=DEFAULT_MAX_REQUEST_BYTES, ge=1024, description=(
        "The largest request body in bytes (at least 1024); a larger one gets HTTP 413."))
    max_queued_requests: int = Field(default=64, ge=0, description=(
        "Requests that may wait for a place in the batch; beyond it a request gets HTTP 429 (queue full)."))
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)  # EngineConfig's: KV cache share of a GPU
    kv_cache_memory_bytes: int | None = Field(default=None, ge=1)  # EngineConfig's: KV cache bytes per device
    # Custom Ray resources each coordinator replica requires, e.g. {"tandem_coordinator": 1} with the
    # head node started with that resource: the replicas (and so their gRPC servers) stay on the
    # node the gRPC Service reaches; their model groups are placed anywhere.
    coordinator_resources: dict[str, float] | None = Field(default=None, description=(
        "Custom Ray resources each coordinator replica requires, e.g. `{\"tandem_coordinator\": 1}`, to keep "
        "the replicas (and their gRPC servers) on the nodes that have them. Not `CPU` or `GPU`."))

    enable_auto_tool_choice: bool = Field(default=False, description=(
        "Let the model decide whether to call tools (`tool_choice: \"auto\"`, OpenAI's default when a "
        "request has `tools`). Needs `tool_call_parser`."))
    tool_call_parser: ToolCallParserName | None = Field(default=None, description=(
        "How the model writes tool calls, in vLLM's names: `hermes` (`<tool_call>{...}</tool_call>`: Qwen 2.5 "
        "and 3, Hermes, SmolLM3), `llama3_json` (Llama 3.1 / 3.2 JSON), `pythonic` (`[f(a=1)]`: Llama 3.2 / 4 "
        "pythonic, Gemma 3). Once a call begins it is held to the tools' schemas."))
    reasoning_parser: ReasoningParserName | None = Field(default=None, description=(
        "Split a reasoning model's thinking from its answer, in vLLM's names: `deepseek_r1`, `qwen3`. The "
        "thinking comes back as `message.reasoning_content` (streamed as `delta.reasoning_content`); "
        "structured outputs and tool calls apply after it."))
    chat_template: str | None = Field(default=None, description=(
        "A Jinja chat template (its text, or a file that holds it) to use instead of the model's own; "
        "vLLM's `--chat-template`. A template that refers to `tools` renders tools itself."))

    disable_playground: bool = Field(default=False, description=(
        "Serve no playground page (`/playground`, and `/` redirecting there): the API alone."))

    @model_validator(mode="after")
    def _auto_tool_choice_needs_a_parser(self) -> "ServeArgs":
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (one of "
                             f"{', '.join(get_args(ToolCallParserName))})")
        return self

    def chat_template_text(self) -> str | None:
        """The chat template's text: chat_template itself, or the file it names."""
        if self.chat_template is None:
            return None
        if "{" not in self.chat_template and "\n" not in self.chat_template:
            path = Path(self.chat_template).expanduser()
            try:
                return path.read_text(encoding="utf-8")
            except OSError as e:
                raise ValueError(f"chat_template: cannot read the file {self.chat_template!r} ({e.strerror})") from None
        return self.chat_template

    @field_validator("coordinator_resources")
    @classmethod
    def _custom_resources_only(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for name, amount in (value or {}).items():
            if name in ("CPU", "GPU", "memory", "object_store_memory") or amount <= 0:
                raise ValueError(f"coordinator_resources: a custom resource name and a positive amount, got "
                                 f"{name!r}: {amount!r} (a coordinator needs no CPU or GPU of its own)")
        return value

    def engine_config(self) -> EngineConfig:
        knobs = {k: getattr(self, k) for k in ("cpu_kernels", "cpu_isa", "rank_threads", "placement_timeout_s", "omp_spin_count",
                                               "enforce_eager")
                 if getattr(self, k) is not None}
        return EngineConfig(**knobs, model=self.model, tokenizer=self.tokenizer, dtype=self.dtype,
                            max_model_len=self.max_model_len, tensor_parallel_size=self.tensor_parallel_size,
                            max_num_seqs=self.max_num_seqs, seed=self.seed, device=self.device,
                            block_size=self.block_size, enable_prefix_caching=self.enable_prefix_caching,
                            max_num_batched_tokens=self.max_num_batched_tokens, prefill_stall_ms=self.prefill_stall_ms,
                            distributed_executor_backend="ray", placement_strategy=self.placement_strategy,
                            disjoint_cores=self.disjoint_cores, gguf_weights=self.gguf_weights,
                            gpu_memory_utilization=self.gpu_memory_utilization,
                            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                            speculative_config=self.speculative_config)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


def parse_args(args: dict[str, Any]) -> ServeArgs:
    if isinstance(args.get("speculative_config"), dict):
        args = {**args, "speculative_config": SpeculativeConfig.model_validate(args["speculative_config"])}
    serve_args = ServeArgs.model_validate(args)
    serve_args.engine_config()  # the engine's own rules, checked before any replica starts
    serve_args.chat_template_text()  # a template file that can't be read fails here, not in a replica
    return serve_args


def build_app(args: dict[str, Any]):
    """The import_path entry of serve_config.yaml / a RayService."""
    if args.get("api_key") is not None:
        raise ValueError("api_key must not be written in the application's args: Ray Serve logs them in "
                         "plain text. Set api_key_env (an environment variable's name, e.g. TANDEM_API_KEY) "
                         "or api_key_file instead, and rotate this key.")
    return make_app(parse_args(dict(args)))


def make_app(args: ServeArgs):
    from deployments.coordinator import Coordinator

    if args.coordinator_resources:
        options = {**Coordinator.ray_actor_options, "resources": dict(args.coordinator_resources)}
        return Coordinator.options(ray_actor_options=options).bind(args)
    return Coordinator.bind(args)
