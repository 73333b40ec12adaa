"""Typed configuration, validated once at the edge (LLM(), build_app(), the CLI).

Keys and rules follow vLLM's `speculative_config` for `method: "draft_model"` (the table of the seed
document this project started from).
Every error is a ValueError (pydantic's ValidationError is one) whose message names the key.
"""
from __future__ import annotations

import math
import os
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.structured import StructuredOutputsParams

# Filled in by the engine from the loaded models; a user never sets these.
INTERNAL_SPEC_FIELDS = (
    "target_model_config", "draft_model_config", "target_parallel_config",
    "draft_parallel_config", "draft_load_config",
)
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens")
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
MAX_LOGIT_BIAS = 300  # OpenAI's
# vLLM's _SAMPLING_EPS: a temperature below it is greedy (dividing logits by it overflows to NaN).
SAMPLING_EPS = 1e-5

# The choices of the engine keys that take one of a few names; ServeArgs and the CLI use the same ones.
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Device = Literal["auto", "cpu", "cuda"]
PlacementStrategy = Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"]
GgufWeights = Literal["int8", "blocks", "float32"]
CpuIsa = Literal["auto", "avx512_vnni", "avx512", "avx_vnni", "avx2", "none"]  # engine/kernels/targets.py


class SpeculativeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["draft_model"] | None = Field(default=None, description=(
        "The speculative method; only `draft_model` (an independent draft model). Inferred when `model` is given."))
    model: str | None = Field(default=None, description=(
        "The draft model, in the same forms as the target's: a Hugging Face id, a local directory, a `.gguf` "
        "file or `random:<preset>`."))
    num_speculative_tokens: int = Field(gt=0, description=(
        "K, the tokens the draft proposes per step (> 0). With `adaptive`, the most a step proposes."))
    draft_tensor_parallel_size: int | None = Field(default=None, ge=1, description=(
        "The draft's tensor parallelism: 1 or the target's `tensor_parallel_size`. Unset: the target's."))
    max_model_len: int | None = Field(default=None, ge=1, description=(
        "Caps the context length; not above either model's limit."))
    parallel_drafting: bool = Field(default=False, description=(
        "PARD: one draft forward proposes all K tokens (the context plus K-1 mask tokens). Needs a draft "
        "trained for it that names its mask token in its config.json."))
    rejection_sample_method: Literal["standard", "synthetic", "block"] = Field(default="standard", description=(
        "`standard`: lossless rejection sampling. `block`: lossless block verification (accepts at least as "
        "much). `synthetic`: a fixed acceptance for benchmarks; not exact."))
    synthetic_acceptance_rates: list[float] | None = Field(default=None, description=(
        "Synthetic mode only: K non-increasing unconditional acceptance rates (entry i: the probability that "
        "the first i+1 drafts are all accepted)."))
    synthetic_acceptance_length: float | None = Field(default=None, description=(
        "Synthetic mode only, instead of the rates: a mean acceptance length in [1, K+1], resolved to the "
        "minimum-variance schedule (2.6 at K=3: [1.0, 0.6, 0.0])."))
    use_heterogeneous_vocab: bool = Field(default=False, description=(
        "Token-Level Intersection (TLI): lets the draft have another tokenizer and vocabulary than the target."))
    draft_sample_method: Literal["greedy", "probabilistic"] = Field(default="greedy", description=(
        "`greedy`: the draft proposes its argmax. `probabilistic`: it samples, and verification runs the full "
        "ratio test."))
    # Tandem's extension (FR-Spec, engine/frequent_tokens.py): the draft's LM head computes only its N
    # most frequent tokens' rows; the target verifies against its full distribution, so output stays
    # exact. Off by default until it measures better on the default pair (benchmarks/spec_bench.py).
    draft_head_tokens: int | None = Field(default=None, ge=1, description=(
        "Tandem's extension (FR-Spec): the draft's LM head scores only its N most frequent tokens (by its "
        "tokenizer's merge ranks; special tokens and the base alphabet always), so a draft step reads fewer "
        "weights. Lossless: the target verifies against its full distribution. Unset: the whole vocabulary."))
    # Tandem's extension: choose each request's K per step in [0, num_speculative_tokens] from
    # measured costs and its running acceptance (engine/adaptive.py); 0 is plain decoding.
    adaptive: bool = Field(default=False, description=(
        "Tandem's extension: choose each request's K every step in [0, `num_speculative_tokens`] from measured "
        "step costs and the request's acceptance; K=0 is plain decoding."))
    # Tandem's extension (PEARL-style post-verify): while the target verifies a block, the draft group
    # drafts the next one, assuming the block is accepted whole and the target's bonus token equals
    # the next draft; when it is, the next step verifies at once, else that block is discarded (the
    # draft's cache rolls back) and the row drafts afresh. Off by default: it pays only when the
    # groups run on their own devices (GPUs, or disjoint cores: EngineConfig.disjoint_cores); on
    # shared cores the two forwards slow each other and the engine falls back to sequential steps.
    draft_ahead: bool = Field(default=False, description=(
        "Tandem's extension: the draft drafts the next block while the target verifies this one. Pays only "
        "when the two groups run on their own devices (GPUs, or `disjoint_cores` on a CPU); needs "
        "`draft_placement` `separate`."))
    # Tandem's extension: where the draft group runs. "separate": actors of its own, one device per
    # rank (extra devices; what draft_ahead overlaps). "colocated": each draft rank inside a target
    # rank's actor, on its device, sharing its torch.distributed group (as vLLM runs a draft;
    # draft_tensor_parallel_size 1 puts the whole draft on the target's rank 0). "auto" (default):
    # colocated on GPUs, so one GPU can speculate; separate on CPU, where both share the cores
    # either way and separate actors let draft_ahead overlap them on disjoint cores.
    draft_placement: Literal["auto", "separate", "colocated"] = Field(default="auto", description=(
        "Tandem's extension: `separate` (the draft on actors and devices of its own), `colocated` (each draft "
        "rank inside a target rank's actor, on its device), `auto` (colocated on GPUs, separate on a CPU)."))

    @model_validator(mode="before")
    @classmethod
    def _reject_misplaced_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if "tensor_parallel_size" in data:
            raise ValueError("speculative_config: 'tensor_parallel_size' is not a speculative config key; "
                             "use 'draft_tensor_parallel_size' for the draft model's tensor parallelism")
        for key in SAMPLING_KEYS:
            if key in data:
                raise ValueError(f"speculative_config: '{key}' is a sampling parameter, not speculative config; "
                                 f"set it in SamplingParams or the request")
        for key in INTERNAL_SPEC_FIELDS:
            if key in data:
                raise ValueError(f"speculative_config: '{key}' is an internal field filled in by the engine; "
                                 f"do not set it")
        known = set(cls.model_fields)
        unknown = sorted(k for k in data if k not in known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; valid keys: {sorted(known)}")
        if data.get("method") == "ngram":
            raise ValueError("speculative_config: method 'ngram' is not supported yet; use 'draft_model'")
        if data.get("method") is None and data.get("model"):
            data = {**data, "method": "draft_model"}  # inferred, as vLLM does
        return data

    @model_validator(mode="after")
    def _check_rules(self) -> "SpeculativeConfig":
        k = self.num_speculative_tokens
        if self.method is None:
            raise ValueError("speculative_config: set 'model' (the draft model) or 'method'")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config: 'model' is required with method 'draft_model'")
        synthetic = self.rejection_sample_method == "synthetic"
        rates, length = self.synthetic_acceptance_rates, self.synthetic_acceptance_length
        if not synthetic and (rates is not None or length is not None):
            key = "synthetic_acceptance_rates" if rates is not None else "synthetic_acceptance_length"
            raise ValueError(f"speculative_config: '{key}' is only valid with rejection_sample_method 'synthetic'")
        if rates is not None and length is not None:
            raise ValueError("speculative_config: 'synthetic_acceptance_rates' and 'synthetic_acceptance_length' "
                             "are mutually exclusive")
        if synthetic and rates is None and length is None:
            raise ValueError("speculative_config: rejection_sample_method 'synthetic' needs "
                             "'synthetic_acceptance_rates' or 'synthetic_acceptance_length'")
        if rates is not None:
            if len(rates) != k:
                raise ValueError(f"speculative_config: 'synthetic_acceptance_rates' must have "
                                 f"num_speculative_tokens={k} entries, got {len(rates)}")
            if any(not 0.0 <= r <= 1.0 for r in rates):
                raise ValueError("speculative_config: 'synthetic_acceptance_rates' entries must lie in [0, 1]")
            if any(b > a for a, b in zip(rates, rates[1:])):
                raise ValueError("speculative_config: 'synthetic_acceptance_rates' must be non-increasing")
        if length is not None and not 1.0 <= length <= k + 1:
            raise ValueError(f"speculative_config: 'synthetic_acceptance_length' must lie in [1, {k + 1}] "
                             f"(1 to num_speculative_tokens + 1), got {length}")
        if self.draft_ahead and self.draft_placement == "colocated":
            raise ValueError("speculative_config: 'draft_ahead' overlaps the draft group with the target's, which "
                             "needs draft_placement 'separate' (a colocated draft shares the target's actor)")
        if self.use_heterogeneous_vocab and self.method != "draft_model":
            raise ValueError("speculative_config: 'use_heterogeneous_vocab' is only supported with "
                             "method 'draft_model'")
        return self

    def synthetic_rates(self) -> list[float]:
        """Unconditional acceptance per position for synthetic mode, as vLLM defines it: entry i is
        the probability that the first i+1 drafts are all accepted.

        A target mean acceptance length L resolves to the minimum-variance schedule: the first
        floor(L - 1) drafts always accepted, the next with the fractional part, the rest never
        (2.6 at K=3 -> [1.0, 0.6, 0.0]; 3.5 at K=4 -> [1.0, 1.0, 0.5, 0.0]).
        """
        if self.synthetic_acceptance_rates is not None:
            return list(self.synthetic_acceptance_rates)
        k, mean_accepted = self.num_speculative_tokens, self.synthetic_acceptance_length - 1.0
        whole = int(math.floor(mean_accepted + 1e-9))
        rates = [1.0] * min(whole, k) + [0.0] * max(0, k - whole)
        if whole < k:
            rates[whole] = round(mean_accepted - whole, 12)
        return rates


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description=(
        "The target model: a Hugging Face id, a local Hugging Face directory, a `.gguf` file, or "
        "`random:<preset>` (random weights, for tests)."))
    tokenizer: str | None = Field(default=None, description="The tokenizer to load. Unset: the model's own.")
    dtype: Dtype = Field(default="auto", description=(
        "The weights' and activations' dtype. `auto`: float32 on a CPU, bfloat16 on a GPU."))
    max_model_len: int | None = Field(default=None, ge=1, description=(
        "The longest sequence (prompt plus output). Unset: the model's limit, lowered to what the KV cache holds."))
    tensor_parallel_size: int = Field(default=1, ge=1, description="The target's tensor parallelism (ranks).")
    # The batch bound (sequences decoding at once). Unset: 16 on a CPU (two cores gain little past
    # that; each more row costs a verify's rows) and 256 on a GPU (vLLM's default).
    max_num_seqs: int | None = Field(default=None, ge=1, description=(
        "Sequences decoding at once (the batch bound). Unset: 16 on a CPU, 256 on a GPU."))
    # Paged KV cache (engine/kv/): tokens per block, a power of two (vLLM's default 16), and automatic
    # prefix caching (on, as in vLLM v1): full blocks of committed tokens are shared between requests
    # with the same token chain (and cache_salt).
    block_size: int = Field(default=16, ge=1, le=256, description=(
        "Tokens per KV cache block; a power of two up to 256."))
    # Tokens one step computes in each model (vLLM's max_num_batched_tokens): the decoding rows' K+1
    # verify tokens first, then prefill chunks of admitted prompts with what is left, so a long prompt
    # is prefilled over several steps while the running streams go on. Unset: 256 on a CPU (Gemma 3
    # 270M prefills ~640 tokens/s on 2 cores: a chunk pauses the running streams ~0.4-0.5 s; smaller
    # chunks pause them less but cost a long prompt's TTFT more, benchmarks/stall_bench.py), 2048 on
    # a GPU (vLLM's default for online serving).
    max_num_batched_tokens: int | None = Field(default=None, ge=1, description=(
        "Tokens one step computes per model: the decoding rows' verify tokens first, then prefill chunks. "
        "Unset: 256 on a CPU, 2048 on a GPU."))
    # A step that carries a prompt chunk pauses every decoding stream for as long as the chunk takes,
    # and a token costs 2-3x more on an AVX2 CPU than on an AVX-512 one: while streams decode, chunks are
    # sized from measured step times instead (engine/prefill_pacing.py). 300 ms on a CPU: a long prompt's
    # chunks pause the streams about that long (AVX2 EPYC, Gemma 3: ~650 ms with 256-token chunks).
    prefill_stall_ms: float | None = Field(default=None, ge=0, description=(
        "While streams decode, prompt chunks are sized from measured step times so that a step carrying one "
        "takes about this long (within max_num_batched_tokens). 0: off. Unset: 300 on a CPU, off on a GPU."))
    enable_prefix_caching: bool = Field(default=True, description=(
        "Share the KV cache blocks of a common prompt prefix between requests (and their `cache_salt`)."))
    seed: int = Field(default=0, description="The engine's random seed (a request's own `seed` wins for it).")
    device: Device = Field(default="auto", description="Where the models run. `auto`: a GPU when there is one.")
    distributed_executor_backend: Literal["mp", "ray"] | None = Field(default=None, description=(
        "`ray`: the model groups run as Ray actors, as in serving. Unset (or `mp`): in this process, unless a "
        "tensor parallelism above 1 needs Ray."))
    # How Ray places the ranks of both groups (one placement group, one bundle per rank, target's
    # first): PACK fills a node before the next (the default: tensor parallelism wants one node's
    # interconnect); STRICT_PACK refuses to leave one node; SPREAD / STRICT_SPREAD put consecutive
    # ranks on different nodes (a draft on a node of its own: target TP 1 + draft TP 1, STRICT_SPREAD).
    placement_strategy: PlacementStrategy = Field(default="PACK", description=(
        "How Ray places the ranks of both groups on a cluster: `PACK` fills a node first, `STRICT_PACK` keeps "
        "them on one node, `SPREAD` and `STRICT_SPREAD` put consecutive ranks on different nodes."))
    # CPU only: pin each rank of both groups to its own share of the node's cores (rank i of R gets
    # cores [i*n/R, (i+1)*n/R)), as if each ran on its own device. Without it every rank uses every
    # core (the groups take turns). Draft-ahead overlaps the groups only when this is on.
    disjoint_cores: bool = Field(default=False, description=(
        "CPU: pin each rank of both groups to its own share of the node's cores, as if each had its own "
        "device. Off: every rank uses every core."))
    # CPU, a .gguf model (or an embedded one): how its quantized tensors are held and multiplied.
    # "int8": the file's blocks, multiplied by activations rounded to int8 per 32 values with integer
    # dot products (VNNI's vpdpbusd, else AVX2's vpmaddubsw, as llama.cpp does; the same bits on every
    # target): the fastest; logits off float32's by up to ~1.6 of ~40, mean KL ~1e-2 (README). "blocks": the same
    # blocks rebuilt in registers to float32, outputs bit-identical to "float32" (their dequantized
    # copies, in about a third of the memory). "float32": the reference.
    gguf_weights: GgufWeights = Field(default="int8", description=(
        "CPU, a GGUF model: `int8` multiplies the file's blocks by int8 activations (fastest), `blocks` rebuilds "
        "them to float32 in registers (bit-identical to `float32`), `float32` holds dequantized copies."))
    # KV cache sizing (engine/memory.py): after the weights load, each GPU's caches get this share
    # of the device less what is in use; kv_cache_memory_bytes, when set, is the byte budget per
    # device instead (on a CPU, unset: 4 GiB, vLLM's CPU default). The blocks that fit are shared by
    # all sequences; a cache too small for one max_model_len sequence lowers a defaulted
    # max_model_len to what fits (with a warning) and refuses an explicit one.
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1, description=(
        "The share of each GPU for the weights and the KV cache; the KV cache gets what the weights leave."))
    kv_cache_memory_bytes: int | None = Field(default=None, ge=1, description=(
        "KV cache bytes per device, instead of `gpu_memory_utilization`. Unset on a CPU: 4 GiB."))
    speculative_config: SpeculativeConfig | None = Field(default=None, description=(
        "The draft model and how it speculates (see the speculative config keys). Unset: plain decoding."))
    # CPU only. Our C++ kernels (csrc/): small-row linears (decode and verify steps, GGUF blocks), the
    # decode layer's ops, the grammar-mask apply. False turns all of them off: every linear on oneDNN,
    # a GGUF model's quantized tensors held as float32 (the blocks need the kernel), masks in PyTorch.
    # A machine that can't build or run them falls back the same way by itself.
    cpu_kernels: bool = Field(default=True, description=(
        "CPU: our C++ kernels (small-row linears, GGUF blocks, the decode layer's ops, grammar masks). False: "
        "oneDNN and PyTorch for everything, a GGUF model's tensors held as float32."))
    # CPU only: which build of the kernels (engine/kernels/targets.py): "auto" the best this CPU runs (its
    # CPUID flags, then a process that builds and runs it; none where the CPU has no AVX2: PyTorch, with a
    # log line), or one by name: "avx512_vnni", "avx512", "avx_vnni", "avx2" (e.g. the AVX2 build on an
    # AVX-512 machine, to test or measure it; refused where the CPU lacks it), or "none" (= cpu_kernels
    # False). The int8 kernel gives the same bits on every target; float32 ops may differ in the last bits.
    cpu_isa: CpuIsa = Field(default="auto", description=(
        "CPU: which build of the kernels. `auto`: the best this CPU runs; a name forces one (refused where the "
        "CPU lacks it); `none`: the same as `cpu_kernels` false."))
    # The decode / verify step compiled whole at static shapes (engine/models/compiled_step.py): on a GPU a
    # CUDA graph per padded batch size, replayed each step (vLLM's default; its flag to turn it off has
    # this name). Unset: compiled on a GPU, eager on a CPU (the CPU's fast path is the C++ decode layer).
    # False on a CPU compiles the GPU's step with inductor and PyTorch's own linears (how the suite tests it).
    enforce_eager: bool | None = Field(default=None, description=(
        "False: decode and verify steps compiled whole (torch.compile, static shapes; on a GPU, CUDA graphs per "
        "batch size). True: eager PyTorch. Unset: compiled on a GPU, eager on a CPU (its C++ kernels)."))
    # CPU only: torch threads per rank. Unset: the node's cores over the ranks of one group (the
    # groups take turns on the same cores). Set it where other work shares the node (several
    # replicas on one node: each would otherwise take every core).
    rank_threads: int | None = Field(default=None, ge=1, description=(
        "CPU: torch threads per model rank. Unset: the node's cores over a group's ranks."))
    # How long the model groups' placement waits for the Ray cluster to have room (at start and on
    # a restart), seconds; then the engine fails with what it asked for.
    placement_timeout_s: float = Field(default=120.0, ge=0, description=(
        "Seconds the model groups wait for the Ray cluster to have room (at start and on a restart) before "
        "the engine fails."))
    # GOMP_SPINCOUNT of the rank processes (CPU): how long an idle OpenMP thread spins before it
    # sleeps. 30k spins here cost 1.05x a step against the default's 1.18x and PASSIVE's 1.4x (the
    # step's kernels are many short parallel regions).
    omp_spin_count: int = Field(default=30000, ge=0, description=(
        "CPU: `GOMP_SPINCOUNT` of the rank processes, how long an idle OpenMP thread spins before it sleeps."))

    # The environment may set these (read once, here: actors get the config, not the variables);
    # a value given in the config wins.
    ENV_FIELDS: ClassVar[dict[str, str]] = {
        "TANDEM_CPU_KERNELS": "cpu_kernels", "TANDEM_SKINNY_KERNEL": "cpu_kernels", "TANDEM_CPU_ISA": "cpu_isa",
        "TANDEM_RANK_THREADS": "rank_threads", "TANDEM_PLACEMENT_TIMEOUT_S": "placement_timeout_s",
        "TANDEM_GOMP_SPINCOUNT": "omp_spin_count"}

    @model_validator(mode="before")
    @classmethod
    def _from_environment(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        found = {field: os.environ[var] for var, field in cls.ENV_FIELDS.items()
                 if os.environ.get(var) and field not in data}
        return {**found, **data} if found else data

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _spec_from_dict(cls, value: Any) -> Any:
        # validate here so the message keeps its 'speculative_config:' prefix
        return SpeculativeConfig.model_validate(value) if isinstance(value, dict) else value

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"block_size must be a power of two (1, 2, ..., 16, 32, ...), got {value}")
        return value

    def resolved_max_num_batched_tokens(self) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 2048 if self.resolved_device() == "cuda" else 256

    def resolved_prefill_stall_s(self) -> float:
        if self.prefill_stall_ms is not None:
            return self.prefill_stall_ms / 1000
        return 0.0 if self.resolved_device() == "cuda" else 0.3

    def resolved_max_num_seqs(self) -> int:
        if self.max_num_seqs is not None:
            return self.max_num_seqs
        return 256 if self.resolved_device() == "cuda" else 16

    @model_validator(mode="after")
    def _check_draft_tp(self) -> "EngineConfig":
        spec = self.speculative_config
        if spec is not None and spec.draft_tensor_parallel_size not in (None, 1, self.tensor_parallel_size):
            raise ValueError(
                f"speculative_config: 'draft_tensor_parallel_size' must be 1 or the target's "
                f"tensor_parallel_size ({self.tensor_parallel_size}), got {spec.draft_tensor_parallel_size}")
        return self

    def colocated_draft(self) -> bool:
        """Whether the draft ranks live in the target ranks' actors (draft_placement, resolved)."""
        spec = self.speculative_config
        if spec is None or spec.draft_placement == "separate":
            return False
        if spec.draft_placement == "colocated":
            return True
        return self.resolved_device() == "cuda" and not spec.draft_ahead

    @property
    def draft_tensor_parallel_size(self) -> int:
        spec = self.speculative_config
        if spec is None or spec.draft_tensor_parallel_size is None:
            return self.tensor_parallel_size  # inherited from the target, as in vLLM
        return spec.draft_tensor_parallel_size

    def compiled_step(self) -> bool:
        """Whether decode and verify steps run compiled (enforce_eager, resolved)."""
        if self.enforce_eager is not None:
            return not self.enforce_eager
        return self.resolved_device() == "cuda"

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def torch_dtype(self):
        import torch

        if self.dtype == "auto":  # exact float32 on CPU; bfloat16 on GPU
            return torch.bfloat16 if self.resolved_device() == "cuda" else torch.float32
        return getattr(torch, self.dtype)


