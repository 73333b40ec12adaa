"""Building a target's kernel library and checking that a process here can run it.

Each target compiles the same sources with its own flags into $TANDEM_CACHE_DIR/kernels (default
~/.cache/tandem/kernels), once per source hash and flags; later processes (Ray actors included) load
the built library in about a second. A CPU can list an extension that the OS (a hypervisor, a kernel
booted without its state) doesn't enable, and then the library's first instruction dies with SIGILL:
so a child process builds, loads and runs each target first, and the verdict is kept per library and
CPU (a build that fails is a verdict too, logged).
"""
from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
from pathlib import Path

from engine.kernels.targets import Target, cpu_features

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / name for name in ("skinny_linear.cpp", "int8_linear.cpp", "decode_ops.cpp", "decode_layer.cpp",
                                    "token_mask.cpp")]
HEADERS = sorted(CSRC.glob("*.h")) + sorted((CSRC / "simd").glob("*.h"))
# -ffp-contract=off: the block kernel's multiply and add are never fused (its weights equal the
# dequantized copy's); no -march: a cached library runs on any CPU of its target.
COMMON_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]


def flags(target: Target) -> list[str]:
    return [*COMMON_FLAGS, *target.flags, f"-DTANDEM_ISA={target.name}", f"-DTANDEM_OPS={target.namespace}"]


def library(target: Target) -> tuple[str, Path]:
    """The library's name and build directory (new whenever a source or a flag changes)."""
    from engine.models.loading import cache_dir  # here: loading imports the models, which import us

    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS) + " ".join(flags(target)).encode())
    name = f"{target.namespace}_{digest.hexdigest()[:12]}"
    return name, cache_dir() / "kernels" / name


def build_and_load(target: Target) -> None:
    """Compile (first time only) and load `target`'s library into this process."""
    from torch.utils import cpp_extension

    name, build_dir = library(target)
    build_dir.mkdir(parents=True, exist_ok=True)
    # cpp_extension runs `ninja` from PATH; the pip-installed one sits beside this interpreter,
    # which is not on PATH when the venv is used without activating it.
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), path])
    try:
        # cpp_extension holds a file lock while building, so concurrent actors build it once; the
        # library is loaded RTLD_LOCAL, so two targets' copies of a header's inline functions never mix.
        cpp_extension.load(name=name, sources=[str(p) for p in SOURCES], build_directory=str(build_dir),
                           extra_cflags=flags(target), extra_include_paths=[str(CSRC)], is_python_module=False)
    finally:
        os.environ["PATH"] = path


PROBE = """
import sys, torch
from engine.kernels.build import build_and_load
from engine.kernels.targets import BY_NAME
target = BY_NAME[sys.argv[1]]
build_and_load(target)
ops = getattr(torch.ops, target.namespace)
x, w = torch.ones(3, 64), torch.ones(8, 64)
assert torch.equal(ops.skinny_linear(x, w, None), x @ w.T)
u, dm = torch.ones(1, 16, 16, 4, dtype=torch.uint8), torch.ones(1, 2, 1, 16)
assert torch.allclose(ops.int8_linear(x, u, dm, 0, 16, 1, None), torch.full((3, 16), 64.0))
"""


def runs_here(target: Target) -> tuple[bool, str]:
    """Whether a process here can build, load and run `target`'s library, and if not, why."""
    _, build_dir = library(target)
    features = " ".join(sorted(cpu_features()))
    verdict = build_dir / f"runs-{hashlib.sha256(features.encode()).hexdigest()[:12]}"
    if verdict.exists():
        outcome = verdict.read_text()
    else:
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
        try:
            child = subprocess.run([sys.executable, "-c", PROBE, target.name], capture_output=True, timeout=900, env=env)
        except subprocess.TimeoutExpired:
            return False, "building and trying it took over 900 s"  # a slow machine, not a verdict: asked again next time
        outcome = "ok" if child.returncode == 0 else \
            f"signal {-child.returncode}" if child.returncode < 0 else f"exit {child.returncode}"
        if outcome != "ok":
            logger.warning("CPU kernels (%s): a process here could not build or run them (%s): %s", target.name,
                           outcome, child.stderr.decode(errors="replace")[-2000:])
        build_dir.mkdir(parents=True, exist_ok=True)
        verdict.write_text(outcome)
    return outcome == "ok", outcome
