"""Tensor parallelism as a separate pass over a built model (gpt-fast's tp.py, with explicit collectives).

Column-parallel: q/k/v and gate/up keep 1/tp of their output rows (whole heads, whole MLP slices).
With fewer key/value heads than ranks (GQA, MQA: Gemma 3 270M has one), each rank keeps the one
key/value head its query heads use, replicated across tp / num_kv_heads ranks (as vLLM does).
Row-parallel: o and down keep 1/tp of their input columns; their partial outputs are summed by an
all-reduce that the layer's forward calls itself (Attention/MLP.forward, via `tp_group`).
Embedding and LM head stay replicated: a vocab-parallel LM head would save 1/tp of its read per
step but add an all-gather of [B, T, V] logits (or a distributed sampler); on these small models
the replicated head keeps every rank's logits identical, so sampling needs no collective at all.
"""
from __future__ import annotations

from torch import nn

from engine.models.gguf_blocks import SPAN
from engine.models.linear import BlockLinear, dense_linear as _dense, dense
from engine.models.transformer import Transformer


def row_range(total: int, rank: int, world: int, heads: int | None = None) -> tuple[int, int]:
    """The output rows rank keeps of a column-parallel weight with `total` rows: 1/world of them, or
    with `heads` < world (key/value heads to replicate) the rows of head rank * heads // world."""
    if heads is not None and heads < world:
        size = total // heads
        head = rank * heads // world
        return head * size, (head + 1) * size
    rows = total // world
    return rank * rows, (rank + 1) * rows


def _keep_rows(layer: nn.Module, rank: int, world: int, heads: int | None = None) -> nn.Module:
    a, b = row_range(layer.out_features, rank, world, heads)
    bias = nn.Parameter(layer.bias[a:b].clone(), requires_grad=False) if layer.bias is not None else None
    if isinstance(layer, BlockLinear):
        return BlockLinear(layer.blocks.rows(a, b), bias)
    return _dense(layer.weight[a:b].clone(), bias)


def _keep_cols(layer: nn.Module, rank: int, world: int) -> nn.Module:
    cols = layer.in_features // world
    if isinstance(layer, BlockLinear):
        if cols % layer.blocks.group == 0 and cols % SPAN == 0:
            return BlockLinear(layer.blocks.cols(rank * cols, (rank + 1) * cols), layer.bias)
        layer = dense(layer)  # the shard would cut through blocks or the kernel's spans: float32
    return _dense(layer.weight[:, rank * cols : (rank + 1) * cols].clone(), layer.bias)


def check_shardable(args, world: int) -> None:
    if world == 1:
        return
    for what, n in (("attention heads", args.num_heads), ("MLP intermediate size", args.intermediate_size)):
        if n % world:
            raise ValueError(f"tensor_parallel_size {world} does not divide the model's {what} ({n})")
    kv = args.num_kv_heads
    if kv % world and world % kv:  # neither split nor replicated evenly
        raise ValueError(f"tensor_parallel_size {world} neither divides the model's key/value heads ({kv}) nor is "
                         f"a multiple of them (to replicate each across ranks)")


COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split by output rows
ROW_PARALLEL = ("o_proj", "down_proj")  # split by input columns


def split_of(name: str) -> str | None:
    """How a parameter (HF name) is split across ranks: "rows", "kv_rows" (rows of key/value heads,
    which may be replicated), "cols" or None (replicated)."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in ("k_proj", "v_proj"):
        return "kv_rows"
    if len(parts) >= 2 and parts[-2] in COLUMN_PARALLEL:
        return "rows"  # weight and bias alike
    if len(parts) >= 2 and parts[-2] in ROW_PARALLEL and parts[-1] == "weight":
        return "cols"
    return None


def shard(model: Transformer, rank: int, world: int, group, sliced: bool = False) -> Transformer:
    """Keep rank's shard of every layer in place; layers then all-reduce over `group`.
    sliced: the weights were loaded as this rank's slices already (loading.load_model)."""
    check_shardable(model.args, world)
    if world == 1:
        return model
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not sliced:
            attn.q_proj, mlp.gate_proj, mlp.up_proj = (_keep_rows(p, rank, world) for p in (attn.q_proj, mlp.gate_proj, mlp.up_proj))
            attn.k_proj, attn.v_proj = (_keep_rows(p, rank, world, attn.num_kv_heads) for p in (attn.k_proj, attn.v_proj))
            attn.o_proj, mlp.down_proj = _keep_cols(attn.o_proj, rank, world), _keep_cols(mlp.down_proj, rank, world)
        attn.num_heads //= world
        attn.num_kv_heads = max(1, attn.num_kv_heads // world)
        attn.tp_group = mlp.tp_group = group
    return model
