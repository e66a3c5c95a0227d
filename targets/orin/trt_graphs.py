"""The recipe's graphs rewritten into what a strongly typed TensorRT network builds well, still plain ONNX that
ONNX Runtime runs (that is how the orin bundle is verified where there is no Jetson).

Strongly typed means the ONNX types are the engine's types (TensorRT picks no precision of its own), so the graph
must say FP16 where it wants FP16:
- every GEMM with a constant weight computes in FP16: the activation is cast to FP16 (one Cast per activation,
  shared by q/k/v and gate/up), the weight is FP16 or an INT4/INT8 `DequantizeLinear` whose scale is FP16 (its
  output type is the scale's type), and the product is cast back to FP32;
- the patch Conv likewise, and embedding tables are stored in FP16 and cast back after the Gather;
- norms (RMSNorm, LayerNorm), softmax, RoPE, attention scores and the residual stream stay FP32, as do the graph
  inputs and outputs and the KV cache.
Before that, the fixes the capability check names are applied: an INT4 `DequantizeLinear` that feeds no GEMM
(embedding table, patch Conv kernel, position table) is folded into a float constant, and blocked INT8 (TensorRT
blocks INT4 only) is re-quantized per output channel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx_ir as ir

from edgekit import names
from edgekit.export.save import save_model
from edgekit.ir_values import const_array, input_of, name_of
from edgekit.passes import find_weight_matmuls
from edgekit.passes.base import PassContext, PassPreconditionError
from edgekit.passes.fp16 import Fp16Pass, output_to_fp16
from edgekit.passes.patterns import add_initializer, remove_if_unused
from edgekit.passes.sparsity import is_2to4

from .capability import FOLD_DEQUANTIZE, PER_CHANNEL_INT8, CapabilityReport, check_model

F16, F32 = ir.DataType.FLOAT16, ir.DataType.FLOAT


@dataclass
class GraphChanges:
    graph: str
    folded: list[str] = field(default_factory=list)  # DequantizeLinear nodes folded into constants
    per_channel: list[str] = field(default_factory=list)  # blocked INT8 re-quantized per channel
    fp16_gemms: int = 0
    fp16_qdq_gemms: int = 0
    fp16_convs: int = 0
    fp16_tables: int = 0
    sparse_2_4_weights: int = 0  # GEMM weights whose K groups of 4 hold at most 2 non-zeros

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def dequantize(q: np.ndarray, scale: np.ndarray, axis: int, block: int) -> np.ndarray:
    """DequantizeLinear without zero point (the only kind TensorRT takes), in float32."""
    q = q.astype(np.float32)
    s = np.asarray(scale, np.float32)
    if s.ndim == 0 or s.size == 1:
        return q * s.reshape(())
    if block:
        return q * np.repeat(s, block, axis=axis)
    shape = [1] * q.ndim
    shape[axis] = -1
    return q * s.reshape(shape)


def _dq_parts(node: ir.Node) -> tuple[np.ndarray, np.ndarray, int, int]:
    q = const_array(input_of(node, 0))
    s = const_array(input_of(node, 1))
    axis = node.attributes["axis"].as_int() if "axis" in node.attributes else 1
    axis = axis % max(q.ndim, 1)
    block = node.attributes["block_size"].as_int() if "block_size" in node.attributes else 0
    return q, s, axis, block


def _replace_with_constant(model: ir.Model, value: ir.Value, array: np.ndarray, name: str) -> ir.Value:
    const = add_initializer(model.graph, np.ascontiguousarray(array), name)
    value.replace_all_uses_with(const, replace_graph_outputs=True)
    return const


def fold_dequantize(model: ir.Model, node: ir.Node) -> None:
    """Replace a constant DequantizeLinear (and a Reshape by a constant shape right after it) with its value."""
    q, s, axis, block = _dq_parts(node)
    w = dequantize(q, s, axis, block)
    out = node.outputs[0]
    users = list(out.uses())
    name = (input_of(node, 0).name or node.name or "").removesuffix(".qweight")
    if len(users) == 1 and users[0].node.op_type == "Reshape":
        reshape = users[0].node
        shape = reshape.inputs[1].const_value if reshape.inputs[1] is not None else None
        if shape is not None:
            _replace_with_constant(model, reshape.outputs[0], w.reshape(shape.numpy()), f"{name}.folded")
            remove_if_unused(model, reshape)
            remove_if_unused(model, node)
            return
    _replace_with_constant(model, out, w, f"{name}.folded")
    remove_if_unused(model, node)


def per_channel_int8(model: ir.Model, node: ir.Node) -> None:
    """A blocked INT8 weight (K, N) as per-output-channel INT8 with scale (N,): the blocks' values, re-quantized."""
    q, s, axis, block = _dq_parts(node)
    w = dequantize(q, s, axis, block)  # (K, N)
    amax = np.abs(w).max(axis=0)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q8 = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    base = (input_of(node, 0).name or node.name or "").removesuffix(".qweight")
    node.replace_input_with(0, add_initializer(model.graph, q8, f"{base}.qweight_pc"))
    node.replace_input_with(1, add_initializer(model.graph, scale, f"{base}.scales_pc"))
    node.attributes.pop("block_size", None)
    node.attributes["axis"] = ir.AttrInt64("axis", 1)
    _drop_unused_initializers(model)  # the blocked integers and scales


def _drop_unused_initializers(model: ir.Model) -> None:
    for name, v in list(model.graph.initializers.items()):
        if not v.uses() and not v.is_graph_output():
            model.graph.initializers.pop(name, None)


