"""Linear layers on the fastest kernel the device has, chosen once at load time.

On CPU, oneDNN with a pre-packed weight keeps a verify step of K+1 rows close to the cost of
one row (MKL's small-M sgemm costs ~2.3x its matrix-vector path here; see benchmarks/decode_step.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(x: Tensor, layer: nn.Linear) -> Tensor:
    packed = getattr(layer, "packed_weight", None)
    if packed is None:
        return F.linear(x, layer.weight, layer.bias)
    flat = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(flat, packed, layer.bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


def pack_linears(model: nn.Module) -> int:
    """Give every float32 CPU nn.Linear a oneDNN-packed copy of its weight. Returns how many.

    The dense weight is released unless another module shares it (a tied LM head keeps the
    embedding table).
    """
    if not onednn_available():
        return 0
    shared = {id(p) for name, p in model.named_parameters(remove_duplicate=False)
              if not name.endswith(("_proj.weight", "lm_head.weight"))}
    count = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.weight.device.type == "cpu" \
                and module.weight.dtype == torch.float32:
            module.packed_weight = module.weight.detach().to_mkldnn()
            if id(module.weight) not in shared:
                module.weight = nn.Parameter(torch.empty(0), requires_grad=False)
            count += 1
    return count