MAX_CACHE_SALT_CHARS = 1024
MAX_STOP_CHARS = 1024


def check_cache_salt(salt: Any) -> str | None:
    """vLLM's cache_salt: a non-empty string (None: the shared cache); ValueError otherwise."""
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt or len(salt) > MAX_CACHE_SALT_CHARS:
        raise ValueError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters")
    return salt


# Where a draft trained for parallel drafting names its mask token (the keys vLLM reads).
PARALLEL_DRAFTING_TOKEN_KEYS = ("pard_token", "ptd_token_id", "dflash_config.mask_token_id")


def parallel_drafting_token(draft_config) -> int:
    """The draft's mask token for parallel drafting (PARD), from its HF config."""
    dflash = getattr(draft_config, "dflash_config", None) or {}
    for value in (dflash.get("mask_token_id") if isinstance(dflash, dict) else None,
                  getattr(draft_config, "pard_token", None), getattr(draft_config, "ptd_token_id", None)):
        if value is not None:
            token = int(value)
            if not 0 <= token < draft_config.vocab_size:
                raise ValueError(f"speculative_config: the draft's parallel drafting token ({token}) is outside "
                                 f"its vocabulary (size {draft_config.vocab_size})")
            return token
    raise ValueError("speculative_config: 'parallel_drafting' needs a draft model trained for parallel drafting "
                     "(PARD): its config.json must name the mask token as one of "
                     + ", ".join(f"'{k}'" for k in PARALLEL_DRAFTING_TOKEN_KEYS) + "; this draft has none")


