"""Decode speed of this checkout against another revision, side by side in one run: the guard for
changes that touch the decode path ("must not drop").

    .venv/bin/python benchmarks/ab_decode.py --base b41a9e1 [--model HuggingFaceTB/SmolLM2-135M-Instruct]
                                             [--rounds 4] [--tokens 128]

The base revision is checked out in a temporary git worktree; each round runs both trees once, in
alternating order, each in a fresh process (in-process LLM.generate, greedy, plain decoding, batch 1
and 8 prompts, best of 2 generations). Reported: each side's median tok/s and the median of the
rounds' own ratios (new / base), with their range. Writes benchmarks/results/ab_decode.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from machine import cpu_model, save  # noqa: E402

ONE_TREE = """
import json, sys, time
from engine import LLM, SamplingParams
llm = LLM(model=sys.argv[1], max_model_len=1024, max_num_seqs=8)
tokens = int(sys.argv[2])
params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
prompts = [f"Story {i}: the history of the printing press" for i in range(8)]
llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8))
out = {}
for batch in (1, 8):
    runs = []
    for _ in range(2):
        start = time.perf_counter()
        llm.generate(prompts[:batch], params)
        runs.append(batch * tokens / (time.perf_counter() - start))
    out[batch] = max(runs)
print(json.dumps(out))
"""


def run_tree(tree: Path, model: str, tokens: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", ONE_TREE, model, str(tokens)], cwd=tree, capture_output=True,
                         text=True, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the revision to compare against")
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(base), args.base], check=True)
        try:
            runs = {"base": [], "new": []}
            for r in range(args.rounds):
                for side in (("base", "new") if r % 2 == 0 else ("new", "base")):
                    runs[side].append(run_tree(base if side == "base" else ROOT, args.model, args.tokens))
                    print(side, runs[side][-1], flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    result = {"cpu": cpu_model(), "base": args.base, "model": args.model, "tokens": args.tokens, "runs": runs}
    for batch in ("1", "8"):
        ratios = [n[batch] / b[batch] for n, b in zip(runs["new"], runs["base"])]
        result[f"batch_{batch}"] = {"base_tok_s": statistics.median(b[batch] for b in runs["base"]),
                                    "new_tok_s": statistics.median(n[batch] for n in runs["new"]),
                                    "ratio": statistics.median(ratios), "range": [min(ratios), max(ratios)]}
        row = result[f"batch_{batch}"]
        print(f"batch {batch}: base {row['base_tok_s']:.1f}  new {row['new_tok_s']:.1f} tok/s  new/base "
              f"{row['ratio']:.3f}x ({row['range'][0]:.3f}-{row['range'][1]:.3f})")
    print(f"wrote {save('ab_decode', result, key=('cpu', 'model', 'base'))}")


if __name__ == "__main__":
    main()
