"""The decode / verify forward at static shapes, compiled whole; on a GPU, one CUDA graph per shape.

gpt-fast's and vLLM v1's recipe. A step of B rows of T tokens (T = 1 a decode, K+1 a verify, the
draft's own rows) is padded to a bucket: B to the next of BATCH_BUCKETS, the block tables to the next
power of two of blocks, so a few shapes serve every step. Inputs are copied into persistent buffers of
that shape; the forward reads them with no host read and no Python branch on a tensor's value (the
keys span the padded table's width and the masks hide what lies past each query: ForwardContext's
`static`), so `torch.compile(fullgraph=True)` takes it as one graph, and on a GPU the graph is
captured once per shape and replayed (one launch a step instead of ~70 kernels a layer from Python).

Padded rows have all-zero tables: their keys and values land in the null block (engine/kv_cache.py),
their logits are dropped. Prefill chunks stay eager (their shapes are many, their cost is compute).
On a CPU this path runs with PyTorch's own linears (inductor's C++ code), not our kernels: it is how
the suite tests the GPU's step without a GPU; the CPU's fast path is the C++ decode layer.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import Tensor

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
MIN_TABLE_BLOCKS = 8  # the narrowest padded block table (128 positions at block_size 16)


def batch_bucket(rows: int) -> int | None:
    """The padded batch for `rows` rows, or None past the largest bucket (the step runs eager)."""
    return next((b for b in BATCH_BUCKETS if b >= rows), None)


def table_bucket(blocks: int, max_blocks: int) -> int:
    """The padded block-table width: the next power of two (at least MIN_TABLE_BLOCKS), capped at the
    widest table a sequence can have."""
    width = MIN_TABLE_BLOCKS
    while width < blocks:
        width *= 2
    return max(blocks, min(width, max_blocks))


@dataclass
class _Shape:
    """One padded shape's persistent inputs, its output and (on a GPU) its captured graph."""

    tokens: Tensor  # [B, T]
    positions: Tensor  # [B, T]
    tables: Tensor  # [B, W]
    pad_positions: Tensor  # [B, T]: 0..T-1 in every row, what padded rows read (block 0, the null block)
    logits: Tensor | None = None  # [B, T, V], the graph's output (GPU)
    graph: "torch.cuda.CUDAGraph | None" = None


class CompiledStep:
    """`step(tokens, positions, tables)` -> float32 logits [B, T, V], as `model(...)` returns them, for
    rows of at most max_tokens tokens; `takes(B, T)` says which steps it runs."""

    def __init__(self, model: torch.nn.Module, cache, max_blocks: int, max_tokens: int, cuda_graphs: bool):
        self.model, self.cache = model, cache
        self.max_blocks, self.max_tokens = max_blocks, max_tokens
        self.cuda_graphs = cuda_graphs
        self.shapes: dict[tuple[int, int, int], _Shape] = {}
        self.pool = torch.cuda.graph_pool_handle() if cuda_graphs else None
        self.graph_bytes = 0  # what the captured graphs hold on the device (their memory pool)
        # the batch and the table width as dynamic dimensions: one compiled graph for all buckets of a
        # row length T (1 and K+1); a CUDA graph per bucket
        self.forward = torch.compile(self._forward, fullgraph=True, dynamic=True)

    def _forward(self, tokens: Tensor, positions: Tensor, tables: Tensor) -> Tensor:
        return self.model(tokens, positions, self.cache, tables, static=True)

    def takes(self, rows: int, tokens: int) -> bool:
        return tokens <= self.max_tokens and batch_bucket(rows) is not None

    @torch.inference_mode()
    def step(self, tokens: Tensor, positions: Tensor, tables: Tensor) -> Tensor:
        B, T = tokens.shape
        shape = self._shape(batch_bucket(B), T, table_bucket(tables.shape[1], self.max_blocks))
        # rows past B are padding (they may hold an earlier, larger step's rows): zero tokens and
        # tables, positions 0..T-1; a real row's table is zero past its own width
        shape.tokens[B:].zero_()
        shape.positions[B:].copy_(shape.pad_positions[B:])
        shape.tables.zero_()
        shape.tokens[:B].copy_(tokens, non_blocking=True)
        shape.positions[:B].copy_(positions, non_blocking=True)
        shape.tables[:B, : tables.shape[1]].copy_(tables, non_blocking=True)
        if shape.graph is None:
            return self.forward(shape.tokens, shape.positions, shape.tables)[:B]
        shape.graph.replay()
        return shape.logits[:B].clone()  # the next replay overwrites the graph's output

    def _shape(self, B: int, T: int, W: int) -> _Shape:
        key = (B, T, W)
        if key in self.shapes:
            return self.shapes[key]
        dev = self.cache.k[0].device
        pad_positions = torch.arange(T, device=dev).repeat(B, 1)
        shape = _Shape(torch.zeros(B, T, dtype=torch.long, device=dev), pad_positions.clone(),
                       torch.zeros(B, W, dtype=torch.long, device=dev), pad_positions)
        t = time.perf_counter()
        if self.cuda_graphs:
            # warm up on a side stream (compilation, autotuning, lazy allocations), then capture
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.forward(shape.tokens, shape.positions, shape.tables)
            torch.cuda.current_stream().wait_stream(side)
            before = torch.cuda.memory_reserved()
            shape.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(shape.graph, pool=self.pool):
                shape.logits = self.forward(shape.tokens, shape.positions, shape.tables)
            torch.cuda.synchronize()
            self.graph_bytes += torch.cuda.memory_reserved() - before
        log.debug("compiled step %s (batch, tokens, table blocks)%s in %.1f s", key,
                  f", CUDA graph captured ({self.graph_bytes / 2**20:.0f} MiB in the graphs' pool)"
                  if self.cuda_graphs else "", time.perf_counter() - t)
        self.shapes[key] = shape
        return shape
