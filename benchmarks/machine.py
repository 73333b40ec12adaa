"""Which machine a benchmark ran on, and results files that keep one row per machine (CPU model):
this machine kind's CPU changes between sessions, and each machine's numbers stay."""
from __future__ import annotations

import json
import platform
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
# the CPU flags that decide which kernels run (ours and llama.cpp's)
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")


def cpu_model() -> str:
    """The CPU's model name and the flags of FLAGS it has."""
    name, flags = platform.processor(), set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            name = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
    return f"{name} ({' '.join(f for f in FLAGS if f in flags)})"


def save(name: str, result: dict, key: tuple[str, ...] = ("cpu",)) -> Path:
    """Append this machine's row to benchmarks/results/<name>.json: one row per CPU model (and per the
    other `key` fields), a new run replacing the row it repeats."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    history = json.loads(path.read_text()) if path.exists() else []
    if isinstance(history, dict):  # a file from before rows were kept per machine: its one row stays
        history = [{"cpu": "not recorded", **history}]
    for h in history:  # rows from before --isa existed ran on each side's best build
        if "isa" in key:
            h.setdefault("isa", "native")
    history = [h for h in history if any(h.get(k) != result.get(k) for k in key)] + [result]
    path.write_text(json.dumps(history, indent=1))
    return path
