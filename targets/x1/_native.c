/* Compiled kernels for the X1 emulator's hottest instructions (docs/x1/numerics.md).
 *
 * Why: a decode step of a small model is hundreds of tiny numpy calls, and the per-call overhead, not the
 * arithmetic, sets the emulator's wall time. These kernels do the same IEEE single-precision operations in the
 * same order as the numpy kernels in kernels.py / emulator.py, so results are bit-identical with or without
 * this module (tests/test_x1_native.py checks them against the numpy path). Rules that keep it so:
 *   - built with -ffp-contract=off (no fused multiply-add: numpy rounds every product) and without fast-math;
 *   - integer dot products (INT8 x INT4/INT8 codes held as floats) are exact in float32 in any order; every
 *     other sum runs in the order numpy's reductions use (sequential over the group axis);
 *   - rintf() under the default rounding mode is numpy's rint (round half to even);
 *   - nothing that calls exp() lives here: numpy's SIMD exp is not libm's.
 * Inputs are float32 C-contiguous buffers; the Python side checks shapes and falls back to numpy otherwise.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define FP16_MAX 65504.0f

/* float32 -> FP16 (round half to even, overflow to inf) -> float32: numpy's astype(float16).astype(float32)
 * for every non-NaN input (NaN stays a quiet NaN of the same sign). */
static inline float round_fp16(float x) {
    uint32_t u, a;
    memcpy(&u, &x, 4);
    a = u & 0x7fffffffu;
    if (a >= 0x7f800000u) { /* inf or NaN */
        if (a > 0x7f800000u) u |= 0x00400000u;
        memcpy(&x, &u, 4);
        return x;
    }
    if (a >= 0x477ff000u) { /* >= 65520: rounds past 65504 */
        u = (u & 0x80000000u) | 0x7f800000u;
        memcpy(&x, &u, 4);
        return x;
    }
    if (a < 0x38800000u) { /* below 2^-14: FP16 subnormal, fixed step 2^-24 (both scalings exact) */
        return rintf(x * 16777216.0f) * 5.9604644775390625e-08f;
    }
    u += 0xfffu + ((u >> 13) & 1u); /* round the 23-bit mantissa to 10 bits, half to even */
    u &= 0xffffe000u;
    memcpy(&x, &u, 4);
    return x;
}

static inline float clip_fp16(float y) { /* np.clip(y, -65504, 65504): NaN passes through */
    return y < -FP16_MAX ? -FP16_MAX : (y > FP16_MAX ? FP16_MAX : y);
}

/* FP16 storage of whole arrays: out = FP16(clip ? clip(x) : x) (out may be x). The F16C conversion (vcvtps2ph
 * with round-to-nearest-even, then vcvtph2ps) where the CPU has it, else the bit arithmetic above; both are IEEE
 * round-half-even, as numpy's conversion is (the tests compare them on random bit patterns). */
static void round_fp16_scalar(const float *x, float *o, Py_ssize_t n, int clip) {
    for (Py_ssize_t i = 0; i < n; i++) o[i] = round_fp16(clip ? clip_fp16(x[i]) : x[i]);
}

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define EK_HAVE_F16C_PATH 1
__attribute__((target("avx2,f16c"))) static void round_fp16_f16c(const float *x, float *o, Py_ssize_t n, int clip) {
    const __m256 hi = _mm256_set1_ps(FP16_MAX), lo = _mm256_set1_ps(-FP16_MAX);
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        if (clip) v = _mm256_max_ps(lo, _mm256_min_ps(hi, v)); /* min/max return the 2nd operand on NaN: kept */
        _mm256_storeu_ps(o + i, _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
    }
    round_fp16_scalar(x + i, o + i, n - i, clip);
}
#endif

static void (*round_fp16_rows)(const float *, float *, Py_ssize_t, int) = round_fp16_scalar;

/* Kernels are compiled three times on x86-64 (AVX-512, AVX2+F16C+SSE4.1, baseline) and picked at load time by
 * the CPU; -ffp-contract=off holds in every clone, so the choice changes speed, never results. */
#if defined(__GNUC__) && defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define EK_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
#endif
#ifndef EK_CLONES
#define EK_CLONES
#endif

/* Dynamic INT8 of one row (quantize_rows_int8): returns a_s = max|x| / 127 (NaN if any x is NaN) and writes
 * q = clip(rint(x / nonzero(a_s)), -127, 127). */
static inline float quant_row(const float *x, Py_ssize_t k, float *q) {
    float amax = 0.0f, a_s, d;
    int nan = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        float a = fabsf(x[i]);
        nan |= a != a;
        amax = a > amax ? a : amax;
    }
    a_s = nan ? NAN : amax / 127.0f;
    d = a_s + (a_s == 0.0f ? 1.0f : 0.0f); /* nonzero(): s + (s == 0) */
    for (Py_ssize_t i = 0; i < k; i++) {
        float v = rintf(x[i] / d);
        q[i] = v < -127.0f ? -127.0f : (v > 127.0f ? 127.0f : v);
    }
    return a_s;
}

/* --- buffer helpers --------------------------------------------------------------------------------------- */
typedef struct {
    Py_buffer view;
    int held;
} Buf;

