"""Sampling + verification time per step, before and after batching, beside the target's forward.

Gemma 3 270M's vocabulary (262,144), batch 1 and 8, K = 3 and 5, temperature 0.8 with top-p 0.95
(the sampled path; greedy rows are an argmax either way), greedy drafter. "before" is the per-row
loop of commit fdf0e6a (its sampling.py and rejection.py, loaded from git in this process); "dense"
is the batched verifier on dense [N, V] distributions, allocating them afresh (what an accelerator
runs); "after" is the verifier's own path (`step_probs`: sparse
nuclei on a CPU when every row truncates), on a copy of the same logits, as the verifier
overwrites the forward's output. All take turns, `--iters` times each.

    .venv/bin/python benchmarks/sampling_bench.py --iters 10
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
BEFORE = "fdf0e6a"
sys.path.insert(0, str(ROOT))


def module_at(commit: str, path: str, name: str, **inject) -> types.ModuleType:
    source = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout
    module = types.ModuleType(name)
    module.__dict__.update(inject)
    sys.modules[name] = module
    exec(compile(source.replace("from engine.sampling import", "from old_sampling import"), path, "exec"),
         module.__dict__)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", choices=["text", "random"], default="text",
                        help="text: windows of English prose (a realistic nucleus); random: random token ids "
                             "(a flat distribution whose top-p nucleus spans tens of thousands of tokens)")
    parser.add_argument("--drafts", choices=["random", "target"], default="random",
                        help="random: random token ids (rejected: the positions after them see garbage, "
                             "flatter distributions); target: the target's own greedy continuation (what a "
                             "good drafter proposes)")
    parser.add_argument("--top-p", type=float, default=0.95, help="1.0: untruncated rows (the dense path)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from engine.config import SamplingParams
    from engine.models.loading import resolve_model
    from engine.rejection import rejection_sample
    from engine.sampling import Probs, SamplingTensors, batch_probs, invalid_rows, step_probs
    from engine.worker import ModelWorker

    old_sampling = module_at(BEFORE, "engine/sampling.py", "old_sampling")
    old_rejection = module_at(BEFORE, "engine/rejection.py", "old_rejection")

    from engine.kv_cache import static_tables
    from engine.step import Prefill

    worker = ModelWorker(resolve_model("google/gemma-3-270m"), num_blocks=8 * 16 + 1, block_size=16, dtype=torch.float32)
    tables = static_tables(8, 256, 16)
    vocab = worker.vocab_size
    from engine.models.loading import load_tokenizer

    text = (ROOT / "README.md").read_text()
    worker_tokens = load_tokenizer(resolve_model("google/gemma-3-270m"), None).encode(text)[:400]
    params = SamplingParams(temperature=0.8, top_p=args.top_p, max_tokens=64)
    rows = []
    for batch in (1, 8):
        for k in (3, 5):
            gen = torch.Generator().manual_seed(0)
            if args.prompts == "text":
                ids = worker_tokens
                prompts = [ids[40 * b: 40 * b + 32] for b in range(batch)]
            else:
                prompts = [torch.randint(0, vocab, (32,), generator=gen).tolist() for _ in range(batch)]
            for b, p in enumerate(prompts):
                worker.prefill([Prefill(tables[b], 0, p[:-1])])  # the step feeds the last prompt token
            drafts = [torch.randint(0, vocab, (k,), generator=gen).tolist() for _ in range(batch)]
            if args.drafts == "target":
                drafts = [[] for _ in range(batch)]
                for step in range(k):
                    last = [q[-1] for q in prompts] if step == 0 else [d[-1] for d in drafts]
                    out = worker.forward(tables[:batch], [31 + step] * batch, [[t] for t in last], last_only=True)
                    for b, t in enumerate(out[:, 0].argmax(-1).tolist()):
                        drafts[b].append(t)
            feed = [[p[-1]] + d for p, d in zip(prompts, drafts)]
            for b in range(batch):
                worker.add_request(f"r{b}", b)
            ids = [f"r{b}" for b in range(batch)]
            times = {"forward": [], "before": [], "dense": [], "after": []}
            logits = None
            for _ in range(args.iters):
                start = time.perf_counter()
                logits = worker.forward(tables[:batch], [31] * batch, feed)
                times["forward"].append(time.perf_counter() - start)

                start = time.perf_counter()  # before: the old verifier's per-row loop
                for b in range(batch):
                    p = old_sampling.probs_from_logits(logits[b, : k + 1], params.temperature, params.top_k,
                                                       params.top_p)
                    old_rejection.verify_standard(p, drafts[b], None, worker.generators[ids[b]])
                times["before"].append(time.perf_counter() - start)

                flat = logits.reshape(-1, vocab)[torch.tensor([b * (k + 1) + j for b in range(batch)
                                                                for j in range(k + 1)])]
                draft_ids = torch.tensor([t for d in drafts for t in d])
                st = SamplingTensors.build([params] * batch, "cpu", repeats=[k + 1] * batch)

                start = time.perf_counter()  # dense: batched, on [N, V] distributions
                p = batch_probs(flat, st)
                invalid_rows(p)
                uniforms, final = worker.draws(ids, [False] * batch, [k] * batch, k)
                tokens, accepted = rejection_sample(Probs(p), draft_ids, [k] * batch, None, uniforms, final)
                torch.cat([tokens, accepted[:, None]], 1).tolist()
                times["dense"].append(time.perf_counter() - start)

                owned = flat.clone()
                start = time.perf_counter()  # after: the verifier's path
                p, bad = step_probs(owned, st)
                uniforms, final = worker.draws(ids, [False] * batch, [k] * batch, k)
                tokens, accepted = rejection_sample(p, draft_ids, [k] * batch, None, uniforms, final)
                torch.cat([tokens, accepted[:, None], bad.view(batch, k + 1).any(1, keepdim=True).long()], 1).tolist()
                times["after"].append(time.perf_counter() - start)
            med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
            rows.append({"batch": batch, "k": k, "forward_ms": med["forward"], "before_ms": med["before"],
                         "dense_ms": med["dense"], "after_ms": med["after"],
                         "before_share": med["before"] / med["forward"], "dense_share": med["dense"] / med["forward"],
                         "after_share": med["after"] / med["forward"]})
    print(f"{'batch':>5} {'K':>3} {'forward ms':>11} {'before ms':>10} {'dense ms':>9} {'after ms':>9} "
          f"{'before/fwd':>10} {'dense/fwd':>9} {'after/fwd':>9}")
    for r in rows:
        print(f"{r['batch']:>5} {r['k']:>3} {r['forward_ms']:>11.1f} {r['before_ms']:>10.1f} {r['dense_ms']:>9.1f} "
              f"{r['after_ms']:>9.1f} {r['before_share']:>10.0%} {r['dense_share']:>9.0%} {r['after_share']:>9.0%}")
    out = ROOT / "benchmarks" / "results" / f"sampling_bench_{args.prompts}_{args.drafts}_drafts{'' if args.top_p == 0.95 else f'_top_p_{args.top_p}'}.json"
    out.write_text(json.dumps({"vocab": vocab, "iters": args.iters, "threads": args.threads, "before": BEFORE,
                               "prompts": args.prompts, "drafts": args.drafts,
                               "params": params.model_dump(), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
