"""Our CPU kernels, and the one place Python reaches them (vLLM's csrc/ with its _custom_ops facade):

- csrc/skinny_linear.cpp: float32 and block-weight linears for the few rows of decode and verify steps;
- csrc/int8_linear.cpp: GGUF blocks times int8 activations, any number of rows;
- csrc/decode_ops.cpp: RMSNorm, attention over block tables and ragged rows, the gated activation;
- csrc/decode_layer.cpp: a whole decoder layer as one call; csrc/token_mask.cpp: a grammar's bitmask.

Each op has one source, written in the vector layer of csrc/simd.h and built for every target of
targets.py (AVX2, AVX-VNNI, AVX-512, AVX-512 VNNI); `choose("auto")` takes the best one this CPU runs
(its CPUID flags, then a child process that builds and runs it), `choose("avx2")` a given one, and
`choose("none")` none: PyTorch and oneDNN then, with one log line. A process uses the target its
engine's config names (`cpu_isa`); several can be loaded side by side (the tests run every one the
machine can execute).
"""
from __future__ import annotations

import functools
import logging
import threading

import torch

from engine.kernels import build
from engine.kernels.targets import BY_NAME, CPU_ISA_CHOICES, TARGETS, Target, cpu_features, cpu_runs, missing

__all__ = ["Kernels", "MAX_ROWS", "CPU_ISA_CHOICES", "TARGETS", "choose", "load", "runnable", "active", "select"]

logger = logging.getLogger(__name__)

# Up to this many rows (decode, verify steps of a batch, short prefills) the small-row kernels run within
# ~10% of oneDNN's blocked GEMM (at 17-64 rows) or faster (fewer), with every row independent of the
# others; beyond, oneDNN. Block weights need it most: oneDNN reads them only dequantized, per call.
MAX_ROWS = 64


class Kernels:
    """The ops of one target's library: `ops.<op>(...)` (torch.ops.tandem_<target>) and its DecodeLayer."""

    def __init__(self, target: Target):
        self.target = target
        self.name = target.name
        self.ops = getattr(torch.ops, target.namespace)
        self._classes = getattr(torch.classes, target.namespace)

    def decode_layer(self, *args):
        """A csrc/decode_layer.cpp DecodeLayer(heads, scale, window, eps, norm_offset, gelu) of this target."""
        return self._classes.DecodeLayer(*args)

    def __repr__(self) -> str:
        return f"Kernels({self.name})"


_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _loaded(name: str) -> Kernels | str:
    """The target's Kernels, or why it can't be had here."""
    target = BY_NAME[name]
    if lacks := missing(target):
        return f"this CPU has no {', '.join(lacks)}"
    ok, outcome = build.runs_here(target)
    if not ok:
        return f"a process here could not build or run it ({outcome})"
    try:
        build.build_and_load(target)
    except Exception as exc:  # no compiler, no ninja, a broken toolchain: PyTorch still works
        return f"it could not be built ({exc})"
    return Kernels(target)


def load(name: str) -> Kernels | None:
    """The kernels of target `name` (built on first use), or None where this machine can't run them."""
    with _lock:
        got = _loaded(name)
    return got if isinstance(got, Kernels) else None


def runnable() -> list[str]:
    """Every target whose instructions this CPU has, best first (the tests run each)."""
    return [t.name for t in cpu_runs()]


@functools.lru_cache(maxsize=None)
def choose(cpu_isa: str = "auto") -> Kernels | None:
    """The kernels for EngineConfig.cpu_isa: "auto" the best target that builds and runs here (None, with a
    log line, where none does: no AVX2, not x86, no compiler), "none" None, a target's name that one (a
    ValueError saying why where it can't run here)."""
    if cpu_isa not in CPU_ISA_CHOICES:
        raise ValueError(f"cpu_isa must be one of {', '.join(CPU_ISA_CHOICES)}, got {cpu_isa!r}")
    if cpu_isa == "none":
        logger.info("CPU kernels: off (cpu_isa none): PyTorch and oneDNN for every op")
        return None
    if cpu_isa != "auto":
        with _lock:
            got = _loaded(cpu_isa)
        if isinstance(got, str):
            raise ValueError(f"cpu_isa {cpu_isa}: {got}; the targets this CPU runs: "
                             f"{', '.join(runnable()) or 'none'} (or auto, none)")
        logger.info("CPU kernels: %s (cpu_isa %s)", got.name, cpu_isa)
        return got
    reasons = []
    for target in cpu_runs():
        with _lock:
            got = _loaded(target.name)
        if isinstance(got, Kernels):
            logger.info("CPU kernels: %s (%s)", got.name, target.summary)
            return got
        reasons.append(f"{target.name}: {got}")
        logger.warning("CPU kernels: %s unusable: %s", target.name, got)
    why = "; ".join(reasons) if reasons else \
        "this CPU has no AVX2/FMA/F16C" if cpu_features() else "not an x86-64 CPU with /proc/cpuinfo"
    logger.warning("CPU kernels: none runs here (%s); PyTorch and oneDNN for every op, GGUF weights as float32", why)
    return None


_active: Kernels | None = None


def select(cpu_isa: str = "auto") -> Kernels | None:
    """choose(cpu_isa), and make it this process's kernels for the ops that take no model (grammar masks)."""
    global _active
    _active = choose(cpu_isa)
    return _active


def active() -> Kernels | None:
    """The kernels select() last chose in this process (None before, or where there are none)."""
    return _active
