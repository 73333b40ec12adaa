"""One linear at a time: the int8 kernel (gguf_weights: int8) on every kernel target this CPU runs
(AVX-512 VNNI, AVX-512, AVX-VNNI, AVX2), against the float32 block kernel of the best target
(gguf_weights: blocks; oneDNN on a dequantized copy past 64 rows), on the embedded models' shapes and
quantization types, at the row counts of decode (1), verify (5, 8 x 5 = 40), batched decode (8, 64)
and prefill (256).

    .venv/bin/python benchmarks/int8_linear_bench.py [--threads 2] [--targets avx2,avx512_vnni]

Random weights in each type's integer range and scale layout (the kernels' cost does not depend on
the values). Each cell: the best of 3 timed loops, the kernels alternating. Prints a table and
writes benchmarks/results/int8_linear_bench.json (one row per machine).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model, save  # noqa: E402

# name, N, K, q range, group, offsets: Gemma 3 270M (Q8_0 LM head, Q5_0 gate|up, Q6_K down), SmolLM2 (Q4_1)
SHAPES = [("Gemma LM head, Q8_0", 262144, 640, (-128, 127), 32, False),
          ("Gemma gate|up, Q5_0", 4096, 640, (-16, 15), 32, False),
          ("Gemma down, Q6_K", 640, 2048, (-32, 31), 16, False),
          ("SmolLM2 gate|up, Q4_1", 3072, 576, (0, 15), 32, True)]
ROWS = (1, 5, 8, 40, 64, 256)


def best_ms(fn, macs: float) -> float:
    reps = max(1, int(1e9 / macs))
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--targets", default=None, help="comma-separated kernel targets (default: every one this CPU runs)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from engine import kernels
    from engine.models.gguf_blocks import BlockWeight, Int8Blocks

    names = args.targets.split(",") if args.targets else kernels.runnable()
    targets = {name: kernels.choose(name) for name in names}
    if not targets:
        sys.exit("no kernel target runs here (no AVX2, not x86, or no compiler)")
    best = targets[names[0]]
    gen = torch.Generator().manual_seed(0)
    result = {"cpu": cpu_model(), "threads": args.threads, "date": time.strftime("%Y-%m-%d"), "targets": names,
              "rows": []}
    print(f"{'linear':<24}{'rows':>5}{'blocks ms':>11}" + "".join(f"{n + ' ms':>16}" for n in names)
          + f"{names[0] + ' GMAC/s':>20}")
    for name, n, k, (lo, hi), group, offsets in SHAPES:
        q = torch.randint(lo, hi + 1, (n, k), generator=gen).to(torch.int8)
        so = torch.rand(n, k // group, 2, generator=gen).half().float() * 0.01
        if not offsets:
            so[..., 1] = -0.0
        weight = BlockWeight(q, so, group)
        packed, int8 = weight.packed(), Int8Blocks.of(weight)
        for m in ROWS:
            x = torch.randn(m, k, generator=gen)
            if m <= kernels.MAX_ROWS:
                def blocks():
                    best.ops.block_linear(x, packed.q, packed.scale_offset, packed.zero, packed.rows, None)
            else:
                def blocks():
                    w = best.ops.block_dequantize(packed.q, packed.scale_offset, packed.zero, packed.rows)
                    torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

            def on_int8(ops):
                return lambda: ops.int8_linear(x, int8.u, int8.dm, int8.lo, int8.rows, int8.max_code, None)
            macs = float(n * k * max(m, 4))
            t_blocks = best_ms(blocks, macs)
            t_int8 = {t: best_ms(on_int8(k_.ops), macs) for t, k_ in targets.items()}
            row = {"linear": name, "rows": m, "blocks_ms": t_blocks, "int8_ms": t_int8,
                   "int8_gmac_s": n * k * m / t_int8[names[0]] / 1e6}
            result["rows"].append(row)
            print(f"{name:<24}{m:>5}{t_blocks:>11.2f}" + "".join(f"{t_int8[t]:>16.2f}" for t in names)
                  + f"{row['int8_gmac_s']:>20.1f}", flush=True)
    print(f"wrote {save('int8_linear_bench', result, key=('cpu', 'threads', 'targets'))}")


if __name__ == "__main__":
    main()
