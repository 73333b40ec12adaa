"""Sharded loading (engine/models/checkpoint.py, loading.load_sharded): each tensor-parallel rank
builds its model on the meta device and reads only its slices of a safetensors checkpoint."""
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import save_file

from engine import LLM, SamplingParams
from engine.models import checkpoint as checkpoint_module
from engine.models.checkpoint import Checkpoint
from engine.models.loading import ModelSource, build_model, load_sharded, load_state_dict
from engine.models.presets import random_checkpoint
from engine.models.tp import shard


def save_hf_dir(directory: Path, preset: str, seed: int, dtype: torch.dtype) -> Path:
    """A random model as a Hugging Face directory, its weights in `dtype`, split over two files."""
    config, tokenizer, state = random_checkpoint(preset, seed)
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    names = sorted(state)
    half = len(names) // 2
    for i, part in enumerate((names[:half], names[half:])):
        save_file({n: state[n].to(dtype).contiguous() for n in part}, directory / f"model-0000{i + 1}.safetensors")
    return directory


@pytest.mark.parametrize("preset,world", [("tiny-llama", 2), ("tiny-qwen3", 2), ("tiny-gemma3", 1)])  # 1 kv head
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_rank_reads_exactly_its_shard_of_the_whole_model(tmp_path, preset, world, dtype):
    directory = save_hf_dir(tmp_path / preset, preset, 3, dtype)
    source = ModelSource("hf_dir", str(directory))
    for rank in range(world):
        config, state = load_state_dict(source)
        whole = shard(build_model(config, state), rank, world, None)  # the whole model, then sliced
        _, sliced = load_sharded(source, torch.float32, "cpu", rank, world)
        sliced = shard(sliced, rank, world, None, sliced=True)
        want, got = dict(whole.named_parameters()), dict(sliced.named_parameters())
        assert want.keys() == got.keys()
        for name in want:
            assert torch.equal(want[name], got[name]), f"rank {rank}: {name}"
        assert sliced.model.layers[0].self_attn.num_heads == whole.model.layers[0].self_attn.num_heads
        if config.tie_word_embeddings:
            assert sliced.lm_head.weight is sliced.model.embed_tokens.weight


def test_column_slices_read_in_chunks_equal_the_columns(tmp_path, monkeypatch):
    full = torch.randn(37, 48)
    save_file({"w": full}, tmp_path / "m.safetensors")
    monkeypatch.setattr(checkpoint_module, "COLUMN_CHUNK_BYTES", 5 * 48 * 4)  # 5 rows a read
    ckpt = Checkpoint(tmp_path)
    assert torch.equal(ckpt.read("w", cols=(16, 40)), full[:, 16:40])
    assert torch.equal(ckpt.read("w", rows=(9, 30)), full[9:30])
    assert torch.equal(ckpt.read("w"), full)


def test_a_truncated_checkpoint_is_a_clear_error(tmp_path):
    save_file({"w": torch.randn(64, 64)}, tmp_path / "m.safetensors")
    path = tmp_path / "m.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="truncated"):
        Checkpoint(tmp_path).read("w")
    (tmp_path / "m.safetensors").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        Checkpoint(tmp_path)


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(["hello world", "the cat sat"], params)]


def test_a_directory_serves_like_the_same_weights_and_tensor_parallel_equals_one_rank(tmp_path):
    directory = save_hf_dir(tmp_path / "m", "tiny-llama", 1, torch.float32)
    reference = greedy(LLM(model="random:tiny-llama:1"))
    assert greedy(LLM(model=str(directory))) == reference
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        assert greedy(LLM(model=str(directory), tensor_parallel_size=2, distributed_executor_backend="ray")) == reference
    finally:
        ray.shutdown()