def check_model_pair(spec: SpeculativeConfig, target_vocab: int, draft_vocab: int,
                     target_max_len: int, draft_max_len: int) -> None:
    """Rules that need both models loaded."""
    if target_vocab != draft_vocab and not spec.use_heterogeneous_vocab:
        raise ValueError(
            f"Target and draft model should have the same vocabulary size. Target model vocab_size="
            f"{target_vocab}. Draft model vocab_size={draft_vocab}. Using models with different tokenizers "
            f"can cause out-of-bounds errors during speculative decoding. Set "
            f"'use_heterogeneous_vocab': true in speculative_config to use Token-Level Intersection.")
    if spec.max_model_len is not None and spec.max_model_len > min(target_max_len, draft_max_len):
        raise ValueError(
            f"speculative_config: 'max_model_len' ({spec.max_model_len}) is above the draft's or the target's "
            f"limit ({min(target_max_len, draft_max_len)})")


class SamplingParams(BaseModel):
    """Per-request sampling. temperature 0 is greedy."""

    model_config = ConfigDict(extra="forbid")

    n: int = Field(default=1, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    # applied to the target's logits before temperature, in verification as in plain decoding
    presence_penalty: float = 0.0  # minus this for every token already in the output
    frequency_penalty: float = 0.0  # minus this times the token's count in the output
    repetition_penalty: float = 1.0  # tokens in the prompt or output: logit / this if > 0, else * this
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    # log-probabilities returned: the sampled token's and the `logprobs` most likely at each step
    # (the distribution sampled from: after penalties, temperature, top-k/top-p; greedy at T = 1),
    # and with prompt_logprobs those of every prompt token after the first (the raw model's)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # the output held to a grammar (JSON schema, regex, choice, Lark/GBNF), in plain and speculative
    # decoding alike: every sampled position is masked by the grammar's state (engine/structured.py)
    structured_outputs: StructuredOutputsParams | None = None
    # Tandem's own: False decodes this request with the target alone (no drafting), e.g. to measure
    # what speculation buys; with True, each output token's origin comes back (TokenOrigin)
    speculative: bool = True
    spec_trace: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        if value is None:
            return []
        return [value] if isinstance(value, str) else value

    @field_validator("temperature")
    @classmethod
    def _tiny_temperature_is_greedy(cls, value: float) -> float:
        return 0.0 if 0.0 <= value < SAMPLING_EPS else value

    @model_validator(mode="after")
    def _check(self) -> "SamplingParams":
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (disabled) or at least 1, got {self.top_k}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):  # held-back text and its search scale with it
            raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters")
        if any(t < 0 for t in self.stop_token_ids):  # the upper bound is the engine's vocabulary
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {[t for t in self.stop_token_ids if t < 0][:5]}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.logit_bias:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
            bad = [t for t, b in self.logit_bias.items() if t < 0 or not -100.0 <= b <= 100.0]
            if bad:
                raise ValueError(f"logit_bias: token ids must be >= 0 and biases in [-100, 100] (token {bad[0]})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        return self

    @property
    def penalized(self) -> bool:
        """Whether the target's logits change before sampling (penalties or a logit bias)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
