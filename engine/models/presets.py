"""Random-weight models of fixed shapes, for tests and benchmarks (`random:<preset>[:<seed>]`).

Tiny presets come with a character-level tokenizer so tests can use text prompts; the
real-shape presets reuse the character tokenizer too (benchmarks feed token ids).
"""
from __future__ import annotations

import string

import torch

# Tiny shapes: logits spread enough (initializer_range 0.2) that sampling tests see real distributions.
PRESETS: dict[str, dict] = {
    "tiny-llama": dict(model_type="llama", vocab_size=48, hidden_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                       initializer_range=0.2, rope_theta=10000.0),
    "tiny-qwen3": dict(model_type="qwen3", vocab_size=48, hidden_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                       initializer_range=0.2, rope_theta=10000.0),
    "tiny-gemma3": dict(model_type="gemma3_text", vocab_size=48, hidden_size=64, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=16, intermediate_size=128,
                        initializer_range=0.2, sliding_window=8, query_pre_attn_scalar=16,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
    # tiny-llama with every character JSON needs (structured outputs' tests)
    "tiny-llama-json": dict(model_type="llama", vocab_size=104, hidden_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                            initializer_range=0.2, rope_theta=10000.0),
    # A draft that declares a mask token for parallel drafting (PARD); its weights are tiny-llama's
    # for the same seed (random, so its drafts are untrained either way).
    "tiny-llama-pard": dict(model_type="llama", vocab_size=48, hidden_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                            initializer_range=0.2, rope_theta=10000.0, pard_token=47),
    # Real shapes for benchmarks: SmolLM2-135M and a 1.7B Llama (SmolLM2-1.7B's shape).
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                         initializer_range=0.02, rope_theta=100000.0, tie_word_embeddings=True),
    "smollm2-135m-pard": dict(model_type="llama", vocab_size=49152, hidden_size=576, num_hidden_layers=30,
                              num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                              initializer_range=0.02, rope_theta=100000.0, tie_word_embeddings=True,
                              pard_token=49151),
    "llama-1.7b": dict(model_type="llama", vocab_size=49152, hidden_size=2048, num_hidden_layers=24,
                       num_attention_heads=32, num_key_value_heads=32, intermediate_size=8192,
                       initializer_range=0.02, rope_theta=130000.0, tie_word_embeddings=True),
    # Qwen3-8B and Qwen3-0.6B's shapes: the GPU speed row (benchmarks/gpu_speed.py, scripts/gpu_check.sh)
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                     initializer_range=0.02, rope_theta=1000000.0),
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                       initializer_range=0.02, rope_theta=1000000.0, tie_word_embeddings=True),
}

SPECIALS = ["<unk>", "<s>", "</s>"]
# appended characters keep every earlier one's id (smaller vocabularies take a prefix)
ALPHABET = " " + string.ascii_lowercase + string.digits + ".,!?'\n-:" + string.ascii_uppercase + '{}[]"_;()/+=*<>#@&%$|\\~^`\t'


def _hf_config(preset: str):
    from transformers import AutoConfig

    if preset not in PRESETS:
        raise ValueError(f"unknown random preset {preset!r}; presets: {', '.join(PRESETS)}")
    kwargs = dict(PRESETS[preset])
    model_type = kwargs.pop("model_type")
    kwargs.setdefault("tie_word_embeddings", False)
    kwargs.update(max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    return AutoConfig.for_model(model_type, **kwargs)


def char_tokenizer(vocab_size: int):
    """A character-level tokenizer: specials, then one token per character of ALPHABET."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ALPHABET[: max(0, vocab_size - len(SPECIALS))]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(chars))}
    vocab.update({f"<extra_{i}>": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                  eos_token="</s>", pad_token="<unk>")
    out.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    return out


def random_checkpoint(preset: str, seed: int, config_only: bool = False, device: str = "cpu",
                      dtype: torch.dtype = torch.float32):
    """(HF config, tokenizer, state dict) of a random model; weights ~ N(0, initializer_range).
    On another device than the CPU the weights are drawn there, in `dtype`, by that device's generator
    (an 8B model's 32 GB of float32 drawn on the host would take minutes); the values then differ
    from the CPU's for the same seed."""
    config = _hf_config(preset)
    tokenizer = char_tokenizer(config.vocab_size)
    if config_only:
        return config, tokenizer, None
    from engine.models.transformer import ModelArgs, Transformer

    args = ModelArgs.from_hf_config(config)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(args).state_dict().items()}
    gen = torch.Generator(device=device).manual_seed(seed)
    std = config.initializer_range
    state = {}
    for name, shape in shapes.items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        noise = torch.randn(shape, generator=gen, device=device, dtype=dtype)
        if name.endswith("norm.weight"):
            # Gemma stores (weight - 1): zero means unit scale; perturb so the offset path is tested
            base = 0.0 if config.model_type.startswith("gemma") else 1.0
            state[name] = noise.mul_(0.1).add_(base)
        else:
            state[name] = noise.mul_(std)
    return config, tokenizer, state
