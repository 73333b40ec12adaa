"""Our forward equals transformers' own model on the same weights; ragged batches equal one-by-one."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import GEMMA3, SMOLLM2
from engine.kv_cache import KVCache, static_tables
from engine.models import build_model, load_state_dict, resolve_model
from engine.models.linear import pack_linears


def ours_and_hf(name):
    config, state = load_state_dict(resolve_model(name))
    ours = build_model(config, state)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.load_state_dict(state, strict=False)
    if config.tie_word_embeddings:
        hf.tie_weights()
    return ours, hf


BLOCK = 16


def cache_for(model, rows=4, length=96):
    a = model.args
    return KVCache(a.num_layers, rows * length // BLOCK + 1, BLOCK, a.num_kv_heads, a.head_dim, torch.float32)


def tables(*rows: int, length: int = 96) -> torch.Tensor:
    """Block tables of cache_for's rows, each row's blocks in reverse order (paging, not slots)."""
    every = static_tables(4, length, BLOCK)
    return torch.tensor([every[r][::-1] for r in rows])


@pytest.mark.parametrize("name", ["random:tiny-llama", "random:tiny-qwen3", "random:tiny-gemma3",
                                  SMOLLM2, GEMMA3])
@pytest.mark.parametrize("packed", [False, True])
def test_logits_match_transformers(name, packed):
    ours, hf = ours_and_hf(name)
    if packed:  # the inference path: fused q|k|v and gate|up, oneDNN-packed weights
        ours.fuse_projections()
        assert pack_linears(ours) > 0
    ids = torch.randint(3, ours.args.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
        # prefill 30 tokens, then 10 more through the cache: exercises cached attention and
        # (tiny-gemma3, window 8) sliding-window layers
        cache = cache_for(ours)
        first = ours(ids[:, :30], torch.arange(30)[None], cache, tables(2))
        rest = ours(ids[:, 30:], torch.arange(30, 40)[None], cache, tables(2))
    out = torch.cat([first, rest], dim=1)
    rel = (out - ref).abs().max() / ref.abs().max()
    assert rel <= 1e-4, f"max relative error {rel:.2e}"


@pytest.mark.parametrize("name", ["random:tiny-llama", "random:tiny-gemma3"])
def test_ragged_batch_equals_one_by_one(name):
    ours = build_model(*load_state_dict(resolve_model(name)))
    ours.fuse_projections()
    pack_linears(ours)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 48, (n,), generator=gen).tolist() for n in (12, 20, 5)]
    new = [torch.randint(3, 48, (n,), generator=gen).tolist() for n in (1, 4, 3)]
    worker_cache = cache_for(ours)
    with torch.no_grad():
        alone = []
        for slot, (p, t) in enumerate(zip(prompts, new)):
            ours(torch.tensor([p]), torch.arange(len(p))[None], worker_cache, tables(slot))
            pos = torch.arange(len(p), len(p) + len(t))[None]
            alone.append(ours(torch.tensor([t]), pos, worker_cache, tables(slot))[0])
        # the same new tokens as one ragged batch, into fresh slots of a second cache
        cache = cache_for(ours)
        for slot, p in zip((3, 0, 1), prompts):
            ours(torch.tensor([p]), torch.arange(len(p))[None], cache, tables(slot))
        T = max(map(len, new))
        ids = torch.zeros(3, T, dtype=torch.long)
        for b, t in enumerate(new):
            ids[b, : len(t)] = torch.tensor(t)
        starts = torch.tensor([len(p) for p in prompts])
        batched = ours(ids, starts[:, None] + torch.arange(T)[None], cache, tables(3, 0, 1))
    for b, t in enumerate(new):
        torch.testing.assert_close(batched[b, : len(t)], alone[b], rtol=1e-4, atol=1e-4)
