"""Patterns for the matrix unit: weight MatMuls (INT4/INT8 dequantised, FP16 transposed or plain, with a fused
bias Add) and patch-embedding Convs, each one `XL_GEMM.*`.

Why weights are repacked here: the program stores them in the layout the X1 streams (numerics.md: INT4 nibbles
column-major by output column then group, FP16 group scales), so neither the emulator nor a device reorders
them at load.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

from edgekit import names

from .graph_view import attrs, name

if TYPE_CHECKING:
    from .lowering_context import LoweringContext

_INT4_TYPES = (ir.DataType.INT4, ir.DataType.UINT4)


def try_gemm(low: LoweringContext, n: ir.Node) -> bool:
    g = low.g
    if n.op_type != "MatMul" or g.is_const(n.inputs[0]):
        return False
    x, w = n.inputs[0], n.inputs[1]
    if x is None or w is None:  # both are required inputs of a MatMul
        return False
    consumed = [n]
    dq = g.op(w, "DequantizeLinear")
    tr = g.op(w, "Transpose")
    if (
        dq is not None
        and g.only_use(w, n)
        and all(g.is_init(i) for i in dq.inputs[:2])
        and len(dq.inputs) == 2
        and attrs(dq).get("axis", 1) == 0
    ):
        q_in = dq.inputs[0]
        q = np.asarray(g.array(q_in)).astype(np.int16)
        s = np.asarray(g.array(dq.inputs[1]), np.float32)
        q_tensor = None if q_in is None else q_in.const_value  # None for a folded constant: not integer codes
        bits = 4 if q_tensor is not None and q_tensor.dtype in _INT4_TYPES else 8
        wname = name(w)[: -len(".weight_dq")] if name(w).endswith(".weight_dq") else name(n)
        attr = low.add_matrix_int(wname, q, s, bits)
        mnem = "XL_GEMM.W4A8" if bits == 4 else "XL_GEMM.W8A8"
        consumed.append(dq)
    elif tr is not None and g.only_use(w, n) and g.is_init(tr.inputs[0]) and attrs(tr).get("perm") == [1, 0]:
        src = name(tr.inputs[0])
        wname = src[: -len(".weight")] if src.endswith(".weight") else name(n)
        attr = low.add_matrix_f16(wname, np.asarray(g.array(tr.inputs[0]), np.float32).T)
        mnem = "XL_GEMM.F16"
        consumed.append(tr)
    elif g.is_init(w):
        attr = low.add_matrix_f16(name(w), np.asarray(g.array(w), np.float32))
        mnem = "XL_GEMM.F16"
    else:
        return False
    out, anchor = n.outputs[0], n
    adds = g.users(out)
    if len(adds) == 1 and adds[0].op_type == "Add" and not out.is_graph_output():
        other = [i for i in adds[0].inputs if i is not out]
        bias = other[0] if len(other) == 1 else None
        if g.is_init(bias) and np.asarray(g.array(bias)).ndim == 1:
            attr["bias"] = low.add_const(bias)
            anchor, out = adds[0], adds[0].outputs[0]
            consumed.append(adds[0])
    role = next((r for r in ("q_proj", "o_proj") if f"/{r}/" in name(n)), None)
    if role and low.graph_name in DECODER_NAMES and DECODER_ATTENTION.search(name(n)):
        attr["head_role"] = role
    low.emit(anchor, consumed, [(mnem, {**attr, "in": [name(x)], "out": [name(out)]})], "gemm")
    return True


DECODER_NAMES = (names.DECODER_ROLE, names.DECODER)
# a decoder layer's attention, whatever the module prefix (model.layers, language_model.model.layers in LLaVA,
# model.text_model.layers in Idefics3): the projections DSS masks by head
DECODER_ATTENTION = re.compile(r"/layers\.\d+/self_attn/")


def try_conv(low: LoweringContext, n: ir.Node) -> bool:
    """A patch embedding (stride = kernel, no padding, groups, or dilation): an im2col FP16 GEMM."""
    g = low.g
    if n.op_type != "Conv" or not g.is_init(n.inputs[1]):
        return False
    a = attrs(n)
    w = np.asarray(g.array(n.inputs[1]), np.float32)
    kh, kw = w.shape[2:]
    if (
        a.get("strides") != [kh, kw]
        or any(a.get("pads", [0]))
        or a.get("group", 1) != 1
        or any(d != 1 for d in a.get("dilations", [1, 1]))
    ):
        return False
    attr = low.add_matrix_f16(name(n.inputs[1]), w.reshape(w.shape[0], -1).T)
    attr["im2col"] = [int(kh), int(kw)]
    bias = n.inputs[2] if len(n.inputs) > 2 else None
    if bias is not None:
        attr["bias"] = low.add_const(bias)
    low.emit(n, [n], [("XL_GEMM.F16", {**attr, "in": [name(n.inputs[0])], "out": [name(n.outputs[0])]})], "conv")
    return True