static int get_f32(PyObject *obj, Buf *b, int writable, const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    b->held = 0;
    if (PyObject_GetBuffer(obj, &b->view, flags) < 0) return -1;
    b->held = 1;
    if (b->view.itemsize != 4 || b->view.format == NULL || strcmp(b->view.format, "f") != 0) {
        PyErr_Format(PyExc_TypeError, "%s: expected a float32 buffer", what);
        return -1;
    }
    return 0;
}

static void release(Buf *b) {
    if (b->held) PyBuffer_Release(&b->view);
    b->held = 0;
}

static Py_ssize_t count(Buf *b) { return b->view.len / 4; }

/* --- XL_GEMM.W4A8 / W8A8 ------------------------------------------------------------------------------------
 * int_gemm(x (M, K) f32, codes int8 in the layout `gemm_layout` names, scales (G, N) f32, group,
 *          col_mask (N) f32 | None, out (M, N) f32)
 * Working memory is allocated per call: callers may run on several threads.
 * Per row m: a_s = max|x| / 127; q = clip(rint(x / nonzero(a_s)), -127, 127); acc_j = q_j . codes_j in int32
 * (exact, as the float32 BLAS sums are: |acc| < 2^24); y = sum_j acc_j * (scales_j * a_s), in increasing j;
 * y *= col_mask; out = FP16(clip(y)). (IntGemm: quantize_rows_int8, the batched matmul, `acc *= scales * a_s`,
 * add.reduce over axis 0, to_fp16.) This portable version reads the codes output-major, (N, K), so each group's
 * dot product is a contiguous integer reduction the compiler vectorises. */
EK_CLONES
static void int_gemm_rows(const float *X, const int8_t *W, const float *S, Py_ssize_t m, Py_ssize_t n,
                          Py_ssize_t groups, Py_ssize_t group, const float *CM, float *Y, float *t, float *qf,
                          int16_t *q) {
    const Py_ssize_t k = groups * group;
    for (Py_ssize_t r = 0; r < m; r++) {
        float *yr = Y + r * n;
        const float a_s = quant_row(X + r * k, k, qf);
        int finite = 1;
        for (Py_ssize_t i = 0; i < k; i++) {
            float v = qf[i];
            finite &= v == v;
            q[i] = (int16_t)(v == v ? v : 0.0f);
        }
        for (Py_ssize_t j = 0; j < groups; j++)
            for (Py_ssize_t c = 0; c < n; c++) t[j * n + c] = S[j * n + c] * a_s;
        for (Py_ssize_t c = 0; c < n; c++) {
            const int8_t *wc = W + c * k;
            float y = 0.0f;
            for (Py_ssize_t j = 0; j < groups; j++) {
                const int16_t *qj = q + j * group;
                const int8_t *wj = wc + j * group;
                int32_t acc = 0;
                for (Py_ssize_t i = 0; i < group; i++) acc += (int32_t)qj[i] * (int32_t)wj[i];
                float p = (float)acc * t[j * n + c];
                y = j == 0 ? p : y + p;
            }
            if (!finite) y = NAN; /* a NaN activation: numpy's float matmul spreads it to every output */
            if (CM) y *= CM[c];
            yr[c] = y;
        }
        round_fp16_rows(yr, yr, n, 1);
    }
}

#ifdef EK_HAVE_F16C_PATH
/* The same GEMM with AVX2 integer dot products: codes as int8 pairs along K, (K/2, N, 2), widened to int16 on
 * load, so one vpmaddwd multiplies two K positions of eight output columns by a broadcast pair of activations and
 * adds the pairs in int32 (exact). The float rescale and the sum over groups run per column in the same order as
 * above. int8 keeps a small decoder's weights in L2 from one token to the next. */
__attribute__((target("avx2"))) static void int_gemm_rows_avx2(const float *X, const int8_t *W2, const float *S,
                                                              Py_ssize_t m, Py_ssize_t n, Py_ssize_t groups,
                                                              Py_ssize_t group, const float *CM, float *Y, float *t,
                                                              float *qf, int32_t *qp) {
    const Py_ssize_t k = groups * group, pairs = group / 2;
    for (Py_ssize_t r = 0; r < m; r++) {
        float *yr = Y + r * n;
        const float a_s = quant_row(X + r * k, k, qf);
        int finite = 1;
        for (Py_ssize_t i = 0; i < k; i += 2) {
            float lo = qf[i], hi = qf[i + 1];
            finite &= (lo == lo) & (hi == hi);
            int16_t l = (int16_t)(lo == lo ? lo : 0.0f), h = (int16_t)(hi == hi ? hi : 0.0f);
            qp[i / 2] = (int32_t)((uint32_t)(uint16_t)l | ((uint32_t)(uint16_t)h << 16));
        }
        for (Py_ssize_t i = 0; i < groups * n; i++) t[i] = S[i] * a_s;
        Py_ssize_t c = 0;
        for (; c + 16 <= n; c += 16) {
            __m256 y0 = _mm256_setzero_ps(), y1 = _mm256_setzero_ps();
            for (Py_ssize_t j = 0; j < groups; j++) {
                __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
                for (Py_ssize_t p = j * pairs; p < (j + 1) * pairs; p++) {
                    const __m256i qv = _mm256_set1_epi32(qp[p]);
                    const int8_t *w = W2 + (p * n + c) * 2;
                    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w));
                    const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 16)));
                    a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(w0, qv));
                    a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(w1, qv));
                }
                const __m256 p0 = _mm256_mul_ps(_mm256_cvtepi32_ps(a0), _mm256_loadu_ps(t + j * n + c));
                const __m256 p1 = _mm256_mul_ps(_mm256_cvtepi32_ps(a1), _mm256_loadu_ps(t + j * n + c + 8));
                y0 = j ? _mm256_add_ps(y0, p0) : p0;
                y1 = j ? _mm256_add_ps(y1, p1) : p1;
            }
            _mm256_storeu_ps(yr + c, y0);
            _mm256_storeu_ps(yr + c + 8, y1);
        }
        for (; c < n; c++) {
            float y = 0.0f;
            for (Py_ssize_t j = 0; j < groups; j++) {
                int32_t acc = 0;
                for (Py_ssize_t p = j * pairs; p < (j + 1) * pairs; p++) {
                    const int8_t *w = W2 + (p * n + c) * 2;
                    acc += (int32_t)(int16_t)(qp[p] & 0xffff) * w[0] + (int32_t)(int16_t)(qp[p] >> 16) * w[1];
                }
                float pr = (float)acc * t[j * n + c];
                y = j == 0 ? pr : y + pr;
            }
            yr[c] = y;
        }
        for (c = 0; c < n; c++) {
            if (!finite) yr[c] = NAN; /* a NaN activation: numpy's float matmul spreads it to every output */
            if (CM) yr[c] *= CM[c];
        }
        round_fp16_rows(yr, yr, n, 1);
    }
}
#endif

