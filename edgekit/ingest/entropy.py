"""The input statistic of the input-adaptive precision gate: Shannon entropy of a study's display values.

Why this one: it is the seed's statistic ("low entropy takes the higher-precision path"), and it costs
microseconds on the host before any model runs. One definition for the daemon's gate (`[precision_gate]`) and
the bench that measures whether the gate helps (bench/precision_gate.py).
"""

from __future__ import annotations

import numpy as np


def display_entropy_bits(frames: np.ndarray) -> float:
    """Entropy in bits of the display values (frames in [0, 1]) over 256 equal bins."""
    hist = np.histogram(np.asarray(frames), bins=256, range=(0.0, 1.0))[0].astype(np.float64)
    p = hist[hist > 0] / hist.sum()
    return float(-(p * np.log2(p)).sum()) if p.size else 0.0
