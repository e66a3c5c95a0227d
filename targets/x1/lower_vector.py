"""Patterns for the vector unit's fused instructions: RMSNorm (`VRMSNORM`), SiLU x up (`VSILU_MUL`) and exact GELU
(`VGELU`), each matched from the small ONNX ops the exporter decomposes it into."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

from .graph_view import GraphView, name

if TYPE_CHECKING:
    from .lowering_context import LoweringContext


def _single_user(g: GraphView, v: ir.Value, op_type: str) -> ir.Node | None:
    """The one node reading `v` if it is an `op_type`, else None."""
    nxt = g.users(v)
    return nxt[0] if len(nxt) == 1 and nxt[0].op_type == op_type else None


def try_rmsnorm(low: LoweringContext, n: ir.Node) -> bool:
    """x * Reciprocal(Sqrt(ReduceMean(x * x) + eps)) * gamma."""
    g = low.g
    if n.op_type != "ReduceMean":
        return False
    sq = g.op(n.inputs[0], "Mul")
    if sq is None or sq.inputs[0] is not sq.inputs[1] or not g.only_use(sq.outputs[0], n):
        return False
    x = sq.inputs[0]
    chain, cur = [sq, n], n
    for op in ("Add", "Sqrt", "Reciprocal"):
        nxt = _single_user(g, cur.outputs[0], op)
        if nxt is None:
            return False
        cur = nxt
        chain.append(cur)
    eps_in = [i for i in chain[2].inputs if i is not n.outputs[0]]
    if len(eps_in) != 1 or not g.is_const(eps_in[0]):
        return False
    mul1 = _single_user(g, cur.outputs[0], "Mul")
    if mul1 is None or x not in mul1.inputs:
        return False
    mul2 = _single_user(g, mul1.outputs[0], "Mul")
    if mul2 is None:
        return False
    gamma = [i for i in mul2.inputs if i is not mul1.outputs[0]]
    if len(gamma) != 1 or not g.is_init(gamma[0]):
        return False
    eps = float(np.asarray(g.array(eps_in[0])).reshape(-1)[0])
    low.emit(
        mul2,
        [*chain, mul1, mul2],
        [("VRMSNORM", {"gamma": low.add_const(gamma[0]), "eps": eps, "in": [name(x)], "out": [name(mul2.outputs[0])]})],
        "rmsnorm",
    )
    return True


def try_silu_mul(low: LoweringContext, n: ir.Node) -> bool:
    """(x * Sigmoid(x)) * up: the SwiGLU MLP's gate."""
    g = low.g
    if n.op_type != "Sigmoid":
        return False
    x = n.inputs[0]
    users = g.users(n.outputs[0])
    if len(users) != 1 or users[0].op_type != "Mul" or x not in users[0].inputs:
        return False
    silu = users[0]
    mul = _single_user(g, silu.outputs[0], "Mul")
    if mul is None or silu.outputs[0].is_graph_output():
        return False
    up = [i for i in mul.inputs if i is not silu.outputs[0]]
    if len(up) != 1:
        return False
    low.emit(
        mul, [n, silu, mul], [("VSILU_MUL", {"in": [name(x), name(up[0])], "out": [name(mul.outputs[0])]})], "silu_mul"
    )
    return True


def try_gelu(low: LoweringContext, n: ir.Node) -> bool:
    """x * 0.5 * (1 + Erf(x / sqrt(2))), matched from its Erf."""
    g = low.g
    if n.op_type != "Erf":
        return False
    erf_in = n.inputs[0]
    pre = g.op(erf_in, "Mul")
    if erf_in is None or pre is None or not g.only_use(erf_in, n):
        return False
    operands = [i for i in pre.inputs if not g.is_const(i)]
    if len(operands) != 1:
        return False
    x = operands[0]
    add = _single_user(g, n.outputs[0], "Add")
    if add is None:
        return False
    fin = _single_user(g, add.outputs[0], "Mul")
    if fin is None:
        return False
    half = g.op([i for i in fin.inputs if i is not add.outputs[0]][0], "Mul")
    if half is None or x not in half.inputs or not g.only_use(half.outputs[0], fin):
        return False
    low.emit(
        fin,
        [pre, n, add, half, fin],
        [("VGELU", {"approx": "none", "in": [name(x)], "out": [name(fin.outputs[0])]})],
        "gelu",
    )
    return True
