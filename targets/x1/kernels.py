"""The X1's integer numerics (docs/x1/numerics.md) as vectorised numpy kernels the emulator calls.

Why float32 arrays holding integers: INT8 x INT4 products summed over one weight group (<= 127 x 8 x 64 = 65 024)
and INT8 x INT4 attention dots over a head (<= 127 x 8 x 128) are below 2^24, so BLAS float32 matmuls give the
exact INT32 accumulator values, in any summation order, at BLAS speed. Rescaling then follows the spec's order.
"""

from __future__ import annotations

import os
import threading

import numpy as np

try:  # the optional C kernels (setup.py); without a compiler at install time, numpy runs them, bit for bit
    from . import _native
except ImportError:  # pragma: no cover - depends on how the package was built
    _BUILT = False  # `_native` stays unbound: every use of it is behind `native.enabled` or `native.available`
else:
    _BUILT = True

FP16_MAX = 65504.0
_FP16_MIN_NORMAL = np.float32(2.0**-14)
_FP16_SUBNORMAL_STEP, _INV_FP16_SUBNORMAL_STEP = np.float32(2.0**-24), np.float32(2.0**24)
_BITWISE_FP16_FROM = 2048  # elements: below this numpy's own conversion is cheaper than the bit arithmetic
_clip = (
    getattr(getattr(np, "_core", None), "umath", np).clip
    if hasattr(getattr(getattr(np, "_core", None), "umath", None), "clip")
    else np.clip
)
_NATIVE_ROWS = 4  # rows up to which `IntGemm` runs the C kernel; BLAS is faster on more (prefill)
_GROUP_BY_GROUP_FROM = 1 << 17  # G x M x N elements from which `IntGemm` accumulates group by group
_SAFE_SCALE = 2.0**-100  # a row scale at least this (and finite) makes x / scale lie within +-127 exactly
_I8_MIN, _I8_MAX, _I4_MIN, _I4_MAX = np.float32(-127.0), np.float32(127.0), np.float32(-8.0), np.float32(7.0)


def nonzero(scale: np.ndarray) -> np.ndarray:
    """`np.where(scale == 0, 1, scale)` as one addition: s + (s == 0) is exactly 1 where s is zero and exactly s
    elsewhere (s + 0 == s, NaN stays NaN), for about half the cost on the small arrays of a decode step."""
    return np.add(scale, scale == 0)


def to_fp16(x: np.ndarray, *, owned: bool = False) -> np.ndarray:
    """FP16 storage: round half to even, saturating to +-65504, read back as FP32.

    Large float32 arrays round in float32 bit arithmetic instead of through numpy's float16 type, whose
    conversion is scalar code on many builds (~14 ns per element): in the FP16 normal range, round-half-even of
    the 23-bit mantissa to 10 bits (add 0xFFF plus the lowest kept bit, clear the low 13 bits; a carry moves into
    the exponent exactly as FP16 rounding does); below 2^-14 FP16 is subnormal with a fixed step of 2^-24, so
    the value is rint(x * 2^24) * 2^-24 (both scalings exact). Bit-identical to `astype(float16)` (the kernel
    tests check it against it on edge cases and random bit patterns).

    `owned=True` says the caller gives `x` away (a kernel's own fresh result): a large float32 one is then
    rounded in place, saving the full-size temporaries that, on the vision encoder's activations, cost more in
    page faults than the arithmetic."""
    if native.enabled and x.dtype == np.float32:
        if owned and x.flags.c_contiguous and x.flags.writeable:
            _native.fp16_round(x, x, True)
            return x
        out = np.empty(x.shape, np.float32)
        _native.fp16_round(x if x.flags.c_contiguous else np.ascontiguousarray(x), out, True)
        return out
    big = x.dtype == np.float32 and x.size >= _BITWISE_FP16_FROM
    if owned and not big and x.dtype == np.float32 and isinstance(x, np.ndarray) and x.flags.writeable:
        return _clip(x, -FP16_MAX, FP16_MAX, out=x).astype(np.float16).astype(np.float32)
    if big and owned and x.flags.c_contiguous and x.flags.writeable:
        _clip(x, -FP16_MAX, FP16_MAX, out=x)
    else:
        x = _clip(x, -FP16_MAX, FP16_MAX)  # the ufunc np.clip calls, without its Python wrapper
        if not big:
            return x.astype(np.float16).astype(np.float32)
        if not x.flags.c_contiguous:
            x = np.ascontiguousarray(x)
    return _round_fp16_in_place(x)


