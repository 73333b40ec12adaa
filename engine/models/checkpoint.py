"""A rank's slices of a safetensors checkpoint, read without holding the rest of it.

safetensors' own loader maps each file: the pages a rank touches count towards its resident
memory until the file is closed, so a rank reading its half of every tensor peaks near twice its
shard. Here each slice is read with plain reads into a tensor of its own: what stays resident is
the shard, plus one slice (in the checkpoint's dtype) while it is converted.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
COLUMN_CHUNK_BYTES = 16 << 20  # a column slice reads whole rows, this many bytes at a time


@dataclass(frozen=True)
class Entry:
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # of the tensor's first byte in the file


class Checkpoint:
    """The tensors of a directory's *.safetensors files, by name (headers only, until `read`)."""

    def __init__(self, directory: Path):
        self.entries: dict[str, Entry] = {}
        for path in sorted(Path(directory).glob("*.safetensors")):
            with open(path, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                if meta["dtype"] not in DTYPES:
                    raise ValueError(f"{path.name}: tensor {name} has dtype {meta['dtype']}, which Tandem does not read")
                self.entries[name] = Entry(path, DTYPES[meta["dtype"]], tuple(meta["shape"]),
                                           8 + size + meta["data_offsets"][0])
        if not self.entries:
            raise ValueError(f"{directory} has no *.safetensors weights")

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape

    def read(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> Tensor:
        """The tensor, or rows [r0, r1) of it, or columns [c0, c1) of a matrix, in its own dtype."""
        e = self.entries[name]
        itemsize = torch.empty(0, dtype=e.dtype).element_size()
        with open(e.path, "rb", buffering=0) as f:
            if cols is None:
                r0, r1 = rows or (0, e.shape[0] if e.shape else 1)
                row = math.prod(e.shape[1:])
                out = torch.empty((r1 - r0, *e.shape[1:]) if e.shape else (), dtype=e.dtype)
                _read_into(f, e.offset + r0 * row * itemsize, out)
                return out
            n, k = e.shape
            c0, c1 = cols
            out = torch.empty((n, c1 - c0), dtype=e.dtype)
            step = max(1, COLUMN_CHUNK_BYTES // (k * itemsize))
            buffer = torch.empty((min(step, n), k), dtype=e.dtype)
            for r in range(0, n, step):
                part = buffer[: min(step, n - r)]
                _read_into(f, e.offset + r * k * itemsize, part)
                out[r : r + len(part)] = part[:, c0:c1]
            return out


def _read_into(f, offset: int, out: Tensor) -> None:
    view = memoryview(out.view(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
    f.seek(offset)
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise ValueError(f"{f.name}: ends inside a tensor (truncated file?)")
        done += n
