"""ModelWorker: one model shard on one device, with its KV cache and per-request RNGs.

The worker knows nothing of requests' lifetimes beyond what each call says: the scheduler owns
block tables and lengths. Drafting and verification are its two jobs (proposer.py, verifier.py).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
from pathlib import Path

import torch
from torch import Tensor

from engine.kv_cache import KVCache
from engine.models.compiled_step import CompiledStep
from engine.models.gguf_blocks import read_block_weights
from engine.models.linear import pack_linears, use_blocks
from engine.models.loading import ModelSource, build_model, load_sharded, load_state_dict
from engine import kernels as cpu_kernels_lib
from engine.kernels import MAX_ROWS
from engine.models.tp import shard
from engine.models.transformer import SMALL_QUERY_ROWS
from engine.step import Prefill, TokenLogprob

logger = logging.getLogger(__name__)


def _return_freed_memory() -> None:
    """Hand the load's freed float32 copies back to the OS: glibc keeps freed heap pages, and
    a worker's resident size would stay at its load-time peak."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class ModelWorker:
    def __init__(self, source: ModelSource, num_blocks: int | None, block_size: int, dtype: torch.dtype,
                 device: str = "cpu", rng_stream: str = "target", pack: bool = True,
                 rank: int = 0, world: int = 1, group=None, gguf_weights: str = "int8", cpu_kernels: bool = True,
                 cpu_isa: str = "auto", compiled: bool = False):
        """gguf_weights, cpu_kernels, cpu_isa: EngineConfig's (cpu_kernels False or cpu_isa "none": no C++
        kernel, every linear on oneDNN, GGUF tensors as float32; where this machine runs none of the
        kernels' targets, the same by itself). compiled: decode and verify steps compiled whole
        (EngineConfig.compiled_step; engine/models/compiled_step.py): on a CPU the model keeps PyTorch's
        own float32 linears, which torch.compile traces, instead of our kernels'."""
        self.compiled = compiled and world == 1  # tensor-parallel steps all-reduce between ops: eager
        if self.compiled and device == "cpu":
            cpu_kernels = False
        kernels = cpu_kernels_lib.select(cpu_isa if cpu_kernels else "none") if device == "cpu" else None
        self.kernels = kernels
        if source.kind == "hf_dir":  # each rank reads only its slices
            config, model = load_sharded(source, dtype, device, rank, world)
            self.model = shard(model, rank, world, group, sliced=True)
        else:
            config, state = load_state_dict(source, device, dtype)
            model = build_model(config, state, dtype=dtype, device=device)
            if gguf_weights != "float32" and pack and source.kind == "gguf" and kernels and dtype == torch.float32:
                # the file's own blocks instead of float32 (~1/3 the bytes)
                nbytes = use_blocks(model, read_block_weights(Path(source.path), state, config))
                logger.info("%s: quantized weights kept as blocks (%.0f MB), multiplied %s (CPU kernels: %s)",
                            Path(source.path).name, nbytes / 2**20,
                            "by int8 activations" if gguf_weights == "int8" else "in float32", kernels.name)
            del state
            self.model = shard(model, rank, world, group)
        if pack:
            self.model.fuse_projections()
            if device == "cpu" and dtype == torch.float32 and not self.compiled:
                pack_linears(self.model, kernels, int8=kernels is not None and gguf_weights == "int8")
        _return_freed_memory()
        self.args = self.model.args
        self.hf_config = config
        self.device, self.dtype, self.block_size = device, dtype, block_size
        self.cache = None
        self.step: CompiledStep | None = None  # with the cache
        if num_blocks is not None:  # else allocate_cache, once the engine knows how many fit
            self.allocate_cache(num_blocks)
        self.rng_stream = rng_stream  # target and draft draw from independent streams
        self.generators: dict[str, torch.Generator] = {}

    def block_bytes(self) -> int:
        """One KV block on this rank: keys and values of every layer, block_size tokens."""
        local_kv_heads = self.model.model.layers[0].self_attn.num_kv_heads  # this rank's share
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.args.num_layers * local_kv_heads * self.block_size * self.args.head_dim * itemsize

    def weight_bytes(self) -> int:
        tensors = {id(p): p.numel() * p.element_size() for p in self.model.parameters()}
        for module in self.model.modules():
            blocks = getattr(module, "blocks", None)
            if blocks is not None:
                tensors[id(blocks)] = blocks.nbytes  # a tied LM head shares its embedding's
        return sum(tensors.values())

    def allocate_cache(self, num_blocks: int, max_model_len: int | None = None) -> None:
        """The KV cache, and with it the compiled step (whose graphs read this cache). max_model_len:
        the widest block table a step can have (unset: every block)."""
        self.cache = self.step = None  # the old ones first: a restart may replace them
        local_kv_heads = self.model.model.layers[0].self_attn.num_kv_heads
        self.cache = KVCache(self.args.num_layers, num_blocks, self.block_size, local_kv_heads,
                             self.args.head_dim, self.dtype, self.device)
        if self.compiled:
            max_blocks = num_blocks - 1 if max_model_len is None else -(-max_model_len // self.block_size)
            self.step = CompiledStep(self.model, self.cache, max_blocks, SMALL_QUERY_ROWS,
                                     cuda_graphs=self.device == "cuda")

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    def add_request(self, request_id: str, seed: int) -> None:
        # Seed per (request, stream): reusing one seed on both sides would correlate the draft's
        # draws with the acceptance test and bias the output.
        digest = hashlib.sha256(f"{seed}:{self.rng_stream}".encode()).digest()
        self.generators[request_id] = torch.Generator(device=self.device).manual_seed(
            int.from_bytes(digest[:8], "little"))

    def remove_request(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def draws(self, request_ids: list[str], greedy: list[bool], counts: list[int], width: int,
              greedy_uniforms: bool = False) -> tuple[Tensor, Tensor]:
        """Each row's random numbers from its request's own generator, on this device: uniforms
        [B, width] for acceptance tests (counts[b] drawn, the rest 0) and one more [B] for the token
        the row samples. Greedy rows draw nothing (zeros), or only their acceptance uniforms with
        greedy_uniforms (synthetic acceptance is random at every temperature). What a row draws
        depends on that row alone, so a seeded request's output doesn't depend on its batch."""
        dev = self.device
        uniforms = torch.zeros(len(request_ids), width + 1, device=dev)
        for b, (rid, is_greedy, n) in enumerate(zip(request_ids, greedy, counts)):
            if is_greedy and not greedy_uniforms:
                continue
            drawn = torch.rand(n + (0 if is_greedy else 1), generator=self.generators[rid], device=dev)
            uniforms[b, :n] = drawn[:n]
            if not is_greedy:
                uniforms[b, width] = drawn[n]
        return uniforms[:, :width], uniforms[:, width]

    @torch.inference_mode()
    def forward(self, tables: list[list[int]], starts: list[int], tokens: list[list[int]] | Tensor,
                last_only: bool = False, logits: bool = True) -> Tensor:
        """Ragged forward: row b writes tokens[b] at positions starts[b].. through its block table
        tables[b] (which covers them; padding positions past it land in the null block).
        `tokens` is host lists, or a [B, T] tensor on this device (every row T tokens: no host read).

        Returns float32 logits [B, T, V] (padded rows past len(tokens[b]) are garbage),
        or [B, 1, V] at each row's last token when last_only, or [B, 0, V] without logits (the
        cache written, the LM head skipped).
        """
        dev = self.device
        if isinstance(tokens, Tensor):
            ids, (B, T) = tokens, tokens.shape
            lengths = [T] * B
        else:
            B, T = len(tokens), max(len(t) for t in tokens)
            lengths = [len(t) for t in tokens]
            ids = torch.zeros(B, T, dtype=torch.long)
            for b, row in enumerate(tokens):
                ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
            ids = ids.to(dev)
        # padding continues the row's positions; its table is padded with the null block to cover them
        positions = torch.tensor(starts, dtype=torch.long)[:, None] + torch.arange(T)[None, :]
        table = self._table_tensor(tables, max(starts) + T)
        if logits and self.step is not None and self.step.takes(B, T):
            out = self.step.step(ids, positions.to(dev), table.to(dev))  # [B, T, V]
            if not last_only:
                return out
            if all(n == T for n in lengths):
                return out[:, T - 1:]
            return out.gather(1, torch.tensor(lengths, device=dev)[:, None, None].sub(1).expand(-1, 1, out.shape[-1]))
        logit_index = torch.tensor([[n - 1] for n in lengths]).to(dev) if last_only else None
        if not logits:
            logit_index = torch.zeros(B, 0, dtype=torch.long, device=dev)
        return self.model(ids, positions.to(dev), self.cache, table.to(dev), logit_index)

    def _table_tensor(self, tables: list[list[int]], end: int) -> Tensor:
        """Block tables as [rows, blocks covering positions < end]: each cut there, or padded with the
        null block (padding positions write there)."""
        width = -(-end // self.block_size)
        table = torch.zeros(len(tables), width, dtype=torch.long)
        for b, row in enumerate(tables):
            row = row[:width]
            table[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        return table

    @property
    def takes_ragged_rows(self) -> bool:
        """Whether forward_ragged runs here: every layer in C++ on the int8 kernel (rows independent)."""
        return self.model.layers_take_any_rows

    @torch.inference_mode()
    def forward_ragged(self, tables: list[list[int]], starts: list[int], tokens: list[list[int]],
                       scored: list[tuple[int, int]]) -> tuple[Tensor, list[int]]:
        """Rows of any lengths in one forward, without padding: a decode step's rows beside prompt
        chunks of hundreds of tokens. Row b writes tokens[b] at starts[b].. through tables[b].
        scored[b] = (first, count) for the first len(scored) rows: logits at tokens[b][first:first + count].

        Returns (float32 logits [sum counts, V] in row order, where each scored row's begin)."""
        dev = self.device
        lengths = [len(t) for t in tokens]
        ids = torch.tensor([t for row in tokens for t in row], dtype=torch.long)[None]
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)])[None]
        row_seqs = torch.repeat_interleave(torch.arange(len(tokens)), torch.tensor(lengths))
        table = self._table_tensor(tables, max(s + n for s, n in zip(starts, lengths)))
        offsets, firsts, index = 0, [], []
        for b, n in enumerate(lengths):
            if b < len(scored):
                first, count = scored[b]
                firsts.append(len(index))
                index.extend(range(offsets + first, offsets + first + count))
            offsets += n
        logit_index = torch.tensor(index, dtype=torch.long)[None].to(dev)
        logits = self.model(ids.to(dev), positions.to(dev), self.cache, table.to(dev), logit_index, row_seqs.to(dev))
        return logits[0], firsts

    @torch.inference_mode()
    def prefill_scored(self, table: list[int], first: int, tokens: list[int], answers: list[int], top: int,
                       chunk: int = 64) -> list[TokenLogprob]:
        """prefill(), also scoring answers[i] (the token after tokens[i]) by the model's own
        log-softmax, with the `top` most likely at each position. Chunks are small: each one's
        logits span the vocabulary."""
        out = []
        for start in range(0, len(tokens), chunk):
            logits = self.forward([table], [first + start], [tokens[start:start + chunk]])[0]
            lp = torch.log_softmax(logits, dim=-1)
            picked = lp.gather(1, torch.tensor(answers[start:start + chunk], device=lp.device)[:, None])
            rank = ((lp > picked).sum(-1) + 1).tolist()
            picked = picked[:, 0].tolist()
            ids, values = ([], [])
            if top:
                best = torch.topk(lp, top, dim=-1)
                ids, values = best.indices.tolist(), best.values.tolist()
            out.extend(TokenLogprob(p, r, list(zip(ids[i], values[i])) if top else [])
                       for i, (p, r) in enumerate(zip(picked, rank)))
        return out

    def prefill(self, chunks: list[Prefill], max_rows: int = 512) -> None:
        """Write each chunk's tokens at its positions through its block table; no logits (the next
        step feeds the last prompt token). Short chunks (at most SMALL_QUERY_ROWS tokens) of different
        sequences share forwards of at most MAX_ROWS rows, the decode-step path where every row is
        computed on its own, so each writes the keys and values it writes alone; a step admitting
        many short prompts prefills them in a forward or two, not one each. Longer chunks run
        alone, in pieces of max_rows."""
        short = [c for c in chunks if len(c.tokens) <= SMALL_QUERY_ROWS]
        for c in chunks:
            if len(c.tokens) > SMALL_QUERY_ROWS:
                for at in range(0, len(c.tokens), max_rows):
                    self.forward([c.table], [c.start + at], [c.tokens[at:at + max_rows]], logits=False)
        for group in padded_groups([len(c.tokens) for c in short], MAX_ROWS):
            self.forward([short[i].table for i in group], [short[i].start for i in group],
                         [short[i].tokens for i in group], logits=False)


SMALL_ROWS = 16  # a forward of this many rows costs about what one row costs: weights stream once


def padded_groups(lengths: list[int], max_rows: int, waste: float = 1.25) -> list[list[int]]:
    """Indices of `lengths` in forwards of [B, T] rows: longest first, a row joins the current
    forward while its padded size B * T stays within `waste` of the tokens it holds (or at most
    SMALL_ROWS, which cost about one row) and within max_rows."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    held = 0
    for i in order:
        if groups:
            width, n = lengths[groups[-1][0]], len(groups[-1]) + 1
            padded = n * width
            if padded <= max_rows and (padded <= SMALL_ROWS or padded <= waste * (held + lengths[i])):
                groups[-1].append(i)
                held += lengths[i]
                continue
        groups.append([i])
        held = lengths[i]
    return groups
