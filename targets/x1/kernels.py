"""The X1's integer numerics (docs/x1/numerics.md) as vectorised numpy kernels the emulator calls.

Why float32 arrays holding integers: INT8 x INT4 products summed over one weight group (<= 127 x 8 x 64 = 65 024)
and INT8 x INT4 attention dots over a head (<= 127 x 8 x 128) are below 2^24, so BLAS float32 matmuls give the
exact INT32 accumulator values, in any summation order, at BLAS speed. Rescaling then follows the spec's order.
"""

from __future__ import annotations

import numpy as np

FP16_MAX = 65504.0
_FP16_MIN_NORMAL = np.float32(2.0 ** -14)
_FP16_SUBNORMAL_STEP, _INV_FP16_SUBNORMAL_STEP = np.float32(2.0 ** -24), np.float32(2.0 ** 24)
_BITWISE_FP16_FROM = 2048  # elements: below this numpy's own conversion is cheaper than the bit arithmetic
_clip = getattr(getattr(np, "_core", None), "umath", np).clip if hasattr(getattr(getattr(np, "_core", None), "umath",
                                                                                  None), "clip") else np.clip
_SAFE_SCALE = 2.0 ** -100  # a row scale at least this (and finite) makes x / scale lie within +-127 exactly


def to_fp16(x: np.ndarray) -> np.ndarray:
    """FP16 storage: round half to even, saturating to +-65504, read back as FP32.

    Large float32 arrays round in float32 bit arithmetic instead of through numpy's float16 type, whose
    conversion is scalar code on many builds (~14 ns per element): in the FP16 normal range, round-half-even of
    the 23-bit mantissa to 10 bits (add 0xFFF plus the lowest kept bit, clear the low 13 bits; a carry moves into
    the exponent exactly as FP16 rounding does); below 2^-14 FP16 is subnormal with a fixed step of 2^-24, so
    the value is rint(x * 2^24) * 2^-24 (both scalings exact). Bit-identical to `astype(float16)` (the kernel
    tests check it against it on edge cases and random bit patterns)."""
    x = _clip(x, -FP16_MAX, FP16_MAX)  # the ufunc np.clip calls, without its Python wrapper
    if x.dtype != np.float32 or x.size < _BITWISE_FP16_FROM:
        return x.astype(np.float16).astype(np.float32)
    u = x.view(np.uint32)
    r = u >> 13
    r &= 1
    r += 0xFFF
    r += u
    r &= 0xFFFFE000
    y = r.view(np.float32)
    small = np.abs(x) < _FP16_MIN_NORMAL
    if small.any():
        y[small] = np.rint(x[small] * _INV_FP16_SUBNORMAL_STEP) * _FP16_SUBNORMAL_STEP
    return y


