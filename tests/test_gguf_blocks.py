"""GGUF weights as blocks (engine/models/gguf_blocks.py, the block kernel in csrc/skinny_linear.cpp):
exact decoding of every GGUF type we read, packed forms (4-bit, float16 scales) that hold the same
values in the file's own bytes, a kernel bit-identical to the float32 one, and whole models whose
outputs equal the float32 path's bit for bit, in a tenth of its memory."""
import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.gguf_blocks import DECODERS, QK_K, BlockWeight, Int8Blocks, TwoLevelScales, decode, read_block_weights
from engine.models.loading import load_state_dict, resolve_model
from engine.kernels import MAX_ROWS
from engine.worker import ModelWorker

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"  # Q4_1 layers, Q8_0 embedding
GEMMA3 = "google/gemma-3-270m"  # Q5_0, Q8_0, Q4_K, Q6_K

from conftest import needs_kernels as needs_kernel  # noqa: E402


def random_blocks(type_name: str, rows: int, blocks_per_row: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes in `type_name`'s layout, with every float16 field a finite number."""
    from gguf.quants import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType[type_name]
    _, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * blocks_per_row, size), dtype=np.uint8)
    f16_fields = {"Q6_K": [208]}.get(type_name, [0, 2] if type_name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else [0])
    for at in f16_fields:
        raw[:, at:at + 2] = np.ascontiguousarray(
            rng.standard_normal(len(raw)).astype(np.float16)).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("type_name", sorted(DECODERS))
def test_every_type_decodes_to_gguf_py_values_bit_for_bit(type_name):
    from gguf import dequantize
    from gguf.quants import GGMLQuantizationType

    raw = random_blocks(type_name, rows=6, blocks_per_row=2, rng=np.random.default_rng(7))
    ours = decode(raw, type_name).dequantize()
    reference = torch.from_numpy(dequantize(raw, GGMLQuantizationType[type_name]).reshape(6, -1).copy())
    assert ours.shape == reference.shape
    assert torch.equal(ours.view(torch.int32), reference.view(torch.int32))


@pytest.mark.parametrize("model", [SMOLLM2, GEMMA3])
def test_our_tensor_table_is_gguf_pys_byte_for_byte(model):
    """engine/models/gguf_file.py reads the tensor table without decoding the metadata (gguf-py's
    reader spends ~13 s on Gemma's vocabulary): same names, types, shapes and bytes."""
    from gguf import GGUFReader

    from engine.models.gguf_file import read_tensors

    path = resolve_model(model).path
    ours, theirs = read_tensors(path), GGUFReader(path).tensors
    assert [(t.name, t.type_name) for t in ours] == [(t.name, t.tensor_type.name) for t in theirs]
    for a, b in zip(ours, theirs):
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype, a.name
        assert np.array_equal(a.data.view(np.uint8), np.asarray(b.data).view(np.uint8)), a.name


def test_a_file_that_is_not_gguf_is_refused_by_name(tmp_path):
    from engine.models.gguf_file import GgufFormatError, read_tensors

    bad = tmp_path / "weights.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(GgufFormatError, match="weights.gguf: not a GGUF file"):
        read_tensors(bad)
    bad.write_bytes(b"GGUF" + (7).to_bytes(4, "little") + bytes(16))
    with pytest.raises(GgufFormatError, match="version 7"):
        read_tensors(bad)


@pytest.mark.parametrize("model,types", [(SMOLLM2, {"Q4_1", "Q8_0"}), (GEMMA3, {"Q5_0", "Q8_0", "Q4_K", "Q6_K"})])
def test_every_quantized_tensor_of_the_embedded_models_is_kept_as_blocks(model, types):
    from engine.models.gguf_file import read_tensors  # gguf-py's own table: the test above

    source = resolve_model(model)
    config, state = load_state_dict(source)
    blocks = read_block_weights(source.path, state, config)
    quantized = [t for t in read_tensors(source.path) if t.type_name in DECODERS]
    assert {t.type_name for t in quantized} == types
    assert len(blocks) == len(quantized)  # none fell back to float32
    for name, weight in blocks.items():  # checked when read; check the check
        assert torch.equal(weight.dequantize(), state[name])
    nbytes = sum(w.nbytes for w in blocks.values())
    assert nbytes < 0.4 * sum(state[name].nbytes for name in blocks)
    # the k-quants' scales factor as their file stores them, and the int8 kernel keeps both levels
    two_level = [w for w in blocks.values() if w.two_level is not None]
    assert len(two_level) == sum(t.type_name.endswith("_K") for t in quantized)
    assert all(Int8Blocks.of(w).two_level for w in two_level)


