"""Which nodes of a graph TensorRT 10.3 can build, checked before any device is involved (in the spirit of
`polygraphy inspect capability`).

Every node is looked up in onnx-tensorrt's operator table (`optable`): the op must be there and supported, its data
type among the listed ones, and the restrictions that can be read off the graph must hold (constant `axes`, one
LayerNormalization output, TopK's `sorted`/`K`). Quantization gets the checks TensorRT's parser and builder make
(onnx-tensorrt `QuantDequantLinearHelper`; TensorRT's Dequantize operator docs): zero points all zero, scales
constant, block quantization only for INT4 and only as a weight-only GEMM (a constant 2-D weight feeding a
MatMul's B, even last dimension). Nodes the plan puts on the DLA are checked against what the DLA takes (FP16 and
INT8 only, static shapes, its layer list).

Each finding names the node and the reason, and either the fix the orin build applies (`fix`, see
`trt_graphs.py`) or none, which is a refusal.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx_ir as ir

from edgekit.errors import ConfigError
from edgekit.ir_values import input_of

from .optable import TYPE_NAMES, OpTable, load_table

# Fix codes the build knows how to apply (trt_graphs.py).
FOLD_DEQUANTIZE = "fold-dequantize"
PER_CHANNEL_INT8 = "per-channel-int8"
GPU_FALLBACK = "gpu-fallback"
FIX_TEXT = {
    FOLD_DEQUANTIZE: "dequantized at build time into a float constant (the weight ships in the compute precision)",
    PER_CHANNEL_INT8: "re-quantized to per-output-channel INT8 (scale (N,)), which TensorRT takes",
    GPU_FALLBACK: "runs on the GPU instead (GPU fallback is on in the plan)",
}
_AXES_INPUT = {"Squeeze": 1, "Unsqueeze": 1, "Pad": 3, "Slice": 3}  # where `axes` is an input (opset >= 13/18)
_REDUCE = {"ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin"}
_REDUCE |= {"ReduceProd", "ReduceSum", "ReduceSumSquare"}

# What the DLA runs (TensorRT developer guide, "DLA Supported Layers and Restrictions": activation, comparison,
# concatenation, convolution/deconvolution, element-wise, LRN, parametric ReLU, pooling, resize, scale, shuffle,
# slice, softmax, unary), as the ONNX ops onnx-tensorrt imports into those layers. MatMul between activations,
# normalisation layers and Erf are not in it.
DLA_OPS = {
    "Relu", "Sigmoid", "Tanh", "Clip", "LeakyRelu", "PRelu",
    "Equal", "Greater", "Less",
    "Concat", "Conv", "ConvTranspose",
    "Add", "Sub", "Mul", "Div", "Max", "Min", "Pow",
    "LRN", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "Resize", "BatchNormalization",
    "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Slice", "Softmax",
    "Abs", "Sin", "Cos", "Atan",
}  # fmt: skip
DLA_SOURCE = (
    "docs.nvidia.com/deeplearning/tensorrt/latest/inference-library/dla-layer-restrictions.html (layer list and "
    "'DLA does not support dynamic dimensions'); DLA precisions FP16 and INT8"
)
_DLA_TYPES = {"FP16", "INT8"}
_SHAPE_OPS = {"Shape", "Constant", "Range", "ConstantOfShape"}  # shape arithmetic, not tensor math


@dataclass
class Finding:
    graph: str
    node: str
    op: str
    reason: str
    fix: str | None = None  # a FIX_TEXT code the build applies; None: refused
    device: str = "gpu"  # "gpu", or "dla" for a DLA constraint

    @property
    def refused(self) -> bool:
        return self.fix is None

    def reason_line(self) -> str:
        tail = f"; fix: {FIX_TEXT[self.fix]}" if self.fix else ""
        where = " on DLA" if self.device == "dla" else ""
        return f"node '{self.node}' ({self.op}) not supported by TensorRT{where}: {self.reason}{tail}"

    def line(self) -> str:
        return f"{self.graph}: {self.reason_line()}"


@dataclass
class CapabilityReport:
    graph: str
    nodes: int
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    dla: bool = False

    @property
    def refused(self) -> list[Finding]:
        return [f for f in self.findings if f.refused]

    @property
    def supported_nodes(self) -> int:
        return self.nodes - len({f.node for f in self.findings if f.device == "gpu"})

    def to_dict(self) -> dict:
        return {
            "graph": self.graph,
            "nodes": self.nodes,
            "supported_nodes": self.supported_nodes,
            "dla_checked": self.dla,
            "findings": [asdict(f) for f in self.findings],
            "notes": self.notes,
        }


def _type_name(value: ir.Value | None) -> str | None:
    if value is None or value.dtype is None:
        return None
    return TYPE_NAMES.get(int(value.dtype), value.dtype.name)


def _constant(value: ir.Value | None) -> np.ndarray | None:
    """The value of an initializer or a Constant node's output, else None."""
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value.numpy()
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and "value" in producer.attributes:
        return producer.attributes["value"].as_tensor().numpy()
    return None


