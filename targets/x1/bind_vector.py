"""Binding of the vector unit's fused instructions: `VRMSNORM`, `VSILU_MUL`, `VGELU`, `XL_ROPE_ROTATE`.

Each has a C kernel (`native`) and a numpy path that compute the same IEEE operations in the same order; the
numpy path is the reference (docs/x1/emulator.md).
"""

from __future__ import annotations

import math

import numpy as np

from .kernels import by_row_blocks, erf, native, scratch


def rmsnorm(binder, attr, ins, outs, layer):
    gamma = np.asarray(binder.program.weights[attr["gamma"]], np.float32)
    eps, one = np.float32(attr["eps"]), np.float32(1.0)
    entry = binder.sized("rmsnorm", layer, binder.v.rmsnorm_ops)
    x_id, y_id = ins[0], outs[0]

    def run(store, ctx):
        x = store[x_id]
        n = x.shape[-1]
        if native.enabled and x.dtype == np.float32 and n == gamma.size and x.flags.c_contiguous:
            y = store[y_id] = np.empty(x.shape, np.float32)  # (a transposed view sums in another order: numpy)
            native.lib.norm(0, x, gamma, None, float(eps), y)
            return entry(x.size)
        if x.size == n and x.dtype == np.float32:  # one row (decode): the same steps on numpy scalars
            v = x.reshape(n)
            ms = np.float32(np.add.reduce(v * v) / np.intp(n))  # float64 quotient cast back, as below
            store[y_id] = x * (one / np.sqrt(ms + eps)) * gamma
            return entry(x.size)
        # np.mean(x * x, axis=-1, keepdims=True), as np.mean computes it, without its Python wrapper
        ms = np.add.reduce(x * x, axis=-1, keepdims=True)
        if isinstance(ms, np.ndarray):
            np.true_divide(ms, np.intp(x.shape[-1]), out=ms, casting="unsafe")
        else:
            ms = np.mean(x * x, axis=-1, keepdims=True)
        store[y_id] = x * (one / np.sqrt(ms + eps)) * gamma
        return entry(x.size)

    return run


def silu_mul(binder, attr, ins, outs, layer):
    entry = binder.sized("silu_mul", layer, binder.v.silu_mul_ops)
    g_id, u_id, y_id = ins[0], ins[1], outs[0]
    one = np.float32(1.0)

    def run(store, ctx):
        g = store[g_id]
        store[y_id] = g / (one + np.exp(-g)) * store[u_id]
        return entry(g.size)

    return run


def gelu(binder, attr, ins, outs, layer):
    entry = binder.sized("gelu", layer, binder.v.silu_mul_ops)
    x_id, y_id = ins[0], outs[0]
    half, inv_sqrt2, one = np.float32(0.5), np.float32(1.0 / math.sqrt(2.0)), np.float32(1.0)

    def gelu(x):
        return x * half * (erf(x * inv_sqrt2) + one)

    def run(store, ctx):
        x = store[x_id]
        if native.enabled and x.dtype == np.float32:  # C around numpy's own exp (bit-identical)
            x = x if x.flags.c_contiguous else np.ascontiguousarray(x)
            e = scratch.get("gelu_exp", (x.size,), np.float64)
            native.lib.gelu_pre(x, e)
            np.exp(e, out=e)
            y = store[y_id] = np.empty(x.shape, np.float32)
            native.lib.gelu_post(x, e, y)
            return entry(x.size)
        store[y_id] = by_row_blocks(gelu, x)
        return entry(x.size)

    return run


def rope(binder, attr, ins, outs, layer):
    entry = binder.sized("rope", layer, binder.v.rope_ops)
    (x_id, cos_id, sin_id), y_id = ins[:3], outs[0]
    is_q = attr.get("role") == "q"

    signed = binder.signed_sin

    def run(store, ctx):
        x, sin = store[x_id], store[sin_id]
        d = x.shape[-1]
        half = d // 2
        cos = store[cos_id]
        if (
            native.enabled
            and sin.size == d
            and cos.size == d
            and not d % 2
            and x.dtype == np.float32
            and sin.dtype == np.float32
            and cos.dtype == np.float32
            and x.ndim >= cos.ndim
        ):
            y = store[y_id] = np.empty(x.shape, np.float32)  # one position (decode): the C kernel
            native.lib.rope(
                x if x.flags.c_contiguous else np.ascontiguousarray(x),
                np.ascontiguousarray(cos),
                np.ascontiguousarray(sin),
                y,
            )
        elif d % 2 or sin.shape[-1] != d:
            rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
            store[y_id] = x * store[cos_id] + rot * sin
        else:
            # rot * sin with rot = [-x2, x1] is [x2, x1] * [-sin1, sin2] exactly (an IEEE product's sign is
            # the XOR of the operands' signs, its magnitude the same): one product over a half-swapped view
            # of x, with the signed table made once per sin array (shared by every RoPE of the call)
            pair = signed[0]
            if pair is None or pair[0] is not sin:
                ss = sin.copy()
                np.negative(ss[..., :half], out=ss[..., :half])
                pair = signed[0] = (sin, ss.reshape(*ss.shape[:-1], 2, half))
            t = x.reshape(*x.shape[:-1], 2, half)[..., ::-1, :] * pair[1]
            y = x * store[cos_id]
            y += t.reshape(y.shape)
            store[y_id] = y
        frac = ctx.frac[layer] if is_q and ctx.mask is not None and layer is not None else 1.0
        return entry(x.size * frac)

    return run
