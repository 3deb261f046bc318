"""Goodness-of-fit helper shared by the exactness tests."""

from __future__ import annotations

import numpy as np
import scipy.stats


def chi_square_pvalue(samples: np.ndarray, expected: np.ndarray) -> float:
    """Goodness of fit of integer samples to probabilities `expected` (flattened bins).

    Zero-probability bins must be empty (asserted) and are left out; bins expecting fewer
    than 5 counts are merged into one. A single remaining bin is an exact match: p = 1.
    """
    expected = np.asarray(expected, np.float64).ravel()
    counts = np.bincount(samples, minlength=expected.size)
    assert counts.size == expected.size, "a sample fell outside the bins"
    impossible = expected <= 0
    assert counts[impossible].sum() == 0, f"zero-probability bins hit: {np.flatnonzero(impossible & (counts > 0))}"
    f_exp = expected[~impossible] / expected[~impossible].sum() * samples.size
    f_obs = counts[~impossible].astype(np.float64)
    small = f_exp < 5
    if small.any():
        f_exp = np.append(f_exp[~small], f_exp[small].sum())
        f_obs = np.append(f_obs[~small], f_obs[small].sum())
    if f_exp.size < 2:
        return 1.0
    return float(scipy.stats.chisquare(f_obs, f_exp).pvalue)
