"""GPTQ for one weight, in numpy: quantize the columns of W (N, K) one at a time along K and push each column's
rounding error onto the columns not yet quantized, through the inverse of the activation Hessian H = X^T X.

Why: round-to-nearest treats each weight alone; the output error of a linear layer is (W - Q) H (W - Q)^T, and
GPTQ (Frantar et al., 2022) minimises it greedily with the closed-form update of Optimal Brain Quantization.
Each block's scale is chosen when the sweep reaches the block, from the weights as updated so far, by the
block's share of the output error (`quantize_blocks` with the block's Gram matrix), so the integers and scales
land in the same MatMulNBits / blocked-DequantizeLinear layout as every other method. Columns are visited in
order (no act-order): the blocks must stay contiguous along K for those encodings.

With float zero points (`float_zeros`, asymmetric, MatMulNBits only) the sweep is followed by a refit: the codes
fixed, each row's block scales and offsets are solved jointly by least squares on the whole output error
(W - Q) H (W - Q)^T, cross-block terms included, which the block-by-block choice during the sweep cannot see.
H there is the sweep's own, damped and shrunk towards its diagonal. On the raw X^T X, a calibration set with about
as few tokens as a row has parameters (2 K / block) let the solve fit the calibration outputs exactly, with scales
and offsets that held-out inputs met as noise (2-5x RTN's output error, where the sweep alone beat RTN).
`code_sweeps` then revisits every code once per sweep, moving it one step where that lowers the row's output
error (GPTQ rounds each column once, against the columns still to come; this also sees the ones before), and
refits again: a local search towards the nearest grid point in the output metric.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .int4_encode import QuantizedWeight, check_block, quantize_blocks, round_codes

CHUNK = 128  # columns updated lazily together (the GPTQ paper's B); rounded up to a multiple of the block


def block_hessians(h: np.ndarray, block: int) -> np.ndarray:
    """The (K/B, B, B) diagonal blocks of a (K, K) Hessian: each block's own share of the output error."""
    k = h.shape[0]
    g = k // block
    return np.stack([h[i * block : (i + 1) * block, i * block : (i + 1) * block] for i in range(g)]).astype(np.float32)


def hessian(x: np.ndarray) -> np.ndarray:
    """H = X^T X / tokens for activations (tokens, K), in float64."""
    x = np.asarray(x, np.float64)
    return x.T @ x / max(x.shape[0], 1)


def gptq_quantize(
    w_nk: np.ndarray,
    h: np.ndarray,
    block: int,
    *,
    bits: int = 4,
    symmetric: bool = True,
    damp: float = 0.01,
    shrink: float = 0.0,
    clip_grid: int = 0,
    scale_search: bool = True,
    signed_scales: bool = False,
    float_zeros: bool = False,
    code_sweeps: int = 0,
    name: str = "weight",
) -> QuantizedWeight:
    """GPTQ of an (N, K) weight against the (K, K) Hessian `h` of its input. `shrink` adds that fraction of each
    channel's own diagonal (H -> H + shrink diag(H): towards RTN weighted by the channels' energy, unchanged by a
    per-channel scaling such as AWQ's), and `damp` times the mean diagonal is added to all (the usual 1%:
    calibration sets smaller than K leave H singular)."""
    n, k = w_nk.shape
    check_block(k, block, name)
    qmax = 2**bits - 1
    float_zeros = float_zeros and not symmetric
    h = np.asarray(h, np.float64)
    hd, dead = _regularised(h, shrink, damp)
    w = np.asarray(w_nk, np.float64).copy()
    w[:, dead] = 0.0

    def block_grid(wg: np.ndarray, hg: np.ndarray) -> QuantizedWeight:
        """The scale (and zero point) of one block of columns `wg` (N, B), by its share `hg` of the output error."""
        return quantize_blocks(
            wg.astype(np.float32),
            block,
            bits=bits,
            symmetric=symmetric,
            hessian=hg,
            clip_grid=clip_grid,
            scale_search=scale_search,
            signed_scales=signed_scales,
            float_zeros=float_zeros,
            name=name,
        )

    codes, scales, zeros = _sweep(w, _upper_inverse_cholesky(hd), block_hessians(h, block), block, qmax, block_grid)
    target = np.asarray(w_nk, np.float64).copy()
    target[:, dead] = 0.0
    if float_zeros:
        scales, zeros = refit_scales_offsets(target, hd, codes, scales, zeros, block)
        if code_sweeps:
            codes = search_codes(target, hd, codes, scales, zeros, block, qmax, code_sweeps)
            scales, zeros = refit_scales_offsets(target, hd, codes, scales, zeros, block)
        return QuantizedWeight(q=codes, scales=scales, zero_points=zeros, bits=bits, block=block)
    if code_sweeps:
        codes = search_codes(target, hd, codes, scales, zeros, block, qmax, code_sweeps)
    return QuantizedWeight(
        q=codes, scales=scales, zero_points=None if symmetric else zeros.astype(np.uint8), bits=bits, block=block
    )


