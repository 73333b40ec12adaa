"""The decode layer's CPU kernels (engine/kernels/csrc/decode_ops.cpp, every target this CPU runs): RMSNorm, gated activations and
attention with the paged KV-cache write, against PyTorch references; rows independent of the step's size."""
import math

import pytest
import torch
import torch.nn.functional as F

from engine.kv_cache import KVCache
from engine.models import build_model, load_state_dict, resolve_model
from engine.models.linear import pack_linears
from conftest import needs_kernels


def reference_rms_norm(x, w, eps, offset):
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return h * (offset + w)


@pytest.mark.parametrize("offset", [0.0, 1.0])  # Llama, Gemma
@pytest.mark.parametrize("n", [64, 576, 100])  # 100: a masked tail
def test_rms_norm_matches_pytorch_and_rows_are_independent(kernel, offset, n):
    gen = torch.Generator().manual_seed(n)
    x, w = torch.randn(1200, n, generator=gen) * 3, torch.randn(n, generator=gen)  # enough rows for both threads
    out = kernel.ops.rms_norm(x, w, 1e-6, offset)
    torch.testing.assert_close(out, reference_rms_norm(x, w, 1e-6, offset), rtol=2e-6, atol=2e-6)
    for r in (0, 1, 6, 700, 1199):
        assert torch.equal(kernel.ops.rms_norm(x[r:r + 1].clone(), w, 1e-6, offset), out[r:r + 1])


@pytest.mark.parametrize("gelu", [False, True])
def test_gated_activation_matches_pytorch(kernel, gelu):
    gen = torch.Generator().manual_seed(int(gelu))
    gate_up = torch.randn(5, 2 * 1540, generator=gen) * 4  # 1540: a masked tail
    gate_up[0, :6] = torch.tensor([-100.0, 100.0, -1e30, 1e30, 0.0, -0.0])  # far tails stay finite
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
    out = kernel.ops.gated_act(gate_up, gelu)
    assert torch.isfinite(out).all()
    many = torch.randn(100, 2 * 1540, generator=gen)  # rows split across threads: each row as alone
    both = kernel.ops.gated_act(many, gelu)
    assert all(torch.equal(kernel.ops.gated_act(many[r:r + 1].clone(), gelu), both[r:r + 1]) for r in (0, 57, 99))
    # PyTorch's tanh form cancels to 0 where ours keeps a tiny value: absolute tolerance at values ~100
    torch.testing.assert_close(out, act * up, rtol=1e-5, atol=1e-5)