/* Which weight layout int_gemm reads, chosen once per process by the CPU: "pairs8" (K/2, N, 2) int8 for the
 * AVX2 kernel, "nk8" (N, K) int8 for the portable one. */
static int gemm_pairs8 = 0;

static int get_i8(PyObject *obj, Buf *b, const char *what) {
    b->held = 0;
    if (PyObject_GetBuffer(obj, &b->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    b->held = 1;
    if (b->view.itemsize != 1 || b->view.format == NULL || strcmp(b->view.format, "b") != 0) {
        PyErr_Format(PyExc_TypeError, "%s: expected an int8 buffer", what);
        return -1;
    }
    return 0;
}

static PyObject *int_gemm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Buf x, w, s, mask, out;
    PyObject *result = NULL;
    long group;
    int has_mask;
    x.held = w.held = s.held = mask.held = out.held = 0;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "int_gemm takes 6 arguments");
        return NULL;
    }
    group = PyLong_AsLong(args[3]);
    if (group <= 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "group must be positive");
        return NULL;
    }
    has_mask = args[4] != Py_None;
    if (get_f32(args[0], &x, 0, "x") || get_i8(args[1], &w, "codes") ||
        get_f32(args[2], &s, 0, "scales") ||
        (has_mask && get_f32(args[4], &mask, 0, "col_mask")) || get_f32(args[5], &out, 1, "out"))
        goto done;
    {
        Py_ssize_t n = out.view.ndim ? out.view.shape[out.view.ndim - 1] : 0, groups, k, m = 0;
        groups = n ? count(&s) / n : 0;
        k = groups * group;
        if (n == 0 || k == 0 || count(&s) != groups * n || w.view.len != k * n ||
            count(&x) % k != 0 || (gemm_pairs8 && group % 2) || w.view.ndim != (gemm_pairs8 ? 3 : 2) ||
            (m = count(&x) / k) * n != count(&out) || (has_mask && count(&mask) != n)) {
            PyErr_SetString(PyExc_ValueError, "int_gemm: inconsistent shapes");
            goto done;
        }
        float *t = malloc(sizeof(float) * (size_t)(groups * n + 2 * k)), *qf;
        if (t == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        qf = t + groups * n;
        int16_t *q = (int16_t *)(qf + k);
        const float *X = x.view.buf, *S = s.view.buf, *CM = has_mask ? (const float *)mask.view.buf : NULL;
        const int8_t *W = (const int8_t *)w.view.buf;
        float *Y = out.view.buf;
        Py_BEGIN_ALLOW_THREADS
#ifdef EK_HAVE_F16C_PATH
        if (gemm_pairs8)
            int_gemm_rows_avx2(X, W, S, m, n, groups, group, CM, Y, t, qf, (int32_t *)q);
        else
#endif
            int_gemm_rows(X, W, S, m, n, groups, group, CM, Y, t, qf, q);
        Py_END_ALLOW_THREADS
        free(t);
        Py_INCREF(Py_None);
        result = Py_None;
    }
done:
    release(&x); release(&w); release(&s); release(&mask); release(&out);
    return result;
}

/* --- KVAPPEND -----------------------------------------------------------------------------------------------
 * kv_append(new (2, B, H, n, D), codes (2, B, H, cap, D), scales (2, B, H, cap, D/group), v (B, H, cap, D),
 *           t, group)
 * Per group of `group` values of each new K and V row: s = FP16(max|x| / 7); code = clip(rint(x / nonzero(s)),
 * -8, 7) + 0.0; codes and s go to rows t..t+n of the store, and for V also code * s (the dequantised row).
 * (KVCache.append with quantize_groups_int4_in_place.) */