def _regularised(h: np.ndarray, shrink: float, damp: float) -> tuple[np.ndarray, np.ndarray]:
    """The Hessian GPTQ sweeps with: a dead channel (diagonal <= 0, its weights zeroed by the caller) set to 1 on
    the diagonal, every channel's diagonal times 1 + `shrink`, plus `damp` times the mean diagonal; and the dead
    channels' mask."""
    hd = h.copy()
    dead = np.diag(hd) <= 0
    hd[dead, dead] = 1.0
    hd[np.diag_indices(hd.shape[0])] *= 1.0 + shrink
    hd[np.diag_indices(hd.shape[0])] += damp * float(np.mean(np.diag(hd)))
    return hd, dead


def _sweep(
    w: np.ndarray,
    u: np.ndarray,
    hb: np.ndarray,
    block: int,
    qmax: int,
    block_grid: Callable[[np.ndarray, np.ndarray], QuantizedWeight],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GPTQ's sweep over the columns of `w` (N, K; updated in place) with H^-1 = U^T U: each block's grid chosen
    (`block_grid`) when the sweep reaches it, each column rounded on it and its error pushed onto the columns to
    come, lazily in chunks of CHUNK columns. (codes uint8 (N, K), scales and zero points float32 (N, K/B))."""
    n, k = w.shape
    codes = np.zeros((n, k), np.uint8)
    scales = np.zeros((n, k // block), np.float32)
    zeros = np.zeros((n, k // block), np.float32)
    chunk = block * max(1, -(-CHUNK // block))
    for i1 in range(0, k, chunk):
        i2 = min(i1 + chunk, k)
        w1 = w[:, i1:i2].copy()
        e1 = np.zeros_like(w1)
        u1 = u[i1:i2, i1:i2]
        for j in range(i2 - i1):
            col = i1 + j
            g = col // block
            if col % block == 0:
                qw = block_grid(w1[:, j : j + block], hb[g : g + 1])
                scales[:, g], zeros[:, g] = qw.scales[:, 0], qw.zeros()[:, 0]
            s, z = scales[:, g].astype(np.float64), zeros[:, g].astype(np.float64)
            q = round_codes(w1[:, j], s, z, qmax)
            err = (w1[:, j] - (q - z) * s) / u1[j, j]
            w1[:, j:] -= np.outer(err, u1[j, j:])
            e1[:, j] = err
            codes[:, col] = q
        w[:, i2:] -= e1 @ u[i1:i2, i2:]
    return codes, scales, zeros


def refit_scales_offsets(
    w: np.ndarray, h: np.ndarray, codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray, block: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the block scales s_g and offsets b_g minimising (Q - W) H (Q - W)^T for Q = s_g c + b_g on block
    g (codes c fixed); returned as (scales, float zero points = -b/s), float32 (N, K/B). A row keeps its old
    parameters where the solve does not lower that error (an ill-conditioned H). Pass the regularised Hessian GPTQ
    sweeps with (`gptq_quantize`'s), not the raw calibration one: with about as few tokens as a row's 2 K / B
    parameters the raw H lets the solve fit them exactly, and the check on the same H cannot see it."""
    n, k = w.shape
    g = k // block
    hr = h.reshape(g, block, g, block)
    hbb = hr.sum((1, 3))  # offsets x offsets, the same for every row
    wh = w @ h
    old = (codes.reshape(n, g, block) - zeros[..., None]) * scales[..., None]
    out_s, out_z = scales.astype(np.float64).copy(), zeros.astype(np.float64).copy()
    rows = max(1, (1 << 24) // (g * k))  # (rows, G, G, B) float64 intermediates of about 128 MB
    for r0 in range(0, n, rows):
        r1 = min(r0 + rows, n)
        c = codes[r0:r1].reshape(r1 - r0, g, block).astype(np.float64)
        t = np.einsum("rgi,gihj->rghj", c, hr)  # (c_g H)_(h, j)
        m = np.empty((r1 - r0, 2 * g, 2 * g))
        m[:, :g, :g] = np.einsum("rghj,rhj->rgh", t, c)
        m[:, :g, g:] = t.sum(-1)
        m[:, g:, :g] = m[:, :g, g:].swapaxes(1, 2)
        m[:, g:, g:] = hbb
        whr = wh[r0:r1].reshape(r1 - r0, g, block)
        rhs = np.concatenate([(c * whr).sum(-1), whr.sum(-1)], axis=1)
        m[:, np.arange(2 * g), np.arange(2 * g)] += (
            1e-9 * np.abs(m[:, np.arange(2 * g), np.arange(2 * g)]).max(-1)[:, None]
        )
        try:
            theta = np.linalg.solve(m, rhs[..., None])[..., 0]
        except np.linalg.LinAlgError:
            continue
        s_new, b_new = theta[:, :g], theta[:, g:]
        ok = np.all(np.isfinite(theta), axis=1) & np.all(np.abs(s_new) > 1e-12, axis=1)
        s_safe = np.where(np.abs(s_new) > 1e-12, s_new, 1.0)
        new = c * s_safe[..., None] + b_new[..., None]

        wr = w[r0:r1].reshape(new.shape)
        ok &= _row_error(new - wr, h) < _row_error(old[r0:r1] - wr, h)
        out_s[r0:r1] = np.where(ok[:, None], s_new, out_s[r0:r1])
        out_z[r0:r1] = np.where(ok[:, None], -b_new / s_safe, out_z[r0:r1])
    return out_s.astype(np.float32), out_z.astype(np.float32)


def search_codes(
    w: np.ndarray,
    h: np.ndarray,
    codes: np.ndarray,
    scales: np.ndarray,
    zeros: np.ndarray,
    block: int,
    qmax: int,
    sweeps: int,
) -> np.ndarray:
    """Coordinate descent on the codes (N, K) for fixed scales and zero points: each column in turn, every row's
    code moves by -1 or +1 (within 0..qmax) where that lowers its output error d H d^T, d = dequantized - w."""
    q = codes.astype(np.int16).copy()
    s = np.repeat(np.asarray(scales, np.float64), block, axis=1)
    z = np.repeat(np.asarray(zeros, np.float64), block, axis=1)
    d = (q - z) * s - np.asarray(w, np.float64)
    for _ in range(sweeps):
        moved = 0
        for j in range(q.shape[1]):
            g = d @ h[:, j]
            best_gain, best_step = np.zeros(q.shape[0]), np.zeros(q.shape[0], np.int16)
            for step in (-1, 1):
                delta = step * s[:, j]
                gain = 2 * delta * g + delta * delta * h[j, j]
                better = (gain < best_gain) & (q[:, j] + step >= 0) & (q[:, j] + step <= qmax)
                best_gain, best_step = np.where(better, gain, best_gain), np.where(better, step, best_step)
            q[:, j] += best_step
            d[:, j] += best_step * s[:, j]
            moved += int(np.count_nonzero(best_step))
        if not moved:
            break
    return q.astype(np.uint8)


def _row_error(d: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Each row's output error d H d^T for a dequantization error d (N, G, B)."""
    d = d.reshape(d.shape[0], -1)
    return ((d @ h) * d).sum(-1)


def _upper_inverse_cholesky(h: np.ndarray) -> np.ndarray:
    """U upper-triangular with H^-1 = U^T U, adding damping until H is positive definite."""
    extra = 0.0
    mean_diag = float(np.mean(np.diag(h)))
    for _ in range(8):
        try:
            hinv = np.linalg.inv(h + extra * np.eye(h.shape[0]))
            return np.linalg.cholesky((hinv + hinv.T) / 2).T
        except np.linalg.LinAlgError:
            extra = max(extra * 10, 1e-4 * mean_diag or 1e-6)
    raise np.linalg.LinAlgError("activation Hessian is not positive definite even after damping")