class _Scratch(threading.local):
    """Per-thread flat buffers, one per named slot, grown on demand, for large temporaries that never leave a
    kernel. Why: a fresh multi-hundred-KiB temporary is mapped from the OS and faulted in page by page on every
    call (on the vision encoder that costs as much as the arithmetic); a reused one is already resident."""

    def __init__(self):
        self.buffers: dict[str, np.ndarray] = {}

    def get(self, slot: str, shape: tuple, dtype=np.float32) -> np.ndarray:
        n = 1
        for d in shape:
            n *= d
        buf = self.buffers.get(slot)
        if buf is None or buf.size < n or buf.dtype != dtype:
            buf = self.buffers[slot] = np.empty(max(n, 1), dtype)
        return buf[:n].reshape(shape)


scratch = _Scratch()  # public: the emulator's kernels share these buffers


class _NativeSwitch:
    """Whether the compiled kernels run (`targets/x1/_native.c`). On when the module was built, unless the
    environment says EDGEKIT_X1_NATIVE=0; `set(False)` runs the numpy kernels instead (the tests and
    `bench/x1_emulator_speed.py` compare the two). Results are the same either way; only speed differs."""

    def __init__(self):
        self.available = _BUILT
        if _BUILT:
            self.lib = _native  # the compiled module itself: its kernels and switches (unset when it was not built)
        self.enabled = self.available and os.environ.get("EDGEKIT_X1_NATIVE", "1") != "0"

    def set(self, on: bool) -> bool:
        """Turn the native kernels on or off; returns the previous setting. Turning them on without the module
        is refused."""
        if on and not self.available:
            raise RuntimeError("edgekit.targets.x1._native was not built (no C compiler at install time)")
        prev, self.enabled = self.enabled, bool(on)
        return prev


native = _NativeSwitch()


def to_fp16_scratch(x: np.ndarray) -> np.ndarray:
    """`to_fp16(x)` into this thread's scratch buffer (valid until the next call): for a kernel's own operand,
    such as the FP16 activations a GEMM reads."""
    if x.dtype != np.float32 or x.size < _BITWISE_FP16_FROM:
        return to_fp16(x)
    if native.enabled:
        y = scratch.get("fp16_operand", x.shape)
        _native.fp16_round(x if x.flags.c_contiguous else np.ascontiguousarray(x), y, True)
        return y
    y = _clip(x, -FP16_MAX, FP16_MAX, out=scratch.get("fp16_operand", x.shape))
    return _round_fp16_in_place(y)


def _round_fp16_in_place(x: np.ndarray) -> np.ndarray:
    """`to_fp16`'s bit arithmetic on a clipped, C-contiguous float32 array it may overwrite (scratch space for
    the temporaries): the subnormal fix-ups are computed from the values before rounding."""
    t = np.abs(x, out=scratch.get("fp16_abs", x.shape))
    small = np.less(t, _FP16_MIN_NORMAL, out=scratch.get("fp16_small", x.shape, np.bool_))
    fix = np.rint(x[small] * _INV_FP16_SUBNORMAL_STEP) * _FP16_SUBNORMAL_STEP if small.any() else None
    u, r = x.view(np.uint32), t.view(np.uint32)
    np.right_shift(u, 13, out=r)
    r &= 1
    u += 0xFFF
    u += r
    u &= 0xFFFFE000
    if fix is not None:
        x[small] = fix
    return x


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
        q = x / nonzero(scale)
        np.rint(q, out=q)
        _clip(q, _I8_MIN, _I8_MAX, out=q)
        return q, scale
    amax = np.abs(x).max(axis=-1, keepdims=True)
    scale = (amax / np.float32(127.0)).astype(np.float32)
    safe = np.where(scale == 0, np.float32(1.0), scale)
    q = np.clip(np.rint(x / safe), -127, 127).astype(np.float32)
    return q, scale


