"""Our small-M float32 linear kernel (engine/kernels/csrc/skinny_linear.cpp), on every target this CPU runs,
and how the kernels are chosen: a forced target, none, a CPU whose OS refuses them."""
import pytest
import torch

from engine.models.linear import PackedLinear, pack_linears
from conftest import KERNEL_TARGETS, needs_kernels
from engine import kernels as cpu_kernels
from engine.kernels import MAX_ROWS


@pytest.mark.parametrize("n,k", [(960, 576), (100, 37), (7, 16), (1, 1000), (13, 2051)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64_reference(kernel, n, k, with_bias):
    gen = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if with_bias else None
    for m in (1, 2, 5, 6, 7, 13, MAX_ROWS):
        x = torch.randn(m, k, generator=gen)
        ref = x.double() @ w.double().T + (b.double() if with_bias else 0)
        out = kernel.ops.skinny_linear(x, w, b)
        assert out.shape == (m, n)
        rel = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        assert rel < 1e-5, f"m={m}: relative error {rel:.1e}"


def test_a_row_does_not_depend_on_the_other_rows(kernel):
    """A 1-token step and a K+1-token step must give the same bits for the same input row, so
    greedy speculation reproduces plain decoding exactly."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3072, 576, generator=gen)
    x = torch.randn(MAX_ROWS, 576, generator=gen)
    full = kernel.ops.skinny_linear(x, w, None)
    for m in range(1, MAX_ROWS + 1):
        part = kernel.ops.skinny_linear(x[:m].contiguous(), w, None)
        assert torch.equal(part, full[:m]), f"rows 0..{m - 1} differ when computed {m} at a time"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(kernel.ops.skinny_linear(x, w, None), full), "depends on the thread count"
    finally:
        torch.set_num_threads(threads)


def test_bad_shapes_are_refused(kernel):
    w = torch.randn(8, 32)
    with pytest.raises(RuntimeError, match="matching x"):
        kernel.ops.skinny_linear(torch.randn(2, 31), w, None)
    with pytest.raises(RuntimeError, match="bias"):
        kernel.ops.skinny_linear(torch.randn(2, 32), w, torch.randn(7))


def test_linear_uses_both_kernels_and_they_agree(kernel):
    layer = torch.nn.Linear(64, 48, bias=True)
    model = torch.nn.Sequential(layer)
    assert pack_linears(model, kernel) == 1
    assert isinstance(model[0], PackedLinear) and model[0].skinny
    for rows in (1, 5, MAX_ROWS, MAX_ROWS + 1, 100):  # skinny kernel, then oneDNN
        x = torch.randn(rows, 64)
        ref = x.double() @ layer.weight.double().T + layer.bias.double()
        rel = ((model[0](x).double() - ref).abs().max() / ref.abs().max()).item()
        assert rel < 1e-5


def test_without_the_kernel_a_tied_lm_head_runs_on_onednn():
    """pack_linears without the kernel (cpu_kernels off, or no AVX-512, no compiler): every linear,
    including an LM head that keeps its dense weight because the embedding shares it, runs on oneDNN."""
    from torch import nn

    from engine.models.linear import pack_linears

    model = nn.Module()
    model.embed = nn.Embedding(50, 16)
    model.lm_head = nn.Linear(16, 50, bias=False)
    model.lm_head.weight = model.embed.weight
    assert pack_linears(model, None) == 1
    assert isinstance(model.lm_head, PackedLinear) and not model.lm_head.skinny
    assert model.lm_head.weight is model.embed.weight  # kept: the embedding shares it
    x = torch.randn(3, 16)
    assert torch.allclose(model.lm_head(x), x @ model.embed.weight.T, atol=1e-5)


@needs_kernels
def test_a_cpu_whose_os_refuses_the_instructions_falls_back_with_a_log_line(tmp_path):
    """A machine where a process can't run the kernels (the child process that tries each target died
    with SIGILL, as on a CPU listing AVX-512 that the OS doesn't enable): no library is loaded, a warning
    says why, and an engine still generates, on PyTorch and oneDNN."""
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    # cpu_isa auto (the fallback is auto's): a TANDEM_CPU_ISA of the caller's would force one target
    env = {**{k: v for k, v in os.environ.items() if k != "TANDEM_CPU_ISA"}, "TANDEM_CACHE_DIR": str(tmp_path)}
    script = textwrap.dedent("""
        import hashlib, logging
        logging.basicConfig(level=logging.WARNING)
        from engine.kernels import build, choose, targets
        features = " ".join(sorted(targets.cpu_features()))
        for target in targets.cpu_runs():
            _, build_dir = build.library(target)
            build_dir.mkdir(parents=True)
            (build_dir / f"runs-{hashlib.sha256(features.encode()).hexdigest()[:12]}").write_text("signal 4")
        assert choose() is None
        assert not list((build_dir.parent).glob("*/*.so"))  # never built, never loaded
        from engine import LLM, SamplingParams
        llm = LLM(model="random:tiny-llama:1", max_model_len=64)
        assert llm.core.executor.target.worker.model.decode_layers is None
        out = llm.generate("hello there", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                         cwd=str(Path(cpu_kernels.__file__).resolve().parents[2]))
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]
    assert "unusable: a process here could not build or run it (signal 4)" in run.stderr
    assert "none runs here" in run.stderr


def test_a_forced_target_is_that_target_or_a_clear_error():
    """cpu_isa names a target: that build, or (where the CPU lacks its instructions) a ValueError naming
    what is missing and what runs here; none turns the kernels off; auto takes the best."""
    from engine.kernels.targets import TARGETS, missing

    assert cpu_kernels.choose("none") is None
    for target in TARGETS:
        if missing(target):
            with pytest.raises(ValueError, match=f"cpu_isa {target.name}: this CPU has no .*targets this CPU runs"):
                cpu_kernels.choose(target.name)
        else:
            assert cpu_kernels.choose(target.name).name == target.name
    best = cpu_kernels.choose("auto")
    assert (best.name if best else None) == (KERNEL_TARGETS[0] if KERNEL_TARGETS else None)
    with pytest.raises(ValueError, match="cpu_isa must be one of"):
        cpu_kernels.choose("sse2")