def reference_attention(qkv, positions, tables, k_cache, v_cache, cos, sin, q_norm, k_norm, eps, offset, heads,
                        scale, window):
    """Straight from the definitions, one query at a time (writes the caches too). Caches are
    [blocks, kv_heads, block_size, dim]: position p of row b is block tables[b][p // bs], offset p % bs."""
    B, T = positions.shape
    hkv, bs, D = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]

    def at(b, p):
        return int(tables[b, p // bs]), p % bs
    qkv = qkv.view(B, T, heads + 2 * hkv, D)

    def rope(x, b, t):
        half = D // 2
        return x * cos[b, t] + torch.cat([-x[..., half:], x[..., :half]], -1) * sin[b, t]

    def norm(x, w):
        return x if w is None else reference_rms_norm(x, w, eps, offset)

    for b in range(B):
        for t in range(T):
            blk, off = at(b, int(positions[b, t]))
            k_cache[blk, :, off] = rope(norm(qkv[b, t, heads:heads + hkv], k_norm), b, t)
            v_cache[blk, :, off] = qkv[b, t, heads + hkv:]
    out = torch.empty(B, T, heads, D)
    for b in range(B):
        for t in range(T):
            p = int(positions[b, t])
            lo = max(0, p - window + 1) if window else 0
            for h in range(heads):
                g = h // (heads // hkv)
                q = rope(norm(qkv[b, t, h], q_norm), b, t)
                keys = torch.stack([k_cache[at(b, s)[0], g, at(b, s)[1]] for s in range(lo, p + 1)])
                values = torch.stack([v_cache[at(b, s)[0], g, at(b, s)[1]] for s in range(lo, p + 1)])
                out[b, t, h] = torch.softmax(keys @ q * scale, -1) @ values
    return out.view(B * T, heads * D)


@pytest.mark.parametrize("heads,kv_heads,dim,norms,window", [(9, 3, 64, False, 0), (4, 1, 256, True, 0),
                                                             (4, 2, 32, True, 5), (2, 2, 16, False, 3)])
def test_attention_matches_the_definition_with_grouped_heads_windows_and_qk_norms(kernel, heads, kv_heads, dim, norms, window):
    gen = torch.Generator().manual_seed(heads * dim + window)
    B, T, num_blocks, bs = 3, 4, 20, 4
    positions = torch.tensor([[10, 11, 12, 13], [0, 1, 2, 3], [19, 20, 21, 22]])
    # each row's blocks scattered over the pool, in no order; row 1 needs one block, the rest pad
    tables = torch.randperm(num_blocks - 1, generator=gen)[:B * 6].view(B, 6) + 1
    k_cache, v_cache = torch.randn(2, num_blocks, kv_heads, bs, dim, generator=gen)  # earlier tokens
    qkv = torch.randn(B * T, (heads + 2 * kv_heads) * dim, generator=gen)
    angles = positions[..., None].float() * (1.0 / 10000 ** (torch.arange(0, dim, 2) / dim))
    emb = torch.cat([angles, angles], -1)
    cos, sin = emb.cos().contiguous(), emb.sin().contiguous()
    q_norm, k_norm = (torch.randn(dim, generator=gen), torch.randn(dim, generator=gen)) if norms else (None, None)
    scale = 1 / math.sqrt(dim)
    args = (positions, tables)
    ours_k, ours_v = k_cache.clone(), v_cache.clone()
    out = kernel.ops.decode_attention(qkv, *args, ours_k, ours_v, cos, sin, q_norm, k_norm, 1e-6, 1.0, heads,
                                            scale, window)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref = reference_attention(qkv, *args, ref_k, ref_v, cos, sin, q_norm, k_norm, 1e-6, 1.0, heads, scale, window)
    torch.testing.assert_close(ours_k, ref_k, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours_v, ref_v, rtol=0, atol=0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

    # one token at a time from the same caches: every row bit-identical to the 4-token step's
    k_one, v_one = k_cache.clone(), v_cache.clone()
    rows = []
    for t in range(T):
        step = qkv.view(B, T, -1)[:, t].contiguous()
        rows.append(kernel.ops.decode_attention(
            step, positions[:, t:t + 1].contiguous(), tables, k_one, v_one, cos[:, t].contiguous(),
            sin[:, t].contiguous(), q_norm, k_norm, 1e-6, 1.0, heads, scale, window))
    assert torch.equal(torch.stack(rows, 1).view(B * T, -1), out)
    assert torch.equal(k_one, ours_k) and torch.equal(v_one, ours_v)


@pytest.mark.parametrize("heads,kv_heads,dim,norms,window", [(9, 3, 64, False, 0), (4, 1, 256, True, 24)])
def test_a_prompt_cut_anywhere_gets_the_same_attention_bits_as_in_one_call(kernel, heads, kv_heads, dim, norms, window):
    """70 prompt rows from position 5 (tiles of 16 rows, key groups aligned to positions): in one call,
    and cut into calls of 1, 16, 17 and 36 rows, every output row and cache entry is the same bits,
    and both match the definition. (A prefill chunk's keys and values don't depend on where it ends.)"""
    gen = torch.Generator().manual_seed(dim + window)
    T, start, bs, num_blocks = 70, 5, 16, 8
    positions = torch.arange(start, start + T)[None]
    tables = (torch.randperm(num_blocks - 1, generator=gen) + 1)[None]
    k_cache, v_cache = torch.randn(2, num_blocks, kv_heads, bs, dim, generator=gen)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * dim, generator=gen)
    angles = positions[..., None].float() * (1.0 / 10000 ** (torch.arange(0, dim, 2) / dim))
    emb = torch.cat([angles, angles], -1)
    cos, sin = emb.cos().contiguous(), emb.sin().contiguous()
    q_norm, k_norm = (torch.randn(dim, generator=gen), torch.randn(dim, generator=gen)) if norms else (None, None)
    scale = 1 / math.sqrt(dim)

    def run(cuts):
        k, v, outs, at = k_cache.clone(), v_cache.clone(), [], 0
        for n in cuts:
            piece = slice(at, at + n)
            outs.append(kernel.ops.decode_attention(
                qkv[piece].contiguous(), positions[:, piece].contiguous(), tables, k, v, cos[:, piece].contiguous(),
                sin[:, piece].contiguous(), q_norm, k_norm, 1e-6, 1.0, heads, scale, window))
            at += n
        return torch.cat(outs), k, v

    whole, k_whole, v_whole = run([T])
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref = reference_attention(qkv.view(1, T, -1).reshape(T, -1), positions, tables, ref_k, ref_v, cos, sin, q_norm,
                              k_norm, 1e-6, 1.0, heads, scale, window)
    torch.testing.assert_close(whole, ref, rtol=1e-5, atol=1e-5)
    for cuts in ([1] * 5 + [65], [16] * 4 + [6], [17, 17, 36], [36, 1, 33]):
        out, k, v = run(cuts)
        assert torch.equal(out, whole) and torch.equal(k, k_whole) and torch.equal(v, v_whole), cuts


@pytest.mark.parametrize("heads,kv_heads,dim,norms,window", [(9, 3, 64, False, 0), (4, 1, 256, True, 24)])
def test_ragged_rows_get_the_bits_of_each_sequence_alone(kernel, heads, kv_heads, dim, norms, window):
    """A step's rows of different lengths in one call (row_seqs names each token's block table): two
    decode rows, a verify row of 4 and a 40-token prompt chunk, each output row and cache entry the
    same bits as that sequence's rows in a call of their own. (A chunk rides in a decode step.)"""
    gen = torch.Generator().manual_seed(dim + heads)
    bs, num_blocks = 16, 24
    starts, lengths = [30, 7, 50, 18], [1, 1, 4, 40]
    tables = (torch.randperm(num_blocks - 1, generator=gen) + 1)[:4 * 5].view(4, 5)
    k_cache, v_cache = torch.randn(2, num_blocks, kv_heads, bs, dim, generator=gen)
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)])[None]
    row_seqs = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))
    N = positions.shape[1]
    qkv = torch.randn(N, (heads + 2 * kv_heads) * dim, generator=gen)
    angles = positions[..., None].float() * (1.0 / 10000 ** (torch.arange(0, dim, 2) / dim))
    emb = torch.cat([angles, angles], -1)
    cos, sin = emb.cos().contiguous(), emb.sin().contiguous()
    q_norm, k_norm = (torch.randn(dim, generator=gen), torch.randn(dim, generator=gen)) if norms else (None, None)
    scale = 1 / math.sqrt(dim)
    k, v = k_cache.clone(), v_cache.clone()
    ragged = kernel.ops.decode_attention(qkv, positions, tables, k, v, cos, sin, q_norm, k_norm, 1e-6, 1.0,
                                               heads, scale, window, row_seqs)
    k_alone, v_alone, outs, at = k_cache.clone(), v_cache.clone(), [], 0
    for b, n in enumerate(lengths):
        piece = slice(at, at + n)
        outs.append(kernel.ops.decode_attention(
            qkv[piece].contiguous(), positions[:, piece].contiguous(), tables[b:b + 1].contiguous(), k_alone, v_alone,
            cos[:, piece].contiguous(), sin[:, piece].contiguous(), q_norm, k_norm, 1e-6, 1.0, heads, scale, window))
        at += n
    assert torch.equal(ragged, torch.cat(outs))
    assert torch.equal(k, k_alone) and torch.equal(v, v_alone)
    with pytest.raises(RuntimeError, match="row_seqs"):  # a row naming a table the step doesn't have
        kernel.ops.decode_attention(qkv, positions, tables, k, v, cos, sin, q_norm, k_norm, 1e-6, 1.0, heads,
                                          scale, window, row_seqs + 1)