EK_CLONES
static void kv_append_rows(const float *NW, float *C, float *S, float *V, Py_ssize_t B, Py_ssize_t H, Py_ssize_t n,
                           Py_ssize_t D, Py_ssize_t cap, Py_ssize_t G, long group, Py_ssize_t t0) {
    for (Py_ssize_t w = 0; w < 2; w++)
        for (Py_ssize_t b = 0; b < B; b++)
            for (Py_ssize_t h = 0; h < H; h++)
                for (Py_ssize_t r = 0; r < n; r++) {
                    Py_ssize_t bh = (w * B + b) * H + h, row = bh * cap + t0 + r;
                    const float *src = NW + ((bh * n) + r) * D;
                    float *dc = C + row * D, *ds = S + row * G;
                    float *dv = V + ((b * H + h) * cap + t0 + r) * D;
                    for (Py_ssize_t g = 0; g < G; g++) {
                        const float *x = src + g * group;
                        float amax = 0.0f, sc, d;
                        int nan = 0;
                        for (long i = 0; i < group; i++) {
                            float a = fabsf(x[i]);
                            nan |= a != a;
                            amax = a > amax ? a : amax;
                        }
                        sc = round_fp16(nan ? NAN : amax / 7.0f);
                        d = sc + (sc == 0.0f ? 1.0f : 0.0f);
                        ds[g] = sc;
                        for (long i = 0; i < group; i++) {
                            float c = rintf(x[i] / d);
                            c = (c < -8.0f ? -8.0f : (c > 7.0f ? 7.0f : c)) + 0.0f;
                            dc[g * group + i] = c;
                            if (w == 1) dv[g * group + i] = c * sc;
                        }
                    }
                }
}

static PyObject *kv_append(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Buf nw, codes, scales, vbuf;
    PyObject *result = NULL;
    nw.held = codes.held = scales.held = vbuf.held = 0;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "kv_append takes 6 arguments");
        return NULL;
    }
    Py_ssize_t t0 = PyLong_AsSsize_t(args[4]);
    long group = PyLong_AsLong(args[5]);
    if (PyErr_Occurred()) return NULL;
    if (get_f32(args[0], &nw, 0, "new") || get_f32(args[1], &codes, 1, "codes") ||
        get_f32(args[2], &scales, 1, "scales") || get_f32(args[3], &vbuf, 1, "v"))
        goto done;
    if (nw.view.ndim != 5 || codes.view.ndim != 5 || scales.view.ndim != 5 || vbuf.view.ndim != 4) {
        PyErr_SetString(PyExc_ValueError, "kv_append: wrong ranks");
        goto done;
    }
    {
        Py_ssize_t *ns = nw.view.shape, *cs = codes.view.shape;
        Py_ssize_t B = ns[1], H = ns[2], n = ns[3], D = ns[4], cap = cs[3], G;
        if (group <= 0 || D % group || ns[0] != 2 || cs[0] != 2 || cs[1] != B || cs[2] != H || cs[4] != D ||
            t0 < 0 || t0 + n > cap) {
            PyErr_SetString(PyExc_ValueError, "kv_append: inconsistent shapes");
            goto done;
        }
        G = D / group;
        Py_ssize_t *ss = scales.view.shape, *vs = vbuf.view.shape;
        if (ss[0] != 2 || ss[1] != B || ss[2] != H || ss[3] != cap || ss[4] != G || vs[0] != B || vs[1] != H ||
            vs[2] != cap || vs[3] != D) {
            PyErr_SetString(PyExc_ValueError, "kv_append: inconsistent store shapes");
            goto done;
        }
        const float *NW = nw.view.buf;
        float *C = codes.view.buf, *S = scales.view.buf, *V = vbuf.view.buf;
        Py_BEGIN_ALLOW_THREADS
        kv_append_rows(NW, C, S, V, B, H, n, D, cap, G, group, t0);
        Py_END_ALLOW_THREADS
        Py_INCREF(Py_None);
        result = Py_None;
    }
done:
    release(&nw); release(&codes); release(&scales); release(&vbuf);
    return result;
}

/* --- XL_VMATMUL_CAUSAL (decode: one query row, one scale group per head) -------------------------------------
 * attn_scores(q (H, D), kcodes (KV, cap, D), kscales (KV, cap), T, scale, mask (T), out (H, T))
 * Per query head h of KV head h / (H / KV): q_s = max|q| / 127; qi = clip(rint(q / nonzero(q_s)), -127, 127);
 * out[h, t] = ((qi . kcodes[t]) * kscales[t]) * q_s / scale + mask[t].
 * (_Binder._scores with quantize_rows_int8 for batch 1, one new row, G == 1.) */
EK_CLONES
static void attn_scores_rows(const float *Q, const float *KC, const float *KS, const float *M, float *O, float *qi,
                             Py_ssize_t H, Py_ssize_t D, Py_ssize_t KV, Py_ssize_t cap, Py_ssize_t T, float scale) {
    const Py_ssize_t per = H / KV;
    for (Py_ssize_t h = 0; h < H; h++) {
        const float *K = KC + (h / per) * cap * D, *S = KS + (h / per) * cap;
        float *o = O + h * T;
        const float q_s = quant_row(Q + h * D, D, qi);
        for (Py_ssize_t t = 0; t < T; t++) {
            const float *kt = K + t * D;
            float dot = 0.0f;
            /* exact (integers below 2^24), so any summation order gives the same value: let it vectorise */
#pragma omp simd reduction(+ : dot)
            for (Py_ssize_t i = 0; i < D; i++) dot += qi[i] * kt[i];
            o[t] = dot * S[t] * q_s / scale + M[t];
        }
    }
}

