"""Token-Level Intersection on the real pair: target google/gemma-3-270m, draft SmolLM2-135M-Instruct.

    .venv/bin/python benchmarks/tli_bench.py [--ks 1 2 3 5] [--max-tokens 64] [--no-hf]

Reports the vocabulary intersection; for each K and drafting mode the acceptance rate, mean
acceptance length and tokens/s against plain target decoding (same process, same prompts);
acceptance with and without re-tokenizing target tokens the draft lacks; and transformers'
assisted generation on the same pair for comparison. Writes benchmarks/results/tli_bench.json
and tli_bench.png.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from engine import LLM, SamplingParams

TARGET, DRAFT = "google/gemma-3-270m", "HuggingFaceTB/SmolLM2-135M-Instruct"
PROMPTS = [
    "The history of the printing press begins",
    "def quicksort(items):\n",
    "Shopping list:\n1. eggs\n2.",
    "La capitale de la France est",
    "<start_of_turn>user\nExplain gravity in two sentences.<end_of_turn>\n<start_of_turn>model\n",
]
RESULTS = Path(__file__).parent / "results"


def tokens_per_second(llm: LLM, params: SamplingParams) -> float:
    """One request at a time (latency-bound decoding, where speculation is meant to help)."""
    llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    start, produced = time.perf_counter(), 0
    for i, prompt in enumerate(PROMPTS):
        p = params.model_copy(update={"seed": i})
        produced += len(llm.generate(prompt, p)[0].outputs[0].token_ids)
    return produced / (time.perf_counter() - start)


def spec_llm(k: int, draft_sample_method: str) -> LLM:
    return LLM(model=TARGET, max_model_len=512,
               speculative_config={"model": DRAFT, "num_speculative_tokens": k, "use_heterogeneous_vocab": True,
                                   "draft_sample_method": draft_sample_method})


def hf_assisted(max_tokens: int) -> dict[str, float]:
    """transformers' universal assisted generation (cross-tokenizer), greedy, vs its own plain decoding."""
    from transformers import AutoModelForCausalLM

    from engine.models.loading import _dequantized_dir, load_tokenizer, resolve_model

    t_src, d_src = resolve_model(TARGET), resolve_model(DRAFT)
    t_tok, d_tok = load_tokenizer(t_src), load_tokenizer(d_src)
    target = AutoModelForCausalLM.from_pretrained(_dequantized_dir(Path(t_src.path)), dtype=torch.float32).eval()
    draft_dir = _dequantized_dir(Path(d_src.path))
    fresh_assistant_per_call = False
    timings = {"plain": 0.0, "assisted": 0.0}
    produced = {"plain": 0, "assisted": 0}
    for prompt in PROMPTS:
        ids = t_tok(prompt, return_tensors="pt").input_ids
        for mode in ("plain", "assisted"):
            kwargs = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
            if mode == "assisted":
                # a second generate() with the same cross-tokenizer assistant failed with a shape error
                # in transformers 5.24 (its pruned LM head is reused): load a fresh one per call
                assistant = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
                fresh_assistant_per_call = True
                kwargs.update(assistant_model=assistant, tokenizer=t_tok, assistant_tokenizer=d_tok)
            start = time.perf_counter()
            with torch.inference_mode():
                out = target.generate(ids, **kwargs)
            timings[mode] += time.perf_counter() - start
            produced[mode] += out.shape[1] - ids.shape[1]
    return {"hf_plain_tok_s": produced["plain"] / timings["plain"],
            "hf_assisted_tok_s": produced["assisted"] / timings["assisted"],
            "hf_fresh_assistant_per_call": fresh_assistant_per_call}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 5])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' assisted generation")
    args = ap.parse_args()
    torch.set_num_threads(2)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=args.max_tokens, ignore_eos=True)

    plain = LLM(model=TARGET, max_model_len=512)
    baseline = {"greedy": tokens_per_second(plain, greedy), "sampled": tokens_per_second(plain, sampled)}
    del plain

    rows = []
    mapping = None
    for k in args.ks:
        for drafting, params_name in (("greedy", "greedy"), ("greedy", "sampled"), ("probabilistic", "sampled")):
            llm = spec_llm(k, drafting)
            mapping = llm.core.scheduler.vocab_mapping
            params = greedy if params_name == "greedy" else sampled
            tps = tokens_per_second(llm, params)
            s = llm.spec_decode_stats
            rows.append({"k": k, "drafting": drafting, "requests": params_name,
                         "acceptance_rate": s.acceptance_rate, "mean_acceptance_length": s.mean_acceptance_length,
                         "per_position": s.per_position_rates(), "tok_s": tps,
                         "speedup": tps / baseline[params_name]})
            del llm

    # re-tokenizing target tokens the draft lacks, vs feeding the draft its unk token
    retok = {}
    for retokenize in (True, False):
        llm = spec_llm(3, "greedy")
        llm.core.scheduler.vocab_mapping.retokenize = retokenize
        tokens_per_second(llm, greedy)
        retok["with" if retokenize else "without"] = llm.spec_decode_stats.acceptance_rate
        del llm

    hf = {} if args.no_hf else hf_assisted(args.max_tokens)
    common = mapping.num_common
    result = {"intersection": {"common": common, "target_share": common / 262144, "draft_share": common / 49152},
              "plain_tok_s": baseline, "rows": rows, "retokenize_acceptance": retok, "hf": hf,
              "max_tokens": args.max_tokens, "prompts": len(PROMPTS)}

    print(f"intersection: {common} tokens = {100 * common / 262144:.1f}% of Gemma 3's vocabulary, "
          f"{100 * common / 49152:.1f}% of SmolLM2's")
    print(f"plain target: {baseline['greedy']:.1f} tok/s greedy, {baseline['sampled']:.1f} tok/s sampled (T=0.8)")
    print(f"{'K':>2} {'drafting':<14}{'requests':<9}{'accept':>7}{'mean len':>9}{'tok/s':>7}{'vs plain':>9}")
    for r in rows:
        print(f"{r['k']:>2} {r['drafting']:<14}{r['requests']:<9}{r['acceptance_rate']:>7.2f}"
              f"{r['mean_acceptance_length']:>9.2f}{r['tok_s']:>7.1f}{r['speedup']:>8.2f}x")
    print(f"acceptance (K=3, greedy) with re-tokenization {retok['with']:.3f}, with unk instead {retok['without']:.3f}")
    if hf:
        print(f"transformers assisted generation: {hf['hf_assisted_tok_s']:.1f} tok/s vs its plain "
              f"{hf['hf_plain_tok_s']:.1f} tok/s ({hf['hf_assisted_tok_s'] / hf['hf_plain_tok_s']:.2f}x); "
              f"fresh assistant per call: {hf['hf_fresh_assistant_per_call']}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tli_bench.json").write_text(json.dumps(result, indent=2))
    plot(rows, RESULTS / "tli_bench.png")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for drafting, requests in (("greedy", "greedy"), ("greedy", "sampled"), ("probabilistic", "sampled")):
        sel = [r for r in rows if r["drafting"] == drafting and r["requests"] == requests]
        label = f"{drafting} drafting, {requests} requests"
        ax1.plot([r["k"] for r in sel], [r["mean_acceptance_length"] for r in sel], "o-", label=label)
        ax2.plot([r["k"] for r in sel], [r["speedup"] for r in sel], "o-", label=label)
    ax1.set(xlabel="K", ylabel="mean acceptance length", title="Gemma 3 270M <- SmolLM2-135M (TLI)")
    ax2.axhline(1.0, color="gray", lw=0.8)
    ax2.set(xlabel="K", ylabel="tokens/s vs plain target", title="speed vs plain decoding")
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
