"""The GPU speed row: speculation against plain decoding on real model shapes, and a step's time
against the memory roofline. Run by scripts/gpu_check.sh after the `cuda` tests.

    python benchmarks/gpu_speed.py                # Qwen3-8B-shaped target, Qwen3-0.6B-shaped draft, bf16, GPU
    python benchmarks/gpu_speed.py --dry-run      # tiny shapes on the CPU: everything but the device

Weights are random (`random:qwen3-8b`, `random:qwen3-0.6b`): no download, and the shapes are what
decide a step's time. Random drafts are never accepted, so acceptance is synthetic, with vLLM's
semantics (`rejection_sample_method: synthetic`, `synthetic_acceptance_length`: the mean number of
tokens a verify step emits). Greedy, one stream, `ignore_eos`. Prints one table and writes
benchmarks/results/gpu_speed.json (one row per device).

Columns: tokens/s with and without speculation and their ratio; the plain step's time against the
time to read the target's weights once at the bandwidth a device-to-device copy measures (a decode
step at batch 1 reads every weight once, so that is its floor); a verify step's time against the plain
step's (v, the cost of K+1 tokens against 1).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from engine import LLM, SamplingParams

RESULTS = Path(__file__).parent / "results"
REAL = {"target": "random:qwen3-8b", "draft": "random:qwen3-0.6b", "device": "cuda", "dtype": "bfloat16"}
DRY = {"target": "random:tiny-qwen3", "draft": "random:tiny-qwen3:1", "device": "cpu", "dtype": "float32"}


def weight_bytes(model: str, dtype: torch.dtype) -> int:
    """Bytes of a random preset's weights in `dtype` (a tied LM head counted once)."""
    from engine.models.loading import load_config, resolve_model
    from engine.models.transformer import ModelArgs, Transformer

    args = ModelArgs.from_hf_config(load_config(resolve_model(model)))
    with torch.device("meta"):
        params = dict(Transformer(args).named_parameters())  # a tied LM head is listed once
    return sum(p.numel() for p in params.values()) * torch.empty(0, dtype=dtype).element_size()


def copy_bandwidth(device: str, nbytes: int, repeats: int = 10) -> float:
    """Bytes per second a device-to-device copy moves (read plus write), the best of `repeats`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def decode_rate(llm: LLM, prompt: list[int], tokens: int, device: str) -> float:
    """Output tokens per second of one greedy stream (after one warm-up request)."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    sync(device)
    t = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0]
    sync(device)
    assert len(out.token_ids) == tokens, f"expected {tokens} tokens, got {len(out.token_ids)}"
    return tokens / (time.perf_counter() - t)


def profile_decode(llm: LLM, prompt: list[int], device: str, out: Path, steps: int = 8) -> None:
    """Where a plain decode step's time goes: torch.profiler over `steps` tokens (the ops by their own
    host time and by device time), then cProfile over the same (the Python functions by their own time).
    Written to `out`; the head of each printed."""
    import cProfile
    import io
    import pstats
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    request = [{"prompt_token_ids": prompt}]
    with profile(activities=activities) as prof:
        llm.generate(request, params)
        sync(device)
    table = prof.key_averages()
    text = f"{steps} decode tokens (and the prompt's prefill)\n\nops by host time\n"
    text += table.table(sort_by="self_cpu_time_total", row_limit=25) + "\n"
    if device == "cuda":
        text += "\nops by device time\n" + table.table(sort_by="self_cuda_time_total", row_limit=15) + "\n"
    python = cProfile.Profile()
    t = time.perf_counter()
    python.runcall(llm.generate, request, params)
    sync(device)
    wall = time.perf_counter() - t
    buf = io.StringIO()
    pstats.Stats(python, stream=buf).sort_stats("tottime").print_stats(30)
    text += f"\nPython functions by own time ({1e3 * wall:.1f} ms wall under cProfile)\n" + buf.getvalue()
    out.write_text(text)
    print(text[:12000])


def run(models: dict, k: int, acceptance_length: float, tokens: int, prompt_len: int,
        profile: Path | None = None) -> dict:
    device, dtype = models["device"], getattr(torch, models["dtype"])
    common = dict(dtype=models["dtype"], device=device, max_model_len=prompt_len + tokens + 64, seed=0)
    # plain decoding first, then the same target with the draft: one engine at a time on the device
    plain = LLM(models["target"], **common)
    vocab = len(plain.get_tokenizer())
    prompt = [(7 * i + 3) % (vocab - 3) + 3 for i in range(prompt_len)]  # past the special tokens
    plain_tok_s = decode_rate(plain, prompt, tokens, device)
    if profile:
        profile_decode(plain, prompt, device, profile)
    plain.shutdown()
    del plain
    if device == "cuda":
        torch.cuda.empty_cache()
    spec = LLM(models["target"], speculative_config={
        "model": models["draft"], "num_speculative_tokens": k, "method": "draft_model",
        "rejection_sample_method": "synthetic", "synthetic_acceptance_length": acceptance_length}, **common)
    spec_tok_s = decode_rate(spec, prompt, tokens, device)
    stats = spec.spec_decode_stats
    spec.shutdown()
    target_bytes = weight_bytes(models["target"], dtype)
    bandwidth = copy_bandwidth(device, min(2**30, 4 * target_bytes))
    step_s = 1 / plain_tok_s
    # a speculative round: K draft steps and one verify, emitting the mean acceptance length
    round_s = stats.mean_acceptance_length / spec_tok_s
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
        "date": time.strftime("%Y-%m-%d"),
        "target": models["target"], "draft": models["draft"], "dtype": models["dtype"],
        "k": k, "synthetic_acceptance_length": acceptance_length, "tokens": tokens, "prompt_tokens": prompt_len,
        "plain_tok_s": round(plain_tok_s, 2), "spec_tok_s": round(spec_tok_s, 2),
        "speedup": round(spec_tok_s / plain_tok_s, 3),
        "mean_acceptance_length": round(stats.mean_acceptance_length, 3),
        "target_weight_gb": round(target_bytes / 1e9, 3), "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "plain_step_ms": round(1e3 * step_s, 3), "roofline_step_ms": round(1e3 * target_bytes / bandwidth, 3),
        "roofline_fraction": round(target_bytes / bandwidth / step_s, 3),
        "spec_round_ms": round(1e3 * round_s, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (checks all but the device)")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--acceptance-length", type=float, default=3.0, help="synthetic_acceptance_length, in [1, K+1]")
    p.add_argument("--tokens", type=int, default=None, help="output tokens per stream (default 256; dry run 32)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--profile", type=Path, default=None, help="also profile a few plain decode steps into this file")
    p.add_argument("--out", type=Path, default=None, help="JSON file (default benchmarks/results/gpu_speed.json; "
                   "a dry run writes none unless given)")
    a = p.parse_args()
    models = DRY if a.dry_run else REAL
    if not a.dry_run:
        assert torch.cuda.is_available(), "no CUDA device: use --dry-run on a machine without a GPU"
    row = run(models, a.k, a.acceptance_length, a.tokens or (32 if a.dry_run else 256), a.prompt_tokens,
              a.profile)
    width = max(map(len, row))
    for key, value in row.items():
        print(f"{key:<{width}}  {value}")
    out = a.out or (None if a.dry_run else RESULTS / "gpu_speed.json")
    if out is not None:
        history = json.loads(out.read_text()) if out.exists() else []
        history = [h for h in history if h.get("device") != row["device"]] + [row]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(history, indent=1))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
