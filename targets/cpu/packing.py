"""Projections that read the same input, packed into one MatMul along N (q/k/v into one QKV projection).

Why: at decode a projection is a matrix-vector product whose fixed costs (a kernel dispatch, and with
`accuracy_level` 4 the int8 quantization of its input) are a large share of its time; q, k and v read the same
normed activations, so one (K, Nq + Nk + Nv) product does the three in one pass, and GroupQueryAttention takes the
packed result as its query with key and value left empty (as onnxruntime-genai's decoders do).

What packs: three `com.microsoft.MatMulNBits` with the same input and the same K, bits, block size and accuracy
level, each with constant weights, scales and zero points of the same kind (every MatMulNBits tensor has N as its
leading axis, so packing is a concatenation along axis 0), or three float weight MatMuls (`Transpose(W) ->
MatMul`, as exported); a bias Add behind each (Qwen2) becomes one Add of the concatenated biases. Anything else
(fp16 casts, int8 MatMulInteger, a per-MatMul mixed precision that differs) stays unpacked: GroupQueryAttention
takes q, k and v apart just as well.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from edgekit.passes.patterns import WeightMatMul, add_initializer, find_weight_matmuls

from .attention import MS_DOMAIN
from .graph_walk import NotPortable, const, named

NBITS_ATTRS = ("K", "bits", "block_size")


@dataclass
class Projection:
    node: ir.Node  # MatMulNBits, or the float MatMul
    bias: ir.Node | None  # the Add of a constant bias behind it
    weight: WeightMatMul | None  # the float case


def float_projections(model: ir.Model) -> dict[int, WeightMatMul]:
    """The float weight MatMuls by node id (what `pack_projections` packs besides MatMulNBits)."""
    return {id(w.node): w for w in find_weight_matmuls(model)}


def _attr(node: ir.Node, name: str, default=None):
    a = node.attributes.get(name)
    return default if a is None else a.value


def _projection(value: ir.Value, float_weights: dict[int, WeightMatMul]) -> Projection | None:
    node = value.producer()
    bias = None
    if node is not None and node.op_type == "Add" and node.domain in ("", "ai.onnx"):
        b = const(node.inputs[1])
        if b is None or b.ndim != 1 or const(node.inputs[0]) is not None:
            return None
        first = node.inputs[0]
        bias, node = node, first.producer() if first is not None else None
    if node is None:
        return None
    if node.op_type == "MatMulNBits" and node.domain == MS_DOMAIN:
        return Projection(node, bias, None)
    if id(node) in float_weights:
        return Projection(node, bias, float_weights[id(node)])
    return None


def _nbits_packable(ps: Sequence[Projection]) -> bool:
    first = ps[0].node
    kinds = [const(v) for v in first.inputs[1:]]
    if len(first.inputs) > 4 or any(t is None for t in kinds):  # g_idx or a bias input; a computed weight
        return False
    for p in ps[1:]:
        n = p.node
        if len(n.inputs) != len(first.inputs) or n.inputs[0] is not first.inputs[0]:
            return False
        if any(_attr(n, a) != _attr(first, a) for a in NBITS_ATTRS):
            return False
        if _attr(n, "accuracy_level", 0) != _attr(first, "accuracy_level", 0):
            return False
        tensors = [const(v) for v in n.inputs[1:]]
        if [None if t is None else t.dtype for t in tensors] != [None if t is None else t.dtype for t in kinds]:
            return False
    return True


def _concat(graph: ir.Graph, values: Sequence[ir.Value | None], name: str) -> ir.Value:
    arrays = []
    for v in values:
        array = const(v)
        if array is None:  # the callers checked: every packed input is a constant
            raise NotPortable(f"{name}: a computed input cannot be packed")
        arrays.append(array)
    return add_initializer(graph, np.concatenate(arrays, axis=0), name)


def pack_projections(
    graph: ir.Graph, outputs: Sequence[ir.Value], name: str, float_weights: dict[int, WeightMatMul]
) -> ir.Value | None:
    """One projection computing `outputs` (each (batch, seq, N_i)) concatenated along the last axis, inserted
    after the last of their MatMuls; None (and nothing changed) when they cannot be packed. `float_weights`:
    `float_projections(model)`, found before the lowering's edits."""
    found = [_projection(v, float_weights) for v in outputs]
    ps = [p for p in found if p is not None]
    if len(ps) != len(found) or len({p.bias is None for p in ps}) != 1:
        return None
    weights = [p.weight for p in ps if p.weight is not None]
    first = ps[0].node
    if not weights:
        if not _nbits_packable(ps):
            return None
        roles = ("qweight", "scales", "qzeros")
        inputs = [first.inputs[0]]
        inputs += [
            _concat(graph, [p.node.inputs[i] for p in ps], f"{name}.{roles[i - 1]}")
            for i in range(1, len(first.inputs))
        ]
        attrs = {a.name: a.value for a in first.attributes.values()}
        attrs["N"] = sum(_attr(p.node, "N") for p in ps)
        packed = ir.node("MatMulNBits", inputs, attrs, domain=MS_DOMAIN, name=f"{name}/MatMulNBits")
    elif len(weights) == len(ps) and len({id(w.activation) for w in weights}) == 1:
        w = np.concatenate([w.kn() for w in weights], axis=1)
        packed = ir.node(
            "MatMul", [first.inputs[0], add_initializer(graph, w, f"{name}.weight")], name=f"{name}/MatMul"
        )
    else:
        return None
    nodes = [named(packed)]
    out = packed.outputs[0]
    if ps[0].bias is not None:
        bias = _concat(graph, [p.bias.inputs[1] for p in ps if p.bias is not None], f"{name}.bias")
        nodes.append(named(ir.node("Add", [out, bias], name=f"{name}/Add")))
        out = nodes[-1].outputs[0]
    last = max((p.node for p in ps), key=graph.index)
    graph.insert_after(last, nodes)  # the shared input exists there, and everything reading the result comes later
    return out
