"""Chi-squared goodness of fit, shared by the lossless-sampling tests."""
import numpy as np
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
