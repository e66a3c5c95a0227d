"""HQQ-style data-free refinement (Badri & Shaji, 2023, Half-Quadratic Quantization), in numpy.

Why: without calibration data the only signal is the weight itself, and the squared error RTN minimises lets a
few heavy-tailed weights pull every block's range. HQQ minimises an l_p norm (p < 1) of the dequantization error
instead, which tolerates a few large errors, by half-quadratic splitting: an auxiliary error W_e is shrunk
towards the residual (the proximal step of |.|^p), then the quantization parameters are refit in closed form to
W - W_e. ORT's HQQ refits a float zero point; this one keeps integer zero points (or none: symmetric, as
TensorRT and the X1 take it; `float_zeros` is the GPTQ methods' and refused with hqq), so here the refit is the
scale, by least squares per block, with the codes re-rounded each step; the asymmetric zero point is rounded to
the grid. A step is kept only where it lowers the
block's mean absolute error (HQQ's own stopping rule, per block).
"""

from __future__ import annotations

import numpy as np

from .int4_encode import QuantizedWeight, check_block, quantize_blocks, round_codes


def _shrink(x: np.ndarray, beta: float, p: float) -> np.ndarray:
    """The proximal operator of |x|^p (p < 1) with weight 1/beta, in HQQ's generalised soft-threshold form."""
    return np.sign(x) * np.maximum(np.abs(x) - (1.0 / beta) * np.power(np.abs(x) + 1e-8, p - 1), 0.0)


def hqq_quantize(
    w_nk: np.ndarray,
    block: int,
    *,
    bits: int = 4,
    symmetric: bool = True,
    signed_scales: bool = False,
    iters: int = 20,
    p: float = 0.7,
    beta: float = 1e1,
    kappa: float = 1.01,
    name: str = "weight",
) -> QuantizedWeight:
    """Start from the best RTN scale per block (`quantize_blocks` with its scale search) and refine it."""
    n, k = w_nk.shape
    check_block(k, block, name)
    qmax = 2**bits - 1
    start = quantize_blocks(w_nk, block, bits=bits, symmetric=symmetric, scale_search=True, signed_scales=signed_scales)
    wb = np.asarray(w_nk, np.float32).reshape(n, k // block, block)
    scale, zero = start.scales.copy(), start.zeros().copy()
    q = start.q.reshape(wb.shape).astype(np.float32)
    best = np.abs((q - zero[..., None]) * scale[..., None] - wb).mean(-1)
    s, z = scale.copy(), zero.copy()
    for _ in range(iters):
        c = round_codes(wb, s[..., None], z[..., None], qmax) - z[..., None]
        target = wb - _shrink(wb - c * s[..., None], beta, p)
        den = (c * c).sum(-1)
        s_new = np.where(den > 0, (c * target).sum(-1) / np.where(den > 0, den, 1.0), s)
        if symmetric and not signed_scales:
            s_new = np.where(s_new > 0, s_new, s)
        if not symmetric:  # the offset that best fits the target for these codes and scale, on the grid
            safe = np.where(s_new == 0, 1.0, s_new)
            z = np.clip(np.rint(z + (c - target / safe[..., None]).mean(-1)), 0, qmax)
        s = s_new
        q_try = round_codes(wb, s[..., None], z[..., None], qmax)
        err = np.abs((q_try - z[..., None]) * s[..., None] - wb).mean(-1)
        better = err < best
        if not better.any():
            break
        q = np.where(better[..., None], q_try, q)
        scale, zero, best = np.where(better, s, scale), np.where(better, z, zero), np.where(better, err, best)
        beta *= kappa
    return QuantizedWeight(
        q=q.reshape(n, k).astype(np.uint8),
        scales=scale.astype(np.float32),
        zero_points=None if symmetric else zero.astype(np.uint8),
        bits=bits,
        block=block,
    )
