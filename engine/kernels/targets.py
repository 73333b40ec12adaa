"""The instruction-set targets our CPU kernels are built for, and which of them this CPU runs.

Every target builds the same sources (csrc/) with its own compiler flags into its own library and op
namespace (`torch.ops.tandem_<name>`), so a machine with AVX-512 can load and test the AVX2 build
beside its own. `EngineConfig.cpu_isa` names one ("auto": the first of TARGETS this CPU runs; "none":
PyTorch and oneDNN only).

Another architecture is a row here (its flags, the CPU features it needs) and a vector header
csrc/simd/<arch>.h: e.g. ARM NEON, `Target("neon", ("-march=armv8.2-a+dotprod",), ("asimd", "asimddp"))`,
with csrc/simd/neon.h; the kernels' sources stay as they are.
"""
from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Target:
    name: str                       # cpu_isa's value; the op namespace is tandem_<name>
    flags: tuple[str, ...]          # compiler flags (never -march=native: a build runs on any CPU of its target)
    features: tuple[str, ...]       # what /proc/cpuinfo lists where this target's instructions run
    summary: str

    @property
    def namespace(self) -> str:
        return f"tandem_{self.name}"


_AVX2 = ("-mavx2", "-mfma", "-mf16c")
_AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mfma", "-mf16c")

# Best first: "auto" takes the first this CPU runs.
TARGETS: tuple[Target, ...] = (
    Target("avx512_vnni", _AVX512 + ("-mavx512vnni",),
           ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "fma", "f16c"),
           "AVX-512 with VNNI (Ice Lake and later Xeons, Zen 4/5): 16 lanes, vpdpbusd"),
    Target("avx512", _AVX512, ("avx512f", "avx512bw", "avx512dq", "avx512vl", "fma", "f16c"),
           "AVX-512 F/BW/DQ/VL (Skylake-X): 16 lanes, vpmaddubsw"),
    Target("avx_vnni", _AVX2 + ("-mavxvnni",), ("avx2", "fma", "f16c", "avx_vnni"),
           "AVX2 with AVX-VNNI (Alder Lake and later cores): 8 lanes, 256-bit vpdpbusd"),
    Target("avx2", _AVX2, ("avx2", "fma", "f16c"),
           "AVX2 + FMA + F16C (x86-64-v3: Haswell and later, every Zen): 8 lanes, vpmaddubsw"),
)
BY_NAME = {t.name: t for t in TARGETS}
CPU_ISA_CHOICES = ("auto", *BY_NAME, "none")


@functools.lru_cache(maxsize=None)
def cpu_features() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (CPUID, less what the kernel didn't enable); empty
    where there is no /proc/cpuinfo or the CPU is not x86."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return frozenset()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((l for l in text.splitlines() if l.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def missing(target: Target, features: frozenset[str] | None = None) -> list[str]:
    """The features `target` needs that the CPU lacks."""
    have = cpu_features() if features is None else features
    return [f for f in target.features if f not in have]


def cpu_runs(features: frozenset[str] | None = None) -> list[Target]:
    """The targets whose instructions this CPU has, best first."""
    return [t for t in TARGETS if not missing(t, features)]
