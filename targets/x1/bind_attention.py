"""Binding of the KV cache and attention-engine instructions: `KVEVICT`, `KVAPPEND`, `KVLD`,
`XL_VMATMUL_CAUSAL`, the attention `VSOFTMAX` and `XL_VMATMUL_PV`.

The cache itself is `kvcache.KVCache` (the run's `ctx.kv`); these closures move rows in and out of it and cost
the reads by where the rows live (resident window or DRAM spill, kv-spill.md).
"""

from __future__ import annotations

import numpy as np

from .kernels import native, quantize_rows_int8, softmax, to_fp16
from .step_costs import Entry


def kv_evict(binder, attr, ins, outs, layer):
    costs, kv_bits = binder.costs, binder.env.machine.kv_bits
    k_id = ins[0]

    def run(store, ctx):
        k = store[k_id]
        res, _ = ctx.kv.length(layer)
        evicted = max(0, min(res, res + k.shape[2] - ctx.kv.window))
        if not evicted:
            return None  # predicated off: the window still has room
        ebits = evicted * 2 * k.shape[0] * k.shape[1] * k.shape[3] * kv_bits
        return costs.vector(
            "kv_evict", layer, 0, 1, {"sram_read_bit": ebits, "dram_write_bit": ebits, "_kv_sram_bits": ebits}
        )

    return run


def kv_append(binder, attr, ins, outs, layer):
    costs, kv_bits, ops = binder.costs, binder.env.machine.kv_bits, binder.v.quantize_ops
    k_id, v_id = ins[0], ins[1]
    table: dict = {}

    def run(store, ctx):
        k = store[k_id]
        ctx.kv.append(layer, k, store[v_id])
        values = 2 * k.size
        e = table.get(values)
        if e is None:
            bits = values * kv_bits
            e = table[values] = costs.vector(
                "kv_append", layer, values, ops, {"sram_write_bit": bits, "_kv_sram_bits": bits}
            )
        return e

    return run


def kv_load(binder, attr, ins, outs, layer):
    env, costs = binder.env, binder.costs

    def run(store, ctx):
        res, dram = ctx.kv.length(layer)
        ctx.ctx_len[layer] = (res, dram)
        if not dram:
            return None
        groups = ctx.groups_active(layer)
        b_ = ctx.kv.batch(layer)
        bits = groups * dram * env.head_dim * env.machine.kv_bits * 2 * b_
        return costs.vector("kv_load", layer, 0, 1, {"dram_read_bit": bits, "sram_write_bit": bits})

    return run


def attn_entry(binder, kind, layer, ctx, t, rows) -> Entry:
    env = binder.env
    return binder.costs.attention(
        kind,
        layer,
        env.heads * ctx.frac_or_one(layer),
        ctx.groups_active(layer),
        t,
        rows,
        env.head_dim,
        env.kv_bytes_per_token,
        env.window,
    )


def scores(binder, attr, ins, outs, layer):
    env = binder.env
    q_id, m_id, s_id = ins[0], ins[1], outs[0]
    scale = np.float32(attr["scale"])
    kvh = env.kv_heads

    def run(store, ctx):
        q, mask = store[q_id], store[m_id]
        kv = ctx.kv
        b, h, s_, d = q.shape
        if native.enabled and b == 1 and s_ == 1 and q.dtype == np.float32 and mask.dtype == np.float32:
            ks = kv.key_store(layer)
            if ks is not None and mask.size == ks[2]:  # one query row over T keys: the C kernel
                t = ks[2]
                out = np.empty((1, kvh, h // kvh, 1, t), np.float32)
                native.lib.attn_scores(
                    q.reshape(h, d) if q.flags.c_contiguous else np.ascontiguousarray(q).reshape(h, d),
                    ks[0],
                    ks[1],
                    t,
                    float(scale),
                    np.ascontiguousarray(mask).reshape(t),
                    out,
                )
                store[s_id] = out
                return attn_entry(binder, "attn_scores", layer, ctx, t, 1)
        kf, ksf = kv.keys(layer)  # (b, kv, T, hd) INT4 codes, (b, kv, T, G) FP16 scales, as float32
        b, h, s_, d = q.shape
        qg = q.reshape(b, kvh, h // kvh, s_, d)  # (b, kv, g, s, hd)
        q_int, q_s = quantize_rows_int8(qg)  # per head row
        group = kv.group
        G = kf.shape[-1] // group
        if G == 1:
            # one (g*s, hd) x (hd, T) matmul per KV head instead of one per query head: the integer dot
            # products are exact, so the grouping of rows into BLAS calls cannot change them
            dots = np.matmul(q_int.reshape(b, kvh, -1, d), kf.swapaxes(-1, -2)).reshape(*q_int.shape[:-1], -1)
            s = dots * ksf[:, :, None, None, :, 0]
        else:
            s = 0
            for j in range(G):
                sl = slice(j * group, (j + 1) * group)
                s = s + np.matmul(q_int[..., sl], kf[:, :, None, :, sl].swapaxes(-1, -2)) * ksf[:, :, None, None, :, j]
        store[s_id] = s * q_s / scale + mask
        res, dram = kv.length(layer)
        return attn_entry(binder, "attn_scores", layer, ctx, res + dram, s_ * b)

    return run


def attn_softmax(binder, attr, ins, outs, layer):
    entry = binder.sized("softmax", layer, binder.v.softmax_ops)
    s_id, p_id = ins[0], outs[0]
    c127 = np.float32(127.0)

    def run(store, ctx):
        s = store[s_id]
        p = softmax(s)
        p_s = np.maximum.reduce(p, axis=-1, keepdims=True)  # p.max(axis=-1, keepdims=True)
        p_s /= c127
        # `nonzero(p_s)` is p_s itself here: a softmax row's largest entry is 1 / sum with 1 <= sum <= T, so
        # p_s >= 1 / (127 T) > 0 (or NaN for an all -inf row, which nonzero leaves NaN as well)
        np.divide(p, p_s, out=p)  # p is softmax's own array
        store[p_id] = (np.rint(p, out=p), p_s)
        return entry(s.size * ctx.frac_or_one(layer))

    return run


def pv(binder, attr, ins, outs, layer):
    env = binder.env
    p_id, o_id = ins[0], outs[0]
    kvh = env.kv_heads

    def run(store, ctx):
        p_int, p_s = store[p_id]
        kv = ctx.kv
        v = kv.values(layer)  # v_int * v_s16 per row and group, FP32
        o = np.matmul(p_int, v[:, :, None]) * p_s  # (b, kv, g, s, hd)
        act = ctx.mask[layer] if ctx.mask is not None and layer is not None else None
        if act is not None:
            o = o * act.reshape(1, kvh, -1, 1, 1)
        o = to_fp16(o, owned=True)
        store[o_id] = o
        ctx.attn_out.append((layer, o[0, :, :, -1, :], act))  # head norms, computed if read
        res, dram = kv.length(layer)
        return attn_entry(binder, "attn_values", layer, ctx, res + dram, o.shape[3] * o.shape[0])

    return run
