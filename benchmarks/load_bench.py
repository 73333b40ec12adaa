"""Peak resident memory of one tensor-parallel rank while it loads, against the bytes it keeps.

    .venv/bin/python benchmarks/load_bench.py [--preset llama-1.7b] [--world 2] [--dtype bfloat16]

Saves the random `--preset` model once as a Hugging Face directory (weights in `--dtype`, in
$TANDEM_CACHE_DIR/load_bench), then loads rank 0 of `--world` in a fresh process per method, one at
a time: "whole" (the previous path: every tensor read and converted to float32, the whole model
built, then sliced) and "sharded" (loading.load_sharded: meta device, only this rank's slices read).
Peak RSS is the process's VmHWM (the interpreter and torch included); the shard is the bytes of
the float32 parameters the rank keeps. Writes benchmarks/results/load_bench.json.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"

LOAD = """
import json, sys, time
import torch
from engine.models.loading import ModelSource, build_model, load_sharded, load_state_dict
from engine.models.tp import shard
method, directory, rank, world = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
source = ModelSource("hf_dir", directory)
start = time.perf_counter()
if method == "whole":
    config, state = load_state_dict(source)
    model = shard(build_model(config, state), rank, world, None)
    del state
else:
    config, model = load_sharded(source, torch.float32, "cpu", rank, world)
    model = shard(model, rank, world, None, sliced=True)
seconds = time.perf_counter() - start
kept = sum(p.numel() * p.element_size() for p in model.parameters())
# VmHWM: this process image's peak (ru_maxrss would carry the parent's peak across fork and exec)
hwm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"peak_rss": hwm, "shard_bytes": kept, "seconds": seconds}))
"""


def save_checkpoint(preset: str, dtype: str) -> Path:
    import torch
    from safetensors.torch import save_file

    from engine.models.loading import cache_dir
    from engine.models.presets import random_checkpoint

    directory = cache_dir() / "load_bench" / f"{preset}-{dtype}"
    if (directory / "done").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    config, tokenizer, state = random_checkpoint(preset, 0)
    config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    torch_dtype = getattr(torch, dtype)
    names = sorted(state)
    for i in range(0, len(names), 64):  # several files, as real checkpoints are
        save_file({n: state.pop(n).to(torch_dtype).contiguous() for n in names[i:i + 64]},
                  directory / f"model-{i // 64:05d}.safetensors")
    (directory / "done").write_text("")
    return directory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-1.7b")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    directory = save_checkpoint(args.preset, args.dtype)
    rows = []
    for method in ("whole", "sharded"):
        out = subprocess.run([sys.executable, "-c", LOAD, method, str(directory), "0", str(args.world)],
                             capture_output=True, text=True, cwd=ROOT)
        if out.returncode:
            sys.exit(out.stderr[-2000:])
        row = {"method": method, **json.loads(out.stdout.strip().splitlines()[-1])}
        row["peak_over_shard"] = row["peak_rss"] / row["shard_bytes"]
        rows.append(row)
        print(f"{method:<8} peak RSS {row['peak_rss'] / 2**30:6.2f} GiB, shard {row['shard_bytes'] / 2**30:5.2f} GiB "
              f"(float32), peak/shard {row['peak_over_shard']:.2f}x, {row['seconds']:.1f} s", flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "load_bench.json").write_text(json.dumps(
        {"preset": args.preset, "world": args.world, "checkpoint_dtype": args.dtype, "rank": 0, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
