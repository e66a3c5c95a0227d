"""Patterns for the attention block: the decoder's GQA attention over the KV cache (one `KVEVICT, KVAPPEND,
KVLD, XL_VMATMUL_CAUSAL, VSOFTMAX, XL_VMATMUL_PV` group per layer) and rotary embeddings (`XL_ROPE_ROTATE`).

Why the KV cache is matched by its graph input names (`edgekit.names`): the exporter writes `past_key_values.{i}.*`
in and `present.{i}.*` out; on the X1 the cache lives in the KV banks, so the Concat that grows it becomes an
append into them and the present outputs are read back from the cache (`kv_outputs`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

from edgekit.names import PAST_PREFIX, past_value

from .graph_view import name

if TYPE_CHECKING:
    from .lowering_context import LoweringContext


def _past_key_layer(v: ir.Value | None) -> int | None:
    """The layer of a `past_key_values.{i}.key` input, None for any other value."""
    vname = name(v)
    if not vname.startswith(PAST_PREFIX) or not vname.endswith(".key"):
        return None
    return int(vname[len(PAST_PREFIX) :].split(".")[0])


def try_attention(low: LoweringContext, n: ir.Node) -> bool:
    """Concat(past_key_values.i.key, k) ... Softmax ... MatMul(P, V): the whole GQA block over the KV ring."""
    g = low.g
    layer = _past_key_layer(n.inputs[0]) if n.op_type == "Concat" else None
    if layer is None:
        return False
    past_v = g.values.get(past_value(layer))
    cv = next((c for c in (g.users(past_v) if past_v is not None else []) if c.op_type == "Concat"), None)
    if cv is None:
        return False
    pk, pv = n.outputs[0], cv.outputs[0]
    tr = [c for c in g.users(pk) if c.op_type == "Transpose"]
    uv = [c for c in g.users(pv) if c.op_type == "Unsqueeze"]
    if len(tr) != 1 or len(uv) != 1:
        return False
    uk = g.users(tr[0].outputs[0])
    if len(uk) != 1 or uk[0].op_type != "Unsqueeze":
        return False
    s_mm = g.users(uk[0].outputs[0])
    if len(s_mm) != 1 or s_mm[0].op_type != "MatMul":
        return False
    rq = g.op(s_mm[0].inputs[0], "Reshape")
    chain = []
    cur = s_mm[0]
    for op in ("Div", "Add", "Softmax", "MatMul"):
        nxt = g.users(cur.outputs[0])
        if len(nxt) != 1 or nxt[0].op_type != op:
            return False
        cur = nxt[0]
        chain.append(cur)
    div, add, soft, pv_mm = chain
    if rq is None or pv_mm.inputs[1] is not uv[0].outputs[0]:
        return False
    scale = float(np.asarray(g.array(div.inputs[1])).reshape(-1)[0])
    mask = name([i for i in add.inputs if i is not div.outputs[0]][0])
    q = name(rq.inputs[0])
    k_new, v_new = name(n.inputs[1]), name(cv.inputs[1])
    scores, probs = f"{pv_mm.name}:scores", f"{pv_mm.name}:probs"
    common = {"layer": layer}
    instrs = [
        ("KVEVICT", {**common, "in": [k_new], "out": []}),
        ("KVAPPEND", {**common, "in": [k_new, v_new], "out": []}),
        ("KVLD", {**common, "in": [], "out": []}),
        ("XL_VMATMUL_CAUSAL", {**common, "scale": scale, "in": [q, mask], "out": [scores]}),
        ("VSOFTMAX", {**common, "attn": True, "in": [scores], "out": [probs]}),
        ("XL_VMATMUL_PV", {**common, "in": [probs], "out": [name(pv_mm.outputs[0])]}),
    ]
    low.kv_outputs[layer] = (name(pk), name(pv))
    low.emit(pv_mm, [n, cv, tr[0], uv[0], uk[0], s_mm[0], rq, *chain], instrs, "attention")
    return True


def try_rope(low: LoweringContext, n: ir.Node) -> bool:
    """x * cos + Concat(-x2, x1) * sin, from the Split of x into halves."""
    g = low.g
    if n.op_type != "Split" or len(n.outputs) != 2:
        return False
    x = n.inputs[0]
    neg = g.users(n.outputs[1])
    if len(neg) != 1 or neg[0].op_type != "Neg":
        return False
    cat = g.users(neg[0].outputs[0])
    if len(cat) != 1 or cat[0].op_type != "Concat" or list(cat[0].inputs) != [neg[0].outputs[0], n.outputs[0]]:
        return False
    mul_sin = g.users(cat[0].outputs[0])
    if len(mul_sin) != 1 or mul_sin[0].op_type != "Mul":
        return False
    add = g.users(mul_sin[0].outputs[0])
    if len(add) != 1 or add[0].op_type != "Add":
        return False
    other = [i for i in add[0].inputs if i is not mul_sin[0].outputs[0]][0]
    mul_cos = g.op(other, "Mul")
    if other is None or mul_cos is None or x not in mul_cos.inputs or not g.only_use(other, add[0]):
        return False
    cos = [i for i in mul_cos.inputs if i is not x][0]
    sin = [i for i in mul_sin[0].inputs if i is not cat[0].outputs[0]][0]
    role = "k" if "rotary_k" in name(n) else "q"
    attr: dict = {"role": role, "in": [name(x), name(cos), name(sin)], "out": [name(add[0].outputs[0])]}
    for table in (cos, sin):  # constant tables (a vision tower's fixed grid) travel in the program, as generic ops'
        if g.is_const(table):
            attr.setdefault("const", {})[name(table)] = low.add_const(table)
    low.emit(add[0], [n, neg[0], cat[0], mul_sin[0], mul_cos, add[0]], [("XL_ROPE_ROTATE", attr)], "rope")
    return True
