"""How far Tandem's logits are from transformers' float32 forward on the same weights: both embedded
GGUF models as the engine runs them (the C++ decode layers), with each `gguf_weights` form of the
quantized tensors: "int8" (the default: blocks times int8 activations) and "blocks" (rebuilt to float32).

    .venv/bin/python benchmarks/logit_parity.py

A 64-token prompt: 40 tokens prefilled in one forward, then 12 one-token decode steps and three
4-token verify steps through the paged cache, against transformers' forward over all 64 tokens (its
float32 model on the dequantized weights). Reports the largest absolute logit difference, the largest
logit, the mean KL divergence of the float32 distribution from ours, and whether each position's argmax
agrees. Writes benchmarks/results/logit_parity.json (one
row per machine).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model, save  # noqa: E402

MODELS = {"SmolLM2-135M Q4_1": "HuggingFaceTB/SmolLM2-135M-Instruct", "Gemma-3-270M Q4_K_M": "google/gemma-3-270m"}


def compare(name: str, gguf_weights: str) -> dict:
    from transformers import AutoModelForCausalLM

    from engine.kv_cache import static_tables
    from engine.models.loading import load_state_dict, resolve_model
    from engine.worker import ModelWorker

    source = resolve_model(name)
    worker = ModelWorker(source, 8, 16, torch.float32, gguf_weights=gguf_weights)  # the engine's path: fused, packed
    config, state = load_state_dict(source)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.load_state_dict(state, strict=False)
    if config.tie_word_embeddings:
        hf.tie_weights()
    ids = torch.randint(3, 20000, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    table = static_tables(1, 128, 16)[0]
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0]
        got = [worker.forward([table], [0], [ids[:40]])[0]]
        for pos in range(40, 52):
            got.append(worker.forward([table], [pos], [ids[pos:pos + 1]])[0])
        for pos in range(52, 64, 4):
            got.append(worker.forward([table], [pos], [ids[pos:pos + 4]])[0])
    got = torch.cat(got)
    diff = (got - want).abs()
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="none")
    return {"mean_kl": float(kl.sum(-1).mean()), "max_abs_diff": float(diff.max()), "max_abs_diff_prefill": float(diff[:40].max()),
            "max_abs_diff_decode_verify": float(diff[40:].max()), "max_abs_logit": float(want.abs().max()),
            "argmax_agrees": int((got.argmax(-1) == want.argmax(-1)).sum()), "positions": len(ids)}


def main() -> None:
    torch.set_num_threads(2)
    result = {"cpu": cpu_model(), "date": time.strftime("%Y-%m-%d")}
    print(f"{'model':<22}{'weights':>8}{'max |diff|':>12}{'prefill':>10}{'decode+verify':>15}{'max |logit|':>13}"
          f"{'mean KL':>10}{'argmax':>9}")
    for label, name in MODELS.items():
        for form in ("int8", "blocks"):
            r = result[f"{label}, {form}"] = compare(name, form)
            print(f"{label:<22}{form:>8}{r['max_abs_diff']:>12.2e}{r['max_abs_diff_prefill']:>10.2e}"
                  f"{r['max_abs_diff_decode_verify']:>15.2e}{r['max_abs_logit']:>13.1f}{r['mean_kl']:>10.1e}"
                  f"{r['argmax_agrees']:>5}/{r['positions']}")
    print(f"wrote {save('logit_parity', result)}")


if __name__ == "__main__":
    main()