# (q values, (scale, offset) float16-exact, offsets, group): every packed form the kernel reads
FORMATS = {
    "int8, float32 pairs": (range(-128, 128), False, True, 32),
    "int8, float16 scales only (Q8_0)": (range(-128, 128), True, False, 32),
    "int8, groups of 16 (Q6_K)": (range(-32, 32), False, False, 16),
    "5-bit codes in a byte, float16 scales only (Q5_0)": (range(-16, 16), True, False, 32),
    "4-bit from 0, float16 pairs (Q4_1)": (range(0, 16), True, True, 32),
    "4-bit from -8, scales only (Q4_0)": (range(-8, 8), True, False, 32),
    "4-bit, float32 pairs (Q4_K)": (range(0, 16), False, True, 32),
    "4-bit, groups of 16": (range(0, 16), False, True, 16),
    "int8, groups of 64": (range(-128, 128), False, True, 64),
}


def random_weight(values: range, half: bool, offsets: bool, group: int, n: int, k: int, gen) -> BlockWeight:
    q = torch.randint(values.start, values.stop, (n, k), generator=gen).to(torch.int8)
    so = torch.randn(n, k // group, 2, generator=gen)
    if half:
        so = so.half().float()
    if not offsets:
        so[..., 1] = -0.0
    return BlockWeight(q, so, group)


# (q values, offsets, group): the k-quants, whose scales factor as the file stores them (TwoLevelScales)
TWO_LEVEL = {
    "4-bit, two-level pairs (Q4_K)": (range(0, 16), True, 32),
    "5-bit, two-level pairs (Q5_K)": (range(0, 32), True, 32),
    "6-bit, two-level scales (Q6_K)": (range(-32, 32), False, 16),
}


def random_two_level(values: range, offsets: bool, group: int, n: int, k: int, gen) -> BlockWeight:
    """A k-quant-like weight: float16-valued block floats per 256 weights times 6-bit codes 0..63 (Q4_K,
    Q5_K: d and -dmin) or signed 8-bit ones (Q6_K: d only), scale_offset their float32 products."""
    pairs = 2 if offsets else 1
    q = torch.randint(values.start, values.stop, (n, k), generator=gen).to(torch.int8)
    supers = torch.randn(n, k // QK_K, pairs, generator=gen).half().float()
    codes = torch.randint(0 if offsets else -128, 64 if offsets else 128, (n, k // group, pairs), generator=gen)
    two = TwoLevelScales(supers, codes.to(torch.int8))
    so = two.scale_offset(group)
    if not offsets:
        so = torch.cat([so, torch.full_like(so, -0.0)], dim=-1)
    return BlockWeight(q, so, group, two)


def any_weight(form: str, n: int, k: int, gen) -> BlockWeight:
    return random_two_level(*TWO_LEVEL[form], n, k, gen) if form in TWO_LEVEL else random_weight(*FORMATS[form], n, k, gen)


@pytest.mark.parametrize("form", sorted(TWO_LEVEL))
def test_two_level_scales_follow_every_cut_of_a_weight(form):
    """Splits for tensor parallelism, fused q|k|v rows and row reorders keep a k-quant's two levels where
    they still describe its scales, and drop them (one level, the same weights) where they can't."""
    gen = torch.Generator().manual_seed(3)
    w = random_two_level(*TWO_LEVEL[form], 40, 768, gen)

    def consistent(part: BlockWeight) -> bool:
        two = part.two_level
        return two is not None and torch.equal(two.scale_offset(part.group), part.scale_offset[..., :two.supers.shape[-1]])

    assert consistent(w)
    assert consistent(w.rows(8, 24)) and consistent(w.take(torch.tensor([39, 0, 7])))
    assert consistent(w.cols(256, 768)) and torch.equal(w.cols(256, 768).dequantize(), w.dequantize()[:, 256:])
    assert w.cols(0, 128).two_level is None  # half a 256-weight block
    assert consistent(w.regroup(16)) and torch.equal(w.regroup(16).dequantize(), w.dequantize())
    fused = BlockWeight.cat([w.rows(0, 8), w.rows(8, 40)])
    assert consistent(fused) and torch.equal(fused.dequantize(), w.dequantize())
    offsets = w.two_level.supers.shape[-1] == 2
    other = random_two_level(*TWO_LEVEL["6-bit, two-level scales (Q6_K)" if offsets else "4-bit, two-level pairs (Q4_K)"],
                             8, 768, gen)
    mixed = BlockWeight.cat([w, other])  # a Q4_K beside a Q6_K: their scales stay one level
    assert mixed.two_level is None
    assert torch.equal(mixed.dequantize(), torch.cat([w.dequantize(), other.dequantize()]))


@pytest.mark.parametrize("form", sorted(FORMATS))
@pytest.mark.parametrize("with_bias", [False, True])
def test_block_kernel_equals_the_float32_kernel_bit_for_bit(kernel, form, with_bias):
    gen = torch.Generator().manual_seed(len(form))
    n, k = 99, 4 * 64 + 64  # 99 rows: the last block of 4 is padded
    weight = random_weight(*FORMATS[form], n, k, gen)
    dense = weight.dequantize()
    packed = weight.packed()
    assert packed.shape == weight.shape and torch.equal(packed.dequantize(), dense)
    rows = torch.tensor([[98, 0], [5, 97]])
    assert torch.equal(packed.dequantize(rows), dense[rows])  # an embedding lookup
    bias = torch.randn(n, generator=gen) if with_bias else None
    threads = torch.get_num_threads()
    try:
        for t in {1, threads}:
            torch.set_num_threads(t)
            for m in (1, 2, 5, 6, 7, MAX_ROWS):
                x = torch.randn(m, k, generator=gen)
                out = kernel.ops.block_linear(x, packed.q, packed.scale_offset, packed.zero, packed.rows, bias)
                assert torch.equal(out, kernel.ops.skinny_linear(x, dense, bias)), f"m={m}, threads={t}"
            got = kernel.ops.block_dequantize(packed.q, packed.scale_offset, packed.zero, packed.rows)
            assert torch.equal(got, dense)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("form,bytes_per_weight", [("4-bit from 0, float16 pairs (Q4_1)", 0.625),
                                                   ("int8, float16 scales only (Q8_0)", 1.0625),
                                                   ("4-bit from -8, scales only (Q4_0)", 0.5625),
                                                   ("int8, float32 pairs", 1.25)])
def test_packing_takes_the_files_own_bytes_where_exact(form, bytes_per_weight):
    weight = random_weight(*FORMATS[form], 64, 256, torch.Generator().manual_seed(0))
    assert weight.packed().nbytes == bytes_per_weight * 64 * 256


def test_block_kernel_refuses_bad_shapes(kernel):
    packed = random_weight(*FORMATS["int8, float32 pairs"], 8, 64, torch.Generator().manual_seed(0)).packed()
    q, so = packed.q, packed.scale_offset
    with pytest.raises(RuntimeError, match="does not match x"):
        kernel.ops.block_linear(torch.randn(2, 48), q, so, 0, 8, None)
    with pytest.raises(RuntimeError, match="rows"):
        kernel.ops.block_linear(torch.randn(2, 64), q, so, 0, 9, None)
    with pytest.raises(RuntimeError, match="q must be"):
        kernel.ops.block_linear(torch.randn(2, 64), q.flatten(0, 1), so, 0, 8, None)
    with pytest.raises(RuntimeError, match="scale_offset"):
        kernel.ops.block_linear(torch.randn(2, 64), q, torch.zeros(2, 3, 4, 2), 0, 8, None)


def logits_of_steps(worker: ModelWorker) -> list[torch.Tensor]:
    """Prefill (the oneDNN path), 1-token decode steps, a 5-token verify step and a 20-token
    prefill (the kernel)."""
    model, n = worker.model, MAX_ROWS + 4
    slots = torch.arange(1, -(-(n + 28) // worker.block_size) + 1)[None]  # the block table of one row
    tokens = torch.randint(0, 1000, (1, n), generator=torch.Generator().manual_seed(3))
    out = [model(tokens, torch.arange(n)[None], worker.cache, slots)]
    for pos in range(n, n + 3):
        out.append(model(tokens[:, pos - n:pos - n + 1], torch.tensor([[pos]]), worker.cache, slots))
    out.append(model(tokens[:, :5], torch.arange(n + 3, n + 8)[None], worker.cache, slots))
    out.append(model(tokens[:, :20], torch.arange(n + 8, n + 28)[None], worker.cache, slots))
    return out


@needs_kernel
@pytest.mark.parametrize("model", [SMOLLM2, GEMMA3])
def test_a_model_on_blocks_gives_the_float32_logits_bit_for_bit_in_less_memory(model):
    source = resolve_model(model)
    on_blocks = ModelWorker(source, 2 * MAX_ROWS // 16 + 1, 16, torch.float32, gguf_weights="blocks")
    on_float32 = ModelWorker(source, 2 * MAX_ROWS // 16 + 1, 16, torch.float32, gguf_weights="float32")
    for got, want in zip(logits_of_steps(on_blocks), logits_of_steps(on_float32)):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))

    def weight_bytes(worker):
        tensors = {id(t): t.nbytes for t in worker.model.parameters()}
        for module in worker.model.modules():
            for t in (getattr(module, "packed", None),):
                if t is not None:
                    tensors[id(t)] = t.numel() * 4
            blocks = getattr(module, "blocks", None)
            if blocks is not None:
                tensors[id(blocks.q)] = blocks.nbytes
        return sum(tensors.values())
    # float32 keeps two copies (oneDNN's and the kernel's); the packed blocks take the file's bytes
    assert weight_bytes(on_blocks) < {SMOLLM2: 0.1, GEMMA3: 0.15}[model] * weight_bytes(on_float32)


def greedy_runs(llm: LLM) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=1, ignore_eos=True)
    outs = llm.generate(["The capital of France is", "def fib(n):"], params)
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


@needs_kernel
def test_speculative_decoding_on_blocks_equals_float32_token_for_token_and_logprob_for_logprob():
    """Gemma 3 <- SmolLM2 (TLI), K=3: verify steps of 4 rows, drafts, prefills all on blocks."""
    spec = {"model": SMOLLM2, "num_speculative_tokens": 3, "use_heterogeneous_vocab": True}
    runs = [greedy_runs(LLM(model=GEMMA3, max_model_len=256, gguf_weights=w, speculative_config=spec))
            for w in ("blocks", "float32")]
    assert runs[0] == runs[1]


@needs_kernel
@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_shards_of_blocks_equal_the_float32_shards(rank):
    """Neither embedded model splits over 2 ranks (9 heads; 1 key/value head), so: a random model
    whose linears are blocks, sharded as rank `rank` of 2 (q/k/v, gate/up by rows, o/down by
    columns at block boundaries, then fused), against the same weights in float32."""
    from engine.kv_cache import KVCache
    from engine.models.linear import pack_linears, use_blocks
    from engine.models.loading import build_model
    from engine.models.presets import random_checkpoint
    from engine.models.tp import shard

    config, _, state = random_checkpoint("tiny-llama", 1)
    gen = torch.Generator().manual_seed(rank)
    blocks = {}
    for name, tensor in state.items():
        if name.endswith("_proj.weight"):
            n, k = tensor.shape
            blocks[name] = BlockWeight(torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=gen),
                                       torch.rand(n, k // 16, 2, generator=gen) * 0.1, 16)
            state[name] = blocks[name].dequantize()
    models = []
    for with_blocks in (True, False):
        model = build_model(config, state)
        if with_blocks:
            use_blocks(model, blocks)
        model = shard(model, rank, 2, None)  # no group: each rank's partial sums, compared as they are
        model.fuse_projections()
        pack_linears(model)
        models.append(model)
    assert models[0].model.layers[0].self_attn.o_proj.blocks.shape == (64, 32)
    outs = []
    for model in models:
        cache = KVCache(model.args.num_layers, 2 * MAX_ROWS // 16 + 1, 16, 1, model.args.head_dim, torch.float32, "cpu")
        table = torch.arange(1, 2 * MAX_ROWS // 16 + 1)[None]
        tokens = torch.randint(0, 48, (1, MAX_ROWS + 4), generator=torch.Generator().manual_seed(0))
        outs.append([model(tokens, torch.arange(MAX_ROWS + 4)[None], cache, table),  # oneDNN
                     model(tokens[:, :3], torch.arange(MAX_ROWS + 4, MAX_ROWS + 7)[None], cache, table)])
    for got, want in zip(*outs):
        assert torch.equal(got, want)