def test_attention_refuses_positions_and_blocks_outside_the_cache(kernel):
    k_cache, v_cache = torch.zeros(2, 1, 8, 16), torch.zeros(2, 1, 8, 16)  # 2 blocks of 8
    qkv, trig = torch.zeros(1, 3 * 16), torch.zeros(1, 1, 16)
    for positions, table, match in [([[8]], [[1]], "position"), ([[-1]], [[1]], "position"),
                                    ([[0]], [[2]], "block id"), ([[0]], [[-1]], "block id")]:
        with pytest.raises(RuntimeError, match=match):
            kernel.ops.decode_attention(qkv, torch.tensor(positions), torch.tensor(table), k_cache, v_cache,
                                              trig, trig, None, None, 1e-6, 0.0, 1, 0.25, 0)


@pytest.mark.parametrize("name", ["random:tiny-llama", "random:tiny-qwen3", "random:tiny-gemma3"])
def test_a_model_on_the_kernels_matches_its_pytorch_path(name, kernel):
    """Prefill, then decode and verify-sized steps (tiny-gemma3: sliding window 8), both paths."""
    config, state = load_state_dict(resolve_model(name))
    model = build_model(config, state)
    model.fuse_projections()
    pack_linears(model, kernel)
    assert model.cpu_kernels
    a = model.args
    ids = torch.randint(3, a.vocab_size, (2, 30), generator=torch.Generator().manual_seed(0))
    outs = {}
    for kernels in (True, False):
        model.cpu_kernels = kernels
        cache = KVCache(a.num_layers, 12, 8, a.num_kv_heads, a.head_dim, torch.float32)
        slots = torch.tensor([[7, 2, 9, 4, 11], [1, 5, 3, 10, 6]])  # block tables, 5 blocks of 8 each
        with torch.no_grad():
            steps = [model(ids[:, :20], torch.arange(20).expand(2, -1), cache, slots)]
            steps += [model(ids[:, p:p + 1], torch.tensor([[p], [p]]), cache, slots) for p in range(20, 25)]
            steps.append(model(ids[:, 25:30], torch.arange(25, 30).expand(2, -1), cache, slots))
        outs[kernels] = torch.cat(steps, 1)
    rel = (outs[True] - outs[False]).abs().max() / outs[False].abs().max()
    assert rel < 1e-5, f"max relative difference {rel:.2e}"


