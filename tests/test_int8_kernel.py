"""GGUF blocks times int8 activations (engine/kernels/csrc/int8_linear.cpp, gguf_weights "int8"): the
packed form holds the file's weights exactly, the kernel computes the documented arithmetic (x rounded
to int8 per 32 values, exact integer dots, float32 scales), a row's result never depends on the rows
beside it or the thread count, and whole models stay lossless: plain and speculative decoding agree
token for token, 1-token and K+1-token steps bit for bit."""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.gguf_blocks import BlockWeight, Int8Blocks
from engine.models.linear import BlockLinear
from engine.models.loading import resolve_model
from engine.kernels import MAX_ROWS
from engine.worker import ModelWorker
from conftest import KERNEL_TARGETS, needs_kernels
from engine import kernels as cpu_kernels
from test_gguf_blocks import FORMATS, GEMMA3, SMOLLM2, TWO_LEVEL, any_weight, logits_of_steps, random_weight

FORMS = sorted(FORMATS) + sorted(TWO_LEVEL)



def int8_reference(x: torch.Tensor, weight) -> torch.Tensor:
    """The kernel's arithmetic in float64: per 32 values of a row s = max|x| / 127 and xq = round(x / s)
    (as float32 ops, ties to even), then sum_j W_j * s * xq_j with W the exact block weights."""
    m, k = x.shape
    blocks = x.view(m, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = amax / 127.0
    # a float32 division, as the kernel's (torch's 127.0 / tensor multiplies by a reciprocal: a tie such as
    # -30.5 then rounds the other way)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(blocks * inv)
    q = weight.q.double()
    so = weight.scale_offset.double()
    w = (so[..., :1] * q.view(q.shape[0], -1, weight.group) + so[..., 1:]).view(q.shape)  # exact in float64
    return (xq.double() * scale.double()).view(m, k) @ w.T


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_computes_the_int8_arithmetic(kernel, form, with_bias):
    gen = torch.Generator().manual_seed(len(form) + 1)
    n, k = 99, 3 * 256  # 99 rows: the last tile of 16 is padded
    weight = any_weight(form, n, k, gen)
    packed = Int8Blocks.of(weight)
    assert packed.shape == weight.shape and packed.two_level == (form in TWO_LEVEL)
    assert torch.equal(packed.dequantize(), weight.dequantize())  # the file's weights, exactly
    rows = torch.tensor([[98, 0], [5, 97]])
    assert torch.equal(packed.dequantize(rows), weight.dequantize()[rows])  # an embedding lookup
    bias = torch.randn(n, generator=gen) if with_bias else None
    for m in (1, 5, 8, 9, 70):
        x = torch.randn(m, k, generator=gen)
        x[0, :32] = 0.0  # a block of zeros: scale 0
        out = kernel.ops.int8_linear(x, packed.u, packed.dm, packed.lo, packed.rows, packed.max_code, bias)
        ref = int8_reference(x, weight) + (bias.double() if with_bias else 0)
        # float32 sums of ~K terms: relative to the largest output
        assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max(), f"m={m}"
        # and close to the float32 product: x's rounding is at most 1/254 of each block's largest value
        exact = x.double() @ weight.dequantize().double().T + (bias.double() if with_bias else 0)
        assert (out.double() - exact).abs().max() <= 0.02 * exact.abs().max(), f"m={m}"


@pytest.mark.skipif(len(KERNEL_TARGETS) < 2, reason="this CPU runs one kernel target: nothing to compare it with")
@pytest.mark.parametrize("form", FORMS)
def test_every_target_computes_the_same_bits(form):
    """The integer sums are exact and each output's float steps run in one order on every target: the AVX2
    build (vpmaddubsw, the sign trick for codes of 128 and up) equals the AVX-512 VNNI one bit for bit."""
    gen = torch.Generator().manual_seed(7)
    weight = any_weight(form, 70, 512, gen)
    packed = Int8Blocks.of(weight)
    bias = torch.randn(70, generator=gen)
    for m in (1, 3, 8, 13):
        x = torch.randn(m, 512, generator=gen) * 3
        outs = {name: cpu_kernels.load(name).ops.int8_linear(x, packed.u, packed.dm, packed.lo, packed.rows,
                                                               packed.max_code, bias) for name in KERNEL_TARGETS}
        first = outs[KERNEL_TARGETS[0]]
        for name, out in outs.items():
            assert torch.equal(out, first), f"{name} differs from {KERNEL_TARGETS[0]} at m={m}"


def test_a_row_does_not_depend_on_the_other_rows_or_the_threads(kernel):
    gen = torch.Generator().manual_seed(0)
    weight = random_weight(*FORMATS["4-bit, float32 pairs (Q4_K)"], 1000, 640, gen)
    packed = Int8Blocks.of(weight)
    x = torch.randn(100, 640, generator=gen)
    full = kernel.ops.int8_linear(x, packed.u, packed.dm, packed.lo, packed.rows, packed.max_code, None)
    for m in (1, 2, 5, 7, 8, 9, 17, 64, 99):
        part = kernel.ops.int8_linear(x[:m].contiguous(), packed.u, packed.dm, packed.lo, packed.rows, packed.max_code, None)
        assert torch.equal(part, full[:m]), f"rows 0..{m - 1} differ when computed {m} at a time"
    alone = kernel.ops.int8_linear(x[37:38].contiguous(), packed.u, packed.dm, packed.lo, packed.rows, packed.max_code, None)
    assert torch.equal(alone, full[37:38])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(kernel.ops.int8_linear(x, packed.u, packed.dm, packed.lo, packed.rows, packed.max_code, None), full)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("form,bytes_per_weight", [("4-bit from 0, float16 pairs (Q4_1)", 0.625),
                                                   ("int8, float16 scales only (Q8_0)", 1.0625),
                                                   ("4-bit from -8, scales only (Q4_0)", 0.5625),
                                                   # 4 bits, 2 x 6-bit codes held in bytes per 32, 2 floats per 256
                                                   ("4-bit, two-level pairs (Q4_K)", 4.75 / 8),
                                                   ("5-bit, two-level pairs (Q5_K)", 8.75 / 8),
                                                   ("6-bit, two-level scales (Q6_K)", 8.625 / 8)])
def test_packing_takes_the_files_own_bytes_where_exact(form, bytes_per_weight):
    weight = any_weight(form, 64, 256, torch.Generator().manual_seed(0))
    assert Int8Blocks.of(weight).nbytes == bytes_per_weight * 64 * 256


@pytest.mark.parametrize("form", sorted(TWO_LEVEL))
def test_two_level_scales_give_the_one_level_bits(kernel, form):
    """A k-quant's scales as D * c in the kernel are the float32 products the one-level form stores: the
    outputs are equal bit for bit, in fewer bytes; scales that don't factor exactly keep one level."""
    gen = torch.Generator().manual_seed(11)
    weight = any_weight(form, 50, 768, gen)
    two, one = Int8Blocks.of(weight), Int8Blocks.of(BlockWeight(weight.q, weight.scale_offset, weight.group))
    assert two.two_level and not one.two_level and two.nbytes < one.nbytes and two.group == one.group
    for m in (1, 4, 9):
        x = torch.randn(m, 768, generator=gen)
        a, b = (kernel.ops.int8_linear(x, p.u, p.dm, p.lo, p.rows, p.max_code, None) for p in (two, one))
        assert torch.equal(a, b), f"m={m}"
    off = BlockWeight(weight.q, weight.scale_offset.clone(), weight.group, weight.two_level)
    off.scale_offset[3, 1, 0] = torch.nextafter(off.scale_offset[3, 1, 0], torch.tensor(1e30))
    assert not Int8Blocks.of(off).two_level  # one scale off by an ulp: the file's products are the truth


def test_kernel_refuses_bad_shapes(kernel):
    packed = Int8Blocks.of(random_weight(*FORMATS["int8, float32 pairs"], 16, 64, torch.Generator().manual_seed(0)))
    u, dm = packed.u, packed.dm
    with pytest.raises(RuntimeError, match="does not match x"):
        kernel.ops.int8_linear(torch.randn(2, 96), u, dm, 0, 16, 255, None)
    with pytest.raises(RuntimeError, match="rows"):
        kernel.ops.int8_linear(torch.randn(2, 64), u, dm, 0, 17, 255, None)
    with pytest.raises(RuntimeError, match="u must be"):
        kernel.ops.int8_linear(torch.randn(2, 64), u.flatten(0, 1), dm, 0, 16, 255, None)
    with pytest.raises(RuntimeError, match="dm must be"):
        kernel.ops.int8_linear(torch.randn(2, 64), u, torch.zeros(1, 2, 3, 16), 0, 16, 255, None)
    with pytest.raises(RuntimeError, match="dm must be"):
        kernel.ops.int8_linear(torch.randn(2, 64), u, dm.to(torch.int32), 0, 16, 255, None)
    with pytest.raises(RuntimeError, match="multiple of 256"):  # int8 dm: two levels, 256-weight blocks
        kernel.ops.int8_linear(torch.randn(2, 64), u, torch.zeros(1, 2, 2, 16, dtype=torch.int8), 0, 16, 255, None)
    with pytest.raises(RuntimeError, match="bias"):
        kernel.ops.int8_linear(torch.randn(2, 64), u, dm, 0, 16, 255, torch.zeros(3))
    with pytest.raises(RuntimeError, match="max_code"):
        kernel.ops.int8_linear(torch.randn(2, 64), u, dm, 0, 16, 256, None)


@needs_kernels
@pytest.mark.parametrize("model", [SMOLLM2, GEMMA3])
def test_a_model_on_int8_stays_close_to_float32(model):
    """Every quantized layer runs on the int8 kernel, in every step kind (prefill, decode, verify). On
    these random tokens (harder than text) the measured mean KL of the float32 distribution from ours is
    0.0066 (SmolLM2) and 0.022 (Gemma 3), greedy tokens agree at 89-90%: the bounds leave ~2x room."""
    source = resolve_model(model)
    on_int8 = ModelWorker(source, 2 * MAX_ROWS // 16 + 1, 16, torch.float32, gguf_weights="int8")
    on_float32 = ModelWorker(source, 2 * MAX_ROWS // 16 + 1, 16, torch.float32, gguf_weights="float32")
    blocks = [m for m in on_int8.model.modules() if isinstance(m, BlockLinear)]
    assert blocks and all(isinstance(m.blocks, Int8Blocks) for m in blocks)
    got = torch.cat([s[0] for s in logits_of_steps(on_int8)])
    want = torch.cat([s[0] for s in logits_of_steps(on_float32)])
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="none")
    assert kl.sum(-1).mean() < 0.05
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.85
    assert (got - want).abs().max() < 8  # the largest logits are ~35-40


def test_a_verify_step_gives_each_row_the_bits_of_a_one_token_step(cpu_isa):
    """The verify step of K+1 = 5 tokens against 5 single-token steps from the same cache."""
    source = resolve_model(GEMMA3)
    worker = ModelWorker(source, 8, 16, torch.float32, gguf_weights="int8", cpu_isa=cpu_isa)
    model, slots = worker.model, torch.arange(1, 8)[None]
    tokens = torch.randint(0, 1000, (1, 45), generator=torch.Generator().manual_seed(5))
    model(tokens[:, :40], torch.arange(40)[None], worker.cache, slots)
    verify = model(tokens[:, 40:], torch.arange(40, 45)[None], worker.cache, slots)
    singles = [model(tokens[:, p:p + 1], torch.tensor([[p]]), worker.cache, slots) for p in range(40, 45)]
    assert torch.equal(verify[0], torch.cat([s[0] for s in singles]))


@needs_kernels
def test_speculative_decoding_on_int8_equals_plain_decoding_on_int8():
    """Gemma 3 <- SmolLM2 (TLI), K=3, both on the int8 kernel: the target's tokens and logprobs are
    those of plain decoding, whatever the draft proposes."""
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=1, ignore_eos=True)
    prompts = ["The capital of France is", "def fib(n):"]
    spec = {"model": SMOLLM2, "num_speculative_tokens": 3, "use_heterogeneous_vocab": True}

    def runs(llm):
        return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                for o in llm.generate(prompts, params)]
    assert runs(LLM(model=GEMMA3, max_model_len=256, gguf_weights="int8", speculative_config=spec)) == \
        runs(LLM(model=GEMMA3, max_model_len=256, gguf_weights="int8"))