static PyObject *attn_scores(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Buf q, kc, ks, mask, out;
    PyObject *result = NULL;
    q.held = kc.held = ks.held = mask.held = out.held = 0;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "attn_scores takes 7 arguments");
        return NULL;
    }
    Py_ssize_t T = PyLong_AsSsize_t(args[3]);
    double scale_d = PyFloat_AsDouble(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (get_f32(args[0], &q, 0, "q") || get_f32(args[1], &kc, 0, "kcodes") || get_f32(args[2], &ks, 0, "kscales") ||
        get_f32(args[5], &mask, 0, "mask") || get_f32(args[6], &out, 1, "out"))
        goto done;
    if (q.view.ndim != 2 || kc.view.ndim != 3 || ks.view.ndim != 2) {
        PyErr_SetString(PyExc_ValueError, "attn_scores: wrong ranks");
        goto done;
    }
    {
        Py_ssize_t H = q.view.shape[0], D = q.view.shape[1], KV = kc.view.shape[0], cap = kc.view.shape[1];
        if (KV == 0 || H % KV || kc.view.shape[2] != D || ks.view.shape[0] != KV || ks.view.shape[1] != cap ||
            T < 0 || T > cap || count(&mask) != T || count(&out) != H * T) {
            PyErr_SetString(PyExc_ValueError, "attn_scores: inconsistent shapes");
            goto done;
        }
        const float *Q = q.view.buf, *KC = kc.view.buf, *KS = ks.view.buf, *M = mask.view.buf;
        float *O = out.view.buf, *qi = malloc(sizeof(float) * (size_t)(D ? D : 1));
        if (qi == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        Py_BEGIN_ALLOW_THREADS
        attn_scores_rows(Q, KC, KS, M, O, qi, H, D, KV, cap, T, (float)scale_d);
        Py_END_ALLOW_THREADS
        free(qi);
        Py_INCREF(Py_None);
        result = Py_None;
    }
done:
    release(&q); release(&kc); release(&ks); release(&mask); release(&out);
    return result;
}

/* --- many rows (prefill): the integer products stay in BLAS, the element-wise steps around them come here ---
 * quant_rows(x (M, K), q (M, K), a_s (M)): quantize_rows_int8 — a_s = max|x| / 127 per row,
 * q = clip(rint(x / nonzero(a_s)), -127, 127). */
EK_CLONES
static void quant_rows_all(const float *X, float *Q, float *A, Py_ssize_t m, Py_ssize_t k) {
    for (Py_ssize_t r = 0; r < m; r++) A[r] = quant_row(X + r * k, k, Q + r * k);
}

static PyObject *quant_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Buf x, q, sc;
    PyObject *result = NULL;
    x.held = q.held = sc.held = 0;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "quant_rows takes 3 arguments");
        return NULL;
    }
    if (get_f32(args[0], &x, 0, "x") || get_f32(args[1], &q, 1, "q") || get_f32(args[2], &sc, 1, "a_s")) goto done;
    {
        Py_ssize_t m = count(&sc), k = m ? count(&x) / m : 0;
        if (m == 0 || k * m != count(&x) || count(&q) != count(&x)) {
            PyErr_SetString(PyExc_ValueError, "quant_rows: inconsistent shapes");
            goto done;
        }
        const float *X = x.view.buf;
        float *Q = q.view.buf, *A = sc.view.buf;
        Py_BEGIN_ALLOW_THREADS
        quant_rows_all(X, Q, A, m, k);
        Py_END_ALLOW_THREADS
        Py_INCREF(Py_None);
        result = Py_None;
    }
done:
    release(&x); release(&q); release(&sc);
    return result;
}

/* gemm_epilogue(acc (G, M, N), scales (G, N), a_s (M), col_mask (N) | None, out (M, N)):
 * out = FP16(clip(col_mask * sum_j acc_j * (scales_j * a_s)))  (the sum sequential in j, as add.reduce over
 * axis 0 computes it). */
EK_CLONES
static void epilogue_rows(const float *ACC, const float *S, const float *A, const float *CM, float *Y, Py_ssize_t m,
                          Py_ssize_t n, Py_ssize_t groups) {
    for (Py_ssize_t r = 0; r < m; r++) {
        float *yr = Y + r * n;
        const float a_s = A[r];
        for (Py_ssize_t c = 0; c < n; c++) yr[c] = ACC[r * n + c] * (S[c] * a_s);
        for (Py_ssize_t j = 1; j < groups; j++) {
            const float *aj = ACC + (j * m + r) * n, *sj = S + j * n;
            for (Py_ssize_t c = 0; c < n; c++) yr[c] += aj[c] * (sj[c] * a_s);
        }
        if (CM)
            for (Py_ssize_t c = 0; c < n; c++) yr[c] *= CM[c];
        round_fp16_rows(yr, yr, n, 1);
    }
}

