"""The GPU speed row: speculation against plain decoding on real model shapes, and a step's time
against the memory roofline. Run by scripts/gpu_check.sh after the `cuda` tests.

    python benchmarks/gpu_speed.py                # Qwen3-8B-shaped target, Qwen3-0.6B-shaped draft, bf16, GPU
    python benchmarks/gpu_speed.py --dry-run      # tiny shapes on the CPU: everything but the device

Weights are random (`random:qwen3-8b`, `random:qwen3-0.6b`): no download, and the shapes are what
decide a step's time. Random drafts are never accepted, so acceptance is synthetic, with vLLM's
semantics (`rejection_sample_method: synthetic`, `synthetic_acceptance_length`: the mean number of
tokens a verify step emits). Greedy, one stream, `ignore_eos`. Prints one table and writes
benchmarks/results/gpu_speed.json (one row per device).

Each is measured eager (`enforce_eager`) and compiled (a CUDA graph per batch bucket; on the CPU's dry
run, inductor), one engine at a time, at batch 1, then compiled at batch 8 and 32.
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


def decode_rate(llm: LLM, prompt: list[int], tokens: int, device: str, streams: int = 1) -> float:
    """Output tokens per second of `streams` greedy streams together (after a warm-up of the same batch,
    which compiles and captures the step's shapes)."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    requests = [{"prompt_token_ids": prompt[i % 7:] + prompt[:i % 7]} for i in range(streams)]
    llm.generate(requests, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    sync(device)
    t = time.perf_counter()
    outs = llm.generate(requests, params)
    sync(device)
    assert all(len(o.outputs[0].token_ids) == tokens for o in outs), "a stream stopped early"
    return streams * tokens / (time.perf_counter() - t)


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
        profile: Path | None = None, batches: tuple[int, ...] = (1, 8, 32)) -> dict:
    """One row: plain and speculative decoding, eager and compiled (CUDA graphs on a GPU), at batch 1,
    then compiled at each larger batch. One engine at a time on the device."""
    device, dtype = models["device"], getattr(torch, models["dtype"])
    common = dict(dtype=models["dtype"], device=device, max_model_len=prompt_len + tokens + 64, seed=0,
                  max_num_seqs=max(batches))
    spec_config = {"model": models["draft"], "num_speculative_tokens": k, "method": "draft_model",
                   "rejection_sample_method": "synthetic", "synthetic_acceptance_length": acceptance_length}
    rates, acceptance = {}, {}
    prompt = None
    for eager in (True, False):
        for spec in (False, True):
            llm = LLM(models["target"], speculative_config=spec_config if spec else None, enforce_eager=eager, **common)
            if prompt is None:
                vocab = len(llm.get_tokenizer())
                prompt = [(7 * i + 3) % (vocab - 3) + 3 for i in range(prompt_len)]  # past the special tokens
            for b in (1,) if eager else batches:
                rates[eager, spec, b] = decode_rate(llm, prompt, tokens, device, b)
                if spec:
                    acceptance[eager, b] = llm.spec_decode_stats.mean_acceptance_length
            if profile and not spec and not eager:
                profile_decode(llm, prompt, device, profile)
            llm.shutdown()
            del llm
            if device == "cuda":
                torch.cuda.empty_cache()
    target_bytes = weight_bytes(models["target"], dtype)
    bandwidth = copy_bandwidth(device, min(2**30, 4 * target_bytes))
    floor_s = target_bytes / bandwidth
    plain, fast = rates[False, False, 1], rates[False, True, 1]
    row = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
        "date": time.strftime("%Y-%m-%d"),
        "target": models["target"], "draft": models["draft"], "dtype": models["dtype"],
        "k": k, "synthetic_acceptance_length": acceptance_length, "tokens": tokens, "prompt_tokens": prompt_len,
        "plain_tok_s": round(plain, 2), "spec_tok_s": round(fast, 2), "speedup": round(fast / plain, 3),
        "plain_eager_tok_s": round(rates[True, False, 1], 2), "spec_eager_tok_s": round(rates[True, True, 1], 2),
        "eager_speedup": round(rates[True, True, 1] / rates[True, False, 1], 3),
        "compiled_over_eager": round(plain / rates[True, False, 1], 3),
        "mean_acceptance_length": round(acceptance[False, 1], 3),
        "target_weight_gb": round(target_bytes / 1e9, 3), "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "plain_step_ms": round(1e3 / plain, 3), "plain_eager_step_ms": round(1e3 / rates[True, False, 1], 3),
        "roofline_step_ms": round(1e3 * floor_s, 3),
        "roofline_fraction": round(floor_s * plain, 3),
        # a speculative round: K draft steps and one verify, emitting the mean acceptance length
        "spec_round_ms": round(1e3 * acceptance[False, 1] / fast, 3),
    }
    for b in batches[1:]:  # compiled: tokens/s of b streams, plain and speculative
        row[f"batch{b}_plain_tok_s"] = round(rates[False, False, b], 1)
        row[f"batch{b}_spec_tok_s"] = round(rates[False, True, b], 1)
        row[f"batch{b}_speedup"] = round(rates[False, True, b] / rates[False, False, b], 3)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (checks all but the device)")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--acceptance-length", type=float, default=3.0, help="synthetic_acceptance_length, in [1, K+1]")
    p.add_argument("--tokens", type=int, default=None, help="output tokens per stream (default 256; dry run 32)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--batches", type=int, nargs="+", default=None,
                   help="batch sizes (streams) of the compiled rows; the first is 1 (default 1 8 32; dry run 1 4)")
    p.add_argument("--profile", type=Path, default=None, help="also profile a few plain decode steps into this file")
    p.add_argument("--out", type=Path, default=None, help="JSON file (default benchmarks/results/gpu_speed.json; "
                   "a dry run writes none unless given)")
    a = p.parse_args()
    models = DRY if a.dry_run else REAL
    if not a.dry_run:
        assert torch.cuda.is_available(), "no CUDA device: use --dry-run on a machine without a GPU"
    row = run(models, a.k, a.acceptance_length, a.tokens or (32 if a.dry_run else 256), a.prompt_tokens,
              a.profile, tuple(a.batches or ((1, 4) if a.dry_run else (1, 8, 32))))
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
