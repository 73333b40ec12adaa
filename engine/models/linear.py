"""Linear and embedding layers by weight form, as modules (gpt-fast's quantize.py swaps them in):

- `nn.Linear` / `nn.Embedding`: what a model is built and loaded with; F.linear (other dtypes and
  devices, before packing).
- `PackedLinear` (CPU, float32, after `pack_linears`): up to kernels.MAX_ROWS rows (decode and verify
  steps, short prompts) our small-row kernel (engine/kernels), which reads each weight line once for all rows, so a
  verify step of K+1 tokens costs little more than a decode step, and a row's result does not
  depend on the other rows (1-token and K+1-token steps agree bit for bit); more rows (prefill)
  oneDNN with a pre-packed weight (MKL's sgemm is 2-3x slower here). It holds the weight twice.
- `BlockLinear` / `BlockEmbedding`: a GGUF model's quantized tensors as blocks (gguf_blocks.py;
  `use_blocks` swaps them in, `pack_linears` packs them into a kernel's layout, at the file's own
  bytes where exact). Packed as `Int8Blocks` (gguf_weights "int8"): the int8 kernel for every call,
  any number of rows, activations rounded to int8 per 32 values. Packed as `PackedBlocks`
  ("blocks"): the block kernel for small steps, the weight dequantized for the call in prefill;
  bit-identical to the float32 layers.

Every form answers `in_features` / `out_features`, and `dense()` gives its float32 nn.Linear back (a
tensor-parallel shard that would cut through blocks, a fused q|k|v whose parts differ).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from engine import kernels as cpu_kernels
from engine.kernels import MAX_ROWS, Kernels
from engine.models.gguf_blocks import BlockWeight, Int8Blocks, PackedBlocks


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _frozen(t: Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def dense_linear(weight: Tensor, bias: Tensor | None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = _frozen(weight)
    if bias is not None:
        layer.bias = _frozen(bias)
    return layer


class PackedLinear(nn.Module):
    """A float32 CPU linear on the small-row kernel (small steps; `kernels` None: none) and oneDNN (prefill)."""

    def __init__(self, layer: nn.Linear, kernels: Kernels | None, keep_dense: bool):
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.kernels = kernels
        self.packed = layer.weight.detach().to_mkldnn()
        # the small-row kernel reads the dense weight; without it only a weight another module shares
        # (a tied LM head's embedding table) stays
        self.weight = _frozen(layer.weight.detach().contiguous()) if kernels else \
            layer.weight if keep_dense else _frozen(torch.empty(0))
        self.bias = layer.bias

    @property
    def skinny(self) -> bool:
        return self.kernels is not None

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self.kernels is not None and flat.shape[0] <= MAX_ROWS:
            out = self.kernels.ops.skinny_linear(flat.contiguous(), self.weight, self.bias)
        else:
            out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1])

    def dense(self) -> nn.Linear:
        return dense_linear(self.weight if self.weight.numel() else self.packed.to_dense(), self.bias)


class BlockLinear(nn.Module):
    """A linear whose weight is GGUF blocks: W = scale * q + offset, never held as float32."""

    def __init__(self, blocks: BlockWeight | PackedBlocks | Int8Blocks, bias: Tensor | None = None):
        super().__init__()
        self.blocks = blocks
        self.out_features, self.in_features = blocks.shape
        self.bias = bias
        self.kernels: Kernels | None = None  # set by pack_linears

    def forward(self, x: Tensor) -> Tensor:
        if isinstance(self.blocks, BlockWeight):  # not through pack_linears: pack on first use
            self.blocks = self.blocks.packed()
        if self.kernels is None:
            self.kernels = cpu_kernels.active() or cpu_kernels.choose()
            if self.kernels is None:
                raise RuntimeError("GGUF blocks need the CPU kernels, which this machine can't run")
        ops, b = self.kernels.ops, self.blocks
        flat = x.reshape(-1, x.shape[-1])
        if isinstance(b, Int8Blocks):
            out = ops.int8_linear(flat, b.u, b.dm, b.lo, b.rows, b.max_code, self.bias)
        elif flat.shape[0] <= MAX_ROWS:
            out = ops.block_linear(flat.contiguous(), b.q, b.scale_offset, b.zero, b.rows, self.bias)
        else:  # prefill: the float32 path's own oneDNN call, on this call's dequantized copy
            weight = ops.block_dequantize(b.q, b.scale_offset, b.zero, b.rows)
            out = torch.ops.mkldnn._linear_pointwise(flat, weight, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1])

    def dense(self) -> nn.Linear:
        return dense_linear(self.blocks.dequantize(), self.bias)


class BlockEmbedding(nn.Module):
    """An embedding table as GGUF blocks: a lookup dequantizes only the rows it reads."""

    def __init__(self, blocks: BlockWeight | PackedBlocks | Int8Blocks):
        super().__init__()
        self.blocks = blocks
        self.num_embeddings, self.embedding_dim = blocks.shape

    def forward(self, tokens: Tensor) -> Tensor:
        return self.blocks.dequantize(tokens)


def dense(layer: nn.Module) -> nn.Linear:
    """The float32 nn.Linear of any linear form."""
    return layer if type(layer) is nn.Linear else layer.dense()


def take_rows(layer: nn.Module, rows: Tensor) -> nn.Module:
    """The same linear computing only these output rows, in its own weight form: the same bytes,
    and on our kernels the same results bit for bit (each output row is computed on its own;
    PyTorch's and oneDNN's GEMMs agree to rounding)."""
    bias = None if layer.bias is None else layer.bias[rows.to(layer.bias.device)]
    if isinstance(layer, BlockLinear):
        out = BlockLinear(layer.blocks.take(rows.cpu()), bias)
        out.kernels = layer.kernels
        return out
    weight = dense(layer).weight.detach()
    sub = dense_linear(weight[rows.to(weight.device)].contiguous(), bias)
    return PackedLinear(sub, layer.kernels, keep_dense=False) if isinstance(layer, PackedLinear) else sub


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def use_blocks(model: nn.Module, blocks: dict[str, BlockWeight]) -> int:
    """Swap the float32 layers of `model` (a Transformer, before sharding) named in `blocks` for
    block layers; a tied LM head shares the embedding's blocks. Returns the bytes the blocks take."""
    for name, weight in blocks.items():
        name = name.removesuffix(".weight")
        old = model.get_submodule(name)
        _replace(model, name, BlockEmbedding(weight) if isinstance(old, nn.Embedding) else BlockLinear(weight, old.bias))
    embed = model.model.embed_tokens
    if model.args.tie_word_embeddings and isinstance(embed, BlockEmbedding):
        model.lm_head = BlockLinear(embed.blocks)
    return sum(w.nbytes for w in blocks.values())


