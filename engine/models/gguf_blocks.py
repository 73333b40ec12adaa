"""GGUF weights kept in their own precision, as int8 blocks: W = scale * q + offset.

Every GGUF quantization read here (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) dequantizes, in
gguf-py (which transformers' GGUF loader runs, and so our float32 cache holds), as
fl(fl(scale * q) + offset): q a small integer, one float32 (scale, offset) per 16 or 32 weights of
a row; types without an offset get -0.0, which leaves every float unchanged. So one format holds
all of them exactly: q as int8, (scale, offset) as float32 pairs, 1.25-1.5 bytes a weight instead
of 4. For inference two packed forms narrow them further where that is exact (4-bit q for the 4-bit
types, float16 pairs for the legacy ones: Q4_1 0.625 bytes a weight, as in the file):
`PackedBlocks` for the block kernel (csrc/skinny_linear.cpp), which rebuilds the very float32 values
of the dequantized copy, so outputs are bit-identical to the float32 path; `Int8Blocks` for the int8
kernel (csrc/int8_linear.cpp), which multiplies them by int8-rounded activations. Each tensor is checked
bit for bit against that copy when it is read; one that differs stays float32 (with a log line).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

logger = logging.getLogger(__name__)


NR = 4  # rows the kernel streams side by side (csrc/skinny_linear.cpp)
SPAN = 32  # weights the kernel reads per row and step; every GGUF block is 32 or 256


@dataclass
class TwoLevelScales:
    """A k-quant's (Q4_K, Q5_K, Q6_K) scales as its file holds them: scale = D * c (and offset = M * c'),
    D, M one float32 per 256 weights of a row (the block's d and -dmin), c, c' small integers per group,
    each product one float32 multiply, as gguf-py dequantizes (so scale_offset holds its results)."""
    supers: Tensor  # float32 [N, K // 256, P]: D (and M); P = 2 with offsets, else 1
    codes: Tensor  # int8 [N, K // group, P]: c (and c')

    def take(self, rows) -> "TwoLevelScales":
        return TwoLevelScales(self.supers[rows], self.codes[rows])

    def scale_offset(self, group: int) -> Tensor:
        """[N, K // group, P] float32: the products."""
        return self.supers.repeat_interleave(QK_K // group, dim=1) * self.codes.float()


@dataclass
class BlockWeight:
    q: Tensor  # int8 [N, K]
    scale_offset: Tensor  # float32 [N, K // group, 2]
    group: int  # weights per (scale, offset); a power of two >= 16
    two_level: TwoLevelScales | None = None  # how a k-quant's scales factor (Int8Blocks stores them so)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale_offset.nbytes

    def dequantize(self, rows: Tensor | None = None) -> Tensor:
        """float32 weights (of `rows` only, e.g. token ids for an embedding lookup): a multiply,
        then an add, each rounded, as gguf-py computes them."""
        q, so = (self.q, self.scale_offset) if rows is None else (self.q[rows], self.scale_offset[rows])
        return _dequantize(q, so, self.group)

    def packed(self) -> "PackedBlocks":
        """The same weights in the kernel's layout and the fewest bytes that hold them exactly."""
        return PackedBlocks.of(self)

    def rows(self, start: int, stop: int) -> "BlockWeight":
        two = self.two_level
        return BlockWeight(self.q[start:stop].clone(), self.scale_offset[start:stop].clone(), self.group,
                           two and TwoLevelScales(two.supers[start:stop].clone(), two.codes[start:stop].clone()))

    def take(self, rows: Tensor) -> "BlockWeight":
        return BlockWeight(self.q[rows], self.scale_offset[rows], self.group, self.two_level and self.two_level.take(rows))

    def cols(self, start: int, stop: int) -> "BlockWeight":
        if start % self.group or stop % self.group:
            raise ValueError(f"columns {start}:{stop} cut through blocks of {self.group}")
        g, two = self.group, self.two_level
        if two is not None and start % QK_K == 0 and stop % QK_K == 0:
            two = TwoLevelScales(two.supers[:, start // QK_K: stop // QK_K].contiguous(),
                                 two.codes[:, start // g: stop // g].contiguous())
        else:
            two = None  # a cut through a 256-weight block: its scales stay one level
        return BlockWeight(self.q[:, start:stop].contiguous(),
                           self.scale_offset[:, start // g : stop // g].contiguous(), g, two)

    def regroup(self, group: int) -> "BlockWeight":
        """The same weights with a (scale, offset) pair every `group` (a divisor of ours)."""
        repeat = self.group // group
        two = self.two_level and TwoLevelScales(self.two_level.supers, self.two_level.codes.repeat_interleave(repeat, dim=1))
        return self if repeat == 1 else BlockWeight(self.q, self.scale_offset.repeat_interleave(repeat, dim=1), group, two)

    @staticmethod
    def cat(parts: list["BlockWeight"]) -> "BlockWeight":
        """Rows of several weights (a fused q|k|v or gate|up); two-level scales only where every part has
        them alike (a Q4_K beside a Q6_K keeps one level)."""
        group = min(p.group for p in parts)
        parts = [p.regroup(group) for p in parts]
        twos = [p.two_level for p in parts]
        two = None
        if all(t is not None for t in twos) and len({t.supers.shape[-1] for t in twos}) == 1:
            two = TwoLevelScales(torch.cat([t.supers for t in twos]), torch.cat([t.codes for t in twos]))
        return BlockWeight(torch.cat([p.q for p in parts]), torch.cat([p.scale_offset for p in parts]), group, two)


def _dequantize(q: Tensor, so: Tensor, group: int) -> Tensor:
    so = so.float()
    scaled = so[..., 0:1] * q.unflatten(-1, (-1, group)).float()
    return (scaled + so[..., 1:2] if so.shape[-1] == 2 else scaled).flatten(-2)


@dataclass
class PackedBlocks:
    """A BlockWeight as the kernel reads it (inference only: slice and join before packing).

    Fewer bytes where that is exact: q as 4-bit values where the tensor's q span at most 16 values
    (Q4_0, Q4_1, Q4_K: in every 32 weights, byte j holds weight j in its low half and j + 16 in its
    high half, q = nibble + zero), scales alone where every offset is -0.0 (Q4_0, Q5_0, Q8_0, Q6_K),
    float16 where every value round-trips (the legacy types store them so). Q4_1 takes 0.625 bytes a
    weight, as in the file. Rows are interleaved by NR so that each NR rows are one sequential stream:
    q [ceil(N / NR), K / 32, NR, 32 or 16 bytes], scale_offset [ceil(N / NR), K / group, NR, 2 or 1].
    """
    q: Tensor
    scale_offset: Tensor
    zero: int
    rows: int  # N; q and scale_offset hold it rounded up to NR with zero rows

    @staticmethod
    def of(w: BlockWeight) -> "PackedBlocks":
        n, k = w.shape
        if k % SPAN:
            raise ValueError(f"blocks of {k} columns: the kernel reads multiples of {SPAN}")
        so = _narrow_pairs(w.scale_offset)
        q, zero = w.q.unflatten(-1, (-1, SPAN)), 0  # [N, K / 32, 32]
        lo, hi = int(w.q.min()), int(w.q.max())
        if hi - lo <= 15:
            nibbles = (q.to(torch.int16) - lo).to(torch.uint8)
            q, zero = nibbles[..., :16] | (nibbles[..., 16:] << 4), lo
        return PackedBlocks._of_rows(q, so, zero)

    @staticmethod
    def _of_rows(q: Tensor, so: Tensor, zero: int) -> "PackedBlocks":
        """From row-major q [N, K / 32, bytes] and pairs [N, K / group, 2 or 1]: padded, interleaved."""
        n, pad = q.shape[0], -q.shape[0] % NR
        q, so = (torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]) for t in (q, so))
        return PackedBlocks(_interleave(q), _interleave(so), zero, n)

    def take(self, rows: Tensor) -> "PackedBlocks":
        """These rows only, in this order (a restricted LM head), bytes unchanged."""
        return PackedBlocks._of_rows(self.q[rows // NR, :, rows % NR], self.scale_offset[rows // NR, :, rows % NR],
                                     self.zero)

    @property
    def four_bit(self) -> bool:
        return self.q.dtype == torch.uint8

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows, self.q.shape[1] * SPAN))

    @property
    def group(self) -> int:
        return self.shape[1] // self.scale_offset.shape[1]

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale_offset.nbytes

    def dequantize(self, rows: Tensor | None = None) -> Tensor:
        """float32 weights (of `rows` only), the values of the BlockWeight this was packed from."""
        index = torch.arange(self.rows) if rows is None else rows
        q = self.q[index // NR, :, index % NR]  # [..., K / 32, bytes]
        if self.four_bit:
            q = (torch.cat([q & 0x0F, q >> 4], dim=-1).to(torch.int16) + self.zero).to(torch.int8)
        return _dequantize(q.flatten(-2), self.scale_offset[index // NR, :, index % NR], self.group)


TILE = 16  # weight rows the int8 kernel computes side by side, one int32 lane each (csrc/int8_linear.cpp)


@dataclass
class Int8Blocks:
    """A BlockWeight as the int8 kernel reads it: u = q - lo unsigned (lo: the tensor's smallest q),
    4 bits where u < 16 (Q4_0, Q4_1, Q4_K), else a byte; (d, m) per group of 16 or 32 weights, float16
    where exact, d alone where every m is -0.0, or for the k-quants in their file's two levels (int8
    codes per group times a float32 per 256 weights: TwoLevelScales). The weights are the file's,
    exactly (`dequantize`). u [ceil(N / 16), K / 4, 16, 4] bytes (16 rows side by side, 4 consecutive k
    each), 4-bit [.., K / 8, 16, 4] (byte b: k = 8c + b low, 8c + 4 + b high); dm [ceil(N / 16), K / G,
    2 or 1, 16], two levels int8 [ceil(N / 16), K / G + 4 * K / 256, 2 or 1, 16] (the codes, then each
    float as 4 byte planes: the kernel reads 16 rows' floats from 4 loads).
    """
    u: Tensor
    dm: Tensor
    lo: int
    rows: int  # N; u and dm hold it rounded up to 16 with zero rows
    cols: int  # K
    max_code: int = 255  # hi - lo, the largest u: without VNNI it decides how the kernel sums its products

    @staticmethod
    def of(w: BlockWeight) -> "Int8Blocks":
        if w.group > 32:
            w = w.regroup(32)
        n, k = w.shape
        if k % 32:
            raise ValueError(f"blocks of {k} columns: the int8 kernel reads multiples of 32")
        lo, hi = int(w.q.min()), int(w.q.max())
        u = (w.q.to(torch.int16) - lo).to(torch.uint8)
        if hi - lo <= 15:
            u = u.view(n, k // 8, 2, 4)
            u = u[..., 0, :] | (u[..., 1, :] << 4)
        else:
            u = u.view(n, k // 4, 4)
        dm = _two_level_rows(w)
        return Int8Blocks._of_rows(u, _narrow_pairs(w.scale_offset) if dm is None else dm, lo, k, hi - lo)

    @staticmethod
    def _of_rows(u: Tensor, dm: Tensor, lo: int, cols: int, max_code: int) -> "Int8Blocks":
        """From row-major u [N, K / 4 or K / 8, 4] and pairs [N, K / G, 2 or 1]: padded, tiled."""
        n, pad = u.shape[0], -u.shape[0] % TILE
        u, dm = (torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]) for t in (u, dm))
        tiles = u.shape[0] // TILE
        u = u.view(tiles, TILE, *u.shape[1:]).transpose(1, 2).contiguous()
        dm = dm.view(tiles, TILE, *dm.shape[1:]).permute(0, 2, 3, 1).contiguous()
        return Int8Blocks(u, dm, lo, n, cols, max_code=max_code)

    def take(self, rows: Tensor) -> "Int8Blocks":
        """These rows only, in this order (a restricted LM head), bytes unchanged."""
        return Int8Blocks._of_rows(self.u[rows // TILE, :, rows % TILE], self.dm[rows // TILE, :, :, rows % TILE],
                                   self.lo, self.cols, self.max_code)

    @property
    def four_bit(self) -> bool:
        return self.u.shape[1] * 8 == self.cols

    @property
    def two_level(self) -> bool:
        return self.dm.dtype == torch.int8

    @property
    def group(self) -> int:
        return self.cols // (self.dm.shape[1] - (4 * self.cols // QK_K if self.two_level else 0))

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows, self.cols))

    @property
    def nbytes(self) -> int:
        return self.u.nbytes + self.dm.nbytes

    def dequantize(self, rows: Tensor | None = None) -> Tensor:
        """float32 weights (of `rows` only), the values of the BlockWeight this was packed from."""
        index = torch.arange(self.rows) if rows is None else rows
        u = self.u[index // TILE, :, index % TILE]  # [..., K / 4 or K / 8, 4]
        if self.four_bit:
            u = torch.stack([u & 0x0F, u >> 4], dim=-2)  # [..., K / 8, 2, 4]
        q = (u.flatten(-3 if self.four_bit else -2).to(torch.int16) + self.lo).to(torch.int8)
        dm = self.dm[index // TILE, :, :, index % TILE]  # [..., K / G, 2 or 1]
        if self.two_level:
            groups = self.cols // self.group
            planes = dm[..., groups:, :].view(torch.uint8).unflatten(-2, (-1, 4)).transpose(-1, -2)  # [.., K / 256, P, 4]
            supers = planes.contiguous().view(torch.float32).squeeze(-1)  # [..., K / 256, P]
            dm = supers.repeat_interleave(QK_K // self.group, dim=-2) * dm[..., :groups, :].float()
        return _dequantize(q, dm, self.group)


def _two_level_rows(w: BlockWeight) -> Tensor | None:
    """A k-quant's scales in two levels, int8 [N, K / G + 4 * K / 256, P]: the codes, then each 256-weight
    block's float32 as 4 byte planes (row 4s + j: byte j); None where w has none, or they don't give
    its scale_offset bit for bit."""
    two = w.two_level
    if two is None or w.group not in (16, 32) or w.shape[1] % QK_K:
        return None
    pairs = two.supers.shape[-1]
    if pairs == 1 and not _bits_equal(w.scale_offset[..., 1], torch.full_like(w.scale_offset[..., 1], -0.0)):
        return None
    if not _bits_equal(two.scale_offset(w.group), w.scale_offset[..., :pairs]):
        return None
    n, blocks = two.supers.shape[:2]
    planes = two.supers.contiguous().view(torch.uint8).view(n, blocks, pairs, 4).transpose(2, 3).reshape(n, 4 * blocks, pairs)
    return torch.cat([two.codes.to(torch.int8), planes.view(torch.int8)], dim=1)


def _narrow_pairs(so: Tensor) -> Tensor:
    """(scale, offset) pairs [..., 2] in the fewest bytes that hold them exactly: scales alone where
    every offset is -0.0, float16 where every value is one."""
    if _bits_equal(so[..., 1], torch.full_like(so[..., 1], -0.0)):
        so = so[..., :1]
    half = so.to(torch.float16)
    return half if _bits_equal(half.float(), so) else so


def _interleave(t: Tensor) -> Tensor:
    """[N, a, b] -> [N / NR, a, NR, b]"""
    return t.unflatten(0, (-1, NR)).transpose(1, 2).contiguous()


# --- decoding GGUF blocks into (q, scale, offset), each step as in gguf-py's dequantize_blocks ---

QK_K = 256


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, chunk: int) -> np.ndarray:
    """Low nibbles of each `chunk` bytes, then their high nibbles: [n, bytes] -> [n, 2 * bytes]."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, chunk) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(n, -1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Bit i of a little-endian uint32 per block, i < count: [n, 4] -> [n, count] of 0/1."""
    bits = np.ascontiguousarray(qh).view(np.uint32).reshape(-1, 1) >> np.arange(count, dtype=np.uint32).reshape(1, count)
    return (bits & np.uint32(1)).astype(np.uint8)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 8 six-bit scales and mins packed in 12 bytes."""
    n = scales.shape[0]
    d, m, m_d = np.split(scales.reshape(n, 3, 4), 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1).reshape(n, 8)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1).reshape(n, 8)
    return sc.astype(np.float32), mn.astype(np.float32)


NO_OFFSET = np.float32(-0.0)  # x + -0.0 == x for every float, +0.0 and -0.0 included


def _q4_0(b):
    return _nibbles(b[:, 2:18], 16).astype(np.int8) - np.int8(8), _f16(b[:, 0:2]), None, 32


def _q4_1(b):
    return _nibbles(b[:, 4:20], 16).astype(np.int8), _f16(b[:, 0:2]), _f16(b[:, 2:4]), 32


def _q5_0(b):
    q = _nibbles(b[:, 6:22], 16) | (_high_bits(b[:, 2:6], 32) << np.uint8(4))
    return q.astype(np.int8) - np.int8(16), _f16(b[:, 0:2]), None, 32


def _q5_1(b):
    q = _nibbles(b[:, 8:24], 16) | (_high_bits(b[:, 4:8], 32) << np.uint8(4))
    return q.astype(np.int8), _f16(b[:, 0:2]), _f16(b[:, 2:4]), 32


def _q8_0(b):
    return b[:, 2:34].view(np.int8), _f16(b[:, 0:2]), None, 32


def _q4_k(b):
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    return _nibbles(b[:, 16:144], 32).astype(np.int8), d * sc, -(dmin * mn), 32, _factors([d, -dmin], [sc, mn])


def _factors(supers: list[np.ndarray], codes: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per block: its floats [blocks, 1, P] and its groups' integer codes [blocks, groups, P] (TwoLevelScales;
    the offset's float is -dmin: -(dmin * m) == (-dmin) * m bit for bit)."""
    return (np.stack([s.reshape(-1, 1) for s in supers], axis=-1).astype(np.float32),
            np.stack([c.reshape(c.shape[0], -1) for c in codes], axis=-1).astype(np.int8))


def _q5_k(b):
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    qh = b[:, 16:48].reshape(-1, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    q = _nibbles(b[:, 48:176], 32) | ((qh & np.uint8(1)).reshape(-1, QK_K) << np.uint8(4))
    return q.astype(np.int8), d * sc, -(dmin * mn), 32, _factors([d, -dmin], [sc, mn])


def _q6_k(b):
    n = b.shape[0]
    ql = _nibbles(b[:, 0:128], 64)
    qh = b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = (ql | ((qh & np.uint8(3)).reshape(n, QK_K) << np.uint8(4))).astype(np.int8) - np.int8(32)
    d, sc = _f16(b[:, 208:210]), b[:, 192:208].view(np.int8).astype(np.float32)
    return q, d * sc, None, 16, _factors([d], [sc])


# type name -> (weights per block, bytes per block, decoder)
DECODERS = {
    "Q4_0": (32, 18, _q4_0), "Q4_1": (32, 20, _q4_1), "Q5_0": (32, 22, _q5_0), "Q5_1": (32, 24, _q5_1),
    "Q8_0": (32, 34, _q8_0), "Q4_K": (QK_K, 144, _q4_k), "Q5_K": (QK_K, 176, _q5_k), "Q6_K": (QK_K, 210, _q6_k),
}


def decode(raw: np.ndarray, type_name: str) -> BlockWeight:
    """A GGUF tensor's bytes [N, row bytes] as a BlockWeight with N rows, in the file's row order."""
    per_block, size, decoder = DECODERS[type_name]
    rows = raw.shape[0]
    q, scale, offset, group, *factors = decoder(np.ascontiguousarray(raw).reshape(-1, size))
    scale = scale.reshape(rows, -1)
    offset = np.full_like(scale, NO_OFFSET) if offset is None else offset.reshape(rows, -1)
    q = q.reshape(rows, -1)
    assert q.shape[1] == scale.shape[1] * group and q.shape[1] % per_block == 0
    two = None
    if factors:
        supers, codes = factors[0]
        two = TwoLevelScales(torch.from_numpy(supers.reshape(rows, -1, supers.shape[-1])),
                             torch.from_numpy(codes.reshape(rows, -1, codes.shape[-1])))
    return BlockWeight(torch.from_numpy(np.ascontiguousarray(q)),
                       torch.from_numpy(np.stack([scale, offset], axis=-1)), group, two)


# --- which HF tensor a GGUF tensor is ---

_LAYER_TENSORS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                  "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                  "ffn_down": "mlp.down_proj"}


def hf_name(gguf_name: str) -> str | None:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.weight"
    return None


def _row_orders(name: str, rows: int, config) -> list[np.ndarray | None]:
    """The file's row order, then for Llama q/k the interleaved-rotary order transformers undoes."""
    orders: list[np.ndarray | None] = [None]
    heads = {"q_proj": config.num_attention_heads,
             "k_proj": getattr(config, "num_key_value_heads", config.num_attention_heads)}
    for proj, n_head in heads.items():
        if f".{proj}." in name and rows % (2 * n_head) == 0:
            orders.append(np.arange(rows).reshape(n_head, rows // n_head // 2, 2).swapaxes(2, 1).reshape(rows))
    return orders


def _bits_equal(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.contiguous().view(torch.int32))


def read_block_weights(path: Path, state: dict[str, Tensor], config) -> dict[str, BlockWeight]:
    """The GGUF file's quantized 2-D tensors as BlockWeights under their HF names, each one
    bit-identical (dequantized) to its float32 copy in `state`; any other stays float32."""
    from engine.models.gguf_file import read_tensors

    blocks: dict[str, BlockWeight] = {}
    kept: list[str] = []
    for tensor in read_tensors(path):
        name = hf_name(tensor.name)
        if name is None or name not in state or tensor.type_name not in DECODERS:
            continue
        decoded = decode(tensor.data, tensor.type_name)
        for order in _row_orders(name, decoded.shape[0], config):
            candidate = decoded if order is None else decoded.take(torch.from_numpy(order))
            if _bits_equal(candidate.dequantize(), state[name]):
                blocks[name] = candidate
                break
        else:
            kept.append(name)
    if kept:
        logger.warning("%s: %d tensors differ from their dequantized copy and stay float32: %s",
                       path.name, len(kept), ", ".join(kept[:5]))
    return blocks
