"""Two tiny random models with different tokenizers, written as HF directories.

The target's tokenizer marks word starts with '▁' (SentencePiece style) and has byte-fallback
pieces; the draft's is byte-level BPE style ('Ġ'). Their vocabularies partly overlap.
"""
from pathlib import Path

from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from engine.models.presets import random_checkpoint

COMMON = ["the", "cat", "sat", "on", "mat", "dog", "a", "big", "red", "hat", "is", "and", "of", "to", "in",
          "it", "was", "he", "she", "we"]
TARGET_ONLY = ["run", "fast", "blue", "sun", "moon", "star", "tree", "sky", "sea", "car", "bus", "map", "cup",
               "pen", "box", "key", "door", "wall", "roof", "lamp", "desk"]
DRAFT_ONLY = ["old", "new", "hot", "cold", "up", "down", "left", "right", "yes", "no", "one", "two", "six",
              "ten", "far", "near", "in.", "out", "low", "high", "top", "end", "far."]
SPECIALS = ["<unk>", "<s>", "</s>"]
VOCAB = 48


def _tokenizer(pieces: list[str], marker: str) -> PreTrainedTokenizerFast:
    vocab = {p: i for i, p in enumerate(SPECIALS + pieces)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    if marker == "▁":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
        tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def target_pieces() -> list[str]:
    words = ["▁" + w for w in COMMON + TARGET_ONLY][: VOCAB - len(SPECIALS) - 2]
    return words + ["<0x41>", "<0x42>"]  # byte-fallback pieces: b"A", b"B"


def draft_pieces() -> list[str]:
    return ["Ġ" + w for w in COMMON + DRAFT_ONLY][: VOCAB - len(SPECIALS)]


def write_model(directory: Path, pieces: list[str], marker: str, seed: int, **config_keys) -> Path:
    config, _, state = random_checkpoint("tiny-llama", seed)
    assert config.vocab_size == VOCAB
    config.update(config_keys)
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    save_file(state, directory / "model.safetensors")
    _tokenizer(pieces, marker).save_pretrained(directory)
    return directory


def write_pair(root: Path) -> tuple[str, str]:
    target = write_model(root / "target", target_pieces(), "▁", seed=11)
    draft = write_model(root / "draft", draft_pieces(), "Ġ", seed=12)
    return str(target), str(draft)