@pytest.mark.parametrize("name", ["random:tiny-llama", "random:tiny-qwen3", "random:tiny-gemma3",
                                  "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_whole_layers_in_one_call_give_the_per_op_kernel_path_bit_for_bit(name, cpu_isa):
    """csrc/decode_layer.cpp runs the same kernels in the same order: decode and verify steps,
    dense float32 weights (the random models) and packed GGUF blocks (SmolLM2)."""
    from engine.worker import ModelWorker

    worker = ModelWorker(resolve_model(name), 12, 8, torch.float32, cpu_isa=cpu_isa)
    model = worker.model
    assert model.decode_layers is not None and len(model.decode_layers) == model.args.num_layers
    ids = torch.randint(3, min(1000, model.args.vocab_size), (2, 30), generator=torch.Generator().manual_seed(1))
    layers = model.decode_layers
    outs = {}
    for whole in (True, False):
        model.decode_layers = layers if whole else None
        worker.cache.k = [t.zero_() for t in worker.cache.k]
        slots = torch.tensor([[3, 8, 1, 11], [2, 9, 5, 7]])  # block tables
        with torch.no_grad():
            steps = [model(ids[:, :20], torch.arange(20).expand(2, -1), worker.cache, slots)]
            steps += [model(ids[:, p:p + 1], torch.tensor([[p], [p]]), worker.cache, slots) for p in range(20, 24)]
            steps.append(model(ids[:, 24:30], torch.arange(24, 30).expand(2, -1), worker.cache, slots))
        outs[whole] = torch.cat(steps, 1)
    assert torch.equal(outs[True].view(torch.int32), outs[False].view(torch.int32))


@needs_kernels
def test_without_the_kernels_a_model_runs_on_pytorch_ops(monkeypatch):
    """cpu_kernels=False (what a machine without AVX2 or a compiler gets by itself; also
    TANDEM_CPU_KERNELS=0 in the environment): no decode-layer kernels are used, and a packed model
    still decodes, to the same greedy tokens as with them."""
    from engine import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for kernels, env in ((True, None), (False, None), (None, "0")):
        if env is not None:
            monkeypatch.setenv("TANDEM_CPU_KERNELS", env)
        llm = LLM(model="random:tiny-gemma3", **({} if kernels is None else {"cpu_kernels": kernels}))
        model = llm.core.executor.target.worker.model
        on = kernels is not False and env is None
        assert llm.config.cpu_kernels is on
        assert model.cpu_kernels is on and (model.decode_layers is not None) is on
        outputs[(kernels, env)] = llm.generate("hello there", params)[0].outputs[0].token_ids
    assert len(set(map(tuple, outputs.values()))) == 1