static PyObject *gemm_epilogue(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Buf acc, s, a, mask, out;
    PyObject *result = NULL;
    int has_mask;
    acc.held = s.held = a.held = mask.held = out.held = 0;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "gemm_epilogue takes 5 arguments");
        return NULL;
    }
    has_mask = args[3] != Py_None;
    if (get_f32(args[0], &acc, 0, "acc") || get_f32(args[1], &s, 0, "scales") || get_f32(args[2], &a, 0, "a_s") ||
        (has_mask && get_f32(args[3], &mask, 0, "col_mask")) || get_f32(args[4], &out, 1, "out"))
        goto done;
    {
        Py_ssize_t m = count(&a), n = m ? count(&out) / m : 0, groups = n ? count(&s) / n : 0;
        if (m == 0 || n == 0 || n * m != count(&out) || groups * n != count(&s) || count(&acc) != groups * m * n ||
            (has_mask && count(&mask) != n)) {
            PyErr_SetString(PyExc_ValueError, "gemm_epilogue: inconsistent shapes");
            goto done;
        }
        const float *ACC = acc.view.buf, *S = s.view.buf, *A = a.view.buf;
        const float *CM = has_mask ? (const float *)mask.view.buf : NULL;
        float *Y = out.view.buf;
        Py_BEGIN_ALLOW_THREADS
        epilogue_rows(ACC, S, A, CM, Y, m, n, groups);
        Py_END_ALLOW_THREADS
        Py_INCREF(Py_None);
        result = Py_None;
    }
done:
    release(&acc); release(&s); release(&a); release(&mask); release(&out);
    return result;
}

/* --- FP16 storage of whole arrays ------------------------------------------------------------------------------
 * fp16_round(x, out, clip): out = FP16(x) read back as float32 (out may be x); clip first saturates to +-65504.
 * With a compiler that has _Float16 the conversion is the hardware's (F16C / AVX-512 on x86-64 clones, NEON
 * fcvt on arm64), vectorised; both are IEEE round-half-even, as numpy's conversion is. */
static PyObject *fp16_round(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Buf x, out;
    x.held = out.held = 0;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "fp16_round takes 3 arguments");
        return NULL;
    }
    int clip = PyObject_IsTrue(args[2]);
    if (clip < 0) return NULL;
    if (get_f32(args[0], &x, 0, "x") || get_f32(args[1], &out, 1, "out")) goto fail;
    if (count(&x) != count(&out)) {
        PyErr_SetString(PyExc_ValueError, "fp16_round: sizes differ");
        goto fail;
    }
    {
        const float *X = x.view.buf;
        float *O = out.view.buf;
        Py_ssize_t n = count(&x);
        Py_BEGIN_ALLOW_THREADS
        round_fp16_rows(X, O, n, clip);
        Py_END_ALLOW_THREADS
    }
    release(&x); release(&out);
    Py_RETURN_NONE;
fail:
    release(&x); release(&out);
    return NULL;
}

/* --- norms -------------------------------------------------------------------------------------------------
 * numpy sums a contiguous float32 axis pairwise (eight running sums per block of at most 128, blocks split in
 * halves on multiples of 8); the same order here makes the means bit-identical. A mean divides that float32
 * sum by the count as an intp, which numpy computes in float64 and casts back. */
static float pairwise_sum(const float *a, Py_ssize_t n) {
    if (n < 8) {
        float res = 0.0f;
        for (Py_ssize_t i = 0; i < n; i++) res += a[i];
        return res;
    }
    if (n <= 128) {
        float r[8], res;
        Py_ssize_t i;
        for (int j = 0; j < 8; j++) r[j] = a[j];
        for (i = 8; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; j++) r[j] += a[i + j];
        res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) res += a[i];
        return res;
    }
    Py_ssize_t n2 = n / 2;
    n2 -= n2 % 8;
    return pairwise_sum(a, n2) + pairwise_sum(a + n2, n - n2);
}

/* numpy's add.reduce starts from its identity, +0.0: an all -0.0 row sums to +0.0, as here */
static inline float mean_of(const float *a, Py_ssize_t n) {
    return (float)((double)(0.0f + pairwise_sum(a, n)) / (double)n);
}

/* VRMSNORM per row: ms = mean(x * x); y = x * (1 / sqrt(ms + eps)) * gamma. */
EK_CLONES
static void rmsnorm_rows(const float *X, const float *gamma, float eps, float *Y, float *sq, Py_ssize_t m,
                         Py_ssize_t n) {
    for (Py_ssize_t r = 0; r < m; r++) {
        const float *x = X + r * n;
        float *y = Y + r * n;
        for (Py_ssize_t i = 0; i < n; i++) sq[i] = x[i] * x[i];
        const float inv = 1.0f / sqrtf(mean_of(sq, n) + eps);
        for (Py_ssize_t i = 0; i < n; i++) y[i] = x[i] * inv * gamma[i];
    }
}

/* LayerNormalization over the last axis per row: d = x - mean(x); y = d / sqrt(mean(d * d) + eps) * scale
 * (+ bias). */
EK_CLONES
static void layernorm_rows(const float *X, const float *scale, const float *bias, float eps, float *Y, float *sq,
                           Py_ssize_t m, Py_ssize_t n) {
    for (Py_ssize_t r = 0; r < m; r++) {
        const float *x = X + r * n;
        float *y = Y + r * n;
        const float mean = mean_of(x, n);
        for (Py_ssize_t i = 0; i < n; i++) {
            y[i] = x[i] - mean;
            sq[i] = y[i] * y[i];
        }
        const float den = sqrtf(mean_of(sq, n) + eps);
        if (bias)
            for (Py_ssize_t i = 0; i < n; i++) y[i] = y[i] / den * scale[i] + bias[i];
        else
            for (Py_ssize_t i = 0; i < n; i++) y[i] = y[i] / den * scale[i];
    }
}

