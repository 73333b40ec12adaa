"""Linear layers on the fastest CPU kernel for the step's row count, chosen per call.

- up to skinny.MAX_ROWS rows (decode and verify steps, short prompts): our AVX-512 kernel. It reads each weight
  line once for all rows, so a verify step of K+1 tokens costs little more than a decode step, and
  a row's result does not depend on the other rows (1-token and K+1-token steps agree bit for bit).
- more rows (prefill): oneDNN with a pre-packed weight (MKL's sgemm is 2-3x slower here).

Both need their own copy of the weight, so float32 linears on CPU hold their weights twice.
A GGUF model's quantized linears and embedding instead hold blocks (`use_blocks`, gguf_blocks.py;
packed by `pack_linears` into the kernel's layout, at the file's own bytes where exact): the block
kernel for small steps, the weight dequantized for the call in prefill; bit-identical to the float32
layers. Other dtypes and devices use F.linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.models.gguf_blocks import BlockWeight, PackedBlocks
from engine.models.skinny import MAX_ROWS, skinny_kernel_available


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(x: Tensor, layer: nn.Linear) -> Tensor:
    blocks = getattr(layer, "blocks", None)
    if blocks is not None:
        if isinstance(blocks, BlockWeight):  # not through pack_linears: pack on first use
            blocks = layer.blocks = blocks.packed()
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] <= MAX_ROWS:
            out = torch.ops.tandem.block_linear(flat.contiguous(), blocks.q, blocks.scale_offset, blocks.zero,
                                                blocks.rows, layer.bias)
        else:  # prefill: the float32 path's own oneDNN call, on this call's dequantized copy
            weight = torch.ops.tandem.block_dequantize(blocks.q, blocks.scale_offset, blocks.zero, blocks.rows)
            out = torch.ops.mkldnn._linear_pointwise(flat, weight, layer.bias, "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1])
    packed = getattr(layer, "packed_weight", None)
    if packed is None:
        return F.linear(x, layer.weight, layer.bias)
    flat = x.reshape(-1, x.shape[-1])
    if layer.skinny and flat.shape[0] <= MAX_ROWS:
        out = torch.ops.tandem.skinny_linear(flat.contiguous(), layer.weight, layer.bias)
    else:
        out = torch.ops.mkldnn._linear_pointwise(flat, packed, layer.bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


def embedding(tokens: Tensor, layer: nn.Embedding) -> Tensor:
    blocks = getattr(layer, "blocks", None)
    return layer(tokens) if blocks is None else blocks.dequantize(tokens)


def out_features(layer: nn.Linear) -> int:
    blocks = getattr(layer, "blocks", None)
    return (blocks if blocks is not None else layer.weight).shape[0]


def set_blocks(layer: nn.Module, blocks: BlockWeight | None) -> None:
    """Give a linear or embedding its weights as blocks (releasing the float32 copy), or, with
    None, back as float32."""
    if blocks is None:
        old = getattr(layer, "blocks", None)
        if old is not None:
            layer.weight = nn.Parameter(old.dequantize(), requires_grad=False)
    else:
        layer.weight = nn.Parameter(torch.empty(0), requires_grad=False)
    layer.blocks = blocks


def use_blocks(model: nn.Module, blocks: dict[str, BlockWeight]) -> int:
    """Swap the float32 weights of `model` (a Transformer, before sharding) named in `blocks`
    for those blocks; a tied LM head shares the embedding's. Returns the bytes the blocks take."""
    modules = dict(model.named_modules())
    for name, weight in blocks.items():
        set_blocks(modules[name.removesuffix(".weight")], weight)
    embed, head = model.model.embed_tokens, model.lm_head
    if model.args.tie_word_embeddings and getattr(embed, "blocks", None) is not None:
        set_blocks(head, embed.blocks)
    return sum(w.nbytes for w in blocks.values())


def pack_linears(model: nn.Module, skinny: bool | None = None) -> int:
    """Prepare every float32 CPU nn.Linear for `linear`. Returns how many.

    Each gets a oneDNN-packed copy of its weight. The dense weight is kept for the skinny kernel
    when that is available (skinny=None: if it builds here), else released unless another module
    shares it (a tied LM head keeps the embedding table). Block weights take their packed form
    (BlockWeight.packed: the same values in fewer bytes).
    """
    if not onednn_available():
        return 0
    if skinny is None:
        skinny = skinny_kernel_available()
    if skinny and hasattr(model, "cpu_kernels"):  # the same library holds the decode layer's other ops
        model.cpu_kernels = True
    packed: dict[int, PackedBlocks] = {}  # a tied LM head shares its embedding's blocks
    for module in model.modules():
        blocks = getattr(module, "blocks", None)
        if isinstance(blocks, BlockWeight):
            if id(blocks) not in packed:
                packed[id(blocks)] = blocks.packed()
            module.blocks = packed[id(blocks)]
    shared = {id(p) for name, p in model.named_parameters(remove_duplicate=False)
              if not name.endswith(("_proj.weight", "lm_head.weight"))}
    count = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and getattr(module, "blocks", None) is None \
                and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32:
            module.packed_weight = module.weight.detach().to_mkldnn()
            module.skinny = skinny
            if skinny:
                module.weight = nn.Parameter(module.weight.detach().contiguous(), requires_grad=False)
            elif id(module.weight) not in shared:
                module.weight = nn.Parameter(torch.empty(0), requires_grad=False)
            count += 1
    if getattr(model, "cpu_kernels", False):
        model.build_decode_layers()
    return count