def pack_linears(model: nn.Module, kernels: Kernels | None | str = "auto", int8: bool = False) -> int:
    """Prepare a model's CPU float32 linears for inference. Returns how many became PackedLinear.

    `kernels`: the CPU kernels to run on (engine.kernels.choose's; a cpu_isa name such as "auto" is
    chosen here; None: oneDNN and PyTorch only). Each nn.Linear becomes a PackedLinear (a oneDNN-packed
    copy; the dense weight kept for the small-row kernel where there are kernels). Block layers take
    their packed form: Int8Blocks when `int8`, else PackedBlocks (the same values in fewer bytes). Then
    the model's C++ decode layers are built where they can run.
    """
    if not onednn_available():
        return 0
    if isinstance(kernels, str):
        kernels = cpu_kernels.choose(kernels)
    pack = Int8Blocks.of if int8 and kernels is not None else PackedBlocks.of
    if kernels is not None and hasattr(model, "cpu_kernels"):  # the same library holds the decode layer's other ops
        model.kernels, model.cpu_kernels = kernels, True
    packed: dict[int, PackedBlocks | Int8Blocks] = {}  # a tied LM head shares its embedding's blocks
    for module in model.modules():
        if isinstance(module, (BlockLinear, BlockEmbedding)) and isinstance(module.blocks, BlockWeight):
            if id(module.blocks) not in packed:
                packed[id(module.blocks)] = pack(module.blocks)
            module.blocks = packed[id(module.blocks)]
        if isinstance(module, BlockLinear):
            module.kernels = kernels
    shared = {id(p) for name, p in model.named_parameters(remove_duplicate=False)
              if not name.endswith(("_proj.weight", "lm_head.weight"))}
    linears = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear
               and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]
    for name, layer in linears:
        _replace(model, name, PackedLinear(layer, kernels, keep_dense=id(layer.weight) in shared))
    if getattr(model, "cpu_kernels", False):
        model.build_decode_layers()
    return len(linears)
