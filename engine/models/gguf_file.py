"""A GGUF file's tensor table, read without decoding its metadata.

gguf's GGUFReader builds a numpy view for every metadata element: on Gemma 3's file (a 262k-token
vocabulary in the metadata) that is ~18 s of a ~27 s model load, for values we never use (the
tokenizer comes from the dequantized directory). This reader walks the metadata by length only
(one `struct` read per string) and maps each tensor's bytes as GGUFReader shapes them: quantized
types as uint8 [rows..., bytes per row]."""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GGUF_MAGIC = b"GGUF"
_ALIGNMENT_KEY = "general.alignment"
# metadata value types (gguf spec): fixed sizes; 8 is a string, 9 an array
_FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GgufTensor:
    name: str
    type_name: str  # GGMLQuantizationType's name: "Q4_K", "F32", ...
    data: np.ndarray  # a read-only view into the mapped file


class GgufFormatError(ValueError):
    pass


def read_tensors(path: str | Path) -> list[GgufTensor]:
    """Every tensor of the GGUF file at `path`, in file order, its bytes mapped (not copied)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if buf[:4] != GGUF_MAGIC:
        raise GgufFormatError(f"{Path(path).name}: not a GGUF file (magic {bytes(buf[:4])!r})")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise GgufFormatError(f"{Path(path).name}: GGUF version {version} (only 2 and 3 are read; "
                              "a big-endian file reads as a huge version)")
    pos = 24
    alignment = 32

    def string() -> str:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", buf, pos)
        pos += 8 + n
        return buf[pos - n:pos].decode("utf-8")

    def skip(value_type: int, count: int = 1) -> None:
        nonlocal pos
        if value_type in _FIXED_SIZES:
            pos += _FIXED_SIZES[value_type] * count
        elif value_type == _STRING:
            unpack = struct.Struct("<Q").unpack_from
            for _ in range(count):
                pos += 8 + unpack(buf, pos)[0]
        elif value_type == _ARRAY:
            for _ in range(count):
                element_type, n = struct.unpack_from("<IQ", buf, pos)
                pos += 12
                skip(element_type, n)
        else:
            raise GgufFormatError(f"{Path(path).name}: unknown metadata type {value_type} at byte {pos}")

    for _ in range(n_kv):
        key = string()
        (value_type,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if key == _ALIGNMENT_KEY and value_type == 4:
            (alignment,) = struct.unpack_from("<I", buf, pos)
        skip(value_type)

    infos = []
    for _ in range(n_tensors):
        name = string()
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        type_id, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        infos.append((name, dims, GGMLQuantizationType(type_id), offset))
    start = -(-pos // alignment) * alignment

    tensors = []
    for name, dims, qtype, offset in infos:
        block, size = GGML_QUANT_SIZES[qtype]
        if dims[0] % block:
            raise GgufFormatError(f"{Path(path).name}: {name}'s rows ({dims[0]}) are not whole blocks of {block}")
        row_bytes = dims[0] // block * size
        outer = tuple(reversed(dims[1:]))  # numpy order: the row length (ne[0]) last
        n_bytes = row_bytes * int(np.prod(outer, dtype=np.int64))
        raw = np.frombuffer(buf, dtype=np.uint8, count=n_bytes, offset=start + offset)
        if block == 1:  # plain types: elements, as GGUFReader gives them
            data = raw.view(_PLAIN_DTYPES[qtype.name]).reshape(*outer, dims[0])
        else:
            data = raw.reshape(*outer, row_bytes)
        tensors.append(GgufTensor(name, qtype.name, data))
    return tensors


_PLAIN_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                 "I32": np.int32, "I64": np.int64, "BF16": np.uint16}