/* norm(kind, x (M, n), weight (n), bias (n) | None, eps, out (M, n)); kind 0 RMS, 1 LayerNorm. */
static PyObject *norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Buf x, w, b, out;
    PyObject *result = NULL;
    x.held = w.held = b.held = out.held = 0;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "norm takes 6 arguments");
        return NULL;
    }
    long kind = PyLong_AsLong(args[0]);
    double eps = PyFloat_AsDouble(args[4]);
    int has_bias = args[3] != Py_None;
    if (PyErr_Occurred()) return NULL;
    if (get_f32(args[1], &x, 0, "x") || get_f32(args[2], &w, 0, "weight") ||
        (has_bias && get_f32(args[3], &b, 0, "bias")) || get_f32(args[5], &out, 1, "out"))
        goto done;
    {
        Py_ssize_t n = count(&w), m = n ? count(&x) / n : 0;
        if (n == 0 || m * n != count(&x) || count(&out) != count(&x) || (has_bias && count(&b) != n)) {
            PyErr_SetString(PyExc_ValueError, "norm: inconsistent shapes");
            goto done;
        }
        const float *X = x.view.buf, *W = w.view.buf, *B = has_bias ? (const float *)b.view.buf : NULL;
        float *Y = out.view.buf, *S = malloc(sizeof(float) * (size_t)n);
        if (S == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        Py_BEGIN_ALLOW_THREADS
        if (kind == 0) rmsnorm_rows(X, W, (float)eps, Y, S, m, n);
        else layernorm_rows(X, W, B, (float)eps, Y, S, m, n);
        Py_END_ALLOW_THREADS
        free(S);
        Py_INCREF(Py_None);
        result = Py_None;
    }
done:
    release(&x); release(&w); release(&b); release(&out);
    return result;
}

/* --- XL_ROPE_ROTATE, one position: rope(x (H, D), cos (D), sin (D), out (H, D))
 * y = x * cos + [x2, x1] * [-sin1, sin2] (products rounded, then added: as the numpy kernel). */
EK_CLONES
static void rope_rows(const float *X, const float *C, const float *S, float *Y, Py_ssize_t h, Py_ssize_t d) {
    const Py_ssize_t half = d / 2;
    for (Py_ssize_t r = 0; r < h; r++) {
        const float *x = X + r * d;
        float *y = Y + r * d;
        for (Py_ssize_t i = 0; i < half; i++) {
            float t = x[i + half] * -S[i];
            y[i] = x[i] * C[i] + t;
        }
        for (Py_ssize_t i = half; i < d; i++) {
            float t = x[i - half] * S[i];
            y[i] = x[i] * C[i] + t;
        }
    }
}

static PyObject *rope(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Buf x, c, sn, out;
    PyObject *result = NULL;
    x.held = c.held = sn.held = out.held = 0;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "rope takes 4 arguments");
        return NULL;
    }
    if (get_f32(args[0], &x, 0, "x") || get_f32(args[1], &c, 0, "cos") || get_f32(args[2], &sn, 0, "sin") ||
        get_f32(args[3], &out, 1, "out"))
        goto done;
    {
        Py_ssize_t d = count(&c), h = d ? count(&x) / d : 0;
        if (d == 0 || d % 2 || count(&sn) != d || h * d != count(&x) || count(&out) != count(&x)) {
            PyErr_SetString(PyExc_ValueError, "rope: inconsistent shapes");
            goto done;
        }
        const float *X = x.view.buf, *C = c.view.buf, *S = sn.view.buf;
        float *Y = out.view.buf;
        rope_rows(X, C, S, Y, h, d);
        Py_INCREF(Py_None);
        result = Py_None;
    }
done:
    release(&x); release(&c); release(&sn); release(&out);
    return result;
}

/* --- VGELU: x * 0.5 * (erf(x / sqrt 2) + 1), erf by Abramowitz & Stegun 7.1.26 in float64 ------------------
 * numpy's exp is not libm's, so the exponential stays in numpy between two passes:
 *   gelu_pre(x, e):  e = -(a * a), a = |x * inv_sqrt2| in float64      then numpy: np.exp(e, out=e)
 *   gelu_post(x, e, out): the polynomial in t = 1 / (1 + p a), erf = sign * (1 - poly * e), the GELU product,
 * each operation in the order of kernels.erf and the emulator's gelu. */
#define GELU_INV_SQRT2 ((float)(1.0 / sqrt(2.0))) /* np.float32(1.0 / math.sqrt(2.0)) */
EK_CLONES
static void gelu_pre_rows(const float *X, double *E, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        double a = (double)fabsf(X[i] * GELU_INV_SQRT2);
        E[i] = -(a * a);
    }
}

EK_CLONES
static void gelu_post_rows(const float *X, const double *E, float *Y, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        const float xs = X[i] * GELU_INV_SQRT2;
        const double a = (double)fabsf(xs);
        const double s = xs > 0.0f ? 1.0 : (xs < 0.0f ? -1.0 : (xs == 0.0f ? 0.0 : (double)xs));
        double t = a * 0.3275911;
        t += 1.0;
        t = 1.0 / t;
        double y = t * 1.061405429;
        y -= 1.453152027;
        y *= t;
        y += 1.421413741;
        y *= t;
        y -= 0.284496736;
        y *= t;
        y += 0.254829592;
        y *= t;
        y *= E[i];
        y = 1.0 - y;
        y *= s;
        Y[i] = X[i] * 0.5f * ((float)y + 1.0f);
    }
}

