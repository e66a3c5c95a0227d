"""Percentile bootstrap over studies: every headline figure comes with a 95% interval."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def bootstrap_ci(
    per_study: np.ndarray,
    statistic: Callable[[np.ndarray], float],
    *,
    resamples: int = 1000,
    seed: int = 0,
    alpha: float = 0.05,
) -> tuple[float, float]:
    """(low, high) of `statistic` over resamples of the rows of `per_study` (studies drawn with replacement)."""
    n = len(per_study)
    if n == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(resamples, n))
    values = np.array([statistic(per_study[i]) for i in idx])
    lo, hi = np.quantile(values, [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi)