def quantize_groups_int4(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """KV rows: groups of `group` along the last axis, s = max|x| / 7 stored FP16, q = clip(rint(x / s16), -8, 7).
    Returns (q as int8 (..., D), s16 as float16 (..., D / group))."""
    q, s = quantize_groups_int4_f32(x, group)
    return q.astype(np.int8), s.astype(np.float16)


def quantize_groups_int4_f32(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """`quantize_groups_int4` with the codes and the FP16 scales held in float32 (the same values, exactly):
    what the emulator's KV store keeps, so attention reads the cache without converting it every step."""
    g = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    q = np.empty(g.shape, np.result_type(g.dtype, np.float32))  # float64 input: rounded in float64, as before
    s = _int4_group_codes(g, q)
    return q.reshape(x.shape), s


def quantize_groups_int4_in_place(x: np.ndarray, group: int) -> np.ndarray | None:
    """`quantize_groups_int4_f32` writing the codes over `x` (float32; a KV store's fresh rows), returning the
    scales; None (x untouched) when `x`'s last axis cannot be split into groups without a copy."""
    g = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    if x.dtype != np.float32 or not np.may_share_memory(g, x):
        return None
    return _int4_group_codes(g, g)


def _int4_group_codes(g: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Per group (last axis of `g`): s = FP16(max|x| / 7), codes = clip(rint(x / s), -8, 7) into `out`; returns
    s as float32."""
    s = np.maximum.reduce(np.abs(g), axis=-1)  # max|x| per group, as np.max computes it
    s /= np.float32(7.0)
    s = s.astype(np.float16).astype(np.float32)
    s_b = s[..., None]
    np.divide(g, nonzero(s_b), out=out)
    np.rint(out, out=out)
    _clip(out, _I4_MIN, _I4_MAX, out=out)
    out += np.float32(0.0)  # -0.0 -> +0.0: the value an int8 code 0 converts to
    return s


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
        self.codes_nk = self._native_codes()

    def __call__(self, x: np.ndarray, col_mask: np.ndarray | None = None) -> np.ndarray:
        lead = x.shape[:-1]
        if (
            native.enabled
            and self.codes_nk is not None
            and x.dtype == np.float32
            and x.shape[-1] == self.k
            and 0 < x.size <= self.k * _NATIVE_ROWS
            and (col_mask is None or col_mask.dtype == np.float32)
        ):
            out = np.empty((*lead, self.n), np.float32)
            _native.int_gemm(
                x if x.flags.c_contiguous else np.ascontiguousarray(x),
                self.codes_nk,
                self.scales,
                self.group,
                col_mask,
                out,
            )
            return out
        if x.size == self.k and x.dtype == np.float32:
            acc = self._one_row(x)
            if acc is not None:  # a decode step: `to_fp16(y, owned=True)`'s small-array branch, inlined
                y = np.add.reduce(acc, axis=0)
                if col_mask is not None:
                    y *= col_mask
                _clip(y, -FP16_MAX, FP16_MAX, out=y)
                return y.astype(np.float16).astype(np.float32).reshape(*lead, self.n)
        else:
            acc = None
        if acc is not None:
            y = np.add.reduce(acc, axis=0)
        else:
            x2 = x.reshape(-1, self.k)
            if (
                native.enabled
                and x2.dtype == np.float32
                and 0 < x2.shape[0]
                and self.groups * x2.shape[0] * self.n < _GROUP_BY_GROUP_FROM
                and (col_mask is None or col_mask.dtype == np.float32)
            ):
                return self._native_rows(x2, col_mask).reshape(*lead, self.n)
            qa, a_s = quantize_rows_int8(x2)  # (M, K), (M, 1)
            if self.groups * x2.shape[0] * self.n >= _GROUP_BY_GROUP_FROM:
                y = self._group_by_group(qa, a_s)
            else:
                acc = np.matmul(qa.reshape(-1, self.groups, self.group).transpose(1, 0, 2), self.codes)  # (G, M, N)
                # y = sum_j acc_j * (s16_j * a_s), accumulated in increasing j (the outer-axis reduction is
                # sequential)
                acc *= self.scales * a_s[None]
                y = np.add.reduce(acc, axis=0)
        if col_mask is not None:
            y *= col_mask
        return to_fp16(y, owned=True).reshape(*lead, self.n)

    def _native_rows(self, x2: np.ndarray, col_mask: np.ndarray | None) -> np.ndarray:
        """Many rows with the C kernels around BLAS: quantise the rows, take the exact integer products from
        one batched float32 matmul (contiguous, so numpy hands each group to BLAS), rescale, sum and round."""
        m = x2.shape[0]
        x2 = x2 if x2.flags.c_contiguous else np.ascontiguousarray(x2)
        qa = np.empty((self.groups, m, self.group), np.float32)  # group-major: each group a contiguous matrix
        a_s = np.empty(m, np.float32)
        q_rows = np.empty_like(x2)
        _native.quant_rows(x2, q_rows, a_s)
        qa[...] = q_rows.reshape(m, self.groups, self.group).transpose(1, 0, 2)
        acc = np.matmul(qa, self.codes)  # (G, M, N), exact
        out = np.empty((m, self.n), np.float32)
        _native.gemm_epilogue(acc, self.scales, a_s, col_mask, out)
        return out

    def _native_codes(self) -> np.ndarray | None:
        """The codes as the C kernel reads them (int8, in the layout `_native.gemm_layout` names); None without the
        module."""
        if not native.available:
            return None
        kn = self.codes.reshape(self.k, self.n)
        if _native.gemm_layout == "pairs8":  # (K/2, N, 2): K positions paired (groups of odd size: numpy)
            if self.group % 2:
                return None
            return np.ascontiguousarray(kn.reshape(self.k // 2, 2, self.n).transpose(0, 2, 1)).astype(np.int8)
        return np.ascontiguousarray(kn.T).astype(np.int8)

    def _group_by_group(self, qa: np.ndarray, a_s: np.ndarray) -> np.ndarray:
        """The general path for many rows (prefill): the same products and the same sum in increasing j, one
        group at a time into (M, N) buffers instead of (G, M, N) temporaries that outgrow the caches."""
        m = qa.shape[0]
        y, t, acc = (np.empty((m, self.n), np.float32) for _ in range(3))
        scales = self.scales[:, 0, :]
        for j in range(self.groups):
            out = y if j == 0 else acc
            np.matmul(qa[:, j * self.group : (j + 1) * self.group], self.codes[j], out=out)  # exact
            np.multiply(scales[j], a_s, out=t)
            out *= t
            if j:
                y += out
        return y

    def _one_row(self, x: np.ndarray) -> np.ndarray | None:
        """A decode step's single row: the same quantisation, integer matmul and rescale as the general path
        with the row scale as a scalar (no keepdims reduction, transposes or broadcast shapes): the same IEEE
        operations on the same values. None when the row's scale is zero, subnormal-small or not finite (the
        general path handles those)."""
        v = x.reshape(self.k)
        a_s = np.maximum.reduce(np.abs(v)) / _I8_MAX
        if not _SAFE_SCALE <= a_s < np.inf:
            return None
        q = v / a_s
        np.rint(q, out=q)
        acc = np.matmul(q.reshape(self.groups, 1, self.group), self.codes)  # (G, 1, N) exact
        acc *= self.scales * a_s
        return acc

    @classmethod
    def fused(cls, parts: list[IntGemm]) -> IntGemm:
        """One GEMM over the concatenated output columns of GEMMs that read the same activations (Q/K/V,
        gate/up): every output column is computed independently (exact integer accumulation, then an
        elementwise rescale), so the column slices are bit-identical to the separate GEMMs, for one
        activation quantisation and one matmul instead of several."""
        g = cls.__new__(cls)
        g.k, g.group, g.groups = parts[0].k, parts[0].group, parts[0].groups
        g.codes = np.ascontiguousarray(np.concatenate([p.codes for p in parts], axis=-1))
        g.scales = np.ascontiguousarray(np.concatenate([p.scales for p in parts], axis=-1))
        g.n = g.codes.shape[-1]
        g.codes_nk = g._native_codes()
        return g


class F16Gemm:
    """XL_GEMM.F16: FP16 activations and weights, FP32 accumulation, FP16 output."""

    def __init__(self, w_kn16: np.ndarray):
        self.w = w_kn16.astype(np.float32)
        self.k, self.n = self.w.shape

    def rounded_operand(self, x: np.ndarray) -> np.ndarray:
        """The FP16 activations as a GEMM reads them (2-D), in a fresh array: for an input several GEMMs share."""
        return to_fp16(np.ascontiguousarray(x).reshape(-1, self.k))

    def __call__(self, x: np.ndarray, col_mask: np.ndarray | None = None, rounded: np.ndarray | None = None):
        lead = x.shape[:-1]
        xh = to_fp16_scratch(np.ascontiguousarray(x).reshape(-1, self.k)) if rounded is None else rounded
        y = (xh @ self.w).reshape(*lead, self.n)  # 2-D: BLAS
        if col_mask is not None:
            y = y * col_mask
        return to_fp16(y, owned=True)


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


BLOCK_ELEMENTS = 16384  # 64 KiB of float32: a block's temporaries stay in cache and below malloc's mmap size


def by_row_blocks(fn, x: np.ndarray) -> np.ndarray:
    """`fn(x)` for a kernel that works row by row along the last axis (or element by element) and keeps the
    shape, computed on blocks of whole rows of a C-contiguous `x`.

    Why: on the vision encoder's activations (10^5..10^6 elements) each numpy step of a kernel allocates a fresh
    full-size temporary, which malloc maps from the OS and the kernel faults in page by page; by blocks they are
    small, reused and cache-resident. Each row still goes through exactly the same operations (a reduction along
    a contiguous last axis is computed per row), so the result is bit-identical."""
    if x.ndim == 0 or x.size <= 2 * BLOCK_ELEMENTS or not x.flags.c_contiguous:
        return fn(x)
    rows = x.reshape(-1, x.shape[-1])
    step = max(1, BLOCK_ELEMENTS // x.shape[-1])
    first = fn(rows[:step])
    out = np.empty(rows.shape, first.dtype)
    out[:step] = first
    for i in range(step, rows.shape[0], step):
        out[i : i + step] = fn(rows[i : i + step])
    return out.reshape(x.shape)


def softmax(x: np.ndarray) -> np.ndarray:
    """exp(x - max) / sum along the last axis, in one buffer (the same operations, without two more full-size
    temporaries: the vision encoder's attention probabilities are megabytes)."""
    e = x - np.maximum.reduce(x, axis=-1, keepdims=True)  # what x.max / e.sum call, without their wrappers
    np.exp(e, out=e)
    e /= np.add.reduce(e, axis=-1, keepdims=True)
    return e
