"""RMSNorm of the portable decoder as ONNX Runtime's fused norm kernels, the residual Add folded in.

The exporter decomposes RMSNorm (`Mul(x, x) -> ReduceMean -> Add(eps) -> Sqrt -> Reciprocal -> Mul -> Mul(w)`) so
every consumer sees basic ops. ORT 1.32 does not fuse that form back at ORT_ENABLE_ALL (its SimplifiedLayerNorm
fusion looks for Pow and Div; the optimized model, saved with `SessionOptions.optimized_model_filepath`, keeps
all seven nodes per norm, and so no SkipSimplifiedLayerNormalization either). So the lowering writes them:

- `SkipSimplifiedLayerNormalization` (com.microsoft) where the norm reads a residual `Add` of two computed
  values (every norm but the first layer's input norm): inputs (input, skip, gamma), outputs (normed, mean,
  inv_std_var, input + skip); the sum takes the Add's place in the residual stream;
- `SimplifiedLayerNormalization` (ORT registers it in the default ONNX domain, not com.microsoft) elsewhere.

Same math as the decomposition (float32 sum, mean of squares, rsqrt): the lowering's test bounds the difference.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from .attention import MS_DOMAIN
from .graph_walk import NotPortable, const, made_by, named, users


@dataclass
class RmsNorm:
    x: ir.Value
    weight: ir.Value
    eps: float
    out: ir.Value


def _one(value: ir.Value, op_type: str) -> ir.Node:
    found = users(value, op_type)
    if len(found) != 1:
        raise NotPortable(f"{value.name}: {len(found)} {op_type} readers")
    return found[0]


def _other(node: ir.Node, value: ir.Value) -> ir.Value | None:
    a, b = node.inputs
    return b if a is value else a if b is value else None


def _match(mean: ir.Node) -> RmsNorm | None:
    """The RMSNorm whose ReduceMean is `mean`, None when the nodes around it are something else."""
    first = mean.inputs[0] if mean.inputs else None
    sq = first.producer() if first is not None else None
    if sq is None or sq.op_type != "Mul" or sq.inputs[0] is not sq.inputs[1]:
        return None
    axes = const(mean.inputs[1]) if len(mean.inputs) > 1 else None
    keep = mean.attributes.get("keepdims")
    if axes is None or np.asarray(axes).reshape(-1).tolist() != [-1] or (keep is not None and keep.as_int() != 1):
        return None
    x = sq.inputs[0]
    if x is None:
        return None
    try:
        add = _one(mean.outputs[0], "Add")
        recip = _one(_one(add.outputs[0], "Sqrt").outputs[0], "Reciprocal")
        normed = _one(recip.outputs[0], "Mul")
        scaled = _one(normed.outputs[0], "Mul")
    except NotPortable:
        return None
    eps = const(_other(add, mean.outputs[0]))
    weight = _other(scaled, normed.outputs[0])
    gamma = const(weight)
    if _other(normed, recip.outputs[0]) is not x or eps is None or np.size(eps) != 1 or gamma is None or weight is None:
        return None
    if gamma.ndim != 1:
        return None
    return RmsNorm(x, weight, float(np.asarray(eps).item()), scaled.outputs[0])


def find_rms_norms(graph: ir.Graph) -> list[RmsNorm]:
    """Every decomposed RMSNorm in the graph, in graph order."""
    found = []
    for node in graph:
        if node.op_type == "ReduceMean" and node.domain in ("", "ai.onnx"):
            norm = _match(node)
            if norm is not None:
                found.append(norm)
    return found


def _residual(x: ir.Value) -> ir.Node | None:
    """The Add making `x` when it sums two computed tensors of the residual stream (not a bias or a constant)."""
    add = x.producer()
    if add is None or add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.inputs) != 2:
        return None
    if any(v is None or const(v) is not None for v in add.inputs):
        return None
    return add


def fuse_norm(graph: ir.Graph, norm: RmsNorm) -> ir.Value:
    """Replace `norm` (and the residual Add in front, when there is one) by a fused node; returns its output."""
    add = _residual(norm.x)
    out_node = made_by(norm.out, "RMSNorm")
    base = (out_node.name or "").rsplit("/", 1)[0]
    if add is not None:
        node = ir.node(
            "SkipSimplifiedLayerNormalization",
            [add.inputs[0], add.inputs[1], norm.weight],
            {"epsilon": norm.eps},
            domain=MS_DOMAIN,
            num_outputs=4,
            name=f"{base}/SkipSimplifiedLayerNormalization",
        )
        graph.insert_after(add, node)
        norm.out.replace_all_uses_with(node.outputs[0])
        norm.x.replace_all_uses_with(node.outputs[3])
    else:
        node = ir.node(
            "SimplifiedLayerNormalization",
            [norm.x, norm.weight],
            {"epsilon": norm.eps, "axis": -1},
            name=f"{base}/SimplifiedLayerNormalization",
        )
        graph.insert_after(out_node, node)
        norm.out.replace_all_uses_with(node.outputs[0])
    named(node)
    return node.outputs[0]


def leave_unread_outputs_out(graph: ir.Graph) -> None:
    """Leave out the fused norms' outputs nothing reads (the mean and inverse deviation always; the sum after the
    last norm): ORT computes and allocates an optional output only when it is named. onnxruntime-genai's decoders
    name none of them either; on radreport-tiny's 0.12 ms decode step the unread ones cost ~4 us."""
    for node in graph:
        if node.op_type != "SkipSimplifiedLayerNormalization" or node.domain != MS_DOMAIN:
            continue
        for out in node.outputs[1:]:
            if not out.uses() and not out.is_graph_output():
                out.name = ""