def quantize_rows_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dynamic per-row INT8: a_s = max|x| / 127 (zero row -> 0), q = clip(rint(x / a_s), -127, 127)."""
    if x.dtype == np.float32:  # the same operations, in place where that saves a copy
        scale = np.maximum.reduce(np.abs(x), axis=-1, keepdims=True)
        scale /= np.float32(127.0)
        if scale.size == 1 and _SAFE_SCALE <= float(scale.reshape(-1)[0]) < np.inf:
            # one row with a normal, finite scale: |x| / (max|x| / 127) rounds to at most 127, so the clip and
            # the zero guard are no-ops and are skipped (a decode step's common case)
            q = x / scale
            np.rint(q, out=q)
            return q, scale
        q = x / np.where(scale == 0, np.float32(1.0), scale)
        np.rint(q, out=q)
        _clip(q, np.float32(-127.0), np.float32(127.0), out=q)
        return q, scale
    amax = np.abs(x).max(axis=-1, keepdims=True)
    scale = (amax / np.float32(127.0)).astype(np.float32)
    safe = np.where(scale == 0, np.float32(1.0), scale)
    q = np.clip(np.rint(x / safe), -127, 127).astype(np.float32)
    return q, scale


def quantize_groups_int4(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """KV rows: groups of `group` along the last axis, s = max|x| / 7 stored FP16, q = clip(rint(x / s16), -8, 7).
    Returns (q as int8 (..., D), s16 as float16 (..., D / group))."""
    shape = x.shape
    g = x.reshape(*shape[:-1], shape[-1] // group, group)
    s16 = (np.abs(g).max(axis=-1) / np.float32(7.0)).astype(np.float16)
    s = s16.astype(np.float32)[..., None]
    q = np.clip(np.rint(g / np.where(s == 0, np.float32(1.0), s)), -8, 7).astype(np.int8)
    return q.reshape(shape), s16


def dequantize_groups(q: np.ndarray, s16: np.ndarray, group: int) -> np.ndarray:
    shape = q.shape
    g = q.reshape(*shape[:-1], shape[-1] // group, group).astype(np.float32)
    return (g * s16.astype(np.float32)[..., None]).reshape(shape)


def unpack_int4_weight(packed: np.ndarray, k: int) -> np.ndarray:
    """(N, K/2) nibbles, element 2i low -> signed (K, N) float32 codes."""
    n = packed.shape[0]
    u = np.empty((n, packed.shape[1] * 2), np.int16)
    u[:, 0::2], u[:, 1::2] = packed & 0x0F, packed >> 4
    return (u[:, :k] - 8).T.astype(np.float32)


class IntGemm:
    """XL_GEMM.W4A8 / W8A8 with one weight prepared once: codes (G, g, N) and FP16 scales (G, 1, N) as FP32."""

    def __init__(self, q_kn: np.ndarray, s16_ng: np.ndarray, group: int):
        k, n = q_kn.shape
        self.k, self.n, self.group = k, n, group
        self.groups = k // group
        self.codes = np.ascontiguousarray(q_kn.reshape(self.groups, group, n))
        self.scales = np.ascontiguousarray(s16_ng.astype(np.float32).T[:, None, :])  # (G, 1, N)

    def __call__(self, x: np.ndarray, col_mask: np.ndarray | None = None) -> np.ndarray:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.k)
        qa, a_s = quantize_rows_int8(x2)  # (M, K), (M, 1)
        acc = np.matmul(qa.reshape(-1, self.groups, self.group).transpose(1, 0, 2), self.codes)  # (G, M, N) exact
        # y = sum_j acc_j * (s16_j * a_s), accumulated in increasing j (reduction over the outer axis is sequential)
        acc *= self.scales * a_s[None]
        y = np.add.reduce(acc, axis=0)
        if col_mask is not None:
            y *= col_mask
        return to_fp16(y).reshape(*lead, self.n)

    @classmethod
    def fused(cls, parts: list["IntGemm"]) -> "IntGemm":
        """One GEMM over the concatenated output columns of GEMMs that read the same activations (Q/K/V,
        gate/up): every output column is computed independently (exact integer accumulation, then an
        elementwise rescale), so the column slices are bit-identical to the separate GEMMs, for one
        activation quantisation and one matmul instead of several."""
        g = cls.__new__(cls)
        g.k, g.group, g.groups = parts[0].k, parts[0].group, parts[0].groups
        g.codes = np.ascontiguousarray(np.concatenate([p.codes for p in parts], axis=-1))
        g.scales = np.ascontiguousarray(np.concatenate([p.scales for p in parts], axis=-1))
        g.n = g.codes.shape[-1]
        return g


class F16Gemm:
    """XL_GEMM.F16: FP16 activations and weights, FP32 accumulation, FP16 output."""

    def __init__(self, w_kn16: np.ndarray):
        self.w = w_kn16.astype(np.float32)
        self.k, self.n = self.w.shape

    def __call__(self, x: np.ndarray, col_mask: np.ndarray | None = None) -> np.ndarray:
        lead = x.shape[:-1]
        y = (np.ascontiguousarray(to_fp16(x).reshape(-1, self.k)) @ self.w).reshape(*lead, self.n)  # 2-D: BLAS
        if col_mask is not None:
            y = y * col_mask
        return to_fp16(y)


def erf(x: np.ndarray) -> np.ndarray:
    """Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7, below FP32 resolution of GELU's output).

    Evaluated in FP64 as `1 - poly(t) * t * exp(-a*a)`, t = 1 / (1 + p*a), operation by operation in place (the
    same IEEE operations in the same order as the plain expression, without a temporary per step)."""
    s = np.sign(x)
    a = np.abs(x).astype(np.float64)
    t = a * 0.3275911
    t += 1.0
    np.divide(1.0, t, out=t)
    y = t * 1.061405429
    y -= 1.453152027
    y *= t
    y += 1.421413741
    y *= t
    y -= 0.284496736
    y *= t
    y += 0.254829592
    y *= t
    np.multiply(a, a, out=a)
    np.negative(a, out=a)
    np.exp(a, out=a)
    y *= a
    np.subtract(1.0, y, out=y)
    y *= s
    return y.astype(np.float32)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)
