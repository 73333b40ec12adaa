"""Linear layers on the fastest float32 CPU kernel for the step's row count, chosen per call.

- up to skinny.MAX_ROWS rows (decode and verify steps): our AVX-512 kernel. It reads each weight
  line once for all rows, so a verify step of K+1 tokens costs little more than a decode step, and
  a row's result does not depend on the other rows (1-token and K+1-token steps agree bit for bit).
- more rows (prefill): oneDNN with a pre-packed weight (MKL's sgemm is 2-3x slower here).

Both need their own copy of the weight, so float32 linears on CPU hold their weights twice.
Other dtypes and devices use F.linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.models.skinny import MAX_ROWS, skinny_kernel_available


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(x: Tensor, layer: nn.Linear) -> Tensor:
    packed = getattr(layer, "packed_weight", None)
    if packed is None:
        return F.linear(x, layer.weight, layer.bias)
    flat = x.reshape(-1, x.shape[-1])
    if layer.skinny and flat.shape[0] <= MAX_ROWS:
        out = torch.ops.tandem.skinny_linear(flat.contiguous(), layer.weight, layer.bias)
    else:
        out = torch.ops.mkldnn._linear_pointwise(flat, packed, layer.bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


def pack_linears(model: nn.Module, skinny: bool | None = None) -> int:
    """Prepare every float32 CPU nn.Linear for `linear`. Returns how many.

    Each gets a oneDNN-packed copy of its weight. The dense weight is kept for the skinny kernel
    when that is available (skinny=None: if it builds here), else released unless another module
    shares it (a tied LM head keeps the embedding table).
    """
    if not onednn_available():
        return 0
    if skinny is None:
        skinny = skinny_kernel_available()
    shared = {id(p) for name, p in model.named_parameters(remove_duplicate=False)
              if not name.endswith(("_proj.weight", "lm_head.weight"))}
    count = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.weight.device.type == "cpu" \
                and module.weight.dtype == torch.float32:
            module.packed_weight = module.weight.detach().to_mkldnn()
            module.skinny = skinny
            if skinny:
                module.weight = nn.Parameter(module.weight.detach().contiguous(), requires_grad=False)
            elif id(module.weight) not in shared:
                module.weight = nn.Parameter(torch.empty(0), requires_grad=False)
            count += 1
    return count
