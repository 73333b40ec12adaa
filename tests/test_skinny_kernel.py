"""Our small-M float32 linear kernel (engine/models/csrc/skinny_linear.cpp)."""
import pytest
import torch

from engine.models.linear import linear, pack_linears
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
    torch.set_num_threads(1)
    try:
        assert torch.equal(torch.ops.tandem.skinny_linear(x, w, None), full), "depends on the thread count"
    finally:
        torch.set_num_threads(2)


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
    for rows in (1, 5, MAX_ROWS, MAX_ROWS + 1, 100):  # skinny kernel, then oneDNN
        x = torch.randn(rows, 64)
        ref = x.double() @ layer.weight.double().T + layer.bias.double()
        rel = ((linear(x, layer).double() - ref).abs().max() / ref.abs().max()).item()
        assert rel < 1e-5
