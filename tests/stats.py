"""Chi-squared goodness of fit and exact target distributions, shared by the lossless-sampling tests."""
import numpy as np
import torch
from scipy.stats import chisquare

# A test fails when p < ALPHA. Seeds are fixed, so each run is deterministic; ALPHA only states
# how unlikely a pass-to-fail flip would be for a correct sampler under a different seed.
ALPHA = 1e-3


def chi_squared_pvalue(samples: list[int], expected_probs: np.ndarray) -> float:
    """Cells with expected count < 5 are pooled into one, as the test requires."""
    n = len(samples)
    observed = np.bincount(np.asarray(samples), minlength=len(expected_probs)).astype(float)
    expected = np.asarray(expected_probs, dtype=np.float64) * n
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp = exp * obs.sum() / exp.sum()
    return float(chisquare(obs, exp).pvalue)


def exact_first_two(llm, prompt_ids: list[int], temperature: float, top_p: float = 1.0,
                    top_k: int = -1, allowed: tuple[torch.Tensor, torch.Tensor] | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
    """P(t1) and P(t2) = sum over t1 of P(t1) P(t2 | t1), computed from the target model directly;
    with `allowed` (bool [V] for t1, [V] for t2), the distributions masked to them (a grammar's)."""
    from engine.kv_cache import KVCache
    from engine.sampling import probs_from_logits

    model = llm.core.executor.target.worker.model
    a = model.args
    n, V = len(prompt_ids), a.vocab_size
    per_row = -(-(n + 1) // 16)  # blocks of 16 each row needs
    cache = KVCache(a.num_layers, V * per_row + 1, 16, a.num_kv_heads, a.head_dim, torch.float32)
    with torch.no_grad():
        rows = torch.tensor([prompt_ids + [t] for t in range(V)])  # every possible t1, one row each
        tables = torch.arange(1, V * per_row + 1).view(V, per_row)
        logits = model(rows, torch.arange(n + 1)[None].expand(V, -1), cache, tables)
    if allowed is not None:
        logits[:, n - 1] = logits[:, n - 1].masked_fill(~allowed[0], float("-inf"))
        logits[:, -1] = logits[:, -1].masked_fill(~allowed[1], float("-inf"))
    p1 = probs_from_logits(logits[0, n - 1 : n], temperature, top_k, top_p)[0]
    p2_given = probs_from_logits(logits[:, -1], temperature, top_k, top_p)  # [V(t1), V(t2)]
    return p1.numpy(), (p1[:, None] * p2_given).sum(0).numpy()