def _is_constant(value: ir.Value | None) -> bool:
    if value is None:
        return True  # an absent optional input
    producer = value.producer()
    return value.const_value is not None or (producer is not None and producer.op_type == "Constant")


def _infer(model: ir.Model) -> None:
    """Types and shapes on every value (onnx shape inference, initializers left out so size does not matter)."""
    from onnx_ir.passes.common import ShapeInferencePass

    try:
        ShapeInferencePass(check_type=False, strict_mode=False, data_prop=False)(model)
    except Exception:  # noqa: BLE001 - best effort: unknown types are skipped, never guessed
        pass


class _Checker:
    def __init__(self, model: ir.Model, graph: str, table: OpTable, dla: bool, dla_static: bool, fallback: bool):
        self.model, self.graph, self.table = model, graph, table
        self.dla, self.dla_static, self.fallback = dla, dla_static, fallback
        self.findings: list[Finding] = []

    def add(self, node: ir.Node, reason: str, fix: str | None = None, device: str = "gpu") -> None:
        self.findings.append(Finding(self.graph, node.name or f"<{node.op_type}>", node.op_type, reason, fix, device))

    def run(self) -> None:
        for node in self.model.graph:
            n = len(self.findings)
            self.check_node(node)
            if self.dla and len(self.findings) == n:
                self.check_dla(node)

    # GPU ---------------------------------------------------------------------------------------------------------
    def check_node(self, node: ir.Node) -> None:
        if node.domain not in ("", "ai.onnx"):
            self.add(node, f"op of domain '{node.domain}' is not an ONNX standard op; TensorRT needs a plugin for it")
            return
        support = self.table.get(node.op_type)
        if support is None:
            self.add(node, f"not in onnx-tensorrt's operator table for TensorRT {self.table.tensorrt}")
            return
        if not support.supported:
            self.add(node, f"marked unsupported (N) in onnx-tensorrt's table for TensorRT {self.table.tensorrt}")
            return
        if node.op_type in ("DequantizeLinear", "QuantizeLinear"):
            self.check_qdq(node)
            return
        data = _type_name(node.inputs[0]) if node.inputs else None
        if data is not None and support.types and data not in support.types:
            self.add(node, f"input type {data} is not among {', '.join(support.types)}")
            return
        self.check_restrictions(node)

    def check_restrictions(self, node: ir.Node) -> None:
        op = node.op_type
        axes_at = _AXES_INPUT.get(op, 1 if op in _REDUCE else None)
        if axes_at is not None and op != "Slice" and len(node.inputs) > axes_at:  # Slice takes tensor axes at 10.3
            if not _is_constant(node.inputs[axes_at]):
                self.add(node, "`axes` must be an initializer or a constant")
        if op == "LayerNormalization" and any(o.uses() or o.is_graph_output() for o in node.outputs[1:]):
            self.add(node, "only the first output `Y` is supported")
        if op == "TopK":
            k = _constant(node.inputs[1]) if len(node.inputs) > 1 else None
            sorted_attr = node.attributes.get("sorted")
            if sorted_attr is not None and sorted_attr.as_int() != 1:
                self.add(node, "`sorted` must be 1")
            elif k is None or int(np.asarray(k).reshape(-1)[0]) >= 3840:
                self.add(node, "`K` must be a constant below 3840")

    def check_qdq(self, node: ir.Node) -> None:
        x, scale = input_of(node, 0), node.inputs[1] if len(node.inputs) > 1 else None
        zero = node.inputs[2] if len(node.inputs) > 2 else None
        if zero is not None:
            z = _constant(zero)
            if z is None or np.any(z.astype(np.float64) != 0):
                self.add(node, "zero point must be all zeros (TensorRT quantization is symmetric)")
                return
        if not _is_constant(scale):
            self.add(node, "the scale must be a build-time constant")
            return
        if node.op_type == "QuantizeLinear":
            return
        in_type = _type_name(x)
        if in_type is not None and in_type not in ("INT8", "FP8", "INT4"):
            self.add(node, f"dequantizes {in_type}; TensorRT takes INT8, FP8 and INT4")
            return
        s = _constant(scale)
        blocked = s is not None and x.shape is not None and s.ndim == len(x.shape) and s.ndim >= 1 and s.size > 1
        if not blocked and in_type != "INT4":
            return  # per-tensor or per-channel INT8/FP8: the parser's own path
        users = [(u.node, u.idx) for u in x_users(node)]
        feeds_gemm = bool(users) and all(n.op_type == "MatMul" and i == 1 for n, i in users)
        weight_2d = _is_constant(x) and x.shape is not None and len(x.shape) == 2
        if in_type == "INT4":
            if not (feeds_gemm and weight_2d):
                consumers = ", ".join(sorted({n.op_type for n, _ in users})) or "nothing"
                self.add(
                    node,
                    f"INT4 is weight-only for GEMM in TensorRT (a constant 2-D weight feeding MatMul's B); "
                    f"this one feeds {consumers}",
                    FOLD_DEQUANTIZE if _is_constant(x) else None,
                )
            elif x.shape is not None and isinstance(last := x.shape[-1], int) and last % 2:
                self.add(node, "INT4 needs an even last dimension (two values per byte)")
        elif blocked:
            self.add(
                node,
                f"block quantization is for INT4 only in TensorRT 10; this {in_type} weight has scale "
                f"{s.shape if s is not None else None}",
                PER_CHANNEL_INT8 if in_type == "INT8" and weight_2d and feeds_gemm else None,
            )

    # DLA ---------------------------------------------------------------------------------------------------------
    def check_dla(self, node: ir.Node) -> None:
        fix = GPU_FALLBACK if self.fallback else None
        if node.op_type in _SHAPE_OPS:
            return
        if not self.dla_static:
            self.add(node, "DLA needs static shapes (profile min = opt = max)", fix, "dla")
        elif node.op_type not in DLA_OPS:
            self.add(node, "not a layer the DLA runs", fix, "dla")
        else:
            t = _type_name(node.inputs[0]) if node.inputs else None
            if t is not None and t not in _DLA_TYPES:
                self.add(node, f"DLA takes FP16 and INT8 only (input is {t})", fix, "dla")