static PyObject *gelu_pre(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Buf x, e;
    x.held = e.held = 0;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "gelu_pre takes 2 arguments");
        return NULL;
    }
    if (get_f32(args[0], &x, 0, "x")) goto fail;
    if (PyObject_GetBuffer(args[1], &e.view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) goto fail;
    e.held = 1;
    if (e.view.itemsize != 8 || strcmp(e.view.format, "d") != 0 || e.view.len / 8 != count(&x)) {
        PyErr_SetString(PyExc_ValueError, "gelu_pre: e must be float64 of x's size");
        goto fail;
    }
    {
        const float *X = x.view.buf;
        double *E = e.view.buf;
        Py_ssize_t n = count(&x);
        Py_BEGIN_ALLOW_THREADS
        gelu_pre_rows(X, E, n);
        Py_END_ALLOW_THREADS
    }
    release(&x); release(&e);
    Py_RETURN_NONE;
fail:
    release(&x); release(&e);
    return NULL;
}

static PyObject *gelu_post(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Buf x, e, out;
    x.held = e.held = out.held = 0;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "gelu_post takes 3 arguments");
        return NULL;
    }
    if (get_f32(args[0], &x, 0, "x") || get_f32(args[2], &out, 1, "out")) goto fail;
    if (PyObject_GetBuffer(args[1], &e.view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) goto fail;
    e.held = 1;
    if (e.view.itemsize != 8 || strcmp(e.view.format, "d") != 0 || e.view.len / 8 != count(&x) ||
        count(&out) != count(&x)) {
        PyErr_SetString(PyExc_ValueError, "gelu_post: inconsistent sizes");
        goto fail;
    }
    {
        const float *X = x.view.buf;
        const double *E = e.view.buf;
        float *Y = out.view.buf;
        Py_ssize_t n = count(&x);
        Py_BEGIN_ALLOW_THREADS
        gelu_post_rows(X, E, Y, n);
        Py_END_ALLOW_THREADS
    }
    release(&x); release(&e); release(&out);
    Py_RETURN_NONE;
fail:
    release(&x); release(&e); release(&out);
    return NULL;
}

/* use_portable(on): the portable GEMM layout and scalar FP16 rounding even where the CPU has AVX2 / F16C, so the
 * tests can check the code path an arm64 device runs. Returns the layout now in force. */
static void choose_paths(int portable) {
    gemm_pairs8 = 0;
    round_fp16_rows = round_fp16_scalar;
#ifdef EK_HAVE_F16C_PATH
    if (!portable) {
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) round_fp16_rows = round_fp16_f16c;
        if (__builtin_cpu_supports("avx2")) gemm_pairs8 = 1;
    }
#endif
}

static PyObject *use_portable(PyObject *self, PyObject *arg) {
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    choose_paths(on);
    PyObject *layout = PyUnicode_FromString(gemm_pairs8 ? "pairs8" : "nk8");
    if (layout == NULL || PyObject_SetAttrString(self, "gemm_layout", layout) < 0) {
        Py_XDECREF(layout);
        return NULL;
    }
    return layout;
}

static PyMethodDef methods[] = {
    {"use_portable", use_portable, METH_O, "Force the portable paths (tests)."},
    {"int_gemm", (PyCFunction)(void (*)(void))int_gemm, METH_FASTCALL, "XL_GEMM.W4A8/W8A8 over rows."},
    {"kv_append", (PyCFunction)(void (*)(void))kv_append, METH_FASTCALL, "KVAPPEND: INT4 group quantisation."},
    {"attn_scores", (PyCFunction)(void (*)(void))attn_scores, METH_FASTCALL, "XL_VMATMUL_CAUSAL, one query row."},
    {"quant_rows", (PyCFunction)(void (*)(void))quant_rows, METH_FASTCALL, "Dynamic per-row INT8."},
    {"gemm_epilogue", (PyCFunction)(void (*)(void))gemm_epilogue, METH_FASTCALL, "Integer GEMM rescale."},
    {"fp16_round", (PyCFunction)(void (*)(void))fp16_round, METH_FASTCALL, "FP16 storage rounding."},
    {"norm", (PyCFunction)(void (*)(void))norm, METH_FASTCALL, "RMSNorm / LayerNorm over the last axis."},
    {"rope", (PyCFunction)(void (*)(void))rope, METH_FASTCALL, "Rotary embedding of one position."},
    {"gelu_pre", (PyCFunction)(void (*)(void))gelu_pre, METH_FASTCALL, "GELU, up to the exponential."},
    {"gelu_post", (PyCFunction)(void (*)(void))gelu_post, METH_FASTCALL, "GELU, after the exponential."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", "X1 emulator kernels (bit-identical to numpy).",
                                    -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
    choose_paths(0);
    PyObject *mod = PyModule_Create(&module);
    if (mod && PyModule_AddStringConstant(mod, "gemm_layout", gemm_pairs8 ? "pairs8" : "nk8") < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
