"""Our small-M float32 linear kernel (engine/models/csrc/skinny_linear.cpp)."""
import pytest
import torch

from engine.models.linear import PackedLinear, pack_linears
from engine.models.skinny import MAX_ROWS, skinny_kernel_available

pytestmark = pytest.mark.skipif(not skinny_kernel_available(), reason="no AVX-512 or no compiler on this machine")


@pytest.mark.parametrize("n,k", [(960, 576), (100, 37), (7, 16), (1, 1000), (13, 2051)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64_reference(n, k, with_bias):
    gen = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if with_bias else None
    for m in (1, 2, 5, 6, 7, 13, MAX_ROWS):
        x = torch.randn(m, k, generator=gen)
        ref = x.double() @ w.double().T + (b.double() if with_bias else 0)
        out = torch.ops.tandem.skinny_linear(x, w, b)
        assert out.shape == (m, n)
        rel = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        assert rel < 1e-5, f"m={m}: relative error {rel:.1e}"


def test_a_row_does_not_depend_on_the_other_rows():
    """A 1-token step and a K+1-token step must give the same bits for the same input row, so
    greedy speculation reproduces plain decoding exactly."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3072, 576, generator=gen)
    x = torch.randn(MAX_ROWS, 576, generator=gen)
    full = torch.ops.tandem.skinny_linear(x, w, None)
    for m in range(1, MAX_ROWS + 1):
        part = torch.ops.tandem.skinny_linear(x[:m].contiguous(), w, None)
        assert torch.equal(part, full[:m]), f"rows 0..{m - 1} differ when computed {m} at a time"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(torch.ops.tandem.skinny_linear(x, w, None), full), "depends on the thread count"
    finally:
        torch.set_num_threads(threads)


def test_bad_shapes_are_refused():
    w = torch.randn(8, 32)
    with pytest.raises(RuntimeError, match="matching x"):
        torch.ops.tandem.skinny_linear(torch.randn(2, 31), w, None)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.tandem.skinny_linear(torch.randn(2, 32), w, torch.randn(7))


def test_linear_uses_both_kernels_and_they_agree():
    layer = torch.nn.Linear(64, 48, bias=True)
    model = torch.nn.Sequential(layer)
    assert pack_linears(model, skinny=True) == 1
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
    assert pack_linears(model, skinny=False) == 1
    assert isinstance(model.lm_head, PackedLinear) and not model.lm_head.skinny
    assert model.lm_head.weight is model.embed.weight  # kept: the embedding shares it
    x = torch.randn(3, 16)
    assert torch.allclose(model.lm_head(x), x @ model.embed.weight.T, atol=1e-5)


def test_a_cpu_whose_os_refuses_the_instructions_falls_back_with_a_log_line(tmp_path):
    """A machine where a process can't run the kernels (the child process that tries them died with
    SIGILL, as on a CPU listing AVX-512 that the OS doesn't enable): the library is never loaded, a
    warning says why, and an engine still generates, on oneDNN."""
    import os
    import subprocess
    import sys
    import textwrap

    from engine.models import skinny

    env = {**os.environ, "TANDEM_CACHE_DIR": str(tmp_path)}
    script = textwrap.dedent("""
        import hashlib, logging, os
        from pathlib import Path
        logging.basicConfig(level=logging.WARNING)
        from engine.models import skinny
        _, build_dir = skinny._library()
        flags = next(l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags"))
        build_dir.mkdir(parents=True)
        (build_dir / f"runs-{hashlib.sha256(flags.encode()).hexdigest()[:12]}").write_text("signal 4")
        from engine import LLM, SamplingParams
        assert not skinny.skinny_kernel_available()
        assert not list(build_dir.glob("*.so"))  # never built, never loaded
        llm = LLM(model="random:tiny-llama:1", max_model_len=64)
        out = llm.generate("hello there", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                         cwd=str(skinny.Path(skinny.__file__).resolve().parents[2]))
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]
    assert "unusable on this machine (signal 4)" in run.stderr