def x_users(node: ir.Node):
    """Where the output of `node` is read (a graph output counts as no user)."""
    return list(node.outputs[0].uses())


def check_model(
    model: ir.Model,
    graph: str,
    *,
    table: OpTable | None = None,
    dla: bool = False,
    dla_static: bool = True,
    gpu_fallback: bool = True,
) -> CapabilityReport:
    """Check every node of `model` (a graph called `graph` in messages). `dla`: the plan puts it on the DLA;
    `dla_static`: its profiles are static (min = opt = max)."""
    table = table or load_table()
    _infer(model)
    checker = _Checker(model, graph, table, dla, dla_static, gpu_fallback)
    checker.run()
    notes = []
    opset = model.opset_imports.get("", model.graph.opset_imports.get("", 0))
    lo, hi = table.opset_range
    if opset and opset < lo:
        checker.findings.append(Finding(graph, "<model>", "opset", f"opset {opset} is below TensorRT's minimum {lo}"))
    elif opset and opset > hi:
        notes.append(
            f"opset {opset} is above the {hi} the table states; the parser checks only a minimum opset "
            "(onnx-tensorrt ModelImporter.cpp) and reads blocked DequantizeLinear from the scale's shape"
        )
    return CapabilityReport(graph, len(list(model.graph)), checker.findings, notes, dla)


def check_file(path: Path, **kw) -> CapabilityReport:
    return check_model(ir.load(path), path.name, **kw)


def refuse_unsupported(reports: Iterable[CapabilityReport], folder: Path | str | None = None) -> None:
    """One line naming the graph file and the first node nothing fixes (and how many others there are)."""
    refused = [f for r in reports for f in r.refused]
    if refused:
        first = refused[0]
        more = f" (and {len(refused) - 1} more node(s))" if len(refused) > 1 else ""
        if folder is None:
            raise ConfigError(first.line() + more)
        raise ConfigError(first.reason_line() + more, Path(folder) / first.graph)