def _cast(model: ir.Model, value: ir.Value, to: ir.DataType, before: ir.Node, name: str) -> ir.Value:
    cast = ir.node("Cast", [value], {"to": to}, name=name)
    cast.outputs[0].name, cast.outputs[0].dtype = f"{value.name}_{'fp16' if to == F16 else 'fp32'}", to
    if value.shape is not None:
        cast.outputs[0].shape = value.shape
    model.graph.insert_before(before, cast)
    return cast.outputs[0]


class _Fp16Inputs:
    """One FP16 Cast per activation, shared by every GEMM that reads it."""

    def __init__(self, model: ir.Model):
        self.model = model
        self.casts: dict[str, ir.Value] = {}

    def of(self, value: ir.Value, before: ir.Node) -> ir.Value:
        if value.dtype == F16:
            return value
        name = name_of(value)
        if name not in self.casts:
            self.casts[name] = _cast(self.model, value, F16, before, f"{before.name}_CastToFp16")
        return self.casts[name]


def _is_const_dq(value: ir.Value | None) -> ir.Node | None:
    p = value.producer() if value is not None else None
    if p is not None and p.op_type == "DequantizeLinear" and p.inputs[0] is not None and p.inputs[0].is_initializer():
        return p
    return None


def fp16_quantized_gemms(model: ir.Model, casts: _Fp16Inputs) -> int:
    """MatMul(A fp32, DequantizeLinear(int weight, fp32 scale)) -> FP16 compute with an FP16 scale."""
    done = 0
    for node in list(model.graph):
        if node.op_type != "MatMul" or len(node.inputs) != 2:
            continue
        dq = _is_const_dq(node.inputs[1])
        activation = input_of(node, 0)
        if dq is None or activation.dtype not in (F32, None) or node.outputs[0].dtype == F16:
            continue
        scale = input_of(dq, 1)
        if scale.dtype != F16:
            s16 = add_initializer(model.graph, const_array(scale).astype(np.float16), f"{scale.name}_fp16")
            dq.replace_input_with(1, s16)
        dq.outputs[0].dtype = F16
        node.replace_input_with(0, casts.of(activation, node))
        output_to_fp16(model, node)
        done += 1
    _drop_unused_initializers(model)
    return done


def fp16_convs(model: ir.Model, casts: _Fp16Inputs) -> int:
    """Conv with constant float weights (and bias) -> FP16 compute."""
    done = 0
    for node in list(model.graph):
        if node.op_type != "Conv" or node.outputs[0].dtype == F16:
            continue
        params = node.inputs[1:]
        if not all(p is None or (p.is_initializer() and p.dtype == F32) for p in params):
            continue
        for i, p in enumerate(params, start=1):
            if p is not None:
                w16 = const_array(p).astype(np.float16)
                node.replace_input_with(i, add_initializer(model.graph, w16, f"{p.name}_fp16"))
        node.replace_input_with(0, casts.of(input_of(node, 0), node))
        output_to_fp16(model, node)
        done += 1
    _drop_unused_initializers(model)
    return done


def sparse_weights(model: ir.Model) -> int:
    """GEMM weights (float, or integer under a DequantizeLinear) that keep a 2:4 pattern along K."""
    count = 0
    for node in model.graph:
        if node.op_type != "MatMul" or len(node.inputs) != 2 or node.inputs[1] is None:
            continue
        b = node.inputs[1]
        dq = _is_const_dq(b)
        const = dq.inputs[0] if dq is not None else (b if b.is_initializer() else None)
        w = const_array(const) if const is not None else None
        if w is not None and w.ndim == 2 and w.shape[0] % 4 == 0 and np.count_nonzero(w) < w.size and is_2to4(w):
            count += 1
    return count


def prepare_model(model: ir.Model, graph: str, report: CapabilityReport) -> GraphChanges:
    """Apply the capability report's fixes, then make the weight GEMMs FP16 (in place)."""
    changes = GraphChanges(graph)
    by_name = {n.name: n for n in model.graph}
    for f in report.findings:
        node = by_name.get(f.node)
        if node is None or f.device != "gpu":
            continue
        if f.fix == FOLD_DEQUANTIZE:
            fold_dequantize(model, node)
            changes.folded.append(f.node)
        elif f.fix == PER_CHANNEL_INT8:
            per_channel_int8(model, node)
            changes.per_channel.append(f.node)
    float_gemms = sum(1 for m in find_weight_matmuls(model) if m.weight.dtype == F32)
    try:
        Fp16Pass()(model, PassContext(graph=graph))  # float weight GEMMs and embedding tables
    except PassPreconditionError:
        pass  # nothing float left to convert (a fully quantized graph)
    changes.fp16_gemms = float_gemms
    changes.fp16_tables = sum(1 for n in model.graph if n.op_type == "Gather" and input_of(n, 0).dtype == F16)
    casts = _Fp16Inputs(model)
    changes.fp16_qdq_gemms = fp16_quantized_gemms(model, casts)
    changes.fp16_convs = fp16_convs(model, casts)
    changes.sparse_2_4_weights = sparse_weights(model)
    return changes


def prepare_graphs(src: Path, out: Path) -> tuple[list[CapabilityReport], list[GraphChanges], list[CapabilityReport]]:
    """The graphs of `src` (three, or a text model's two), prepared for TensorRT into `out`. Returns the capability
    reports before the fixes (what the recipe's graphs needed), the changes made, and the reports after (which
    must be clean)."""
    out.mkdir(parents=True, exist_ok=True)
    before, changes, after = [], [], []
    for role in names.graph_roles_in(src):
        fname = names.GRAPH_FILES[role]
        model = ir.load(src / fname)
        report = check_model(model, fname)
        before.append(report)
        changes.append(prepare_model(model, fname, report))
        path = save_model(model, out / fname)
        after.append(check_model(ir.load(path), fname))
    return before, changes, after
