"""Our CPU kernels, compiled on first use: small-M linears (csrc/skinny_linear.cpp: float32 and int8-block
weights), GGUF blocks times int8 activations (csrc/int8_linear.cpp, AVX-512 VNNI), the rest of a decode step's layer (csrc/decode_ops.cpp: RMSNorm, attention, gated activation),
the whole layer as one call (csrc/decode_layer.cpp), and a grammar's token bitmask on logits
(csrc/token_mask.cpp).

Compiled for any AVX-512 CPU (not -march=native, so a cache or image built on one machine runs on
another) into $TANDEM_CACHE_DIR/kernels (default ~/.cache/tandem/kernels), once per source and
flags; later processes (Ray actors included) load the built library in about a second. Where it
cannot be built (no AVX-512, no compiler), where the OS doesn't let a process run it (a child process
tries it once per CPU), callers fall back to oneDNN with a log line; EngineConfig.cpu_kernels
turns them off on purpose.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).parent / "csrc" / name
           for name in ("skinny_linear.cpp", "int8_linear.cpp", "decode_ops.cpp", "decode_layer.cpp", "token_mask.cpp")]
HEADERS = [Path(__file__).parent / "csrc" / "kernels.h"]
CFLAGS = ["-O3", "-mavx512f", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"]  # block_linear: never fuse its multiply-add
# Up to this many rows (decode, verify steps of a batch, short prefills) the kernel runs within ~10% of
# oneDNN's blocked GEMM (at 17-64 rows) or faster (fewer), with every row independent of the others;
# beyond, oneDNN. Block weights need it most: oneDNN reads them only dequantized, per call.
MAX_ROWS = 64


def _cpu_has_avx512() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512f " in flags or " avx512f\n" in flags


@functools.lru_cache(maxsize=None)
def skinny_kernel_available() -> bool:
    """Build (first time only) and load the kernel; False with a logged reason if it can't be."""
    if not _cpu_has_avx512():
        logger.info("skinny linear kernel: CPU has no AVX-512; using oneDNN for every linear")
        return False
    if not _runs_here():
        return False
    try:
        _build_and_load()
    except Exception as exc:  # no compiler, no ninja, a broken toolchain: oneDNN still works
        logger.warning("skinny linear kernel could not be built (%s); using oneDNN for every linear", exc)
        return False
    return True


@functools.lru_cache(maxsize=None)
def int8_kernel_available() -> bool:
    """The int8 kernel (csrc/int8_linear.cpp) needs AVX-512 VNNI besides the rest."""
    if not skinny_kernel_available():
        return False
    if not torch.ops.tandem.int8_kernel_runs():
        logger.warning("int8 kernel: this CPU has no AVX-512 VNNI; GGUF blocks are multiplied in float32 "
                       "(gguf_weights: blocks), which is slower")
        return False
    return True


def _library() -> tuple[str, Path]:
    from engine.models.loading import cache_dir  # here: loading imports the model, which imports us

    version = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS) + " ".join(CFLAGS).encode()).hexdigest()[:12]
    name = f"tandem_skinny_{version}"
    return name, cache_dir() / "kernels" / name


def _build_and_load() -> None:
    from torch.utils import cpp_extension

    name, build_dir = _library()
    build_dir.mkdir(parents=True, exist_ok=True)
    # cpp_extension runs `ninja` from PATH; the pip-installed one sits beside this interpreter,
    # which is not on PATH when the venv is used without activating it.
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), path])
    try:
        # cpp_extension holds a file lock while building, so concurrent actors build it once.
        cpp_extension.load(name=name, sources=[str(p) for p in SOURCES], build_directory=str(build_dir),
                           extra_cflags=CFLAGS, is_python_module=False)
    finally:
        os.environ["PATH"] = path


PROBE = """
import torch
from engine.models.skinny import _build_and_load
_build_and_load()
x, w = torch.ones(3, 64), torch.ones(8, 64)
assert torch.equal(torch.ops.tandem.skinny_linear(x, w, None), x @ w.T)
if torch.ops.tandem.int8_kernel_runs():
    u, dm = torch.ones(1, 16, 16, 4, dtype=torch.uint8), torch.ones(1, 2, 1, 16)
    assert torch.allclose(torch.ops.tandem.int8_linear(x, u, dm, 0, 16, None), torch.full((3, 16), 64.0))
"""


def _runs_here() -> bool:
    """Whether the kernels' instructions run in a process here: a CPU can list AVX-512 while the OS
    (a hypervisor, a kernel booted without its state) doesn't enable it, and then the library's
    first instruction dies with SIGILL. So a child process builds, loads and runs it first; the
    verdict is kept per library and CPU (a build that fails is a verdict too: logged here)."""
    import subprocess

    _, build_dir = _library()
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    verdict = build_dir / f"runs-{hashlib.sha256(flags.encode()).hexdigest()[:12]}"
    if verdict.exists():
        outcome = verdict.read_text()
    else:
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
        try:
            child = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, timeout=900, env=env)
        except subprocess.TimeoutExpired:
            logger.warning("skinny linear kernel: building and trying it took over 900 s; using oneDNN this time")
            return False  # a slow machine, not a verdict: asked again next time
        outcome = "ok" if child.returncode == 0 else \
            f"signal {-child.returncode}" if child.returncode < 0 else f"exit {child.returncode}"
        if outcome != "ok":
            logger.warning("skinny linear kernel: a process here could not build or run it (%s): %s",
                           outcome, child.stderr.decode(errors="replace")[-2000:])
        build_dir.mkdir(parents=True, exist_ok=True)
        verdict.write_text(outcome)
    if outcome != "ok":
        logger.warning("skinny linear kernel: unusable on this machine (%s); using oneDNN for every linear", outcome)
    return outcome == "ok"
