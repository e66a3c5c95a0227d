"""Binding of the matrix unit's instructions (`XL_GEMM.*`): integer and FP16 GEMMs, im2col convolutions, and
integer GEMMs over one input fused into one matmul.

DSS: a masked head's q_proj columns are zeroed (`col_mask`) and its q_proj/o_proj costs shrink with the
active fraction of heads.
"""

from __future__ import annotations

import math

import numpy as np

from .kernels import F16Gemm, IntGemm


def fusable_gemms(binder) -> dict[int, FusedGemm]:
    """Integer GEMMs that read the same activation tensor (Q/K/V, gate/up) share one `FusedGemm`, keyed by
    the index of each member's ATTR record. ONNX values are written once, so all members see the same input."""
    by_input: dict[tuple, list[dict]] = {}
    for ins in binder.program.instructions:
        if ins.mnemonic not in ("XL_GEMM.W4A8", "XL_GEMM.W8A8"):
            continue
        attr = binder.program.attrs[ins.operands[0]]
        if "im2col" in attr or "bias" in attr:
            continue
        by_input.setdefault((attr["in_ids"][0], attr["bits"], attr["k"], attr["group"]), []).append(attr)
    out = {}
    for members in by_input.values():
        if len(members) > 1:
            fused = FusedGemm([binder.int_gemm(a) for a in members], members, binder.env.head_dim)
            for a in members:
                out[id(a)] = fused
    return out


def gemm(binder, mnem, attr, ins, outs, layer):
    w, env, costs = binder.program.weights, binder.env, binder.costs
    name = attr["weight"]
    k, n = attr["k"], attr["n"]
    dtype = {16: "fp16", 8: "int8", 4: "int4"}[attr["bits"]]
    role = attr.get("head_role") if env.head_dim else None
    x_id, y_id = ins[0], outs[0]
    table: dict = {}

    def entry(rows, frac):
        """The cost at `rows` rows with `frac` of the heads active (DSS shrinks q_proj's N and o_proj's K)."""
        e = table.get((rows, frac))
        if e is None:
            kk, nn = (k * frac, n) if role == "o_proj" else (k, n * frac if role == "q_proj" else n)
            e = table[(rows, frac)] = costs.gemm(dtype, name, layer, rows, kk, nn)
        return e

    fused = binder.fused.get(id(attr))
    if fused is not None:
        first = fused.attrs[0] is attr

        def run_fused(store, ctx):
            if first:
                fused.run(store, ctx)
            frac = ctx.frac[layer] if role is not None and ctx.mask is not None and layer is not None else 1.0
            return entry(fused.rows, frac)

        return run_fused
    if mnem in ("XL_GEMM.W4A8", "XL_GEMM.W8A8"):
        gemm = binder.int_gemm(attr)
    else:
        gemm = F16Gemm(w[f"{name}.w"])
    bias = np.asarray(w[attr["bias"]], np.float32) if "bias" in attr else None
    im2col = attr.get("im2col")
    shared = isinstance(gemm, F16Gemm) and x_id in binder.f16_shared

    def run(store, ctx):
        x = store[x_id]
        rounded = None
        if shared:  # q/k/v of the vision encoder: the FP16 copy of their input is made once per call
            hit = ctx.fp16_inputs.get(x_id)
            if hit is None or hit[0] is not x:
                hit = ctx.fp16_inputs[x_id] = (x, gemm.rounded_operand(x))
            rounded = hit[1]
        if im2col:
            kh, kw = im2col
            n_, c, h, w_ = x.shape
            x = (
                x.reshape(n_, c, h // kh, kh, w_ // kw, kw)
                .transpose(0, 2, 4, 1, 3, 5)
                .reshape(n_, (h // kh) * (w_ // kw), c * kh * kw)
            )
        col_mask, frac = None, 1.0
        if role is not None and ctx.mask is not None and layer is not None:
            frac = ctx.frac[layer]
            if role == "q_proj":
                col_mask = ctx.col_mask[layer]
        y = gemm(x, col_mask) if rounded is None else gemm(x, col_mask, rounded)  # fresh: bias in place
        if bias is not None:
            y += bias
        if im2col:
            y = y.reshape(x.shape[0], h // kh, w_ // kw, n).transpose(0, 3, 1, 2)
        store[y_id] = y
        return entry(math.prod(x.shape[:-1]), frac)

    return run


class FusedGemm:
    """Integer GEMMs over one input computed as one (`IntGemm.fused`): bit-identical column slices, one
    activation quantisation and one matmul. The first member's step computes and publishes every member's output;
    each member still reports its own cost, so records and totals are those of the separate instructions."""

    def __init__(self, gemms: list[IntGemm], attrs: list[dict], head_dim: int):
        self.attrs = attrs
        self.gemm = IntGemm.fused(gemms)
        self.x_id = attrs[0]["in_ids"][0]
        self.out_ids = [a["out_ids"][0] for a in attrs]
        bounds = np.cumsum([0] + [g.n for g in gemms])
        self.slices = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
        self.q_part = next((i for i, a in enumerate(attrs) if head_dim and a.get("head_role") == "q_proj"), None)
        self.layer = attrs[0].get("layer")
        self.rows = 0

    def run(self, store: list, ctx) -> None:
        x = store[self.x_id]
        col_mask = None
        if self.q_part is not None and ctx.mask is not None and self.layer is not None:
            col_mask = np.ones(self.gemm.n, np.float32)  # x * 1.0 is exact: other members are unmasked
            col_mask[self.slices[self.q_part]] = ctx.col_mask[self.layer]
        y = self.gemm(x, col_mask)
        self.rows = math.prod(x.shape[:-1])
        contiguous = self.rows == 1
        for tid, sl in zip(self.out_ids, self.slices):
            part = y[..., sl]
            store[tid] = part if contiguous else np.ascontiguousarray(part)
