"""Cost of one forward step at batch 1: 1 token (plain decode) vs 5 tokens (verify K=4), ours vs
transformers' own forward on the same weights, against the memory-bandwidth floor.

    .venv/bin/python benchmarks/decode_step.py [--models smollm2 llama-1.7b] [--iters 20]

Prints a table and writes benchmarks/results/decode_step.json. All numbers of one run come from
the same process, so compare ratios, not absolute times (the machine is shared).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.kv_cache import KVCache
from engine.models import build_model, load_state_dict, resolve_model
from engine.models.linear import onednn_available, pack_linears
from engine import kernels as cpu_kernels

MODELS = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct", "llama-1.7b": "random:llama-1.7b"}
CONTEXT = 128  # tokens already in the cache when the timed step runs


def timed(fn, iters: int) -> float:
    """Median milliseconds of fn() over iters runs, after two warm-up runs."""
    return timed_together([fn], iters)[0]


def timed_together(fns, iters: int) -> list[float]:
    """Median milliseconds of each of fns, run in turn iters times: the machine is shared, and
    interleaving lets the 1-token and 5-token steps see the same noise."""
    for fn in fns:
        fn(), fn()
    times = [[] for _ in fns]
    for _ in range(iters):
        for fn, ts in zip(fns, times):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
    return [statistics.median(ts) for ts in times]


def matvec_bandwidth(iters: int) -> float:
    """Bytes/s of the fastest float32 matrix-vector product here (MKL, oneDNN-packed or our
    kernel) over a 512 MB matrix, far larger than any cache."""
    w = torch.randn(65536, 2048)
    x = torch.randn(1, 2048)
    best = timed(lambda: F.linear(x, w), iters)
    if onednn_available():
        packed = w.to_mkldnn()
        best = min(best, timed(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), iters))
    if (kernels := cpu_kernels.choose()) is not None:
        best = min(best, timed(lambda: kernels.ops.skinny_linear(x, w, None), iters))
    return w.numel() * 4 / (best / 1e3)


@torch.inference_mode()
def bench_ours(config, state, iters: int, dtype: torch.dtype, skinny: bool) -> dict[str, float]:
    model = build_model(config, state, dtype=dtype)
    model.fuse_projections()
    pack_linears(model, "auto" if skinny else None)  # float32 only; bfloat16 runs F.linear (oneDNN inside)
    a = model.args
    cache = KVCache(a.num_layers, 1, CONTEXT + 8, a.num_kv_heads, a.head_dim, dtype)
    slots = torch.tensor([0])
    prompt = torch.randint(0, a.vocab_size, (1, CONTEXT), generator=torch.Generator().manual_seed(0))
    model(prompt, torch.arange(CONTEXT)[None], cache, slots)
    steps = [lambda n=n: model(prompt[:, :n], torch.arange(CONTEXT, CONTEXT + n)[None], cache, slots)
             for n in (1, 5)]
    one, five = timed_together(steps, iters)
    return {"ours_1": one, "ours_5": five}


@torch.inference_mode()
def bench_hf(config, state, iters: int, dtype: torch.dtype) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, DynamicCache

    with torch.device("meta"):  # no random init: the weights are assigned from `state`
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype)
    hf.to_empty(device="cpu")
    hf.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    rotary = hf.model.rotary_emb  # its inv_freq buffer is not in the state dict: rebuild it
    hf.model.rotary_emb = type(rotary)(config=config)
    if config.tie_word_embeddings:
        hf.tie_weights()
    hf.eval()
    prompt = torch.randint(0, config.vocab_size, (1, CONTEXT), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=config)
    hf(prompt, past_key_values=cache, use_cache=True)
    def step(n: int) -> None:
        hf(prompt[:, :n], past_key_values=cache, use_cache=True)
        cache.crop(-n)  # drop the n tokens just added

    one, five = timed_together([lambda: step(1), lambda: step(5)], iters)
    return {"hf_1": one, "hf_5": five}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "decode_step.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    skinny = cpu_kernels.choose() is not None
    bandwidth = matvec_bandwidth(args.iters)
    rows = []
    for key in args.models:
        config, state = load_state_dict(resolve_model(MODELS[key]))
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            weight_bytes = sum(t.numel() * dtype.itemsize for t in state.values())
            row = {"model": key, "dtype": dtype_name, "weight_mb": weight_bytes / 1e6,
                   "floor_ms": weight_bytes / bandwidth * 1e3}
            row.update(bench_ours(config, state, args.iters, dtype, skinny=skinny))
            if dtype == torch.float32 and skinny:  # the oneDNN-only path, for comparison
                row.update({k.replace("ours", "onednn"): v for k, v in
                            bench_ours(config, state, args.iters, dtype, skinny=False).items()})
            row.update(bench_hf(config, state, args.iters, dtype))
            row["ours_5_over_1"] = row["ours_5"] / row["ours_1"]
            row["hf_5_over_1"] = row["hf_5"] / row["hf_1"]
            row["hf_1_over_ours_1"] = row["hf_1"] / row["ours_1"]
            rows.append(row)
        del state

    print(f"matrix-vector bandwidth: {bandwidth / 1e9:.1f} GB/s, context {CONTEXT} tokens, "
          f"{args.threads} threads, median of {args.iters}")
    head = f"{'model':<11}{'dtype':<9}{'floor':>8}{'ours 1':>9}{'ours 5':>9}{'5/1':>6}{'HF 1':>9}{'HF 5':>9}{'5/1':>6}{'HF/ours':>9}"
    print(head)
    for r in rows:
        print(f"{r['model']:<11}{r['dtype']:<9}{r['floor_ms']:>7.1f} {r['ours_1']:>8.1f} {r['ours_5']:>8.1f} "
              f"{r['ours_5_over_1']:>5.2f} {r['hf_1']:>8.1f} {r['hf_5']:>8.1f} {r['hf_5_over_1']:>5.2f} "
              f"{r['hf_1_over_ours_1']:>8.2f}x")
        if "onednn_1" in r:
            print(f"{'  (oneDNN only)':<28}{r['onednn_1']:>8.1f} {r['onednn_5']:>8.1f} "
                  f"{r['onednn_5'] / r['onednn_1']:>5.2f}")
    print("(milliseconds per forward at batch 1; floor = weight bytes / float32 matrix-vector bandwidth)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"bandwidth_gb_s": bandwidth / 1e9, "context": CONTEXT,
                                          "threads": args.threads, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
